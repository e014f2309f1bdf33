//! The staged path of one chunk: plan, allocation in the receiver's ring, watermark wait, gather
//! (into a send staging buffer, or in place into a same-host mapping of the ring), one write and
//! the ready frame, then the arrival acknowledgement. Anything that fails after the grant aborts.

use super::direct::DirectTarget;
use super::*;
use crate::geometry::{StagingLayout, TailPart, TailSides, WriterRegion};
use crate::session::staging::{StagingLease, StagingMemory};

impl SenderSession {
    pub(super) fn staged(&self, desc: &TransferDesc, op: &Op, t: &mut TransferTimings) -> Result<Status> {
        let result = self
            .transfer_inner(desc, op, t)
            .map_err(|e| e.context(format!("staged transfer of room {} chunk {} failed", desc.room, desc.chunk)).with_session(&self.id));
        self.log_outcome("staged", desc, &result);
        result
    }

    /// Per chunk: trace on success, debug on failure (the caller gets the error itself; the
    /// receiver logs the room's failure).
    pub(super) fn log_outcome(&self, path: &str, desc: &TransferDesc, result: &Result<Status>) {
        let id = self.id.as_str();
        match result {
            Ok(Status::KVSTAGE_FALLBACK) => {}
            Ok(_) => log::trace!(target: LOG_TARGET, session = id; "[{}] {path} transfer of room {} chunk {} done", desc.trace_id(), desc.room, desc.chunk),
            Err(e) => log::debug!(target: LOG_TARGET, session = id; "[{}] {}", desc.trace_id(), e.chain()),
        }
    }

    /// A chunk the staged path cannot take: warn once per session with the reason, then debug.
    pub(super) fn log_fallback(&self, desc: &TransferDesc, why: &str) {
        let id = self.id.as_str();
        if self.fallback_logged.swap(true, Ordering::Relaxed) {
            log::debug!(target: LOG_TARGET, session = id; "[{}] room {} chunk {}: staged path unavailable, KVSTAGE_FALLBACK: {why}", desc.trace_id(), desc.room, desc.chunk);
        } else {
            log::warn!(target: LOG_TARGET, session = id;
                "[{}] staged path unavailable for room {} chunk {}, KVSTAGE_FALLBACK (the caller may use the slice path): {why} (logged once per session)",
                desc.trace_id(),
                desc.room,
                desc.chunk
            );
        }
    }

