//! Wire form of the request-part fields: the component list a hello carries and the pool token
//! counts of an allocation request. Decoding bounds every count before allocating and validates
//! every spec (a lying peer gets a protocol error naming the field).

use super::codec::{Dec, Enc};
use super::malformed;
use crate::error::Result;
use crate::geometry::parts::{MAX_COMPONENTS, MAX_NAME};
use crate::geometry::state::MAX_GROUPS;
use crate::geometry::{ComponentKind, ComponentSpec, MemoryKind, StateItem};

const MAX_LAYERS: u32 = 4096;

pub fn encode_components(e: &mut Enc, list: &[ComponentSpec]) {
    e.u32(list.len() as u32);
    for c in list {
        e.str(&c.name);
        match &c.kind {
            ComponentKind::Aux { row_bytes } => e.u8(0).u64(*row_bytes),
            ComponentKind::State { item } => {
                e.u8(1).u32(item.outer).u32(item.groups.len() as u32);
                for &g in &item.groups {
                    e.u32(g);
                }
                e.u32(item.dtype_bytes).u8(item.replicated as u8)
            }
            ComponentKind::Pool { unit_bytes, head_sliced } => e.u8(2).u64(*unit_bytes).u8(*head_sliced as u8),
        };
        e.u32(c.page_size).u32(c.layer_ids.len() as u32);
        for &l in &c.layer_ids {
            e.u32(l);
        }
    }
}

pub fn flag(d: &mut Dec, field: &str) -> Result<bool> {
    match d.u8(field)? {
        0 => Ok(false),
        1 => Ok(true),
        f => Err(malformed(format!("{field} {f} is neither 0 nor 1"))),
    }
}

/// An optional memory kind as one byte: 0 none, 1 host, 2 CUDA.
pub fn encode_memory(kind: Option<MemoryKind>) -> u8 {
    match kind {
        None => 0,
        Some(MemoryKind::Host) => 1,
        Some(MemoryKind::Cuda) => 2,
    }
}

/// Decodes [`encode_memory`]'s byte.
pub fn memory(d: &mut Dec, field: &str) -> Result<Option<MemoryKind>> {
    match d.u8(field)? {
        0 => Ok(None),
        1 => Ok(Some(MemoryKind::Host)),
        2 => Ok(Some(MemoryKind::Cuda)),
        k => Err(malformed(format!("{field} {k} is not a memory kind (0 none, 1 host, 2 CUDA)"))),
    }
}

fn count(d: &mut Dec, field: &str, max: u32) -> Result<u32> {
    let n = d.u32(field)?;
    if n > max {
        return Err(malformed(format!("{field} {n} exceeds the limit of {max}")));
    }
    Ok(n)
}

pub fn decode_components(d: &mut Dec) -> Result<Vec<ComponentSpec>> {
    let n = count(d, "num_components", MAX_COMPONENTS as u32)?;
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let name = d.str("component.name", MAX_NAME)?;
        let kind = match d.u8("component.kind")? {
            0 => ComponentKind::Aux { row_bytes: d.u64("component.row_bytes")? },
            1 => {
                let outer = d.u32("state.outer")?;
                let groups = (0..count(d, "state.num_groups", MAX_GROUPS as u32)?).map(|_| d.u32("state.group_dim")).collect::<Result<Vec<_>>>()?;
                let item = StateItem { outer, groups, dtype_bytes: d.u32("state.dtype_bytes")?, replicated: flag(d, "state.replicated")? };
                ComponentKind::State { item }
            }
            2 => ComponentKind::Pool { unit_bytes: d.u64("pool.unit_bytes")?, head_sliced: flag(d, "pool.head_sliced")? },
            k => return Err(malformed(format!("unknown component kind {k}"))),
        };
        let page_size = d.u32("component.page_size")?;
        let layer_ids = (0..count(d, "component.num_layers", MAX_LAYERS)?).map(|_| d.u32("component.layer_id")).collect::<Result<Vec<_>>>()?;
        let spec = ComponentSpec { name, kind, layer_ids, page_size };
        spec.validate(&format!("components[{i}]")).map_err(|e| malformed(format!("the peer's {}", e.message())))?;
        out.push(spec);
    }
    Ok(out)
}

/// `None`: the writer sends no request parts; else the tokens of each pool span it sends.
pub fn encode_pool_tokens(e: &mut Enc, tokens: &Option<Vec<u32>>) {
    match tokens {
        None => {
            e.u8(0);
        }
        Some(v) => {
            e.u8(1);
            encode_u32s(e, v);
        }
    }
}

pub fn decode_pool_tokens(d: &mut Dec) -> Result<Option<Vec<u32>>> {
    if !flag(d, "parts flag")? {
        return Ok(None);
    }
    decode_u32s(d, "pool_tokens", MAX_COMPONENTS as u32).map(Some)
}

/// A list of u32: its length, then its items.
pub fn encode_u32s(e: &mut Enc, list: &[u32]) {
    e.u32(list.len() as u32);
    for &v in list {
        e.u32(v);
    }
}

/// A list of at most `max` u32 (the count checked before anything is allocated).
pub fn decode_u32s(d: &mut Dec, field: &str, max: u32) -> Result<Vec<u32>> {
    let n = count(d, &format!("number of {field}"), max)?;
    (0..n).map(|_| d.u32(field)).collect()
}
