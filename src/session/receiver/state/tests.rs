//! The receiver's state machine without sockets: targeted attacks and races, then a model-based
//! property test that drives random event sequences from several connections against a small
//! reference model and checks the invariants after every step.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::geometry::ModelKind;
use crate::session::pairing;

/// Decode rank: 8 heads, head_dim 4, 2-byte dtype, 2-token pages, 2 layers, TP 1.
fn dst() -> PoolShape {
    PoolShape::new(ModelKind::Mha, 8, 4, 2, 2, 2)
}

/// Prefill rank `r` of TP `tp` (TP 2: writers 0 and 1 of every chunk).
fn src(r: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, 8, 4, 2, 2, 2).with_tp(r, tp)
}

fn info(r: u32, tp: u32, rdma: bool) -> ConnInfo {
    let (s, d) = (src(r, tp), dst());
    ConnInfo { session: format!("s{r}"), pairing: pairing(&s, &d).unwrap(), dst_strides: [Strides::token_major_of(&d, 0), Strides::token_major_of(&d, 1)], src: s, dst: d, in_place: rdma, host_pool: true, direct: false, pool_read_min_run: None, integrity: Integrity::Off, src_components: Default::default(), dst_components: Default::default() }
}

/// Room of 4 pages, chunks of 2 pages (4 tokens): each writer region is 4 tokens × 4 heads × 4
/// × 2 bytes × 2 layers × K/V = 512 bytes, a chunk 1024.
const PAGES: [u32; 4] = [3, 1, 2, 0];
const GRID: usize = 2;
const TOKENS: u32 = 4;
const REGION: u64 = 512;
const CHUNK: u64 = 1024;
/// A region's slabs (K0, K1, V0, V1) and the bytes of one.
const SLABS: usize = 4;
const SLAB: u64 = REGION / SLABS as u64;

#[test]
fn sizes_follow_the_staging_layout() {
    let layout = geometry::staging_layout(&src(0, 2), &dst(), TOKENS).unwrap();
    assert_eq!((layout.region_of(&src(0, 2)).unwrap().unwrap().bytes, layout.total_bytes), (REGION, CHUNK));
}

/// The key the unit tests open room `id` with (the model test draws its own).
fn key(id: u64) -> u64 {
    0x6b65_7900_0000_0000 | id
}

/// Room `id` as its senders name it.
fn at(id: u64) -> RoomRef {
    RoomRef { id, key: key(id) }
}

fn state(ring: u64) -> State {
    let mut st = State::new(64);
    st.register_ring(ring).unwrap();
    st
}

fn land<L: std::fmt::Debug>(t: Result<Target<L>>) -> L {
    match t {
        Ok(Target::Land(l)) => l,
        other => panic!("expected a landing, got {other:?}"),
    }
}

/// Writes writer `w`'s whole region of (room, chunk) for `conn` and reports it ready.
fn deliver(st: &mut State, conn: ConnId, room: u64, chunk: u32, w: u32) -> Result<()> {
    deliver_at(st, conn, at(room), chunk, w)
}

fn deliver_at(st: &mut State, conn: ConnId, room: RoomRef, chunk: u32, w: u32) -> Result<()> {
    let lease = land(st.begin_data(conn, room, chunk, w, w as u64 * REGION, REGION));
    st.end_data(lease, true);
    let r = st.begin_ready(conn, room, chunk, w)?;
    st.finish_ready(r, Ok(()), "s")
}

#[test]
fn another_connection_cannot_write_or_complete_a_grant_it_does_not_hold() {
    let mut st = state(4096);
    let (a, b, intruder) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)), st.add_conn(info(0, 2, false)));
    st.open_room(7, key(7), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(7), 0, 0, TOKENS, CHUNK, None).unwrap();
    // The same prefill rank on another connection: no allocation, no data, no ready, no abort.
    let e = st.allocate(intruder, at(7), 0, 0, TOKENS, CHUNK, None).unwrap_err();
    assert!(e.causes()[0].contains("carried by prefill rank (tp 0, pp 0) != remote claimed by"), "{:?}", e.causes());
    let e = st.begin_data(intruder, at(7), 0, 0, 0, REGION).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL);
    assert!(e.message().contains("without this connection's allocation"), "{}", e.message());
    assert!(st.begin_ready(intruder, at(7), 0, 0).is_err());
    st.abort(intruder, at(7), 0, "mischief");
    st.abort(intruder, at(7), u32::MAX, "mischief");
    assert!(!st.room_outcome(at(7)).unwrap(), "an abort by a non-writer must not fail the room");
    // The real writers complete it.
    deliver(&mut st, a, 7, 0, 0).unwrap();
    st.allocate(b, at(7), 0, 1, TOKENS, CHUNK, None).unwrap();
    deliver(&mut st, b, 7, 0, 1).unwrap();
    assert_eq!(layers_of(&st.take_effects().scatter), [0, 1]);
}

/// The layers a set of scatters covers, each as often as it is scattered.
fn layers_of(jobs: &[ScatterJob]) -> Vec<u32> {
    let mut layers: Vec<u32> = jobs.iter().flat_map(|j| j.layers.iter().copied()).collect();
    layers.sort_unstable();
    layers
}

/// Lands slab `slab` (K0, K1, V0, V1) of writer `w`'s region (placed at `region`).
fn land_slab(st: &mut State, conn: ConnId, w: u32, region: u64, slab: u64) {
    let lease = land(st.begin_data(conn, at(9), 0, w, region + slab * SLAB, SLAB));
    st.end_data(lease, true);
}

/// A layer goes to the pool as soon as both writers' K and V slabs of it landed, before either
/// writer's ready; the chunk is done only when both arrived and every scatter of it ended.
#[test]
fn a_layer_scatters_once_every_writer_landed_its_slabs() {
    let mut st = state(4096);
    let (a, b) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)));
    st.open_room(9, key(9), OpenRoom::pages(&PAGES[..2], GRID), None).unwrap();
    let (_, ra) = st.allocate(a, at(9), 0, 0, TOKENS, CHUNK, None).unwrap();
    for slab in [0, 2] {
        land_slab(&mut st, a, 0, ra, slab);
    }
    assert!(st.take_effects().scatter.is_empty(), "writer 1 has not even claimed its region");
    let (_, rb) = st.allocate(b, at(9), 0, 1, TOKENS, CHUNK, None).unwrap();
    land_slab(&mut st, b, 1, rb, 2);
    assert!(st.take_effects().scatter.is_empty(), "layer 0's K slab of writer 1 is missing");
    land_slab(&mut st, b, 1, rb, 0);
    let mut jobs = st.take_effects().scatter;
    assert_eq!(layers_of(&jobs), [0]);
    for (conn, w, region, slab) in [(b, 1, rb, 3), (a, 0, ra, 1), (a, 0, ra, 3)] {
        land_slab(&mut st, conn, w, region, slab);
        assert!(st.take_effects().scatter.is_empty(), "layer 1's K slab of writer 1 is missing");
    }
    land_slab(&mut st, b, 1, rb, 1);
    jobs.extend(st.take_effects().scatter);
    assert_eq!(layers_of(&jobs), [0, 1]);
    for (conn, w) in [(a, 0), (b, 1)] {
        let r = st.begin_ready(conn, at(9), 0, w).unwrap();
        st.finish_ready(r, Ok(()), "s").unwrap();
    }
    let last = st.take_effects().scatter;
    assert_eq!((last.len(), layers_of(&last)), (1, vec![]), "the last scatter has nothing left but ends the chunk");
    assert!(last[0].last && jobs.iter().all(|j| !j.last), "only the scatter queued at the last arrival is timed from it");
    jobs.extend(last);
    while let Some(job) = jobs.pop() {
        assert!(!st.room_outcome(at(9)).unwrap(), "done with {} scatters still running", jobs.len() + 1);
        st.scatter_done(&job, Ok(None));
    }
    assert!(st.room_outcome(at(9)).unwrap());
    assert_eq!(st.ring_stats().1, 0);
}

/// A chunk that carries a checksum reaches the pool only after its writers' ready were verified;
/// an RDMA writer's bytes count only once it arrived (its immediate binds them).
#[test]
fn checksummed_chunks_and_rdma_writers_hold_the_scatter_back() {
    for (checksummed, rdma) in [(true, false), (false, true)] {
        let mut st = state(4096);
        let integrity = if checksummed { Integrity::Always } else { Integrity::Off };
        // The second writer's policy decides: one checksummed writer holds the whole chunk.
        let a = st.add_conn(ConnInfo { integrity: Integrity::Off, ..info(0, 2, false) });
        let b = st.add_conn(ConnInfo { integrity, ..info(1, 2, rdma) });
        st.open_room(9, key(9), OpenRoom::pages(&PAGES[..2], GRID), None).unwrap();
        let (_, ra) = st.allocate(a, at(9), 0, 0, TOKENS, CHUNK, None).unwrap();
        let (_, rb) = st.allocate(b, at(9), 0, 1, TOKENS, CHUNK, None).unwrap();
        if rdma {
            st.written_in_place(b, at(9), 0, 1, rb, REGION).unwrap();
        } else {
            land_slab(&mut st, b, 1, rb, 0);
            for slab in 1..4 {
                land_slab(&mut st, b, 1, rb, slab);
            }
        }
        for slab in 0..4 {
            land_slab(&mut st, a, 0, ra, slab);
        }
        assert!(st.take_effects().scatter.is_empty(), "checksummed {checksummed}, rdma {rdma}: scattered early");
        let r = st.begin_ready(b, at(9), 0, 1).unwrap();
        st.finish_ready(r, Ok(()), "s").unwrap();
        let early = st.take_effects().scatter;
        // Once the RDMA writer arrived, its bytes count: the other writer's are all in.
        assert_eq!(layers_of(&early), if rdma { vec![0, 1] } else { vec![] }, "checksummed {checksummed}, rdma {rdma}");
        let r = st.begin_ready(a, at(9), 0, 0).unwrap();
        st.finish_ready(r, Ok(()), "s").unwrap();
        let rest = st.take_effects().scatter;
        assert_eq!(layers_of(&rest), if rdma { vec![] } else { vec![0, 1] }, "checksummed {checksummed}, rdma {rdma}");
    }
}

#[test]
fn slab_writes_land_in_any_order_once_each_and_one_at_a_time() {
    let mut st = state(4096);
    let a = st.add_conn(info(0, 2, false));
    st.open_room(7, key(7), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(7), 0, 0, TOKENS, CHUNK, None).unwrap();
    let refused = |r: Result<Target<WriteLease>>, why: &str| {
        let e = r.unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL);
        assert!(e.message().contains(why), "{}", e.message());
    };
    // The last quarter first, then a second write while it is still landing: refused, whatever
    // its range (the overlap check sees only landed bytes).
    let last = land(st.begin_data(a, at(7), 0, 0, 3 * REGION / 4, REGION / 4));
    refused(st.begin_data(a, at(7), 0, 0, 0, REGION / 4), "still landing");
    st.end_data(last, true);
    // Past the region's end, or over landed bytes: refused.
    refused(st.begin_data(a, at(7), 0, 0, REGION - 1, 2), "outside this writer's region");
    refused(st.begin_data(a, at(7), 0, 0, 3 * REGION / 4 - 1, 2), "overlaps bytes already written");
    let first = land(st.begin_data(a, at(7), 0, 0, 0, REGION / 4));
    st.end_data(first, true);
    // Ready with a hole in the middle fails the room; a fresh room fills the hole out of order.
    assert!(st.begin_ready(a, at(7), 0, 0).is_err());
    assert!(st.room_outcome(at(7)).is_err(), "a ready with a hole must fail the room");
    let b = st.add_conn(info(1, 2, false));
    st.open_room(8, key(8), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(b, at(8), 0, 1, TOKENS, CHUNK, None).unwrap();
    // Its region is the allocation's first (regions are placed in claim order).
    for (off, len) in [(REGION / 2, REGION / 2), (0, 0), (0, REGION / 2)] {
        let l = land(st.begin_data(b, at(8), 0, 1, off, len));
        st.end_data(l, true);
    }
    let r = st.begin_ready(b, at(8), 0, 1).expect("a region written back to front is complete");
    st.finish_ready(r, Ok(()), "s").unwrap();
}

