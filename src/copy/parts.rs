//! A rank's registered components (aux buffers, state slots, extra paged pools) and the copies of
//! a request's parts between them and a region's tail ([`crate::geometry::parts`] plans which
//! bytes). Host memory, or CUDA device memory (each buffer of a component one or the other, told
//! by the driver: a device buffer is copied to and from with synchronous copies).

use std::sync::Arc;

use super::cuda::DeviceMemory;
use crate::error::{Error, Result};
use crate::geometry::{ComponentKind, ComponentSpec, PageSpan, PartCopy, RequestParts, TailPart};

/// Most layer ids all components together hold (the hello that carries them is bounded).
const MAX_LAYER_IDS: usize = 8192;

/// One registered component: its spec, how many items (rows, slots, pages) it holds, the bytes of
/// one item on this rank (a row, a slot, a token slot) and a base address per layer (aux: one).
#[derive(Clone, Debug)]
pub struct Component {
    pub spec: ComponentSpec,
    pub items: u64,
    pub item_bytes: u64,
    pub bases: Vec<usize>,
    /// The buffers as CUDA device memory (one per base), when they are; empty: host memory.
    device: DeviceBuffers,
}

/// A component's device buffers (borrowed: the caller keeps them alive).
#[derive(Clone, Default)]
struct DeviceBuffers(Vec<Arc<DeviceMemory>>);

impl std::fmt::Debug for DeviceBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} device buffer(s)", self.0.len())
    }
}

impl Component {
    /// A component over host or device buffers (checked by [`Components::new`]).
    pub fn new(spec: ComponentSpec, items: u64, item_bytes: u64, bases: Vec<usize>) -> Component {
        Component { spec, items, item_bytes, bases, device: DeviceBuffers::default() }
    }

    /// Bytes of one layer's buffer.
    fn buffer_bytes(&self) -> u64 {
        let per_item = match self.spec.kind {
            ComponentKind::Pool { .. } => self.item_bytes.saturating_mul(self.spec.page_size as u64),
            _ => self.item_bytes,
        };
        self.items.saturating_mul(per_item)
    }

    /// The index of the buffer of `layer_id` (aux: the one buffer).
    fn buffer(&self, layer_id: u32) -> Result<usize> {
        match self.spec.kind {
            ComponentKind::Aux { .. } => Ok(0),
            _ => self.spec.layer_ids.binary_search(&layer_id).map_err(|_| Error::internal(format!("component {:?} holds no layer {layer_id}", self.spec.name))),
        }
    }

    /// Copies `len` bytes between byte `offset` of buffer `buffer` and `tail` (`to_tail`: from
    /// the buffer).
    ///
    /// # Safety
    /// `tail` valid for `len` bytes; the range lies in the buffer (the plan keeps it there).
    unsafe fn copy(&self, buffer: usize, offset: u64, tail: *mut u8, len: usize, to_tail: bool) -> Result<()> {
        if let Some(d) = self.device.0.get(buffer) {
            // SAFETY: the caller's contract.
            let tail = unsafe { std::slice::from_raw_parts_mut(tail, len) };
            return if to_tail { d.read(offset as usize, tail) } else { d.write(offset as usize, tail) };
        }
        let at = (self.bases[buffer] as u64 + offset) as *mut u8;
        // SAFETY: the caller's contract; component memory and the tail never overlap.
        unsafe {
            if to_tail {
                std::ptr::copy_nonoverlapping(at, tail, len)
            } else {
                std::ptr::copy_nonoverlapping(tail, at, len)
            }
        }
        Ok(())
    }
}

/// Every component of a rank, in registration order.
#[derive(Clone, Debug, Default)]
pub struct Components {
    pub list: Vec<Component>,
}

