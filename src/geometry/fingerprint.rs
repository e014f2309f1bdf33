//! One rank's pool shape as its peers see it, and the field-by-field comparison of two of them.
//! Its compact wire encoding (`Fingerprint::encode` / `decode`) is in `protocol::fingerprint`.

use super::{agreed_field_mismatches, mismatch_error, PoolShape};
use crate::error::{FieldMismatch, Result};

pub const FINGERPRINT_VERSION: u16 = 2;

/// What one rank tells its peers about its pool: the agreed fields plus its position (TP/PP
/// rank and size, layer ids), so that the peer can compute staging layouts for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub version: u16,
    pub shape: PoolShape,
}

/// Ascending layer ids as `(first, count)` runs of consecutive ids.
pub(crate) fn layer_runs(ids: &[u32]) -> Vec<(u32, u32)> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &id in ids {
        match runs.last_mut() {
            Some((first, count)) if first.checked_add(*count) == Some(id) => *count += 1,
            _ => runs.push((id, 1)),
        }
    }
    runs
}

impl Fingerprint {
    pub fn of(shape: &PoolShape) -> Fingerprint {
        Fingerprint { version: FINGERPRINT_VERSION, shape: shape.clone() }
    }

    /// Fields on which `self` (local) and `remote` disagree, with both values: model kind, global
    /// heads, head_dim, dtype bytes, and the layer ids when neither side has pipeline stages (each
    /// then holds the whole model). Ranks, TP and PP sizes, page sizes, and how each side splits
    /// its layers among its stages may differ.
    pub fn diff(&self, remote: &Fingerprint) -> Vec<FieldMismatch> {
        let (a, b) = (&self.shape, &remote.shape);
        let mut list = Vec::new();
        if self.version != remote.version {
            list.push(FieldMismatch { field: "version".into(), local: self.version.to_string(), remote: remote.version.to_string() });
        }
        list.extend(agreed_field_mismatches(a, b));
        if a.pp_size == 1 && b.pp_size == 1 && a.layer_ids != b.layer_ids {
            list.push(FieldMismatch {
                field: "layer_ids".into(),
                local: format!("{:?}", layer_runs(&a.layer_ids)),
                remote: format!("{:?}", layer_runs(&b.layer_ids)),
            });
        }
        list
    }

    /// `Ok` when [`diff`](Self::diff) is empty, else `KVSTAGE_E_GEOMETRY_MISMATCH` with one cause per
    /// field.
    pub fn check(&self, remote: &Fingerprint) -> Result<()> {
        let list = self.diff(remote);
        if list.is_empty() {
            Ok(())
        } else {
            Err(mismatch_error("local and remote pools", list))
        }
    }
}