fn stage_info(tp_rank: u32, pp_rank: u32, layers: Vec<u32>) -> ConnInfo {
    let (s, d) = (src(tp_rank, 2).with_pp(pp_rank, 2, layers), dst());
    let session = format!("tp{tp_rank}-pp{pp_rank}");
    ConnInfo { session, pairing: pairing(&s, &d).unwrap(), dst_strides: [Strides::token_major_of(&d, 0), Strides::token_major_of(&d, 1)], src: s, dst: d, in_place: false, host_pool: true, direct: false, pool_read_min_run: None, integrity: Integrity::Off, src_components: Default::default(), dst_components: Default::default() }
}

/// Prefill TP 2 × PP 2 (one layer per stage) into the decode rank's two layers: four regions of a
/// quarter chunk, placed in the order the requests come, and the chunk completes only with all.
#[test]
fn regions_of_one_head_group_from_several_stages_complete_a_chunk_together() {
    const QUARTER: u64 = CHUNK / 4;
    let mut st = state(4 * CHUNK);
    let order = [(1, 1), (0, 0), (1, 0), (0, 1)];
    let conns: Vec<ConnId> = order.iter().map(|&(t, p)| st.add_conn(stage_info(t, p, vec![p]))).collect();
    st.open_room(3, key(3), OpenRoom::pages(&PAGES[..2], GRID), None).unwrap();
    for (i, (&c, &(t, _))) in conns.iter().zip(&order).enumerate() {
        let (_, region) = st.allocate(c, at(3), 0, t, TOKENS, CHUNK, None).unwrap();
        assert_eq!(region, i as u64 * QUARTER, "placed in request order");
        let lease = land(st.begin_data(c, at(3), 0, t, region, QUARTER));
        st.end_data(lease, true);
        let r = st.begin_ready(c, at(3), 0, t).unwrap();
        st.finish_ready(r, Ok(()), "s").unwrap();
        let scattered = st.take_effects().scatter;
        assert_eq!(layers_of(&scattered), if i == 3 { vec![0, 1] } else { vec![] }, "after {} of 4 regions", i + 1);
        assert!(scattered.iter().all(|job| job.layout.writers.len() == 4));
    }
}

/// The same prefill rank on a second connection is refused and the room goes on; a different rank
/// claiming a layer of the same heads means the sides split the pipeline differently: the room fails.
#[test]
fn an_overlapping_claim_fails_the_room_only_from_another_rank() {
    let mut st = state(4 * CHUNK);
    let first = st.add_conn(stage_info(0, 0, vec![0]));
    let twin = st.add_conn(stage_info(0, 0, vec![0]));
    let other_stage = st.add_conn(stage_info(0, 1, vec![0, 1]));
    st.open_room(4, key(4), OpenRoom::pages(&PAGES[..2], GRID), None).unwrap();
    st.allocate(first, at(4), 0, 0, TOKENS, CHUNK, None).unwrap();
    let e = st.allocate(twin, at(4), 0, 0, TOKENS, CHUNK, None).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
    assert!(!st.room_outcome(at(4)).unwrap(), "a duplicate of a writer does not fail the room");
    let e = st.allocate(other_stage, at(4), 0, 0, TOKENS, CHUNK, None).unwrap_err();
    assert!(e.causes()[0].contains("layer 0 of head group 0"), "{:?}", e.causes());
    let failed = st.room_outcome(at(4)).unwrap_err();
    assert_eq!(failed.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
    assert!(failed.message().contains("claimed by prefill rank (tp 0, pp 1)"), "{}", failed.message());
}

/// A writer refused for its share of a chunk another writer was granted (its tokens, its size)
/// leaves the chunk unfinishable: the room fails at once naming the writer and why, and the
/// chunk's grant goes back to the ring.
#[test]
fn a_writer_refused_for_its_share_fails_the_room_and_frees_the_grant() {
    for case in 0..3 {
        let mut st = state(4 * CHUNK);
        let (a, b) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)));
        st.open_room(7, key(7), OpenRoom::pages(&PAGES, GRID), None).unwrap();
        st.allocate(a, at(7), 0, 0, TOKENS, CHUNK, None).unwrap();
        assert_eq!(st.ring_stats().1, 1);
        let e = match case {
            0 => st.allocate(b, at(7), 0, 1, TOKENS - 1, CHUNK, None),
            1 => st.allocate(b, at(7), 0, 1, TOKENS, CHUNK + 1, None),
            _ => st.allocate(b, at(7), 0, 1, TOKENS, CHUNK, Some(&[4])),
        }
        .unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "case {case}: {}", e.chain());
        let failed = st.room_outcome(at(7)).unwrap_err();
        assert_eq!(failed.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        assert!(failed.message().contains("writer 1 (session s1, prefill tp rank 1 pp rank 0) was refused for chunk 0: "), "{}", failed.message());
        assert!(failed.message().contains(e.message()), "case {case}: {} does not say {}", failed.message(), e.message());
        assert_eq!(st.ring_stats().1, 0, "case {case}: the unfinishable chunk's grant stayed in the ring");
    }
}

/// A session is idle (may be cut for a newcomer) only when cutting it fails nothing: one that
/// wrote a finished chunk of a room still waiting for its next chunk is not; once cut, it claims
/// nothing more.
#[test]
fn a_session_between_the_chunks_of_a_room_is_not_idle_and_a_cut_one_claims_nothing() {
    let mut st = state(4 * CHUNK);
    let (a, b) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)));
    assert!(st.holds_nothing(a) && st.holds_nothing(b));
    st.open_room(3, key(3), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    for (conn, w) in [(a, 0), (b, 1)] {
        st.allocate(conn, at(3), 0, w, TOKENS, CHUNK, None).unwrap();
        deliver(&mut st, conn, 3, 0, w).unwrap();
    }
    let jobs = st.take_effects().scatter;
    for j in &jobs {
        st.scatter_done(j, Ok(None));
    }
    assert_eq!(st.rooms[&3].chunks[0].phase, Phase::Done, "chunk 0 scattered");
    assert!(!st.holds_nothing(a), "between a room's chunks a writer owes the next: cutting it would fail the room");
    assert_eq!(st.cut_idle(&[a, b]), None);
    st.release_room(at(3));
    assert_eq!(st.cut_idle(&[a, b]), Some(a), "the room released, the first candidate is idle");
    st.open_room(4, key(4), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    let e = st.allocate(a, at(4), 0, 0, TOKENS, CHUNK, None).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_PEER_GONE, "{}", e.chain());
    assert!(st.holds_nothing(a), "a session being cut claimed a grant");
    st.conn_gone(a, Status::KVSTAGE_E_PEER_GONE, "cut");
    assert!(!st.room_outcome(at(4)).unwrap(), "the cut session failed nothing");
}

/// A connection gone after its chunks: a chunk it never claimed is not owed by it when another
/// connection carries its layers there, so the room lives on.
#[test]
fn a_departed_writer_does_not_owe_a_chunk_another_connection_carries_for_it() {
    let mut st = state(4 * CHUNK);
    let (a, twin) = (st.add_conn(info(0, 2, false)), st.add_conn(info(0, 2, false)));
    st.open_room(5, key(5), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(5), 0, 0, TOKENS, CHUNK, None).unwrap();
    deliver(&mut st, a, 5, 0, 0).unwrap();
    st.allocate(twin, at(5), 1, 0, TOKENS, CHUNK, None).unwrap();
    st.conn_gone(a, Status::KVSTAGE_E_PEER_GONE, "closed");
    assert!(!st.room_outcome(at(5)).unwrap(), "nothing a owed is missing");
    st.conn_gone(twin, Status::KVSTAGE_E_PEER_GONE, "closed");
    assert_eq!(st.room_outcome(at(5)).unwrap_err().code(), Status::KVSTAGE_E_PEER_GONE, "twin owed chunk 1");
}

#[test]
fn a_release_during_a_payload_read_defers_the_free_and_discards_the_bytes() {
    let mut st = state(CHUNK);
    let a = st.add_conn(info(0, 2, false));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    let lease = land(st.begin_data(a, at(1), 0, 0, 0, REGION));
    assert_eq!(st.release_room(at(1)), Release::Done);
    // The grant is still live: nobody may get this range while the read writes into it.
    assert_eq!(st.ring_stats().1, 1);
    let reopened = RoomRef { id: 1, key: key(1) + 1 };
    st.open_room(1, reopened.key, OpenRoom::pages(&PAGES, GRID), None).unwrap();
    let b = st.add_conn(info(1, 2, false));
    let (g, _) = st.allocate(b, reopened, 0, 1, TOKENS, CHUNK, None).unwrap();
    assert!(!st.watermark().permits(g.round, g.end()), "a new grant over a pinned range must wait for the watermark");
    assert!(st.register_ring(CHUNK).is_err(), "the ring cannot be replaced under a read");
    st.end_data(lease, true);
    assert!(st.watermark().permits(g.round, g.end()));
    // The old lease's bytes did not count for the reopened room; the old opening's next write is
    // discarded as stale (its session lives on), one naming the new opening has no allocation.
    match st.begin_data(a, at(1), 0, 0, 0, REGION) {
        Ok(Target::Discard(e)) => assert_eq!(e.code(), Status::KVSTAGE_E_STALE_ROOM, "{}", e.message()),
        other => panic!("a stale writer's data must be discarded: {other:?}"),
    }
    assert!(st.begin_data(a, reopened, 0, 0, 0, REGION).unwrap_err().message().contains("without this connection's allocation"));
}

#[test]
fn a_room_id_cannot_be_reopened_while_its_scatter_runs() {
    let mut st = state(4096);
    let (a, b) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)));
    st.open_room(5, key(5), OpenRoom::pages(&PAGES[..2], GRID), None).unwrap();
    for (c, w) in [(a, 0), (b, 1)] {
        st.allocate(c, at(5), 0, w, TOKENS, CHUNK, None).unwrap();
        deliver(&mut st, c, 5, 0, w).unwrap();
    }
    let jobs = st.take_effects().scatter;
    let Release::Draining { gen, .. } = st.release_room(at(5)) else { panic!("a running scatter holds the pages") };
    assert!(st.open_room(5, key(5), OpenRoom::pages(&PAGES, GRID), None).unwrap_err().message().contains("still being released"));
    for job in &jobs {
        assert!(st.draining(5, gen).is_some());
        st.scatter_done(job, Ok(None));
    }
    assert!(st.draining(5, gen).is_none());
    assert_eq!(st.ring_stats().1, 0);
    st.open_room(5, key(5), OpenRoom::pages(&PAGES, GRID), None).unwrap();
}

#[test]
fn a_new_ring_starts_its_own_high_water_mark() {
    let mut st = state(4 * CHUNK);
    let a = st.add_conn(info(0, 2, false));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    st.allocate(a, at(1), 1, 0, TOKENS, CHUNK, None).unwrap();
    assert_eq!(st.metrics().ring_high_water, 2 * CHUNK);
    assert_eq!(st.release_room(at(1)), Release::Done);
    assert_eq!(st.ring_stats().1, 0);
    // A smaller ring replaces it: the old mark would exceed the new ring's size.
    st.register_ring(CHUNK).unwrap();
    assert_eq!(st.metrics().ring_high_water, 0);
    st.open_room(2, key(2), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(2), 0, 0, TOKENS, CHUNK, None).unwrap();
    assert_eq!(st.metrics().ring_high_water, CHUNK);
}