impl Components {
    /// Checks a registration: each spec, names unique, one non-NULL base per layer (aux: one),
    /// buffers that fit the address space and do not overlap (`KVSTAGE_E_INVALID_ARG` naming
    /// `components[i]` and the field).
    pub fn new(list: Vec<Component>) -> Result<Components> {
        if list.len() > crate::geometry::parts::MAX_COMPONENTS {
            return Err(Error::invalid_arg("num_components", format!("{} is above {}", list.len(), crate::geometry::parts::MAX_COMPONENTS)));
        }
        let layer_ids: usize = list.iter().map(|c| c.spec.layer_ids.len()).sum();
        if layer_ids > MAX_LAYER_IDS {
            return Err(Error::invalid_arg("components", format!("name {layer_ids} layer ids in all, more than {MAX_LAYER_IDS} (the handshake carries them)")));
        }
        let mut spans = Vec::new();
        for (i, c) in list.iter().enumerate() {
            let at = format!("components[{i}]");
            c.spec.validate(&at)?;
            if let Some(j) = list[..i].iter().position(|o| o.spec.name == c.spec.name) {
                return Err(Error::invalid_arg(&format!("{at}.name"), format!("{:?} is also the name of components[{j}]", c.spec.name)));
            }
            if c.items == 0 {
                return Err(Error::invalid_arg(&format!("{at}.num_items"), "is 0"));
            }
            let want = if matches!(c.spec.kind, ComponentKind::Aux { .. }) { 1 } else { c.spec.layer_ids.len() };
            if c.bases.len() != want {
                return Err(Error::invalid_arg(&format!("{at}.bases"), format!("holds {} addresses, the component needs {want} (one per layer)", c.bases.len())));
            }
            let bytes = c.buffer_bytes();
            for (k, &base) in c.bases.iter().enumerate() {
                let end = (base as u64).checked_add(bytes).filter(|e| *e <= isize::MAX as u64);
                match end {
                    _ if base == 0 => return Err(Error::invalid_arg(&format!("{at}.bases[{k}]"), "is NULL")),
                    None => return Err(Error::invalid_arg(&format!("{at}.bases[{k}]"), format!("{base:#x} + {bytes} bytes overflows the address space"))),
                    Some(end) => spans.push((base as u64, end, format!("{at}.bases[{k}]"))),
                }
            }
        }
        spans.sort_unstable();
        for pair in spans.windows(2) {
            if pair[1].0 < pair[0].1 {
                return Err(Error::invalid_arg(&pair[1].2, format!("[{:#x}, {:#x}) overlaps {} [{:#x}, {:#x})", pair[1].0, pair[1].1, pair[0].2, pair[0].0, pair[0].1)));
            }
        }
        let mut list = list;
        for (i, c) in list.iter_mut().enumerate() {
            c.device = Self::device_buffers(c, i)?;
        }
        Ok(Components { list })
    }

    /// `c`'s buffers as device memory when the driver says they are (all of them, over each
    /// buffer's whole size, on one device each); empty for host memory.
    fn device_buffers(c: &Component, i: usize) -> Result<DeviceBuffers> {
        let on_device: Vec<bool> = c.bases.iter().map(|&b| super::cuda::is_device_pointer(b as u64)).collect();
        if !on_device.iter().any(|&d| d) {
            return Ok(DeviceBuffers::default());
        }
        if let Some(k) = on_device.iter().position(|&d| !d) {
            return Err(Error::invalid_arg(&format!("components[{i}].bases[{k}]"), "is host memory where the component's other buffers are CUDA device memory"));
        }
        let bytes = c.buffer_bytes() as usize;
        let buffers = c.bases.iter().enumerate().map(|(k, &b)| DeviceMemory::borrow(None, b as u64, bytes, &format!("components[{i}].bases[{k}]")).map(Arc::new));
        Ok(DeviceBuffers(buffers.collect::<Result<_>>()?))
    }

    pub fn specs(&self) -> Vec<ComponentSpec> {
        self.list.iter().map(|c| c.spec.clone()).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    fn count(&self, kind: fn(&ComponentKind) -> bool) -> usize {
        self.list.iter().filter(|c| kind(&c.spec.kind)).count()
    }

    /// Checks what a caller names of a request against the components (`KVSTAGE_E_INVALID_ARG`
    /// naming `arg`'s field and both values): the aux row, one slot per state component, one span
    /// per pool component, each inside its component.
    pub fn check_parts(&self, parts: &RequestParts, arg: &str) -> Result<()> {
        if self.list.is_empty() {
            return Err(Error::invalid_arg(arg, "names request parts, but this engine registered no components (kvstage_engine_register_components)"));
        }
        let states = self.count(|k| matches!(k, ComponentKind::State { .. }));
        let pools = self.count(|k| matches!(k, ComponentKind::Pool { .. }));
        if parts.state_slots.len() != states {
            return Err(Error::invalid_arg(&format!("{arg}.num_state_slots"), format!("{} != {states} (one slot per state component)", parts.state_slots.len())));
        }
        if parts.pools.len() != pools {
            return Err(Error::invalid_arg(&format!("{arg}.num_pool_spans"), format!("{} != {pools} (one span per pool component)", parts.pools.len())));
        }
        let (mut s, mut p) = (0, 0);
        for c in &self.list {
            let name = &c.spec.name;
            match c.spec.kind {
                ComponentKind::Aux { .. } if parts.aux_row >= c.items => {
                    return Err(Error::invalid_arg(&format!("{arg}.aux_row"), format!("{} is outside aux buffer {name:?}'s {} rows", parts.aux_row, c.items)));
                }
                ComponentKind::Aux { .. } => {}
                ComponentKind::State { .. } => {
                    if parts.state_slots[s] >= c.items {
                        return Err(Error::invalid_arg(
                            &format!("{arg}.state_slots[{s}]"),
                            format!("{} is outside state component {name:?}'s {} slots", parts.state_slots[s], c.items),
                        ));
                    }
                    s += 1;
                }
                ComponentKind::Pool { .. } => {
                    let span = &parts.pools[p];
                    let field = format!("{arg}.pool_spans[{p}]");
                    if span.tokens == 0 {
                        return Err(Error::invalid_arg(&format!("{field}.num_tokens"), format!("is 0 (pool {name:?})")));
                    }
                    PageSpan { pages: &span.pages, first_token: span.first_token, tokens: span.tokens as u64 }.check(
                        c.spec.page_size,
                        &format!("{field}.pages"),
                        &format!("{field}.first_token"),
                    )?;
                    if let Some(i) = span.pages.iter().position(|&pg| pg as u64 >= c.items) {
                        return Err(Error::invalid_arg(&format!("{field}.pages[{i}]"), format!("{} is outside pool {name:?}'s {} pages", span.pages[i], c.items)));
                    }
                    p += 1;
                }
            }
        }
        Ok(())
    }

    /// The item a part of component `c` names in `parts`: (slot or row index, pool span).
    fn named<'a>(&self, parts: &'a RequestParts, c: usize) -> (u64, Option<PageSpan<'a>>) {
        let before = &self.list[..c];
        match self.list[c].spec.kind {
            ComponentKind::Aux { .. } => (parts.aux_row, None),
            ComponentKind::State { .. } => (parts.state_slots[before.iter().filter(|o| matches!(o.spec.kind, ComponentKind::State { .. })).count()], None),
            ComponentKind::Pool { .. } => {
                let span = &parts.pools[before.iter().filter(|o| matches!(o.spec.kind, ComponentKind::Pool { .. })).count()];
                (0, Some(PageSpan { pages: &span.pages, first_token: span.first_token, tokens: span.tokens as u64 }))
            }
        }
    }

