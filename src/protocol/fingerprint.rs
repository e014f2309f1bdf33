//! The compact, versioned wire encoding of a geometry fingerprint (in the handshake).
//!
//! Wire format (little-endian), version 2:
//! ```text
//! "KVGF" u16 version  u8 kind(0 MHA, 1 MLA)  u8 dtype_bytes
//! u32 page_size  u32 global_heads  u32 local_heads  u32 head_dim  u32 head_dim_v
//! u32 tp_rank  u32 tp_size  u32 pp_rank  u32 pp_size
//! u32 runs  { u32 first_layer  u32 count } × runs          (layer ids as ascending runs)
//! ```
//! Decoding is bounds-checked and validates the shape; garbage is `KVSTAGE_E_PROTOCOL`.

use super::codec::{Dec, Enc};
use crate::error::{Result, Status};
use crate::geometry::fingerprint::{layer_runs, FINGERPRINT_VERSION};
use crate::geometry::limits::MAX_LAYERS;
use crate::geometry::{Fingerprint, ModelKind, PoolShape};

pub const FINGERPRINT_MAGIC: [u8; 4] = *b"KVGF";
const FIXED_BYTES: usize = 4 + 2 + 1 + 1 + 4 * 10;

impl Fingerprint {
    pub fn encode(&self) -> Vec<u8> {
        let s = &self.shape;
        let runs = layer_runs(&s.layer_ids);
        let mut out = Enc(Vec::with_capacity(FIXED_BYTES + 4 + 8 * runs.len()));
        out.raw(&FINGERPRINT_MAGIC).u16(self.version);
        out.u8(match s.kind {
            ModelKind::Mha => 0,
            ModelKind::Mla => 1,
        });
        out.u8(s.dtype_bytes.min(255) as u8);
        for v in [s.page_size, s.global_heads, s.local_heads, s.head_dim, s.head_dim_v, s.tp_rank, s.tp_size, s.pp_rank, s.pp_size] {
            out.u32(v);
        }
        out.u32(runs.len() as u32);
        for (first, count) in runs {
            out.u32(first).u32(count);
        }
        out.0
    }

    /// Decodes and validates a peer's fingerprint; any malformed input is `KVSTAGE_E_PROTOCOL`.
    pub fn decode(bytes: &[u8]) -> Result<Fingerprint> {
        let mut r = Dec::new(bytes, "fingerprint");
        let magic = r.take(4, "magic")?;
        if magic != FINGERPRINT_MAGIC {
            return Err(r.error(format!("magic {magic:02x?} is not \"KVGF\"")));
        }
        let version = r.u16("version")?;
        if version != FINGERPRINT_VERSION {
            return Err(r.error(format!(
                "version {version} is not supported (this build reads version {FINGERPRINT_VERSION})"
            )));
        }
        let kind = match r.u8("model kind")? {
            0 => ModelKind::Mha,
            1 => ModelKind::Mla,
            other => return Err(r.error(format!("model kind {other} is unknown (0 MHA, 1 MLA)"))),
        };
        let dtype_bytes = r.u8("dtype_bytes")? as u32;
        let page_size = r.u32("page_size")?;
        let global_heads = r.u32("global_heads")?;
        let local_heads = r.u32("local_heads")?;
        let head_dim = r.u32("head_dim")?;
        let head_dim_v = r.u32("head_dim_v")?;
        let tp_rank = r.u32("tp_rank")?;
        let tp_size = r.u32("tp_size")?;
        let pp_rank = r.u32("pp_rank")?;
        let pp_size = r.u32("pp_size")?;
        let runs = r.u32("layer run count")? as usize;
        let left = r.left();
        if runs > left / 8 {
            return Err(r.error(format!("claims {runs} layer runs but only {left} bytes follow")));
        }
        let mut layer_ids = Vec::new();
        for i in 0..runs {
            let first = r.u32("layer run")?;
            let count = r.u32("layer run")?;
            if count == 0 || first.checked_add(count - 1).is_none() || layer_ids.len() + count as usize > MAX_LAYERS {
                return Err(r.error(format!(
                    "layer run {i} ({first}, {count}) is empty, overflows or exceeds {MAX_LAYERS} layers"
                )));
            }
            layer_ids.extend(first..=first + (count - 1));
        }
        r.finish()?;
        let shape = PoolShape {
            kind,
            page_size,
            local_heads,
            global_heads,
            head_dim,
            head_dim_v,
            dtype_bytes,
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
            layer_ids,
        };
        shape.validate().map_err(|e| e.wrap(Status::KVSTAGE_E_PROTOCOL, "fingerprint describes an invalid pool"))?;
        Ok(Fingerprint { version, shape })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::ModelKind;

    fn shape() -> PoolShape {
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 80).with_tp(1, 4)
    }