#[test]
fn senders_of_one_room_must_share_the_prefill_geometry() {
    let mut st = state(1 << 20);
    let (tp2, tp4) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 4, false)));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(tp2, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    let e = st.allocate(tp4, at(1), 0, 1, TOKENS, 512, None).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
    assert!(e.causes().iter().any(|c| c.contains("tp_size: local 2 != remote 4")), "{:?}", e.causes());
}

#[test]
fn a_refused_request_does_not_decide_the_rooms_prefill_geometry() {
    let mut st = state(1 << 20);
    let (tp4, tp2) = (st.add_conn(info(1, 4, false)), st.add_conn(info(0, 2, false)));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    // A stale request (a chunk past the room) from a sender of another TP size is refused...
    assert_eq!(st.allocate(tp4, at(1), 9, 1, TOKENS, 512, None).unwrap_err().code(), Status::KVSTAGE_E_PROTOCOL);
    // ...and the room's real writers are still accepted.
    st.allocate(tp2, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    assert_eq!(st.allocate(tp4, at(1), 0, 1, TOKENS, 512, None).unwrap_err().code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
}

#[test]
fn late_frames_for_closed_rooms_are_discarded_not_fatal() {
    let mut st = state(4096);
    let a = st.add_conn(info(0, 2, false));
    assert!(matches!(st.begin_data(a, at(99), 0, 0, 0, 10), Ok(Target::Discard(_))));
    assert!(matches!(st.begin_slice(a, at(99), 0, 0, 0, 0, 32), Ok(Target::Discard(_))));
    assert_eq!(st.begin_ready(a, at(99), 0, 0).unwrap_err().code(), Status::KVSTAGE_E_STALE_ROOM);
    st.open_room(3, key(3), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(3), 0, 0, TOKENS, CHUNK, None).unwrap();
    st.fail_room(3, Status::KVSTAGE_E_CANCELED, "test".into(), "");
    assert!(matches!(st.begin_data(a, at(3), 0, 0, 0, REGION), Ok(Target::Discard(_))));
    assert_eq!(st.ring_stats().1, 0);
}

/// Decode opens room 7 for request A, A is canceled and the room released, 7 is opened again
/// for request B: A's sender, still sending, gets nothing of B (no grant, no bytes, no arrival),
/// cannot fail B and keeps its session; B completes with its own writers. A guesser holding the
/// cluster token gets nothing either.
#[test]
fn a_stale_writer_or_a_guess_claims_nothing_in_a_reopened_room() {
    let mut st = state(4 * CHUNK);
    let (stale, b0, b1, guesser) = (st.add_conn(info(0, 2, false)), st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)), st.add_conn(info(1, 2, false)));
    let a = RoomRef { id: 7, key: 0xa };
    st.open_room(7, a.key, OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(stale, a, 0, 0, TOKENS, CHUNK, None).unwrap();
    let half = land(st.begin_data(stale, a, 0, 0, 0, REGION / 2));
    st.end_data(half, true);
    assert_eq!(st.release_room(a), Release::Done);
    let b = RoomRef { id: 7, key: 0xb };
    st.open_room(7, b.key, OpenRoom::pages(&PAGES, GRID), None).unwrap();
    let stale_code = |e: Error| e.code();
    // A's sender goes on with A's key: chunk 0's rest, its ready, chunk 1's allocation, slices.
    match st.begin_data(stale, a, 0, 0, REGION / 2, REGION / 2) {
        Ok(Target::Discard(e)) => assert_eq!(e.code(), Status::KVSTAGE_E_STALE_ROOM),
        other => panic!("{other:?}"),
    }
    assert_eq!(st.begin_ready(stale, a, 0, 0).map(|_| ()).map_err(stale_code), Err(Status::KVSTAGE_E_STALE_ROOM));
    assert_eq!(st.allocate(stale, a, 1, 0, TOKENS, CHUNK, None).map(|_| ()).map_err(stale_code), Err(Status::KVSTAGE_E_STALE_ROOM));
    assert!(matches!(st.begin_slice(stale, a, 1, 0, 0, 0, 32), Ok(Target::Discard(e)) if e.code() == Status::KVSTAGE_E_STALE_ROOM));
    assert_eq!(st.slice_done(stale, a, 1).map_err(stale_code), Err(Status::KVSTAGE_E_STALE_ROOM));
    assert_eq!(st.room_grid(stale, a).map(|_| ()).map_err(stale_code), Err(Status::KVSTAGE_E_STALE_ROOM));
    st.abort(stale, a, u32::MAX, "A canceled");
    // A connection that holds a writer slot in B, aborting with A's key (its late abort of A):
    // B goes on.
    st.allocate(b0, b, 0, 0, TOKENS, CHUNK, None).unwrap();
    st.abort(b0, a, u32::MAX, "A canceled, late");
    st.abort(b0, a, 0, "A canceled, late");
    assert!(!st.room_outcome(b).unwrap(), "an abort naming A failed B");
    // Guessed keys: refused the same way, and the reply does not tell the open key.
    for guess in [0, 1, 0xa, 0xc, u64::MAX] {
        let e = st.allocate(guesser, RoomRef { id: 7, key: guess }, 0, 1, TOKENS, CHUNK, None).map(|_| ()).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_STALE_ROOM);
        assert!(!e.message().contains("0xb") && !e.message().contains(" 11"), "{}", e.message());
        st.abort(guesser, RoomRef { id: 7, key: guess }, u32::MAX, "mischief");
    }
    assert!(!st.room_outcome(b).unwrap(), "B neither failed nor completed by another opening's frames");
    assert_eq!(st.ring_stats().1, 1, "nothing was granted for the stale or guessed frames (one grant: b0's)");
    // B's own writers: both chunks, both writers, each claim free for them.
    for chunk in 0..2 {
        for (conn, w) in [(b0, 0), (b1, 1)] {
            if (chunk, w) != (0, 0) {
                st.allocate(conn, b, chunk, w, TOKENS, CHUNK, None).unwrap();
            }
            deliver_at(&mut st, conn, b, chunk, w).unwrap();
        }
    }
    for job in st.take_effects().scatter {
        st.scatter_done(&job, Ok(None));
    }
    assert!(st.room_outcome(b).unwrap(), "B completes with its own writers");
    // A stale sender's session is still usable: it writes into B with B's key.
    assert!(st.conns.contains_key(&stale));
}

#[test]
fn rdma_grants_stay_quarantined_until_the_writer_is_done() {
    let mut st = state(CHUNK);
    let a = st.add_conn(info(0, 2, true));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    st.release_room(at(1));
    assert_eq!(st.ring_stats().1, 1, "the sender may still RDMA-write its grant");
    st.abort(a, at(1), 0, "gave up");
    assert_eq!(st.ring_stats().1, 0, "its abort ends the quarantine");
    st.open_room(2, key(2), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(2), 0, 0, TOKENS, CHUNK, None).unwrap();
    st.release_room(at(2));
    assert_eq!(st.ring_stats().1, 1);
    st.conn_gone(a, Status::KVSTAGE_E_PEER_GONE, "closed");
    assert_eq!(st.ring_stats().1, 0, "its queue pairs are gone: nothing more can land");
}

#[test]
fn a_mapped_writer_keeps_its_quarantine_past_its_connection_until_it_unmaps() {
    // Connection gone first, then the mapping (a sender whose stream was cut mid-gather).
    let mut st = state(CHUNK);
    let a = st.add_conn(info(0, 2, false));
    st.set_in_place(a, true);
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    st.conn_gone(a, Status::KVSTAGE_E_PEER_GONE, "closed");
    assert!(st.room_outcome(at(1)).is_err(), "the room it owed fails");
    st.release_room(at(1));
    assert_eq!(st.ring_stats().1, 1, "it may still write through its mapping");
    let b = st.add_conn(info(0, 2, false));
    st.open_room(2, key(2), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    let (_, region) = st.allocate(b, at(2), 0, 0, TOKENS, CHUNK, None).unwrap();
    assert!(st.begin_data(b, at(2), 0, 0, region, REGION).is_err(), "the range is not writable by another meanwhile");
    st.unmapped(a);
    assert_eq!(st.ring_stats().1, 1, "unmapped: nothing more can land, only the new grant is live");
    assert!(matches!(st.begin_data(b, at(2), 0, 0, region, REGION), Ok(Target::Land(_))));

    // Mapping gone first (the process died), then the connection; and a ready writer's grant is
    // not held by its mapping at all.
    let mut st = state(CHUNK);
    let a = st.add_conn(info(0, 2, false));
    st.set_in_place(a, true);
    assert_eq!(st.mapped_conns(), vec![a]);
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    st.unmapped(a);
    st.release_room(at(1));
    assert_eq!(st.ring_stats().1, 0);
    st.conn_gone(a, Status::KVSTAGE_E_PEER_GONE, "closed");
    assert!(st.mapped_conns().is_empty());
}

/// A connection set up for direct mode that asks for it gets the chunk's pages, and its region
/// is never scattered from the ring; one that is not set up, or does not ask, gets a ring grant.
#[test]
fn direct_grants_name_the_chunks_pages_and_their_regions_are_not_scattered() {
    let mut st = state(4 * CHUNK);
    let (a, b) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)));
    st.set_in_place(a, true);
    st.set_direct(a);
    st.set_in_place(b, true);
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    let g = st.grant(a, at(1), 1, 0, TOKENS, CHUNK, None, true).unwrap();
    assert_eq!(g.pages, PAGES[2..4], "chunk 1's pages");
    // Its bytes on the stream would land in the ring, which is never scattered for it.
    let e = st.begin_data(a, at(1), 1, 0, 0, REGION).unwrap_err();
    assert!(e.code() == Status::KVSTAGE_E_PROTOCOL && e.message().contains("granted to be written into the pool directly"), "{}", e.chain());
    let g = st.grant(b, at(1), 1, 1, TOKENS, CHUNK, None, true).unwrap();
    assert!(g.pages.is_empty(), "a session that does not map the pool writes through the ring");
    let g = st.grant(a, at(1), 0, 0, TOKENS, CHUNK, None, false).unwrap();
    assert!(g.pages.is_empty(), "not asked for");
    st.take_effects();
    for (conn, w) in [(a, 0), (b, 1)] {
        st.written_in_place(conn, at(1), 1, w, w as u64 * REGION, REGION).unwrap();
        let r = st.begin_ready(conn, at(1), 1, w).unwrap();
        assert_eq!((r.in_pool.is_some(), r.mapped), (conn == a, conn == a), "the ready of writer {w} says where its bytes are");
        st.finish_ready(r, Ok(()), "s").unwrap();
    }
    let jobs = st.take_effects().scatter;
    assert!(!jobs.is_empty() && jobs.iter().all(|j| j.in_pool == [0]), "writer 0's region is left out of every scatter: {jobs:?}");
}

