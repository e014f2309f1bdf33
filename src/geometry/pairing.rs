//! Which ranks of the other side a rank exchanges KV data with: the sessions an engine must open
//! (prefill side) or expect (decode side).
//!
//! Tensor parallelism pairs ranks by the head mapping (docs/GEOMETRY.md, "Rank pairing";
//! prefill-side GQA replication: the one rank of each group of copies that sends; MLA: one
//! designated prefill rank per decode rank). Pipeline parallelism pairs stages by their layer ids:
//! a prefill stage writes to every decode stage holding at least one of its layers, whatever the
//! split (uneven, or not contiguous).

use super::heads::{decode_ranks_for_prefill, mla_source_rank, prefill_ranks_for_decode, sends_its_heads};
use super::state::{state_slice, StateItem};
use super::{agreed_field_mismatches, mismatch_error, ModelKind, PoolShape};
use crate::error::{Error, Result};

/// A rank of the other side: its TP rank within its stage and its PP stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerRank {
    pub tp_rank: u32,
    pub pp_rank: u32,
}

/// The decode ranks prefill rank `src` writes to, ordered by (pp_rank, tp_rank).
///
/// `dst_stages[j]` describes decode PP stage `j` (any TP rank of it: its TP size and layer ids are
/// used). Errors: stages out of order or of different TP sizes, layer ids held by two stages,
/// fields both sides must agree on that differ, TP sizes or head counts that do not pair.
pub fn decode_peers(src: &PoolShape, dst_stages: &[PoolShape]) -> Result<Vec<PeerRank>> {
    decode_peers_of_request(src, dst_stages, &[])
}

/// [`decode_peers`] for whole requests whose ranks hold the sharded per-request `states` (their
/// state components' items): a prefill rank that replicates heads another rank sends still owes
/// a decode rank the share of a sharded state item it holds, so it opens that session too
/// (docs/GEOMETRY.md, "Request parts").
pub fn decode_peers_of_request(src: &PoolShape, dst_stages: &[PoolShape], states: &[StateItem]) -> Result<Vec<PeerRank>> {
    let dst_tp = check_stages(src, dst_stages, "decode_stages")?;
    let tp_ranks: Vec<u32> = match src.kind {
        ModelKind::Mha => {
            let mut ranks = Vec::new();
            for d in decode_ranks_for_prefill(src.tp_rank, src.tp_size, dst_tp)? {
                if sends_its_heads(src.tp_rank, d, src.tp_size, dst_tp, src.global_heads) || owes_state(states, src.tp_size, dst_tp, src.tp_rank, d)? {
                    ranks.push(d);
                }
            }
            ranks
        }
        ModelKind::Mla => {
            mla_source_rank(0, src.tp_size, dst_tp)?; // checks the sizes
            (0..dst_tp).filter(|d| d % src.tp_size == src.tp_rank).collect()
        }
    };
    Ok(pairs(src, dst_stages, &tp_ranks))
}

/// The prefill ranks that write to decode rank `dst`, ordered by (pp_rank, tp_rank): the inverse of
/// [`decode_peers`]. `src_stages[j]` describes prefill PP stage `j`.
pub fn prefill_peers(dst: &PoolShape, src_stages: &[PoolShape]) -> Result<Vec<PeerRank>> {
    prefill_peers_of_request(dst, src_stages, &[])
}

/// [`prefill_peers`] for whole requests with the sharded per-request `states`: the inverse of
/// [`decode_peers_of_request`].
pub fn prefill_peers_of_request(dst: &PoolShape, src_stages: &[PoolShape], states: &[StateItem]) -> Result<Vec<PeerRank>> {
    let src_tp = check_stages(dst, src_stages, "prefill_stages")?;
    let tp_ranks: Vec<u32> = match dst.kind {
        ModelKind::Mha => {
            let mut ranks = Vec::new();
            for rs in prefill_ranks_for_decode(dst.tp_rank, src_tp, dst.tp_size)? {
                if sends_its_heads(rs, dst.tp_rank, src_tp, dst.tp_size, dst.global_heads) || owes_state(states, src_tp, dst.tp_size, rs, dst.tp_rank)? {
                    ranks.push(rs);
                }
            }
            ranks
        }
        ModelKind::Mla => vec![mla_source_rank(dst.tp_rank, src_tp, dst.tp_size)?],
    };
    Ok(pairs(dst, src_stages, &tp_ranks))
}