    fn transfer_inner(&self, desc: &TransferDesc, op: &Op, t: &mut TransferTimings) -> Result<Status> {
        let deadline = Deadline::after(desc.timeout);
        let src = &self.pool.shape;
        let dst = &self.remote.shape;
        let span = desc.span(src.page_size)?;
        let tokens = span.tokens as u32; // bounded by `span`
        let layout = geometry::staging_layout(src, dst, tokens)?;
        let writer = self.pair.frame_writer();
        let region = match self.pair.writer {
            Some(_) => layout.region_of(src)?.ok_or_else(|| Error::internal("a paired writer has no region"))?,
            // Another prefill rank sends these heads: a replica writes only its share of the
            // request's parts, with the last chunk.
            None if desc.parts.is_none() => return Ok(Status::KVSTAGE_OK),
            None => WriterRegion::tail_only(src, self.pair.heads),
        };
        let (layout, region) = self.with_parts(desc, layout, region)?;
        if region.bytes == 0 {
            return Ok(Status::KVSTAGE_OK); // a replica without a share of the parts
        }
        // Fallback is decided here, before anything is allocated on either side.
        let staging_limit = self.resources.options.send_staging_bytes;
        let fallback = if self.remote.ring_bytes == 0 {
            Some("the receiver has no staging ring registered".to_owned())
        } else if layout.total_bytes > self.remote.ring_bytes {
            Some(format!("the chunk needs {} bytes of the receiver's {}-byte ring", layout.total_bytes, self.remote.ring_bytes))
        } else if region.bytes > staging_limit {
            Some(format!("this writer's share is {} bytes, above send_staging_bytes {staging_limit}", region.bytes))
        } else {
            None
        };
        if let Some(why) = fallback.as_ref().filter(|_| desc.parts.is_some()) {
            // The slice path carries the KV alone: a chunk with the request's parts has no fallback.
            return Err(Error::new(
                Status::KVSTAGE_E_STAGING_TOO_SMALL,
                format!("the room's last chunk with the request's parts ({} bytes of them) cannot be staged: {why}; request parts have no slice fallback (size the decode ring and send_staging_bytes for the last chunk with its parts)", layout.tail_total),
            ));
        }
        if let Some(why) = fallback {
            self.log_fallback(desc, &why);
            return Ok(Status::KVSTAGE_FALLBACK);
        }
        let plan = (region.layers > 0).then(|| geometry::plan_gather(&*self.pool, &desc.pages, span.first_token, &layout, &region)).transpose()?;
        // A whole chunk's KV ready first, so that waiting for the caller's compute holds no ring
        // space, copy lane or staging buffer another transfer needs (layer-wise: per batch).
        if desc.layers.is_none() {
            self.await_ready(desc.ready.as_deref(), &deadline, op, t)?;
        }

        let direct = self.may_write_direct(plan.as_ref(), &region);
        op.enter("waiting_for_allocation", || format!("the receiver {} to grant {} bytes of its ring", self.link.describe(), layout.total_bytes));
        let alloc = self.expect_reply();
        // Watermark wait, part one: the allocation's round trip (part two: `wait_writable`).
        let asked = Instant::now();
        let sent = self.link.send(
            &Message::AllocReq {
                req: alloc.req,
                room: desc.room,
                chunk: desc.chunk,
                writer,
                tokens,
                bytes: layout.total_bytes,
                trace: desc.trace.clone().unwrap_or_default(),
                pool_tokens: desc.parts.as_ref().map(|p| p.pool_tokens()),
                direct,
            },
            &deadline,
        );
        t.watermark_wait_ns = since(asked);
        sent?;
        // A grant may already be on its way: giving up here must release it too.
        let mut stall = Stall::new(&self.id, desc, self.resources.options.stall_warn);
        let reply = self.wait_reply(&alloc, &deadline, op, "waiting for the allocation", Some(&mut stall));
        t.watermark_wait_ns = since(asked);
        let reply = reply.inspect_err(|e| self.abort(desc, e.message()))?;
        let (round, offset, region_offset, pages) = match reply {
            Message::AllocRsp { status: 0, round, offset, len, region: at, pages, .. }
                if len == layout.total_bytes
                    && at.checked_add(region.bytes).is_some_and(|end| end <= len)
                    && offset.checked_add(len).is_some()
                    && (direct || pages.is_empty()) =>
            {
                (round, offset, at, pages)
            }
            Message::AllocRsp { status: 0, pages, .. } if !pages.is_empty() && !direct => {
                self.abort(desc, "direct grant not asked for");
                return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("the receiver granted {} decode pages to write directly, this writer did not ask to", pages.len())));
            }
            Message::AllocRsp { status: 0, offset, len, region: at, .. } => {
                self.abort(desc, "granted size differs");
                return Err(Error::new(
                    Status::KVSTAGE_E_PROTOCOL,
                    format!("granted {len} bytes at {offset} with this writer's {} at {at}, asked {}", region.bytes, layout.total_bytes),
                ));
            }
            Message::AllocRsp { status, reason, .. } => {
                let code = Status::from_code(status).unwrap_or(Status::KVSTAGE_E_PROTOCOL);
                return Err(Error::new(code, format!("allocation refused by the receiver: {reason}")));
            }
            other => return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("unexpected reply {other:?}"))),
        };
        // From here on the receiver holds ring space for us: every failure aborts first.
        let place = Placement { round, grant_offset: offset, region_offset, region_bytes: region.bytes, writer };
        let direct = (!pages.is_empty()).then_some(DirectTarget { layout: &layout, region: &region, pages: &pages });
        let before = self.link.stream_mark();
        let written = self.write_granted(desc, op, &deadline, (plan.as_ref(), &region.tail), direct, &place, t, &mut stall);
        let arrival = match written {
            Ok(pending) => pending,
            Err(e) => {
                // Pieces or layers of the region may be in the stream already.
                let mark = self.link.stream_mark().filter(|&m| Some(m) != before);
                self.abort_written(desc, mark, &e);
                return Err(e);
            }
        };
        let written_at = Instant::now();
        let mark = self.link.stream_mark();
        op.enter("waiting_for_acknowledgement", || format!("the receiver {} to acknowledge the chunk's arrival", self.link.describe()));
        let ack = self.wait_reply(&arrival, &deadline, op, "waiting for the arrival acknowledgement", Some(&mut stall));
        t.ack_ns = since(written_at);
        match ack {
            Ok(Message::Arrived { status: 0, .. }) => Ok(Status::KVSTAGE_OK),
            Ok(Message::Arrived { status, reason, .. }) => {
                let code = Status::from_code(status).unwrap_or(Status::KVSTAGE_E_PROTOCOL);
                Err(Error::new(code, format!("the receiver rejected the chunk: {reason}")))
            }
            Ok(other) => Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("unexpected reply {other:?}"))),
            Err(e) => {
                self.abort_written(desc, mark, &e);
                Err(e)
            }
        }
    }

    /// Writes the granted region and its ready; the returned [`Pending`] awaits the arrival.
    /// `direct`: the grant names decode pages for this writer's region (of that layout) to be
    /// written directly; its ring range stays granted (and bounds the chunks in flight) though
    /// nothing is written there.
    #[allow(clippy::too_many_arguments)]
    fn write_granted(
        &self,
        desc: &TransferDesc,
        op: &Op,
        deadline: &Deadline,
        (plan, tail): (Option<&geometry::CopyPlan>, &[TailPart]),
        direct: Option<DirectTarget<'_>>,
        place: &Placement,
        t: &mut TransferTimings,
        stall: &mut Stall,
    ) -> Result<Pending<'_>> {
        let Placement { round, grant_offset, region_offset, region_bytes, writer } = *place;
        // Each phase is timed whether it succeeds or not (a timeout shows where it waited).
        let phase = Instant::now();
        let writable = self.wait_writable(round, place.end(), deadline, op, stall);
        t.watermark_wait_ns += since(phase);
        writable?;
        let pending = self.expect_reply();
        let req = pending.req;
        let ready = |checksum| Message::ChunkReady { req, room: desc.room, chunk: desc.chunk, writer, checksum };
        if let (Some(gate), Some(plan)) = (&desc.layers, plan) {
            self.write_by_layers(desc, gate, op, deadline, plan, direct, place, ready, t, stall)?;
            return Ok(pending);
        }
        if let (Some(to), Some(plan)) = (direct, plan) {
            self.write_direct(desc, plan, to, place, ready, deadline, op, t)?;
            self.metrics.sent(region_bytes);
            return Ok(pending);
        }
        let header = place.data(desc, 0, region_bytes);
        // Same host, the ring in the pool's kind of memory (host; or device memory on the pool's
        // device): the gather writes straight into the granted range of the ring.
        if self.writes_in_place() {
            let mut range = self.link.in_place(grant_offset + region_offset, region_bytes).expect("an in-place transport")?;
            op.enter("gathering", String::new);
            if let Some(plan) = plan {
                self.gather(plan, range.as_mut_ptr(), deadline, t)?;
            }
            self.gather_tail(desc, tail, Self::tail_at(range.as_mut_ptr(), region_bytes, tail), t)?;
            let checksum = self.region_checksum(desc, || Ok(checksum(&range.to_host()?)))?;
            drop(range);
            op.enter("writing", String::new);
            let phase = Instant::now();
            let wrote = self.link.finish_in_place(&header, &ready(checksum), deadline);
            t.wire_ns = since(phase);
            wrote?;
            self.metrics.sent(region_bytes);
            return Ok(pending);
        }
        // Over TCP from a host pool: the rows themselves are written, nothing is staged.
        if let Some(plan) = plan.filter(|p| self.writes_from_pool(p)) {
            self.write_from_pool(desc, (plan, tail), place, ready, deadline, op, t)?;
            self.metrics.sent(region_bytes);
            return Ok(pending);
        }
        // A buffer of the engine's pool, held for the gather and the write only.
        let mut staging = self.staging_buffer(region_bytes, deadline, op, t)?;
        if let Some(pieces) = self.pipeline_pieces(plan, &staging) {
            self.write_pipelined(desc, (&pieces, tail), &mut staging, place, ready, deadline, op, t)?;
            self.metrics.sent(region_bytes);
            return Ok(pending);
        }
        op.enter("gathering", String::new);
        if let Some(plan) = plan {
            self.gather(plan, staging.as_mut_ptr(), deadline, t)?;
        }
        if !tail.is_empty() && staging.memory() != StagingMemory::Host {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "request parts need host staging (this session stages in device memory)"));
        }
        self.gather_tail(desc, tail, Self::tail_at(staging.as_mut_ptr(), region_bytes, tail), t)?;
        let checksum = self.region_checksum(desc, || Ok(checksum(&staging.to_host(region_bytes as usize)?)))?;
        op.enter("writing", String::new);
        let phase = Instant::now();
        let wrote = self.write_staged(&mut staging, place, desc, (0, region_bytes), Some(&ready(checksum)), deadline);
        t.wire_ns = since(phase);
        wrote?;
        self.metrics.sent(region_bytes);
        Ok(pending)
    }

    /// Whether the gather writes straight into the receiver's ring: a same-host ring in the memory
    /// kind of this engine's pool (a device ring is opened on the pool's device).
    pub(super) fn writes_in_place(&self) -> bool {
        use crate::transport::shm::RingKind;
        matches!((self.link.in_place_kind(), self.pool.memory), (Some(RingKind::Host), MemoryKind::Host) | (Some(RingKind::Device), MemoryKind::Cuda))
    }

    /// A send staging buffer of at least `len` bytes from the engine's pool: device memory on
    /// the pool's device when this session's NIC reads GPU memory (registered through its
    /// dma-buf; if that fails, counted once and host memory from then on), else host memory,
    /// registered with the RDMA devices when this session writes by RDMA (all timed as the
    /// allocation wait).
    pub(super) fn staging_buffer(&self, len: u64, deadline: &Deadline, op: &Op, t: &mut TransferTimings) -> Result<StagingLease<'_>> {
        op.enter("waiting_for_staging_buffer", || format!("a send staging buffer of {len} bytes from the engine's pool (send_staging_buffers)"));
        let phase = Instant::now();
        let acquired = self.staging_lease(len, deadline, op);
        t.alloc_wait_ns = since(phase);
        acquired
    }

    fn staging_lease(&self, len: u64, deadline: &Deadline, op: &Op) -> Result<StagingLease<'_>> {
        let (pool, copy, rdma) = (&self.resources.staging, &self.resources.copy, &self.resources.rdma);
        if let Some(ordinal) = self.device_staging.filter(|_| !self.gpudirect_refused.load(Ordering::Relaxed)) {
            // Device memory that cannot be had (a GPU full of KV) or registered: host staging.
            let device = pool
                .acquire(len, StagingMemory::Device(ordinal), deadline, op, copy)
                .and_then(|mut lease| lease.register_with(rdma).map(|()| lease));
            match device {
                Ok(lease) => return Ok(lease),
                Err(e) if matches!(e.code(), Status::KVSTAGE_E_TIMEOUT | Status::KVSTAGE_E_CANCELED | Status::KVSTAGE_E_PEER_GONE) => return Err(e),
                Err(e) => {
                    if !self.gpudirect_refused.swap(true, Ordering::Relaxed) {
                        rdma.host_bounce(&self.id, &e.chain());
                    }
                }
            }
        }
        let mut lease = pool.acquire(len, StagingMemory::Host, deadline, op, copy)?;
        if self.link_kind == LinkKind::Rdma {
            // Best effort: a write from an unregistered buffer registers its range for itself.
            let _ = lease.register_with(rdma);
        }
        Ok(lease)
    }

    /// Waits until the caller's ready point fired (by the deadline; see
    /// [`ReadyFence::wait_until`](crate::copy::ReadyFence::wait_until)); timed as the gather phase.
    pub(super) fn await_ready(&self, ready: Option<&crate::copy::ReadyFence>, deadline: &Deadline, op: &Op, t: &mut TransferTimings) -> Result<()> {
        let Some(fence) = ready else { return Ok(()) };
        op.enter("waiting_for_ready_point", || "the caller's CUDA ready point (desc->cuda_stream / cuda_event)".to_owned());
        let phase = Instant::now();
        let fired = fence.wait_until(deadline, || op.is_canceled() || self.shared.state.lock().dead.is_some());
        t.gather_ns += since(phase);
        fired
    }

    /// Gathers `plan` into the region at `dst` (a staging buffer, or this writer's granted
    /// range of the ring), its ready point already passed ([`await_ready`](Self::await_ready));
    /// timed as the gather phase.
    pub(super) fn gather(&self, plan: &geometry::CopyPlan, dst: *mut u8, deadline: &Deadline, t: &mut TransferTimings) -> Result<()> {
        let phase = Instant::now();
        // SAFETY: the pool was validated at registration and its pages checked; `dst` holds the
        // plan's region.
        let gathered = unsafe { self.resources.copy.gather_after(plan, &self.pool, dst, None, deadline) };
        t.gather_ns += since(phase);
        gathered
    }

    /// `layout` and this writer's `region` with the request's parts when `desc` carries them (the
    /// room's last chunk): what the allocation owes besides the KV, and this writer's tail.
    fn with_parts(&self, desc: &TransferDesc, layout: StagingLayout, mut region: WriterRegion) -> Result<(StagingLayout, WriterRegion)> {
        let Some(parts) = &desc.parts else { return Ok((layout, region)) };
        if self.pool.memory == MemoryKind::Cuda && (self.writes_in_place() || self.device_staging.is_some()) {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "request parts need host staging (this session stages in device memory: GPUDirect, or the receiver's device ring)"));
        }
        let (src, dst) = (&self.pool.shape, &self.remote.shape);
        let (tokens, specs) = (parts.pool_tokens(), self.components.specs());
        let sides = TailSides {
            src: &specs,
            dst: &self.remote.components,
            src_tp: src.tp_size,
            dst_tp: dst.tp_size,
            dst_rank: dst.tp_rank,
            pool_tokens: &tokens,
        };
        let (owed, tail) = match self.pair.writer {
            Some(_) => geometry::parts::writer_tail(&sides, &layout, &region)?,
            None => geometry::parts::replica_tail(&sides, &layout, src.tp_rank)?,
        };
        region.bytes += geometry::parts::tail_bytes(&tail);
        region.tail = tail;
        Ok((layout.with_tail_total(owed), region))
    }

    /// Gathers the request's parts `tail` to `tail_at` (host memory of `tail_bytes(tail)` bytes:
    /// the end of a region, or a buffer of their own); timed as the gather phase.
    pub(super) fn gather_tail(&self, desc: &TransferDesc, tail: &[TailPart], tail_at: *mut u8, t: &mut TransferTimings) -> Result<()> {
        let Some(parts) = desc.parts.as_deref().filter(|_| !tail.is_empty()) else { return Ok(()) };
        let phase = Instant::now();
        // SAFETY: `tail_at` holds the tail's bytes (checked by the callers); the parts were
        // checked against the components.
        let gathered = unsafe { self.components.gather(parts, tail, tail_at) };
        t.gather_ns += since(phase);
        gathered
    }

    /// Where the request's parts `tail` go in the host region at `region_at` of `region_bytes`:
    /// its last bytes.
    pub(super) fn tail_at(region_at: *mut u8, region_bytes: u64, tail: &[TailPart]) -> *mut u8 {
        region_at.wrapping_add((region_bytes - geometry::parts::tail_bytes(tail)) as usize)
    }

    /// The checksum of a writer's gathered region when integrity covers the chunk; `sum`
    /// computes it (reading device memory back when it must), called only then.
    pub(super) fn region_checksum(&self, desc: &TransferDesc, sum: impl FnOnce() -> Result<u64>) -> Result<Option<u64>> {
        self.integrity.covers(desc.room.id, desc.chunk).then(sum).transpose()
    }

    /// The end of a region written in pieces: its request parts `tail` (the region's last bytes;
    /// none when empty) as one more piece, then `ready`, bound to every piece (`whole`: the
    /// region's bytes, for a link whose ready names its buffer; empty for a stream transport).
    pub(super) fn finish_region(&self, desc: &TransferDesc, place: &Placement, tail: &[u8], whole: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        let kv_bytes = place.region_bytes - tail.len() as u64;
        if !tail.is_empty() {
            self.link.write_piece(place.grant_offset, &place.data(desc, kv_bytes, tail.len() as u64), tail, deadline)?;
        }
        self.link.finish_pieces(place.grant_offset, &place.data(desc, 0, place.region_bytes), whole, ready, deadline)
    }

    /// Writes `[at, +len)` of the region gathered in `staging` (whole, with its `ready`; or a
    /// piece, without): host memory through the link's chunk or piece write, device memory by
    /// the NIC reading it (GPUDirect).
    pub(super) fn write_staged(
        &self,
        staging: &mut StagingLease<'_>,
        place: &Placement,
        desc: &TransferDesc,
        (at, len): (u64, u64),
        ready: Option<&Message>,
        deadline: &Deadline,
    ) -> Result<()> {
        let header = place.data(desc, at, len);
        match (staging.memory(), ready) {
            (StagingMemory::Host, Some(ready)) => {
                self.link.write_chunk_at(place.grant_offset, &header, &staging.bytes((at + len) as usize)?[at as usize..], ready, deadline)
            }
            (StagingMemory::Host, None) => self.link.write_piece(place.grant_offset, &header, &staging.bytes((at + len) as usize)?[at as usize..], deadline),
            (StagingMemory::Device(_), ready) => self.link.write_device(place.grant_offset, &header, staging.as_mut_ptr() as u64 + at, ready, deadline),
        }
    }
}

/// Where a writer's bytes go: its region inside the grant.
#[derive(Clone, Copy)]
pub(super) struct Placement {
    /// The grant's ring round and offset in the receiver's ring.
    pub round: u64,
    pub grant_offset: u64,
    /// The region's offset inside the grant, and its size.
    pub region_offset: u64,
    pub region_bytes: u64,
    pub writer: u32,
}

impl Placement {
    /// The ring offset past the region (what the watermark must permit).
    fn end(&self) -> u64 {
        self.grant_offset + self.region_offset + self.region_bytes
    }

    /// The header of a write of `[at, +len)` of the region.
    pub fn data(&self, desc: &TransferDesc, at: u64, len: u64) -> Message {
        Message::Data { room: desc.room, chunk: desc.chunk, writer: self.writer, offset: self.region_offset + at, len }
    }

    /// The report of an in-place write of `[at, +len)` of the region.
    pub fn written(&self, desc: &TransferDesc, at: u64, len: u64) -> Message {
        Message::Written { room: desc.room, chunk: desc.chunk, writer: self.writer, offset: self.region_offset + at, len, imm: 0 }
    }
}