/// A stream connection into a host pool has a region read straight into the pool's pages when
/// no checksum must be verified first: its payload's lease names the region (and holds the room's
/// pages until the read ends: a release drains meanwhile), and no scatter copies it. A chunk the
/// integrity policy covers, a connection that writes in place, or one not allowed to, lands in the
/// ring.
#[test]
fn stream_payloads_without_a_checksum_are_read_into_the_pool() {
    let reads_with = |integrity: Integrity, in_place: bool, min_run: Option<u64>| {
        let mut st = state(4 * CHUNK);
        let a = st.add_conn(ConnInfo { pool_read_min_run: min_run, integrity, ..info(0, 2, in_place) });
        st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
        let (_, region) = st.allocate(a, at(1), 1, 0, TOKENS, CHUNK, None).unwrap();
        let Ok(Target::Land(lease)) = st.begin_data(a, at(1), 1, 0, region + 8, REGION - 8) else { panic!("a write of its region lands") };
        let read = lease.into_pool.clone();
        if let Some((plan, offset)) = &read {
            let layout = st.rooms[&1].chunks[1].layout.clone().expect("granted");
            let want = geometry::plan_scatter(&dst(), &PAGES[2..4], &layout, &layout.writers[0]).unwrap();
            assert_eq!((&**plan, *offset), (&want, 8), "region 0's rows in chunk 1's pages, the payload's offset in the region");
            let gen = st.rooms[&1].gen;
            assert_eq!(st.release_room(at(1)), Release::Draining { gen, holders: vec![a] }, "the read holds the room's pages");
            st.end_data(lease, false);
            assert!(!st.rooms.contains_key(&1), "the room left once the read ended");
        } else {
            st.end_data(lease, true);
        }
        read.is_some()
    };
    let reads = |integrity: Integrity, in_place: bool, allowed: bool| reads_with(integrity, in_place, allowed.then_some(0));
    assert!(reads(Integrity::Off, false, true));
    // Writer 0 of two carries half the decode slot's heads: its rows in the pool are head slices,
    // one row long at a time.
    let row = REGION / (TOKENS as u64 * 2 * 2); // 2 layers, K and V
    assert!(reads_with(Integrity::Off, false, Some(row)), "runs of a row reach a minimum of a row");
    assert!(!reads_with(Integrity::Off, false, Some(row + 1)), "runs shorter than the minimum land in the ring");
    assert!(!reads(Integrity::Always, false, true), "a covered chunk is verified in the ring before it reaches the pages");
    assert!(!reads(Integrity::Off, true, true), "an in-place (RDMA) writer writes the ring");
    assert!(!reads(Integrity::Off, false, false), "not allowed (a device pool, or the ring forced)");

    // Read whole, the region is left out of the chunk's scatter.
    let mut st = state(4 * CHUNK);
    let (a, b) = (st.add_conn(ConnInfo { pool_read_min_run: Some(0), ..info(0, 2, false) }), st.add_conn(info(1, 2, false)));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    for (conn, w) in [(a, 0u32), (b, 1)] {
        let (_, region) = st.allocate(conn, at(1), 0, w, TOKENS, CHUNK, None).unwrap();
        let Ok(Target::Land(lease)) = st.begin_data(conn, at(1), 0, w, region, REGION) else { panic!("lands") };
        assert_eq!(lease.into_pool.is_some(), conn == a);
        st.end_data(lease, true);
        let r = st.begin_ready(conn, at(1), 0, w).unwrap();
        assert_eq!((r.in_pool.is_some(), r.mapped), (conn == a, false));
        st.finish_ready(r, Ok(()), "s").unwrap();
    }
    let jobs = st.take_effects().scatter;
    assert!(!jobs.is_empty() && jobs.iter().all(|j| j.in_pool == [0]), "the region read into the pool is not scattered: {jobs:?}");
}

/// A direct writer holds the room's pages: its release drains until the writer reported ready,
/// aborted, or its mapping ended (never by its connection alone: it may still copy).
#[test]
fn a_direct_writer_holds_its_rooms_pages_until_it_reports_or_unmaps() {
    for end in ["ready", "abort", "unmapped"] {
        let mut st = state(4 * CHUNK);
        let a = st.add_conn(info(0, 2, false));
        st.set_in_place(a, true);
        st.set_direct(a);
        st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
        assert!(!st.grant(a, at(1), 0, 0, TOKENS, CHUNK, None, true).unwrap().pages.is_empty());
        assert_eq!(st.release_room(at(1)), Release::Draining { gen: st.rooms[&1].gen, holders: vec![a] }, "{end}");
        match end {
            // A report after the release: refused, but the writer is done with the pages.
            "ready" => assert!(st.begin_ready(a, at(1), 0, 0).is_err()),
            "abort" => st.abort(a, at(1), 0, "gave up"),
            _ => {
                st.conn_gone(a, Status::KVSTAGE_E_PEER_GONE, "closed");
                assert!(st.draining(1, st.rooms[&1].gen).is_some(), "the connection's end does not stop a copy in progress");
                st.unmapped(a);
            }
        }
        assert!(!st.rooms.contains_key(&1), "{end}: the room left once its writer could no longer write");
    }
}

#[test]
fn a_mapping_of_a_replaced_ring_gets_no_grant() {
    let mut st = state(CHUNK);
    let a = st.add_conn(info(0, 2, false));
    st.set_in_place(a, true);
    st.register_ring(2 * CHUNK).unwrap();
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    let e = st.allocate(a, at(1), 0, 0, TOKENS, CHUNK, None).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_PEER_GONE);
    assert!(e.message().contains("registered again"), "{}", e.chain());
    // A session that maps the new ring is served.
    let b = st.add_conn(info(0, 2, false));
    st.set_in_place(b, true);
    st.allocate(b, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
}

#[test]
fn slices_complete_only_when_every_row_arrived_once() {
    let mut st = state(4096);
    let (a, b) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES[..2], GRID), None).unwrap();
    let row = |w: u32| (w * 32, 32);
    let d = dst();
    let send = |st: &mut State, c, w: u32, buffer, token| {
        let (off, len) = row(w);
        let l = land(st.begin_slice(c, at(1), 0, buffer, token, off, len));
        st.end_slice(l, true);
    };
    for t in 0..TOKENS {
        send(&mut st, a, 0, d.buffer_index(0, 0), t);
    }
    let e = st.slice_done(a, at(1), 0).unwrap_err();
    assert!(e.message().contains("after 4 of 16 rows"), "{}", e.message());
    assert!(st.room_outcome(at(1)).is_err(), "a writer short of rows fails the room");
    st.release_room(at(1));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES[..2], GRID), None).unwrap();
    for (c, w) in [(a, 0), (b, 1)] {
        for buffer in 0..4 {
            for t in 0..TOKENS {
                send(&mut st, c, w, buffer, t);
            }
        }
    }
    let (off, len) = row(0);
    assert!(st.begin_slice(a, at(1), 0, 0, 0, off, len).unwrap_err().message().contains("written twice"));
    st.slice_done(a, at(1), 0).unwrap();
    st.slice_done(b, at(1), 0).unwrap();
    assert!(st.room_outcome(at(1)).unwrap());
}

#[test]
fn one_chunk_cannot_mix_staged_and_slice_writers() {
    let mut st = state(4096);
    let (a, b) = (st.add_conn(info(0, 2, false)), st.add_conn(info(1, 2, false)));
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.allocate(a, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    let Ok(Target::Discard(e)) = st.begin_slice(b, at(1), 0, 0, 0, 32, 32) else { panic!("slice into a staged chunk") };
    assert_eq!(e.code(), Status::KVSTAGE_E_UNSUPPORTED);
    assert_eq!(st.slice_done(b, at(1), 0).unwrap_err().code(), Status::KVSTAGE_E_UNSUPPORTED);
    let l = land(st.begin_slice(b, at(1), 1, 0, 0, 32, 32));
    st.end_slice(l, true);
    assert_eq!(st.allocate(a, at(1), 1, 0, TOKENS, CHUNK, None).unwrap_err().code(), Status::KVSTAGE_E_UNSUPPORTED);
}

#[test]
fn events_are_bounded_and_rooms_expire() {
    let mut st = State::new(2);
    st.register_ring(4096).unwrap();
    let now = Instant::now();
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), Some(now + Duration::from_secs(1))).unwrap();
    st.expire(now);
    assert!(!st.room_outcome(at(1)).unwrap());
    st.expire(now + Duration::from_secs(2));
    assert_eq!(st.room_outcome(at(1)).unwrap_err().code(), Status::KVSTAGE_E_TIMEOUT);
    st.open_room(2, key(2), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    st.fail_room(2, Status::KVSTAGE_E_CANCELED, "x".into(), "");
    // Each failed room queues its 2 chunks' events and its own: 6 events, 2 kept (room 1's chunks).
    assert_eq!(st.pending_events(), 2);
    assert_eq!(st.counters(), Counters { events_dropped: 4, rooms_expired: 1 });
    let kept: Vec<_> = st.take_events(None, 8).iter().map(|e| (e.kind, e.room, e.chunk, e.status)).collect();
    assert_eq!(kept, [(EventKind::Chunk, 1, 0, Status::KVSTAGE_E_TIMEOUT), (EventKind::Chunk, 1, 1, Status::KVSTAGE_E_TIMEOUT)]);
}

// --- the model-based property test -----------------------------------------------------------------

/// Actors: connections 0..3 are prefill ranks 0, 1 (TCP) and 0 again (a second connection
/// claiming writer 0), connection 3 is rank 1 over RDMA. Rooms 0..3.
const CONNS: usize = 4;
const ROOMS: u64 = 3;

#[derive(Clone, Debug)]
enum Op {
    Open(u64, usize),
    Release(u64),
    /// Room `ROOMS`: an honest sender's request, for the first chunk it holds no region of.
    Allocate(usize, u64, u32),
    /// Begin a write of one slab of the connection's region (K0, K1, V0, V1), in any order and
    /// possibly twice, or (last `bool` set) a lying write that ends past the region; slab `SLABS`:
    /// an honest sender's next slab (of its first region not written whole, room and chunk
    /// ignored).
    DataBegin(usize, u64, u32, usize, bool),
    DataEnd(usize, bool),
    /// Room `ROOMS`: an honest sender's ready, for its first region written whole.
    Ready(usize, u64, u32, bool),
    Abort(usize, u64, u32),
    SliceBegin(usize, u64, u32, u32, u32),
    SliceEnd(usize, bool),
    SliceDone(usize, u64, u32),
    Scatter(usize, bool),
    Gone(usize),
    RegisterRing,
    /// The in-place writer's mapping of the ring ends (same host: its lease socket closed).
    Unmap,
    /// A frame (`Frame`) naming the room by a key of another opening: an earlier one of the same
    /// id (a stale writer) or, with the flag set or when there is none, a made-up key (a guess).
    Stale(usize, u64, u32, Frame, bool),
}

/// Each frame that names a room.
#[derive(Clone, Copy, Debug)]
enum Frame {
    Allocate,
    Data,
    Ready,
    Abort,
    Slice,
    SliceDone,
}

/// Made-up keys: never issued (the harness issues small ones).
const FORGED: u64 = 0xf0f0_0000_0000_0000;