    /// Runs each of `tail`'s parts between this rank's memory and the tail at `tail_at`
    /// (`prefill`: from the memory into the tail, with the plan's prefill offsets; else back).
    ///
    /// # Safety
    /// `tail_at` valid for `tail_bytes(tail)` bytes; `parts` checked ([`Self::check_parts`]) and
    /// every component's memory live as registered.
    unsafe fn each(&self, parts: &RequestParts, tail: &[TailPart], tail_at: *mut u8, prefill: bool) -> Result<()> {
        for part in tail {
            let c = self.list.get(part.component as usize).ok_or_else(|| Error::internal(format!("part of component {}", part.component)))?;
            let buffer = c.buffer(part.layer_id)?;
            let tail_part = tail_at.wrapping_add(part.offset as usize);
            let (item, span) = self.named(parts, part.component as usize);
            // SAFETY (every copy): the plan keeps each range inside its item and the tail.
            match &part.copy {
                PartCopy::Row => unsafe { c.copy(buffer, item * c.item_bytes, tail_part, part.bytes as usize, prefill)? },
                PartCopy::Ranges(ranges) => {
                    let mut packed = 0usize;
                    for r in ranges {
                        let within = if prefill { r.src } else { r.dst };
                        unsafe { c.copy(buffer, item * c.item_bytes + within, tail_part.wrapping_add(packed), r.len as usize, prefill)? };
                        packed += r.len as usize;
                    }
                }
                PartCopy::Rows { row_bytes, src_at, dst_at } => {
                    let span = span.ok_or_else(|| Error::internal("a pool part without a span"))?;
                    let within = if prefill { *src_at } else { *dst_at };
                    for seg in span.segments(c.spec.page_size, true) {
                        let packed = tail_part.wrapping_add((seg.staging_token * row_bytes) as usize);
                        if *row_bytes == c.item_bytes {
                            unsafe { c.copy(buffer, seg.pool_token * c.item_bytes, packed, (seg.tokens * row_bytes) as usize, prefill)? };
                            continue;
                        }
                        for t in 0..seg.tokens {
                            let at = (seg.pool_token + t) * c.item_bytes + within;
                            unsafe { c.copy(buffer, at, packed.wrapping_add((t * row_bytes) as usize), *row_bytes as usize, prefill)? };
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Prefill side: copies `tail`'s parts of the request into the tail at `dst`.
    ///
    /// # Safety
    /// As for [`Self::each`], `dst` writable and not overlapping component memory.
    pub unsafe fn gather(&self, parts: &RequestParts, tail: &[TailPart], dst: *mut u8) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.each(parts, tail, dst, true) }
    }

    /// Decode side: copies `tail`'s parts from the tail at `src` into the request's items.
    ///
    /// # Safety
    /// As for [`Self::each`], `src` readable and not overlapping component memory.
    pub unsafe fn scatter(&self, parts: &RequestParts, tail: &[TailPart], src: *const u8) -> Result<()> {
        // SAFETY: as for `gather`, the other way (`each` only reads the tail then).
        unsafe { self.each(parts, tail, src as *mut u8, false) }
    }
}