/// Whether prefill rank `src_rank` holds a share of a sharded state item that decode rank
/// `dst_rank` needs (a replicated item travels from one designated rank, a head sender).
fn owes_state(states: &[StateItem], src_tp: u32, dst_tp: u32, src_rank: u32, dst_rank: u32) -> Result<bool> {
    for item in states.iter().filter(|i| !i.replicated) {
        if !state_slice(item, src_tp, dst_tp, src_rank, dst_rank)?.is_empty() {
            return Ok(true);
        }
    }
    Ok(false)
}

fn pairs(local: &PoolShape, stages: &[PoolShape], tp_ranks: &[u32]) -> Vec<PeerRank> {
    let mut out = Vec::new();
    for (j, stage) in stages.iter().enumerate() {
        let shares_a_layer = stage.layer_ids.iter().any(|id| local.layer_ids.binary_search(id).is_ok());
        if shares_a_layer {
            out.extend(tp_ranks.iter().map(|&tp_rank| PeerRank { tp_rank, pp_rank: j as u32 }));
        }
    }
    out
}

/// Validates `local` and the other side's stages; returns the other side's TP size.
pub(super) fn check_stages(local: &PoolShape, stages: &[PoolShape], arg: &str) -> Result<u32> {
    local.validate()?;
    let Some(first) = stages.first() else {
        return Err(Error::invalid_arg(arg, "is empty (one shape per pipeline stage)"));
    };
    let mut owner: std::collections::BTreeMap<u32, usize> = Default::default();
    for (j, stage) in stages.iter().enumerate() {
        let name = format!("{arg}[{j}]");
        stage.validate().map_err(|e| e.context(format!("`{name}`")))?;
        if stage.pp_rank != j as u32 || stage.pp_size as usize != stages.len() {
            return Err(Error::invalid_arg(
                &name,
                format!(
                    "is pp_rank {} of pp_size {}, expected stage {j} of {} (one shape per stage, in stage order)",
                    stage.pp_rank,
                    stage.pp_size,
                    stages.len()
                ),
            ));
        }
        if stage.tp_size != first.tp_size {
            return Err(Error::invalid_arg(&name, format!("has tp_size {}, stage 0 has {}", stage.tp_size, first.tp_size)));
        }
        let list = agreed_field_mismatches(local, stage);
        if !list.is_empty() {
            return Err(mismatch_error(&format!("`{name}` and the local pool"), list));
        }
        for &id in &stage.layer_ids {
            if let Some(other) = owner.insert(id, j) {
                return Err(Error::invalid_arg(&name, format!("holds layer {id}, which stage {other} holds too")));
            }
        }
    }
    Ok(first.tp_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;
    use crate::geometry::staging_layout;

    fn stages(base: &PoolShape, tp: u32, split: &[Vec<u32>]) -> Vec<PoolShape> {
        split.iter().enumerate().map(|(j, ids)| base.clone().with_tp(0, tp).with_pp(j as u32, split.len() as u32, ids.clone())).collect()
    }

    fn even_split(layers: u32, pp: u32) -> Vec<Vec<u32>> {
        let block = layers / pp;
        (0..pp).map(|j| (j * block..(j + 1) * block).collect()).collect()
    }

    /// Every TP/PP combination up to 16 (even splits): the pairs both helpers list are exactly the
    /// (prefill, decode) rank pairs whose staging layout gives the prefill rank a region.
    #[test]
    fn pairing_matches_a_brute_force_over_staging_layouts() {
        let sizes = [1u32, 2, 4, 8, 16];
        let mut checked = 0;
        for kind in [ModelKind::Mha, ModelKind::Mla] {
            // 4 KV heads: TP 8 and 16 replicate them on the prefill side, the decode side, or both.
            let heads = if kind == ModelKind::Mha { 4 } else { 1 };
            let dim = if kind == ModelKind::Mha { 16 } else { 64 };
            let base = PoolShape::new(kind, heads, dim, 2, 4, 16);
            for (&stp, &dtp, &spp, &dpp) in itertools(&sizes) {
                let src_split = even_split(16, spp);
                let dst_split = even_split(16, dpp);
                let src_stages = stages(&base, stp, &src_split);
                let dst_stages = stages(&base, dtp, &dst_split);
                let mut brute = std::collections::BTreeSet::new();
                for (sp, s_stage) in src_stages.iter().enumerate() {
                    for (dp, d_stage) in dst_stages.iter().enumerate() {
                        for rd in 0..dtp {
                            let dst = d_stage.clone().with_tp(rd, dtp);
                            let st = staging_layout(s_stage, &dst, 4).unwrap();
                            for rs in 0..stp {
                                if st.region_of(&s_stage.clone().with_tp(rs, stp)).unwrap().is_some() {
                                    brute.insert((rs, sp as u32, rd, dp as u32));
                                }
                            }
                        }
                    }
                }
                let mut from_prefill = std::collections::BTreeSet::new();
                for (sp, s_stage) in src_stages.iter().enumerate() {
                    for rs in 0..stp {
                        for p in decode_peers(&s_stage.clone().with_tp(rs, stp), &dst_stages).unwrap() {
                            from_prefill.insert((rs, sp as u32, p.tp_rank, p.pp_rank));
                        }
                    }
                }
                let mut from_decode = std::collections::BTreeSet::new();
                for (dp, d_stage) in dst_stages.iter().enumerate() {
                    for rd in 0..dtp {
                        for p in prefill_peers(&d_stage.clone().with_tp(rd, dtp), &src_stages).unwrap() {
                            from_decode.insert((p.tp_rank, p.pp_rank, rd, dp as u32));
                        }
                    }
                }
                assert_eq!(from_prefill, brute, "{kind:?} P(tp {stp}, pp {spp}) -> D(tp {dtp}, pp {dpp}) from the prefill side");
                assert_eq!(from_decode, brute, "{kind:?} P(tp {stp}, pp {spp}) -> D(tp {dtp}, pp {dpp}) from the decode side");
                checked += 1;
            }
        }
        assert_eq!(checked, 2 * 5usize.pow(4));
    }

    /// With a sharded state item, a rank that only replicates heads pairs with every decode rank
    /// its state share goes to: the carriers (docs/GEOMETRY.md) whose share is not empty.
    #[test]
    fn sharded_state_pairs_the_replicas_that_hold_a_share() {
        use crate::geometry::parts::carriers;
        let conv = StateItem { outer: 3, groups: vec![8, 8, 16], dtype_bytes: 2, replicated: false };
        let whole = StateItem { replicated: true, ..conv.clone() };
        let mut extra = 0;
        for (stp, dtp, heads) in [(4u32, 2u32, 1u32), (4, 1, 2), (8, 2, 2), (2, 4, 1), (4, 4, 1), (2, 2, 2)] {
            let base = PoolShape::new(ModelKind::Mha, heads, 64, 2, 4, 2);
            let dst_stages = [base.clone().with_tp(0, dtp)];
            let src_stages = [base.clone().with_tp(0, stp)];
            let mut brute = std::collections::BTreeSet::new();
            for rd in 0..dtp {
                let st = staging_layout(&src_stages[0], &base.clone().with_tp(rd, dtp), 4).unwrap();
                for c in carriers(&st).unwrap() {
                    let kv = c.head_group.is_some();
                    if kv || !state_slice(&conv, stp, dtp, c.src_rank, rd).unwrap().is_empty() {
                        brute.insert((c.src_rank, rd));
                    }
                    extra += usize::from(!kv && !state_slice(&conv, stp, dtp, c.src_rank, rd).unwrap().is_empty());
                }
            }
            let mut from_prefill = std::collections::BTreeSet::new();
            let mut kv_only = std::collections::BTreeSet::new();
            for rs in 0..stp {
                let src = base.clone().with_tp(rs, stp);
                for p in decode_peers_of_request(&src, &dst_stages, &[conv.clone(), whole.clone()]).unwrap() {
                    from_prefill.insert((rs, p.tp_rank));
                }
                for p in decode_peers_of_request(&src, &dst_stages, std::slice::from_ref(&whole)).unwrap() {
                    kv_only.insert((rs, p.tp_rank));
                }
                assert_eq!(decode_peers(&src, &dst_stages).unwrap(), decode_peers_of_request(&src, &dst_stages, &[]).unwrap());
            }
            let mut from_decode = std::collections::BTreeSet::new();
            for rd in 0..dtp {
                for p in prefill_peers_of_request(&base.clone().with_tp(rd, dtp), &src_stages, std::slice::from_ref(&conv)).unwrap() {
                    from_decode.insert((p.tp_rank, rd));
                }
            }
            assert_eq!(from_prefill, brute, "P tp {stp} -> D tp {dtp}, {heads} heads, from the prefill side");
            assert_eq!(from_decode, brute, "P tp {stp} -> D tp {dtp}, {heads} heads, from the decode side");
            // A replicated item adds no session: its writer is a head sender.
            let senders: std::collections::BTreeSet<(u32, u32)> =
                (0..stp).flat_map(|rs| decode_peers(&base.clone().with_tp(rs, stp), &dst_stages).unwrap().into_iter().map(move |p| (rs, p.tp_rank))).collect();
            assert_eq!(kv_only, senders);
        }
        assert!(extra > 0, "no case had a replica owing a state share: the test proves nothing");
    }

    fn itertools(sizes: &[u32]) -> impl Iterator<Item = (&u32, &u32, &u32, &u32)> {
        sizes.iter().flat_map(move |a| sizes.iter().flat_map(move |b| sizes.iter().flat_map(move |c| sizes.iter().map(move |d| (a, b, c, d)))))
    }

    #[test]
    fn uneven_and_interleaved_stages_pair_by_shared_layers() {
        let base = PoolShape::new(ModelKind::Mha, 8, 16, 2, 4, 7);
        // Prefill stages of 4 and 3 layers into one decode stage holding all 7.
        let src = stages(&base, 2, &[vec![0, 1, 2, 3], vec![4, 5, 6]]);
        let dst = stages(&base, 1, &[(0..7).collect()]);
        assert_eq!(decode_peers(&src[1].clone().with_tp(1, 2), &dst).unwrap(), vec![PeerRank { tp_rank: 0, pp_rank: 0 }]);
        assert_eq!(
            prefill_peers(&dst[0], &src).unwrap(),
            vec![
                PeerRank { tp_rank: 0, pp_rank: 0 },
                PeerRank { tp_rank: 1, pp_rank: 0 },
                PeerRank { tp_rank: 0, pp_rank: 1 },
                PeerRank { tp_rank: 1, pp_rank: 1 }
            ]
        );
        // Three prefill stages into two decode stages (3 + 2 + 2 layers against 4 + 3).
        let src = stages(&base, 1, &[vec![0, 1, 2], vec![3, 4], vec![5, 6]]);
        let dst = stages(&base, 1, &[vec![0, 1, 2, 3], vec![4, 5, 6]]);
        let pps = |s: usize| decode_peers(&src[s], &dst).unwrap().iter().map(|p| p.pp_rank).collect::<Vec<_>>();
        assert_eq!((pps(0), pps(1), pps(2)), (vec![0], vec![0, 1], vec![1]));
        // Interleaved layer ids: every stage shares layers with both.
        let src = stages(&base, 1, &[vec![0, 2, 4, 6], vec![1, 3, 5]]);
        let dst = stages(&base, 1, &[vec![0, 1, 2], vec![3, 4, 5, 6]]);
        assert_eq!(prefill_peers(&dst[0], &src).unwrap().len(), 2);
        // A decode stage that takes a subset: prefill stage 1 (layers 4..7) has no peer there.
        let dst = stages(&base, 1, &[vec![0, 1, 2]]);
        assert!(decode_peers(&stages(&base, 1, &[vec![0, 1, 2, 3], vec![4, 5, 6]])[1], &dst).unwrap().is_empty());
    }

    #[test]
    fn bad_stage_lists_are_refused_with_the_reason() {
        let base = PoolShape::new(ModelKind::Mha, 8, 16, 2, 4, 4);
        let local = base.clone();
        let e = decode_peers(&local, &[]).unwrap_err();
        assert!(e.message().contains("`decode_stages`: is empty"), "{}", e.message());
        let twice = stages(&base, 1, &[vec![0, 1], vec![1, 2]]);
        let e = decode_peers(&local, &twice).unwrap_err();
        assert!(e.message().contains("holds layer 1, which stage 0 holds too"), "{}", e.message());
        let mut swapped = stages(&base, 1, &[vec![0, 1], vec![2, 3]]);
        swapped.swap(0, 1);
        let e = decode_peers(&local, &swapped).unwrap_err();
        assert!(e.message().contains("expected stage 0 of 2"), "{}", e.message());
        let mut mixed = stages(&base, 2, &[vec![0, 1], vec![2, 3]]);
        mixed[1] = mixed[1].clone().with_tp(0, 4);
        let e = decode_peers(&local, &mixed).unwrap_err();
        assert!(e.message().contains("has tp_size 4, stage 0 has 2"), "{}", e.message());
        let mut other_dim = stages(&base, 1, &[vec![0, 1, 2, 3]]);
        other_dim[0].head_dim = 32;
        let e = prefill_peers(&local, &other_dim).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        // 8 heads do not pair with TP 3 (the stage itself is invalid).
        let mut tp3 = stages(&base, 1, &[vec![0, 1, 2, 3]]);
        tp3[0].tp_size = 3;
        let e = decode_peers(&local, &tp3).unwrap_err();
        assert!(e.message().contains("`decode_stages[0]`"), "{}", e.message());
    }
}