fn op() -> impl Strategy<Value = Op> {
    let c = 0..CONNS;
    let r = 0..ROOMS;
    let ch = 0u32..3;
    prop_oneof![
        1 => (r.clone(), prop_oneof![Just(2usize), Just(4usize)]).prop_map(|(r, n)| Op::Open(r, n)),
        1 => r.clone().prop_map(Op::Release),
        1 => (c.clone(), r.clone(), ch.clone()).prop_map(|(c, r, ch)| Op::Allocate(c, r, ch)),
        3 => (c.clone(), r.clone(), ch.clone(), 0..=SLABS, prop::bool::weighted(0.1)).prop_map(|(c, r, ch, h, l)| Op::DataBegin(c, r, ch, h, l)),
        3 => (any::<usize>(), prop::bool::weighted(0.9)).prop_map(|(i, ok)| Op::DataEnd(i, ok)),
        2 => (c.clone(), 0..=ROOMS, ch.clone(), prop::bool::weighted(0.9)).prop_map(|(c, r, ch, ok)| Op::Ready(c, r, ch, ok)),
        1 => (c.clone(), r.clone(), prop_oneof![ch.clone(), Just(u32::MAX)]).prop_map(|(c, r, ch)| Op::Abort(c, r, ch)),
        2 => (c.clone(), r.clone(), ch.clone(), 0u32..4, 0u32..4).prop_map(|(c, r, ch, b, t)| Op::SliceBegin(c, r, ch, b, t)),
        2 => (any::<usize>(), prop::bool::weighted(0.95)).prop_map(|(i, ok)| Op::SliceEnd(i, ok)),
        1 => (c.clone(), r.clone(), ch.clone()).prop_map(|(c, r, ch)| Op::SliceDone(c, r, ch)),
        2 => (any::<usize>(), prop::bool::weighted(0.9)).prop_map(|(i, ok)| Op::Scatter(i, ok)),
        1 => c.clone().prop_map(Op::Gone),
        1 => Just(Op::RegisterRing),
        1 => Just(Op::Unmap),
        2 => (c, r, ch, frame(), prop::bool::weighted(0.3)).prop_map(|(c, r, ch, f, forged)| Op::Stale(c, r, ch, f, forged)),
    ]
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        Just(Frame::Allocate),
        Just(Frame::Data),
        Just(Frame::Ready),
        Just(Frame::Abort),
        Just(Frame::Slice),
        Just(Frame::SliceDone),
    ]
}