    #[test]
    fn round_trip_and_compactness() {
        let mut s = shape();
        s.layer_ids = vec![0, 1, 2, 5, 7, 8];
        let fp = Fingerprint::of(&s);
        let bytes = fp.encode();
        assert_eq!(bytes.len(), FIXED_BYTES + 3 * 8);
        assert_eq!(Fingerprint::decode(&bytes).unwrap(), fp);
        assert_eq!(Fingerprint::of(&shape()).encode().len(), 56);
        let mla = PoolShape::new(ModelKind::Mla, 1, 576, 2, 64, 61).with_tp(2, 8);
        assert_eq!(Fingerprint::decode(&Fingerprint::of(&mla).encode()).unwrap().shape, mla);
    }

    #[test]
    fn diff_lists_agreed_fields_only() {
        let a = Fingerprint::of(&shape());
        let b = Fingerprint::of(&PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 80).with_tp(0, 2));
        assert!(a.diff(&b).is_empty());
        a.check(&b).unwrap();
        let mut c = b.shape.clone();
        c.page_size = 64; // page sizes may differ: the staging buffer is token-major
        c.head_dim = 64;
        c.layer_ids = (0..40).collect();
        let c = Fingerprint::of(&c);
        let list: Vec<String> = a.diff(&c).iter().map(|m| m.to_string()).collect();
        assert_eq!(list, ["head_dim: local 128 != remote 64", "layer_ids: local [(0, 80)] != remote [(0, 40)]"]);
        let e = a.check(&c).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        assert_eq!(e.causes().len(), 2);
        // Stages of equal PP sizes may split the layers differently (the staged path follows
        // each side's layer ids).
        let stage = |ids: Vec<u32>| Fingerprint::of(&shape().with_pp(0, 2, ids));
        assert!(stage((0..40).collect()).diff(&stage((0..80).step_by(2).collect())).is_empty());
        // Different pipeline stages hold different layers legitimately.
        let d = Fingerprint::of(&c.shape.clone().with_pp(1, 2, (40..80).collect()).with_tp(0, 1));
        let e = Fingerprint::of(&shape().with_pp(0, 2, (0..40).collect()));
        assert_eq!(e.diff(&d).len(), 1, "{:?}", e.diff(&d));
    }

    #[test]
    fn decode_rejects_garbage_with_protocol_errors() {
        let good = Fingerprint::of(&shape()).encode();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "magic needs 4 bytes"),
            (b"KVGX\x01\x00".to_vec(), "magic"),
            ({ let mut b = good.clone(); b[4] = 1; b }, "version 1 is not supported"),
            ({ let mut b = good.clone(); b[6] = 9; b }, "model kind 9 is unknown"),
            (good[..20].to_vec(), "head_dim needs 4 bytes"),
            (good[..24].to_vec(), "head_dim_v needs 4 bytes"),
            ({ let mut b = good.clone(); b[24..28].copy_from_slice(&0u32.to_le_bytes()); b }, "describes an invalid pool"),
            ({ let mut b = good.clone(); b[44..48].copy_from_slice(&1000u32.to_le_bytes()); b }, "claims 1000 layer runs"),
            ({ let mut b = good.clone(); b[52..56].copy_from_slice(&0u32.to_le_bytes()); b }, "is empty, overflows"),
            ({ let mut b = good.clone(); b[48..52].copy_from_slice(&u32::MAX.to_le_bytes()); b }, "overflows"),
            ({ let mut b = good.clone(); b[52..56].copy_from_slice(&70000u32.to_le_bytes()); b }, "exceeds 65536"),
            ({ let mut b = good.clone(); b.push(0); b }, "1 trailing bytes"),
            ({ let mut b = good.clone(); b[7] = 3; b }, "describes an invalid pool"),
        ];
        for (bytes, text) in cases {
            let e = Fingerprint::decode(&bytes).unwrap_err();
            assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL, "{}", e.message());
            assert!(e.message().contains(text), "{} lacks {text}", e.message());
        }
        let mut b = good.clone();
        b[7] = 3;
        assert!(Fingerprint::decode(&b).unwrap_err().causes()[0].contains("`dtype_bytes`: 3"));
    }
}