/// Honest senders (their next slab, their ready), the decode side opening rooms (a released
/// room's grant stays quarantined for an RDMA writer that never hears of it) and running scatters
/// in any order: chunks get written whole, scattered layer by layer while other writes land, and
/// completed (random sequences of [`op`] seldom get that far); now and then a connection goes, a
/// scatter fails or a room is released in the middle of it.
fn calm_op() -> impl Strategy<Value = Op> {
    let c = 0..CONNS;
    prop_oneof![
        2 => (0..ROOMS, prop_oneof![Just(2usize), Just(4usize)]).prop_map(|(r, n)| Op::Open(r, n)),
        6 => c.clone().prop_map(|c| Op::Allocate(c, ROOMS, 0)),
        16 => c.clone().prop_map(|c| Op::DataBegin(c, 0, 0, SLABS, false)),
        16 => any::<usize>().prop_map(|i| Op::DataEnd(i, true)),
        6 => c.clone().prop_map(|c| Op::Ready(c, ROOMS, 0, true)),
        8 => any::<usize>().prop_map(|i| Op::Scatter(i, true)),
        // Now and then a failure or a release while other chunks are being written or scattered.
        1 => c.clone().prop_map(Op::Gone),
        1 => any::<usize>().prop_map(|i| Op::Scatter(i, false)),
        1 => (0..ROOMS).prop_map(Op::Release),
        // A stale writer of an earlier opening (or a guesser) while the current one is written.
        1 => (c, 0..ROOMS, 0u32..2, frame()).prop_map(|(c, r, ch, f)| Op::Stale(c, r, ch, f, false)),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MPhase {
    Waiting,
    Scattering,
    Done,
}

#[derive(Clone, Debug, Default)]
struct MSlot {
    conn: ConnId,
    /// Where the receiver placed the region (allocation order).
    region: u64,
    /// Which slabs of the region landed (K0, K1, V0, V1).
    slabs: [bool; SLABS],
    rows: HashSet<(u32, u32)>,
    arrived: bool,
    /// Written by RDMA: its bytes count only once it arrived (its immediate came).
    rdma: bool,
}

impl MSlot {
    fn landed(&self, layer: usize) -> bool {
        self.slabs[layer] && self.slabs[2 + layer] && (self.arrived || !self.rdma)
    }
}

#[derive(Clone, Debug)]
struct MChunk {
    phase: MPhase,
    slices: Option<bool>,
    slots: [Option<MSlot>; 2],
    grant: Option<Grant>,
    /// Layers handed to a scatter.
    scattered: [bool; 2],
}

#[derive(Clone, Debug)]
struct MRoom {
    gen: u64,
    chunks: Vec<MChunk>,
    failed: bool,
    released: bool,
    leases: usize,
}

impl MRoom {
    fn live(&self) -> bool {
        !self.failed && !self.released
    }
    fn complete(&self) -> bool {
        self.chunks.iter().all(|c| c.phase == MPhase::Done)
    }
}

struct Harness {
    st: State,
    /// The reference model: rooms by id (a released room stays until drained).
    rooms: HashMap<u64, MRoom>,
    conns: [Option<ConnId>; CONNS],
    writes: Vec<(usize, WriteLease)>,
    slices: Vec<(usize, SliceLease)>,
    scatters: Vec<ScatterJob>,
    /// Connection 3 writes in place; `mapped`: through a same-host mapping that outlives the
    /// connection (else RDMA: its writes end with it).
    mapped: bool,
    /// With `mapped`: connection 3 maps the pool too and asks for direct grants (its chunks go
    /// straight into the room's pages, which it holds while it may still write them).
    direct: bool,
    /// Grants (ids) given directly: their writer holds the room's pages while it may write them.
    direct_grants: HashSet<u64>,
    /// The stream connections may have their payloads read straight into the pool (chunks
    /// without a checksum): each such read holds the room's pages while it lands.
    reads: bool,
    /// Grants an in-place writer may still write into: (connection, grant, room key, chunk). Its
    /// connection may be gone while its mapping lives.
    may_write: Vec<(ConnId, u64, u64, u32)>,
    /// Every key issued for each room id, oldest first (the last is the current or latest
    /// opening's).
    issued: HashMap<u64, Vec<u64>>,
    next_key: u64,
    /// Connections whose mapping lives (the current one and any gone before unmapping).
    mappings: Vec<ConnId>,
    /// The live mapped connection maps a ring that was replaced since (no grant for it).
    stale_mapping: Option<ConnId>,
    /// Every chunk carries a checksum: its bytes reach the pool only after the writers' ready.
    checksummed: bool,
    /// Mappings that ended: a live connection's reports after that cannot be true, so its bytes
    /// count only from its ready on.
    unmapped: Vec<ConnId>,
    /// The chunk events delivered so far, by (room generation, chunk): whether each was `OK`.
    events: HashMap<(u64, u32), bool>,
    /// The room events delivered so far, by room generation: whether each was `OK`.
    room_events: HashMap<u64, bool>,
}

fn writer_of(c: usize) -> u32 {
    [0, 1, 0, 1][c]
}

impl Harness {
    fn new(mapped: bool, checksummed: bool, direct: bool, reads: bool) -> Harness {
        Harness {
            st: state(3 * CHUNK / 2 + 100),
            rooms: HashMap::new(),
            conns: [None; CONNS],
            writes: Vec::new(),
            slices: Vec::new(),
            scatters: Vec::new(),
            mapped,
            direct: direct && mapped,
            direct_grants: HashSet::new(),
            reads,
            may_write: Vec::new(),
            issued: HashMap::new(),
            next_key: 1,
            mappings: Vec::new(),
            stale_mapping: None,
            checksummed,
            unmapped: Vec::new(),
            events: HashMap::new(),
            room_events: HashMap::new(),
        }
    }

    fn conn(&mut self, c: usize) -> ConnId {
        if let Some(id) = self.conns[c] {
            return id;
        }
        let integrity = if self.checksummed { Integrity::Always } else { Integrity::Off };
        let id = self.st.add_conn(ConnInfo { integrity, pool_read_min_run: self.reads.then_some(0), ..info(writer_of(c), 2, c == 3) });
        if c == 3 && self.mapped {
            self.st.set_in_place(id, true);
            self.mappings.push(id);
            if self.direct {
                self.st.set_direct(id);
            }
        }
        self.conns[c] = Some(id);
        id
    }

    /// `id` will not write (room opening `key`, chunk) — every chunk for `None`, every opening for
    /// `key` None — in place any more.
    fn done_writing(&mut self, id: ConnId, key: Option<u64>, chunk: Option<u32>) {
        self.may_write.retain(|&(c, _, k, ch)| !(c == id && key.is_none_or(|x| x == k) && chunk.is_none_or(|x| x == ch)));
        // A released room a direct writer held may leave now.
        self.recount_leases();
    }

    /// Room `room` as an honest sender names it: the key of its latest opening (made up when it
    /// was never opened).
    fn honest(&self, room: u64) -> RoomRef {
        RoomRef { id: room, key: self.issued.get(&room).and_then(|k| k.last()).copied().unwrap_or(FORGED) }
    }

    /// Takes the step's effects: its scatter jobs, and its chunk and room events, checked against
    /// the model updated for the step (the queue is drained as a listener would, so none is
    /// dropped): one event per chunk, `OK` only for a chunk done in a live room, a failure only in
    /// a failed room (none for a released one); then one room event per opening, after every chunk
    /// event of it, `OK` only for a complete live room, a failure only for a failed one.
    fn collect(&mut self) {
        let fx = self.st.take_effects();
        self.scatters.extend(fx.scatter);
        self.st.take_events(None, usize::MAX);
        for e in fx.events {
            let r = self.rooms.get(&e.room).unwrap_or_else(|| panic!("an event for room {}, which the model does not hold: {e:?}", e.room));
            let ok = e.status == Status::KVSTAGE_OK;
            assert!(!self.room_events.contains_key(&r.gen), "an event for room {} after its room event: {e:?}", e.room);
            if e.kind == EventKind::Room {
                assert_eq!(e.chunk as usize, r.chunks.len(), "room {}'s room event carries its chunk count: {e:?}", e.room);
                let unreported: Vec<u32> = (0..r.chunks.len() as u32).filter(|c| !self.events.contains_key(&(r.gen, *c))).collect();
                assert!(unreported.is_empty(), "room {}'s room event before the events of chunks {unreported:?}: {e:?}", e.room);
                match ok {
                    true => assert!(r.complete() && r.live(), "OK for room {} (complete {}, failed {}, released {})", e.room, r.complete(), r.failed, r.released),
                    false => assert!(r.failed, "room {} reported {:?} as a whole without failing", e.room, e.status),
                }
                self.room_events.insert(r.gen, ok);
                continue;
            }
            assert!(self.events.insert((r.gen, e.chunk), ok).is_none(), "a second event for room {} chunk {}: {e:?}", e.room, e.chunk);
            match ok {
                true => assert!(r.chunks[e.chunk as usize].phase == MPhase::Done && r.live(), "OK for room {} chunk {} ({:?}, failed {}, released {})", e.room, e.chunk, r.chunks[e.chunk as usize].phase, r.failed, r.released),
                false => assert!(r.failed, "room {} chunk {} reported {:?} in a room that did not fail", e.room, e.chunk, e.status),
            }
        }
    }

    /// An honest sender's next step: the first live chunk where `id` holds writer `w`'s slot,
    /// has not arrived, and `pick` finds something to do.
    fn own_slot<T>(&self, id: ConnId, w: u32, pick: impl Fn(&MChunk, &MSlot) -> Option<T>) -> Option<(u64, u32, T)> {
        let mut rooms: Vec<_> = self.rooms.iter().filter(|(_, r)| r.live()).collect();
        rooms.sort_by_key(|(id, _)| **id);
        rooms.into_iter().find_map(|(&room, r)| {
            r.chunks.iter().enumerate().find_map(|(i, ch)| {
                let s = ch.slots[w as usize].as_ref().filter(|s| s.conn == id && !s.arrived && ch.slices == Some(false))?;
                pick(ch, s).map(|t| (room, i as u32, t))
            })
        })
    }

    /// The model's streaming rule after bytes landed or a writer arrived: a layer goes to the pool
    /// once both writers' K and V slabs of it are in, unless the chunk is checksummed or done
    /// being written.
    fn model_stream(&mut self, room: u64, chunk: u32) {
        let Some(r) = self.rooms.get_mut(&room).filter(|r| r.live()) else { return };
        let ch = &mut r.chunks[chunk as usize];
        if self.checksummed || ch.phase != MPhase::Waiting || ch.slices != Some(false) {
            return;
        }
        let unmapped = &self.unmapped;
        for l in 0..2 {
            if ch.slots.iter().all(|s| s.as_ref().is_some_and(|s| s.landed(l) && (s.arrived || !unmapped.contains(&s.conn)))) {
                ch.scattered[l] = true;
            }
        }
    }

    /// The model's view of "this connection's writer slot is gone": rooms it owes fail.
    fn model_conn_gone(&mut self, id: ConnId, w: usize) {
        for r in self.rooms.values_mut() {
            let wrote = r.chunks.iter().any(|ch| ch.slots.iter().flatten().any(|s| s.conn == id));
            let owes = r.chunks.iter().any(|ch| {
                ch.phase == MPhase::Waiting && ch.slots[w].as_ref().is_none_or(|s| s.conn == id && !s.arrived)
            });
            if wrote && owes && r.live() && !r.complete() {
                r.failed = true;
            }
        }
    }

    /// A fatal error ends the connection, as the I/O layer does. Its leases are dropped without
    /// being ended (as when its thread panics): the state must release them itself.
    fn kill(&mut self, c: usize) {
        let Some(id) = self.conns[c].take() else { return };
        self.st.conn_gone(id, Status::KVSTAGE_E_PEER_GONE, "test");
        if !self.mappings.contains(&id) {
            self.done_writing(id, None, None); // RDMA: its queue pairs went with it
        }
        self.writes.retain(|(w, _)| *w != c);
        self.slices.retain(|(w, _)| *w != c);
        self.model_conn_gone(id, writer_of(c) as usize);
        self.recount_leases();
        self.collect();
    }

    /// A connection reads one frame at a time: while it is inside a payload it sends nothing else.
    fn busy(&self, c: usize) -> bool {
        self.writes.iter().any(|(x, _)| *x == c) || self.slices.iter().any(|(x, _)| *x == c)
    }

    fn recount_leases(&mut self) {
        for r in self.rooms.values_mut() {
            r.leases = 0;
        }
        for (_, l) in &self.slices {
            if let Some(r) = self.rooms.values_mut().find(|r| r.gen == l.gen) {
                r.leases += 1;
            }
        }
        for j in &self.scatters {
            if let Some(r) = self.rooms.values_mut().find(|r| r.gen == j.gen) {
                r.leases += 1;
            }
        }
        // A payload read straight into a room's pages holds them until the read ended.
        for (_, l) in self.writes.iter().filter(|(_, l)| l.into_pool.is_some()) {
            if let Some(r) = self.rooms.values_mut().find(|r| r.gen == l.gen) {
                r.leases += 1;
            }
        }
        // A direct writer that may still write a room's pages holds them.
        for &(_, _, key, _) in self.may_write.iter().filter(|(_, g, _, _)| self.direct_grants.contains(g)) {
            if let Some((_, r)) = self.rooms.iter_mut().find(|(id, _)| self.issued.get(id).and_then(|k| k.last()) == Some(&key)) {
                r.leases += 1;
            }
        }
        let drained: Vec<u64> = self.rooms.iter().filter(|(_, r)| r.released && r.leases == 0).map(|(id, _)| *id).collect();
        for id in drained {
            self.rooms.remove(&id);
        }
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Open(room, pages) => {
                let key = self.next_key;
                let result = self.st.open_room(room, key, OpenRoom::pages(&PAGES[..pages], GRID), None);
                assert_eq!(result.is_ok(), !self.rooms.contains_key(&room), "open {room}: {result:?}");
                if result.is_ok() {
                    self.next_key += 1;
                    self.issued.entry(room).or_default().push(key);
                    let gen = self.st.rooms[&room].gen;
                    let chunk = MChunk { phase: MPhase::Waiting, slices: None, slots: [None, None], grant: None, scattered: [false; 2] };
                    self.rooms.insert(room, MRoom { gen, chunks: vec![chunk; pages.div_ceil(GRID)], failed: false, released: false, leases: 0 });
                }
            }
            Op::Release(room) => {
                let outcome = self.st.release_room(self.honest(room));
                if let Some(r) = self.rooms.get_mut(&room) {
                    r.released = true;
                }
                self.recount_leases();
                assert_eq!(matches!(outcome, Release::Done), !self.rooms.contains_key(&room), "release {room}: {outcome:?}");
            }
            Op::Allocate(c, room, chunk) => {
                let id = self.conn(c);
                let w = writer_of(c);
                if self.busy(c) {
                    return;
                }
                let (room, chunk) = match room {
                    ROOMS.. => {
                        // Chunks the other writer already holds first: the ring holds one chunk.
                        let free = self.rooms.iter().filter(|(_, r)| r.live()).flat_map(|(&room, r)| {
                            r.chunks.iter().enumerate().filter(|(_, ch)| ch.phase == MPhase::Waiting && ch.slices != Some(true) && ch.slots[w as usize].is_none()).map(move |(i, ch)| (ch.slots[1 - w as usize].is_none(), room, i as u32))
                        });
                        let Some((_, room, chunk)) = free.min() else { return };
                        (room, chunk)
                    }
                    _ => (room, chunk),
                };
                let at = self.honest(room);
                let direct = c == 3 && self.direct;
                let result = self.st.grant(id, at, chunk, w, TOKENS, CHUNK, None, direct);
                if let Ok(g) = &result {
                    // Once its mapping ended, a writer asking for direct grants gets ring ones.
                    let granted = direct && self.mappings.contains(&id);
                    assert_eq!(g.pages.is_empty(), !granted, "a direct grant exactly when asked on a session that maps the pool");
                    if granted {
                        self.direct_grants.insert(g.grant.id);
                    }
                }
                let result = result.map(|g| (g.grant, g.region));
                if self.stale_mapping == Some(id) {
                    assert_eq!(result.map(|_| ()).unwrap_err().code(), Status::KVSTAGE_E_PEER_GONE, "a grant for a mapping of a replaced ring");
                    return;
                }
                let expect = self.rooms.get(&room).filter(|r| r.live()).and_then(|r| r.chunks.get(chunk as usize)).is_some_and(|ch| {
                    ch.phase == MPhase::Waiting && ch.slices != Some(true) && ch.slots[w as usize].is_none()
                });
                assert_eq!(result.is_ok(), expect, "allocate c{c} r{room} ch{chunk}: {result:?}");
                if let Ok((g, region)) = result {
                    let ch = &mut self.rooms.get_mut(&room).unwrap().chunks[chunk as usize];
                    assert_eq!(region, ch.slots.iter().flatten().count() as u64 * REGION, "regions are placed back to back");
                    ch.slices = Some(false);
                    ch.grant = Some(g);
                    ch.slots[w as usize] = Some(MSlot { conn: id, region, rdma: c == 3 && !self.mapped, ..MSlot::default() });
                    if c == 3 {
                        self.may_write.push((id, g.id, at.key, chunk));
                    }
                }
            }
            Op::DataBegin(c, room, chunk, slab, lie) => {
                let Some(id) = self.conns[c].filter(|_| !self.busy(c)) else { return };
                let w = writer_of(c);
                let (room, chunk, slab) = if slab < SLABS {
                    (room, chunk, slab)
                } else {
                    let wm = self.st.watermark();
                    let next = self.own_slot(id, w, |ch, s| s.slabs.iter().position(|&b| !b).filter(|_| ch.grant.is_some_and(|g| wm.permits(g.round, g.end()))));
                    let Some(next) = next else { return };
                    next
                };
                let slot = self.rooms.get(&room).filter(|r| r.live()).and_then(|r| r.chunks.get(chunk as usize)).filter(|ch| ch.slices == Some(false)).and_then(|ch| {
                    ch.slots[w as usize].as_ref().filter(|s| s.conn == id && !s.arrived).map(|s| (s.region, ch.grant.unwrap(), s.slabs[slab]))
                });
                // An honest sender writes only once the watermark allows it.
                if let Some((_, g, _)) = slot {
                    if !lie && !self.st.watermark().permits(g.round, g.end()) {
                        return;
                    }
                }
                // A lie starts one byte into the last slab: it ends one byte past the region.
                let region = slot.map_or(w as u64 * REGION, |s| s.0);
                let offset = region + if lie { REGION - SLAB + 1 } else { slab as u64 * SLAB };
                let fresh = slot.is_some_and(|s| !s.2) && !lie;
                let at = self.honest(room);
                let result = if c == 3 {
                    self.st.written_in_place(id, at, chunk, w, offset, SLAB).map(|()| None)
                } else {
                    self.st.begin_data(id, at, chunk, w, offset, SLAB).map(Some)
                };
                let room_live = self.rooms.get(&room).is_some_and(|r| r.live());
                match result {
                    Err(e) => {
                        assert!(room_live && !fresh, "data c{c} r{room} ch{chunk} slab {slab} refused: {e:?}");
                        assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL);
                        self.kill(c);
                    }
                    Ok(Some(Target::Discard(_))) | Ok(None) if !room_live => {}
                    Ok(None) => {
                        assert!(fresh, "in-place write c{c} r{room} ch{chunk} slab {slab} accepted (lie {lie}, slot {slot:?})");
                        let ch = &mut self.rooms.get_mut(&room).unwrap().chunks[chunk as usize];
                        ch.slots[w as usize].as_mut().unwrap().slabs[slab] = true;
                        self.model_stream(room, chunk);
                        self.collect();
                    }
                    Ok(Some(Target::Discard(e))) => panic!("live room's data discarded: {e:?}"),
                    Ok(Some(Target::Land(lease))) => {
                        assert!(fresh && room_live, "data c{c} r{room} ch{chunk} slab {slab} landed (lie {lie}, slot {slot:?})");
                        // A stream's payload goes straight into the pool exactly when its chunk
                        // has no checksum to verify first.
                        assert_eq!(lease.into_pool.is_some(), self.reads && !self.checksummed, "data c{c} r{room} ch{chunk}: where it lands");
                        self.writes.push((c, lease));
                        self.recount_leases();
                    }
                }
            }
            Op::DataEnd(i, ok) => {
                if self.writes.is_empty() {
                    return;
                }
                let (c, lease) = self.writes.remove(i % self.writes.len());
                let (room, gen, chunk, w, offset) = (lease.room, lease.gen, lease.chunk, writer_of(c), lease.offset);
                self.st.end_data(lease, ok);
                if !ok {
                    self.kill(c);
                    return;
                }
                if let Some(r) = self.rooms.get_mut(&room).filter(|r| r.gen == gen && r.live()) {
                    let s = r.chunks[chunk as usize].slots[w as usize].as_mut().unwrap();
                    s.slabs[((offset - s.region) / SLAB) as usize] = true;
                    self.model_stream(room, chunk);
                }
                self.recount_leases();
                self.collect();
            }
            Op::Ready(c, room, chunk, checksum_ok) => {
                let Some(id) = self.conns[c].filter(|_| !self.busy(c)) else { return };
                let w = writer_of(c);
                let (room, chunk) = match room {
                    ROOMS.. => match self.own_slot(id, w, |_, s| (s.slabs == [true; SLABS]).then_some(())) {
                        Some((r, ch, ())) => (r, ch),
                        None => return,
                    },
                    _ => (room, chunk),
                };
                let at = self.honest(room);
                let result = self.st.begin_ready(id, at, chunk, w);
                self.done_writing(id, Some(at.key), Some(chunk));
                let m = self.rooms.get_mut(&room).filter(|r| r.live());
                let slot = m
                    .and_then(|r| r.chunks.get_mut(chunk as usize))
                    .filter(|ch| ch.slices == Some(false))
                    .and_then(|ch| ch.slots[w as usize].as_mut().filter(|s| s.conn == id));
                match (result, slot) {
                    (Ok(lease), Some(s)) => {
                        assert!(s.slabs == [true; SLABS] && !s.arrived, "ready accepted with slabs {:?}", s.slabs);
                        let verified = if checksum_ok { Ok(()) } else { Err(Error::new(Status::KVSTAGE_E_INTEGRITY, "bad")) };
                        let done = self.st.finish_ready(lease, verified, "s");
                        let r = self.rooms.get_mut(&room).unwrap();
                        if done.is_ok() {
                            let ch = &mut r.chunks[chunk as usize];
                            ch.slots[w as usize].as_mut().unwrap().arrived = true;
                            if ch.slots.iter().all(|s| s.as_ref().is_some_and(|s| s.arrived)) {
                                ch.phase = MPhase::Scattering;
                                ch.scattered = [true; 2];
                            } else {
                                self.model_stream(room, chunk);
                            }
                        } else {
                            assert!(!checksum_ok);
                            r.failed = true;
                        }
                        self.collect();
                    }
                    (Ok(_), None) => panic!("ready c{c} r{room} ch{chunk} accepted without the slot"),
                    (Err(_), Some(s)) => {
                        assert!(s.slabs != [true; SLABS] || s.arrived, "ready refused for a full region");
                        // A ready for a chunk already done is refused without failing the room
                        // (its grant went back; the bytes were scattered); before, it fails it.
                        let r = self.rooms.get_mut(&room).unwrap();
                        if !r.complete() && r.chunks[chunk as usize].phase != MPhase::Done {
                            r.failed = true;
                        }
                        self.collect();
                    }
                    (Err(_), None) => self.collect(),
                }
            }
            Op::Abort(c, room, chunk) => {
                let Some(id) = self.conns[c].filter(|_| !self.busy(c)) else { return };
                let at = self.honest(room);
                self.st.abort(id, at, chunk, "test");
                self.done_writing(id, Some(at.key), (chunk != u32::MAX).then_some(chunk));
                if let Some(r) = self.rooms.get_mut(&room).filter(|r| r.live() && !r.complete()) {
                    let holds = r.chunks.iter().enumerate().any(|(i, ch)| {
                        (chunk == u32::MAX || i as u32 == chunk) && ch.slots.iter().flatten().any(|s| s.conn == id)
                    });
                    if holds {
                        r.failed = true;
                    }
                }
                self.collect();
            }
            Op::SliceBegin(c, room, chunk, buffer, token) => {
                let Some(id) = self.conns[c].filter(|_| !self.busy(c)) else { return };
                let w = writer_of(c);
                let result = self.st.begin_slice(id, self.honest(room), chunk, buffer, token, w * 32, 32);
                let m = self.rooms.get(&room).filter(|r| r.live());
                let ch = m.and_then(|r| r.chunks.get(chunk as usize));
                match result {
                    Ok(Target::Discard(_)) => assert!(m.is_none() || ch.is_some_and(|ch| ch.slices == Some(false))),
                    Ok(Target::Land(lease)) => {
                        let ch = ch.expect("landed in a live chunk");
                        assert!(ch.slices != Some(false) && ch.phase == MPhase::Waiting);
                        let s = ch.slots[w as usize].as_ref();
                        assert!(s.is_none_or(|s| s.conn == id && !s.rows.contains(&(buffer, token))), "slice c{c} landed");
                        let ch = &mut self.rooms.get_mut(&room).unwrap().chunks[chunk as usize];
                        ch.slices = Some(true);
                        ch.slots[w as usize].get_or_insert_with(|| MSlot { conn: id, ..MSlot::default() });
                        self.slices.push((c, lease));
                        self.recount_leases();
                    }
                    Err(_) => {
                        assert!(ch.is_none_or(|ch| ch.phase != MPhase::Waiting || ch.slots[w as usize].as_ref().is_some_and(|s| s.conn != id || s.arrived || s.rows.contains(&(buffer, token)))));
                        self.kill(c);
                    }
                }
            }
            Op::SliceEnd(i, ok) => {
                if self.slices.is_empty() {
                    return;
                }
                let (c, lease) = self.slices.remove(i % self.slices.len());
                let key = (lease.buffer, lease.token);
                let (room, gen, chunk, w) = (lease.room, lease.gen, lease.chunk, writer_of(c));
                self.st.end_slice(lease, ok);
                if let Some(r) = self.rooms.get_mut(&room).filter(|r| r.gen == gen && r.live()) {
                    if ok {
                        r.chunks[chunk as usize].slots[w as usize].as_mut().unwrap().rows.insert(key);
                    }
                }
                self.recount_leases();
                if !ok {
                    self.kill(c);
                }
            }
            Op::SliceDone(c, room, chunk) => {
                let Some(id) = self.conns[c].filter(|_| !self.busy(c)) else { return };
                let w = writer_of(c);
                let result = self.st.slice_done(id, self.honest(room), chunk);
                let r = self.rooms.get_mut(&room).filter(|r| r.live());
                let ch = r.and_then(|r| r.chunks.get_mut(chunk as usize));
                match (result, ch) {
                    (Ok(()), Some(ch)) => {
                        let s = ch.slots[w as usize].as_mut().unwrap();
                        assert_eq!(s.rows.len(), 16, "slices done accepted short");
                        s.arrived = true;
                        if ch.slots.iter().all(|s| s.as_ref().is_some_and(|s| s.arrived)) {
                            ch.phase = MPhase::Done;
                        }
                    }
                    (Ok(()), None) => panic!("slices done accepted for a closed room"),
                    (Err(_), Some(ch)) => {
                        let short = ch.slices == Some(true)
                            && ch.slots[w as usize].as_ref().is_some_and(|s| s.conn == id && !s.arrived && s.rows.len() < 16);
                        if short {
                            self.rooms.get_mut(&room).unwrap().failed = true;
                        }
                    }
                    (Err(_), None) => {}
                }
                self.collect();
            }
            Op::Scatter(i, ok) => {
                if self.scatters.is_empty() {
                    return;
                }
                let job = self.scatters.remove(i % self.scatters.len());
                let result = if ok { Ok(()) } else { Err(Error::new(Status::KVSTAGE_E_CUDA, "scatter failed")) };
                self.st.scatter_done(&job, result.map(|()| None));
                let more = self.scatters.iter().any(|j| (j.gen, j.chunk) == (job.gen, job.chunk));
                if let Some(r) = self.rooms.get_mut(&job.room).filter(|r| r.gen == job.gen) {
                    if !ok && r.live() && !r.complete() {
                        r.failed = true;
                    }
                    let ch = &mut r.chunks[job.chunk as usize];
                    if ch.phase == MPhase::Scattering && !more {
                        ch.phase = MPhase::Done;
                    }
                }
                self.recount_leases();
                self.collect();
            }
            Op::Gone(c) => self.kill(c),
            Op::Unmap => {
                // The oldest mapping still alive ends (a gone connection's, or the live one's).
                if !self.mappings.is_empty() {
                    let id = self.mappings.remove(0);
                    self.st.unmapped(id);
                    self.unmapped.push(id);
                    if self.stale_mapping == Some(id) {
                        self.stale_mapping = None;
                    }
                    self.done_writing(id, None, None);
                    self.collect();
                }
            }
            Op::Stale(c, room, chunk, frame, forged) => self.stale(c, room, chunk, frame, forged),
            Op::RegisterRing => {
                let busy = self.st.ring_stats().1 > 0;
                let result = self.st.register_ring(3 * CHUNK / 2 + 100);
                assert_eq!(result.is_ok(), !busy);
                if result.is_ok() {
                    self.stale_mapping = self.conns[3].filter(|id| self.mappings.contains(id));
                }
                assert!(result.is_err() || self.writes.is_empty() && self.scatters.is_empty(), "ring replaced under a lease");
            }
        }
        self.check();
    }

    /// A frame naming `room` by another opening's key: refused as stale while the id is held,
    /// never an error that ends the session, and nothing changes (the model stays as it is; a
    /// ready or abort only ends its sender's quarantine of that opening's grants).
    fn stale(&mut self, c: usize, room: u64, chunk: u32, frame: Frame, forged: bool) {
        let id = self.conn(c);
        if self.busy(c) {
            return;
        }
        let w = writer_of(c);
        let keys = self.issued.get(&room).cloned().unwrap_or_default();
        // Keys of earlier openings: all issued but the latest (while the id is held, the open one).
        let earlier = &keys[..keys.len().saturating_sub(1)];
        let key = match earlier.len() {
            n if n > 0 && !forged => earlier[chunk as usize % n],
            _ => FORGED | self.next_key,
        };
        let at = RoomRef { id: room, key };
        // A mapping of a replaced ring gets no grant whatever it names (checked first).
        let held = self.rooms.contains_key(&room) && !(matches!(frame, Frame::Allocate) && self.stale_mapping == Some(id));
        let refused = |e: &Error| {
            assert_ne!(e.code(), Status::KVSTAGE_E_PROTOCOL, "{frame:?} with another opening's key ended the session: {}", e.message());
            if held {
                assert_eq!(e.code(), Status::KVSTAGE_E_STALE_ROOM, "{frame:?} with another opening's key: {}", e.message());
            }
        };
        match frame {
            Frame::Allocate => refused(&self.st.allocate(id, at, chunk, w, TOKENS, CHUNK, None).map(|_| ()).unwrap_err()),
            Frame::Data if c == 3 => self.st.written_in_place(id, at, chunk, w, w as u64 * REGION, SLAB).unwrap(),
            Frame::Data => match self.st.begin_data(id, at, chunk, w, w as u64 * REGION, SLAB) {
                Ok(Target::Discard(e)) => refused(&e),
                other => panic!("stale data: {other:?}"),
            },
            Frame::Ready => {
                refused(&self.st.begin_ready(id, at, chunk, w).unwrap_err());
                self.done_writing(id, Some(key), Some(chunk));
            }
            Frame::Abort => {
                self.st.abort(id, at, chunk, "stale");
                self.done_writing(id, Some(key), Some(chunk));
            }
            Frame::Slice => match self.st.begin_slice(id, at, chunk, 0, 0, w * 32, 32) {
                Ok(Target::Discard(e)) => refused(&e),
                other => panic!("a stale slice: {other:?}"),
            },
            Frame::SliceDone => refused(&self.st.slice_done(id, at, chunk).unwrap_err()),
        }
        self.collect();
    }

    /// Invariants that hold after every step.
    fn check(&self) {
        let st = &self.st;
        let ring = st.ring.as_ref().unwrap();
        let live: HashMap<u64, Grant> = ring.live().map(|g| (g.id, *g)).collect();
        assert_eq!(live.keys().copied().collect::<HashSet<_>>(), st.grants.keys().copied().collect::<HashSet<_>>());
        // Nothing a write can still reach is back in the ring.
        for (_, l) in &self.writes {
            assert!(live.contains_key(&l.grant), "a read writes into grant {} that was returned to the ring", l.grant);
        }
        for j in &self.scatters {
            assert!(live.contains_key(&j.grant), "a scatter reads grant {} that was returned to the ring", j.grant);
        }
        // Nothing an in-place writer may still write (through a live mapping, past its
        // connection too) is back in the ring, nor, written directly, back with the caller.
        for &(c, g, room, chunk) in &self.may_write {
            assert!(live.contains_key(&g), "grant {g} of room {room} chunk {chunk} returned while connection {c} may still write it");
            if self.direct_grants.contains(&g) {
                assert!(st.rooms.values().any(|r| r.key == room), "the pages of room opening {room} returned while direct writer {c} may still write chunk {chunk}");
            }
        }
        // Writable grants never overlap.
        let wm = ring.watermark();
        let writable: Vec<&Grant> = live.values().filter(|g| wm.permits(g.round, g.end())).collect();
        for (i, a) in writable.iter().enumerate() {
            for b in &writable[i + 1..] {
                assert!(a.end() <= b.offset || b.end() <= a.offset, "writable grants overlap: {a:?} {b:?}");
            }
        }
        // Leases name rooms that still exist with their generation: pages never returned under them.
        for (_, l) in &self.slices {
            assert!(st.rooms.get(&l.room).is_some_and(|r| r.gen == l.gen), "slice lease on a room that is gone");
        }
        for j in &self.scatters {
            assert!(st.rooms.get(&j.room).is_some_and(|r| r.gen == j.gen), "scatter on a room that is gone");
        }
        // A scatter of a live room reads only slabs that landed, each layer once.
        for (i, j) in self.scatters.iter().enumerate() {
            let Some(m) = self.rooms.get(&j.room).filter(|r| r.gen == j.gen && r.live()) else { continue };
            let ch = &m.chunks[j.chunk as usize];
            for &l in &j.layers {
                assert!(ch.slots.iter().all(|s| s.as_ref().is_some_and(|s| s.landed(l as usize) || s.arrived)), "layer {l} of room {} chunk {} scattered before it landed: {:?}", j.room, j.chunk, ch.slots);
                let twice = self.scatters[i + 1..].iter().any(|k| (k.gen, k.chunk) == (j.gen, j.chunk) && k.layers.contains(&l));
                assert!(!twice, "layer {l} of room {} chunk {} scattered twice", j.room, j.chunk);
            }
        }
        // The state agrees with the model on every room.
        assert_eq!(st.rooms.keys().copied().collect::<HashSet<_>>(), self.rooms.keys().copied().collect::<HashSet<_>>());
        for (id, m) in &self.rooms {
            let r = &st.rooms[id];
            assert_eq!((r.failure.is_some(), r.released), (m.failed, m.released), "room {id}");
            if !m.failed {
                for (i, (c, mc)) in r.chunks.iter().zip(&m.chunks).enumerate() {
                    let phase = match c.phase {
                        Phase::Waiting => MPhase::Waiting,
                        Phase::Scattering => MPhase::Scattering,
                        Phase::Done => MPhase::Done,
                    };
                    assert_eq!(phase, mc.phase, "room {id} chunk {i}");
                    if mc.slices == Some(false) && mc.phase == MPhase::Waiting {
                        assert_eq!(c.layers_taken, mc.scattered, "room {id} chunk {i}: layers scattered");
                    }
                }
            }
        }
        self.check_describe();
        assert!(st.events.len() <= st.max_events);
        // Every chunk that ended was reported: a failed room's chunks each once (those done
        // before the failure as OK), a done chunk of a live room as OK.
        for (id, m) in self.rooms.iter().filter(|(_, m)| !m.released) {
            for (i, ch) in m.chunks.iter().enumerate() {
                let seen = self.events.get(&(m.gen, i as u32));
                match (m.failed, ch.phase) {
                    (true, _) => assert!(seen.is_some(), "room {id} failed without reporting chunk {i}"),
                    (false, MPhase::Done) => assert!(seen.is_some(), "room {id} chunk {i} done without its OK"),
                    (false, _) => {}
                }
            }
            // A failed room and a complete one reported themselves as a whole, with the outcome.
            let ended = m.failed || m.complete();
            assert_eq!(self.room_events.get(&m.gen).copied(), ended.then_some(!m.failed), "room {id}: its room event (failed {}, complete {})", m.failed, m.complete());
        }
    }

    /// The describe documents, parsed back from their JSON, against the model: every room's state,
    /// every chunk's phase, writers and readiness; a chunk said to wait for the watermark names
    /// the oldest allocation of the ring, and its own grant lies past the watermark; the ring's
    /// allocations oldest first.
    fn check_describe(&self) {
        let st = &self.st;
        let now = Instant::now();
        let ring = st.ring.as_ref().unwrap();
        let oldest = ring.live().next().map(|g| {
            let gs = &st.grants[&g.id];
            (gs.room.id, gs.chunk as u64)
        });
        for (id, m) in &self.rooms {
            let doc: serde_json::Value = serde_json::from_str(&serde_json::to_string(&st.describe_room(*id, 4, now).expect("an open room is described")).unwrap()).unwrap();
            let state = doc["state"].as_str().unwrap();
            let want = if m.released {
                "releasing"
            } else if m.failed {
                "failed"
            } else if m.complete() {
                "complete"
            } else {
                "open"
            };
            assert_eq!(state, want, "room {id}: {doc}");
            assert_eq!(doc["failure"].is_null(), !m.failed, "room {id}: {doc}");
            let chunks = doc["chunks"].as_array().unwrap();
            assert_eq!(chunks.len(), m.chunks.len());
            for (i, (c, mc)) in chunks.iter().zip(&m.chunks).enumerate() {
                let phase = c["phase"].as_str().unwrap();
                let slots: Vec<&MSlot> = mc.slots.iter().flatten().collect();
                match mc.phase {
                    MPhase::Done => assert_eq!(phase, "done", "room {id} chunk {i}: {c}"),
                    _ if m.failed => assert_eq!(phase, "failed", "room {id} chunk {i}: {c}"),
                    MPhase::Scattering => assert_eq!(phase, "scattering", "room {id} chunk {i}: {c}"),
                    MPhase::Waiting if slots.is_empty() => assert_eq!(phase, "not_started", "room {id} chunk {i}: {c}"),
                    MPhase::Waiting => {
                        assert!(["waiting_for_watermark", "granted", "writing", "waiting_for_writers"].contains(&phase), "room {id} chunk {i}: {c}");
                        let writers = c["writers"].as_array().unwrap();
                        assert_eq!(writers.len(), slots.len(), "room {id} chunk {i}: {c}");
                        let ready = writers.iter().filter(|w| w["ready"].as_bool().unwrap()).count();
                        assert_eq!(ready, slots.iter().filter(|s| s.arrived).count(), "room {id} chunk {i}: {c}");
                        let grant = st.rooms[id].chunks[i].grant.and_then(|g| st.grants.get(&g)).map(|g| g.grant);
                        let blocked = grant.is_some_and(|g| !ring.watermark().permits(g.round, g.offset + 1));
                        let want = if ready > 0 {
                            Some("waiting_for_writers")
                        } else if blocked {
                            Some("waiting_for_watermark")
                        } else {
                            None
                        };
                        match want {
                            Some(w) => assert_eq!(phase, w, "room {id} chunk {i}: {c}"),
                            None => assert!(["granted", "writing"].contains(&phase), "room {id} chunk {i}: {c}"),
                        }
                        if phase == "waiting_for_watermark" {
                            let g = &c["grant"];
                            let behind = &g["waits_behind"];
                            assert_eq!(Some((behind["room"].as_u64().unwrap(), behind["chunk"].as_u64().unwrap())), oldest, "room {id} chunk {i}: {c}");
                            assert!(!ring.watermark().permits(g["round"].as_u64().unwrap(), g["offset"].as_u64().unwrap() + 1), "room {id} chunk {i}: {c}");
                        }
                    }
                }
            }
        }
        let doc: serde_json::Value = serde_json::from_str(&serde_json::to_string(&st.describe()).unwrap()).unwrap();
        let allocations: Vec<u64> = doc["ring"]["allocations"].as_array().unwrap().iter().map(|a| a["round"].as_u64().unwrap() << 32 | a["offset"].as_u64().unwrap()).collect();
        let live: Vec<u64> = ring.live().map(|g| g.round << 32 | g.offset).collect();
        assert_eq!(allocations, live, "the ring's allocations, oldest first: {doc}");
        assert_eq!(doc["rooms"].as_array().unwrap().len(), self.rooms.len());
    }

    /// Ends everything: leases, scatters, connections; then every room is terminal, and once
    /// released the ring is empty.
    fn finish(mut self) {
        for (c, l) in std::mem::take(&mut self.writes) {
            self.st.end_data(l, false);
            self.kill(c);
        }
        for (_, l) in std::mem::take(&mut self.slices) {
            self.st.end_slice(l, false);
        }
        while !self.scatters.is_empty() {
            self.step(Op::Scatter(self.scatters.len() - 1, true));
        }
        for c in 0..CONNS {
            self.kill(c);
        }
        for id in std::mem::take(&mut self.mappings) {
            self.st.unmapped(id);
            self.done_writing(id, None, None);
        }
        self.st.expire(Instant::now());
        for id in self.st.rooms.keys().copied().collect::<Vec<_>>() {
            if self.st.rooms[&id].released {
                continue;
            }
            // Rooms without a deadline may still wait for writers that never came; with one they
            // are terminal once it passed.
            self.st.rooms.get_mut(&id).unwrap().expires = Some(Instant::now());
        }
        self.st.expire(Instant::now() + Duration::from_secs(1));
        for (&id, r) in &self.st.rooms {
            assert!(r.released || r.failure.is_some() || r.complete(), "room {id} is not terminal");
        }
        for (id, key) in self.st.rooms.iter().map(|(&id, r)| (id, r.key)).collect::<Vec<_>>() {
            assert_eq!(self.st.release_room(RoomRef { id, key }), Release::Done);
        }
        assert_eq!(self.st.ring_stats().1, 0, "ring space leaked");
        assert!(self.st.grants.is_empty() && self.st.rooms.is_empty());
    }
}

/// Sequences per run: at least 10,000 in CI (`KVSTAGE_MODEL_CASES` raises it).
fn model_cases() -> u32 {
    std::env::var("KVSTAGE_MODEL_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: model_cases(), max_shrink_iters: 2000, ..ProptestConfig::default() })]
    #[test]
    fn model_random_sequences_keep_every_invariant(
        mapped in any::<bool>(),
        checksummed in prop::bool::weighted(0.2),
        direct in any::<bool>(),
        reads in any::<bool>(),
        ops in prop_oneof![2 => proptest::collection::vec(op(), 1..80), 1 => proptest::collection::vec(calm_op(), 50..300)],
    ) {
        let mut h = Harness::new(mapped, checksummed, direct, reads);
        for op in ops {
            h.step(op);
        }
        h.finish();
    }
}

/// A slot granted to arrive on the stream (read into the pool) whose connection then reports an
/// in-place write (an RDMA confirm or a same-host mapping after the grant): refused, since its
/// region is never scattered from the ring (the room would complete with stale pages).
#[test]
fn an_in_place_report_for_a_region_granted_to_the_stream_is_refused() {
    let mut st = state(4 * CHUNK);
    let a = st.add_conn(ConnInfo { pool_read_min_run: Some(0), ..info(0, 2, false) });
    st.open_room(1, key(1), OpenRoom::pages(&PAGES, GRID), None).unwrap();
    let (_, ra) = st.allocate(a, at(1), 0, 0, TOKENS, CHUNK, None).unwrap();
    st.set_in_place(a, false);
    let e = st.written_in_place(a, at(1), 0, 0, ra, REGION).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL);
    assert!(e.message().contains("granted to arrive on the stream"), "{}", e.chain());
}
