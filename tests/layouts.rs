//! Every pool layout into every other, bit-exact: only the model shape crosses the wire, each
//! side's layout is its own (docs/GEOMETRY.md, "Pool layouts").
//!
//! The testkit fills the prefill pools and checks the decode pools through its own index formula
//! per engine (`kvstage_testkit::Reference`: sglang's buffers, vLLM's six orders of
//! `[L, B, H, N, K‖V]`, TensorRT-LLM's `[block][layer][K/V][head][token][dim]`), never through the
//! library's strides; and checks every byte of every decode pool (`verify_exact`): the request's
//! rows hold the reference, every other byte (other pages, padding, gaps) is still zero. (The
//! same wrong placement on both sides of a pair can cancel out end to end: the testkit's unit
//! test compares the layout each pool registers with its reference row by row.)
//!
//! With the testkit cluster (a decode child process, this test executable run again as
//! [`zz_decode_child`]; the prefill ranks in this process; real sockets), a request of several
//! chunks on a GQA model (4 KV heads) each time:
//! - all 64 ordered pairs of the 8 layouts, TP changing both ways (P2→D1 and P1→D2 alternate so
//!   that each layout meets both on either side): over TCP; MLA; pages padded on both sides; the
//!   same-host path through the decode ring (direct mode off) and directly into the decode pool;
//! - pages of one token (padded or not, over TCP, MLA, directly) and padded pages directly: 8
//!   pairs each, every layout once on each side, TP changing;
//! - V heads of another size than K's (`head_dim_v`): all 64 pairs over TCP, 8 through the
//!   same-host ring, 8 directly, 8 with padded one-token pages.
//!
//! With engines in this process over loopback TCP (the cluster has one page size and no pipeline
//! stages): a pipeline split with a layout per stage and rank, uneven on both sides and TP
//! changing; and pages of different sizes on the two sides, mixed layouts, a decode prefix, a
//! last chunk ending inside its page (through the ring over TCP and directly over the same-host
//! path).

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kvstage::engine::{Engine, EngineOptions, TransportKind};
use kvstage::geometry::{chunk_span, decode_peers, LayoutPreset, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::receiver::RoomOpening;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::Status;
use kvstage_testkit::cluster::{serve_decode, DecodeChild, Prefill, Setup};
use kvstage_testkit::{page_table, HostPool, Model};

const CHILD_ENV: &str = "KVSTAGE_LAYOUTS_CHILD";
const CHILD_TEST: &str = "zz_decode_child";

/// GQA: 4 KV heads of 12 elements (24-byte rows), 3 layers.
const GQA: Model = Model { name: "custom", kind: ModelKind::Mha, layers: 3, kv_heads: 4, head_dim: 12, head_dim_v: 0, dtype_bytes: 2 };
/// GQA whose V heads are smaller than its K heads (`head_dim_v` 8: 16-byte V rows, 24-byte K
/// rows; vLLM's `head_size_v`, sglang's `v_head_dim`).
const GQA_DV: Model = Model { head_dim_v: 8, ..GQA };
/// MLA: a latent of 20 elements, 2 layers.
const MLA: Model = Model { name: "custom", kind: ModelKind::Mla, layers: 2, kv_heads: 1, head_dim: 20, head_dim_v: 0, dtype_bytes: 2 };

/// The decode side of the cluster: run by the child process only (the flags in `CHILD_ENV`);
/// passes at once in a plain test run.
#[test]
fn zz_decode_child() {
    let Ok(flags) = std::env::var(CHILD_ENV) else { return };
    let args: Vec<String> = flags.split_whitespace().map(str::to_owned).collect();
    let setup = Setup::from_flags(&args).unwrap_or_else(|e| panic!("decode child: bad flags {flags:?}: {e}"));
    if let Err(e) = serve_decode(&setup) {
        panic!("decode child: {}", e.chain());
    }
}

fn child(setup: &Setup) -> DecodeChild {
    let mut cmd = Command::new(std::env::current_exe().expect("the test executable"));
    cmd.args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1", "-q"]).env(CHILD_ENV, setup.flags().join(" "));
    DecodeChild::spawn_command(cmd, setup.decode_tp).unwrap_or_else(|e| panic!("cannot start the decode child: {}", e.chain()))
}

/// A request of 32 tokens in pages of 4, chunks of 8 tokens (4 chunks, a ring of 2).
fn setup(model: Model, (prefill_tp, decode_tp): (u32, u32), transport: TransportKind, direct: bool, page_pad: u64) -> Setup {
    Setup {
        model,
        prefill_tp,
        decode_tp,
        page_size: 4,
        tokens: 32,
        chunk_tokens: 8,
        ring_chunks: 2,
        transport,
        aux_rows: 0,
        state_bytes: 0,
        direct,
        prefill_layout: LayoutPreset::Sglang,
        decode_layout: LayoutPreset::Sglang,
        page_pad,
    }
}

/// P2→D1 for even `i`, P1→D2 for odd.
fn tp(i: usize) -> (u32, u32) {
    if i.is_multiple_of(2) { (2, 1) } else { (1, 2) }
}

/// How chunks should have travelled (checked on the prefill engines' counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    Tcp,
    ShmRing,
    ShmDirect,
}

/// One decode child of `base` with `base.decode_layout`, fed one room in turn by prefill ranks
/// of each layout of `prefills` (the pool cleared between rooms): each room sent, waited for and
/// compared byte for byte. Returns a line per failing pair.
fn run_pairs(base: &Setup, prefills: &[LayoutPreset], expect: Expect) -> Vec<String> {
    let mut failures = Vec::new();
    let mut decode = child(base);
    for (i, &p) in prefills.iter().enumerate() {
        let s = Setup { prefill_layout: p, ..base.clone() };
        let what = format!(
            "{} P{} {} -> D{} {}{}{} over {:?}",
            if s.model.kind == ModelKind::Mla { "MLA" } else { "GQA" },
            s.prefill_tp,
            p.name(),
            s.decode_tp,
            s.decode_layout.name(),
            if s.page_pad > 0 { format!(", pages padded by {}", s.page_pad) } else { String::new() },
            if expect == Expect::ShmRing { ", direct off" } else { "" },
            expect
        );
        match one_room(&mut decode, &s, i as u64 + 1, expect) {
            Ok(()) => eprintln!("ok: {what}"),
            Err(why) => {
                failures.push(format!("{what}: {why}"));
                if decode.command("clear").is_err() {
                    // The child is gone or stuck with a room: a fresh one for the next pair.
                    decode = child(base);
                }
            }
        }
    }
    if let Err(e) = decode.quit() {
        failures.push(format!("decode child D{} {}: {}", base.decode_tp, base.decode_layout.name(), e.chain()));
    }
    failures
}

fn one_room(decode: &mut DecodeChild, s: &Setup, room_id: u64, expect: Expect) -> Result<(), String> {
    fn e(what: &str) -> impl Fn(kvstage::Error) -> String + '_ {
        move |e| format!("{what}: {}", e.chain())
    }
    decode.command("clear").map_err(e("clear"))?;
    let room = decode.open_room(room_id, None).map_err(e("open room"))?;
    let prefill = Prefill::connect(s, &decode.addrs).map_err(e("prefill connect"))?;
    if let Err(err) = prefill.send_room(s, &room, true, None) {
        drop(prefill);
        let _ = decode.command(&format!("release {room_id}"));
        return Err(e("send")(err));
    }
    decode.command(&format!("wait {room_id}")).map_err(e("wait"))?;
    let (bad, first) = decode.verify_exact(room_id).map_err(e("verify"))?;
    // How the chunks went: every session's chunks directly into the decode pool, or none.
    let direct: u64 = prefill.ranks.iter().map(|r| r.engine.shm().direct_chunks()).sum();
    let shm_sessions: u64 = prefill.ranks.iter().map(|r| r.engine.shm().sessions()).sum();
    drop(prefill);
    decode.command(&format!("release {room_id}")).map_err(e("release"))?;
    if bad != 0 {
        return Err(format!("{bad} decode bytes differ from the reference; first: {first}"));
    }
    // A padded decode pool is shared with the sender only where its block is outermost (the
    // testkit then leaves out the last block's padding): elsewhere padding lies between its
    // buffers, which the library does not share (its coverage rule), and the ring serves it.
    let want_direct = if expect == Expect::ShmDirect && can_go_direct(s.decode_layout, s.page_pad) { (s.sessions() * s.chunks()) as u64 } else { 0 };
    let want_shm = if expect == Expect::Tcp { 0 } else { s.sessions() as u64 };
    if (direct, shm_sessions) != (want_direct, want_shm) {
        return Err(format!("{direct} chunks went directly over {shm_sessions} same-host sessions, expected {want_direct} over {want_shm}"));
    }
    Ok(())
}

/// Whether a decode pool of `layout` padded by `pad` can be shared with a same-host sender: the
/// library shares an allocation only where pool buffers cover it end to end, and padding lies
/// between the buffers unless the block is the outermost axis (where the testkit's shared pools
/// leave out the last block's padding).
fn can_go_direct(layout: LayoutPreset, pad: u64) -> bool {
    pad == 0 || matches!(layout, LayoutPreset::VllmBlhnc | LayoutPreset::VllmBlnhc | LayoutPreset::VllmBhlnc | LayoutPreset::Trtllm)
}

fn report(what: &str, failures: Vec<String>) {
    assert!(failures.is_empty(), "{what}: {} failing case(s):\n  {}", failures.len(), failures.join("\n  "));
}

/// What a set of pairs runs with besides the layouts.
#[derive(Clone, Copy, Debug)]
struct Variant {
    model: Model,
    transport: TransportKind,
    direct: bool,
    pad: u64,
    page_size: u32,
    expect: Expect,
}

const TCP: Variant = Variant { model: GQA, transport: TransportKind::Tcp, direct: false, pad: 0, page_size: 4, expect: Expect::Tcp };
const SHM_RING: Variant = Variant { transport: TransportKind::Shm, expect: Expect::ShmRing, ..TCP };
const SHM_DIRECT: Variant = Variant { transport: TransportKind::Shm, direct: true, expect: Expect::ShmDirect, ..TCP };

impl Variant {
    /// The setup of a decode child of `decode` layout with TP change `tp`.
    fn setup(self, decode: LayoutPreset, tp: (u32, u32)) -> Setup {
        let s = setup(self.model, tp, self.transport, self.direct, self.pad);
        Setup { decode_layout: decode, page_size: self.page_size, chunk_tokens: s.chunk_tokens.max(self.page_size), ..s }
    }
}

/// All 64 ordered pairs: one decode child per (decode layout, TP change), each fed by the four
/// prefill layouts whose pair takes that TP change (P2→D1 where the layouts' indices add up to
/// an even number, else P1→D2: each layout meets both changes four times on each side).
fn matrix(v: Variant) -> Vec<String> {
    let all = LayoutPreset::ALL;
    let mut failures = Vec::new();
    // (prefill, decode, TP change) of every pair run.
    let mut pairs = std::collections::HashSet::new();
    for (id, &d) in all.iter().enumerate() {
        for parity in [0, 1] {
            let prefills: Vec<LayoutPreset> = (0..all.len()).filter(|ip| (ip + id) % 2 == parity).map(|ip| all[ip]).collect();
            pairs.extend(prefills.iter().map(|&p| (p, d, tp(parity))));
            failures.extend(run_pairs(&v.setup(d, tp(parity)), &prefills, v.expect));
        }
    }
    assert_eq!(pairs.iter().map(|&(p, d, _)| (p, d)).collect::<std::collections::HashSet<_>>().len(), 64, "every ordered pair once");
    for l in all {
        for change in [tp(0), tp(1)] {
            assert_eq!(pairs.iter().filter(|&&(p, _, t)| p == l && t == change).count(), 4, "{} as the prefill side with {change:?}", l.name());
            assert_eq!(pairs.iter().filter(|&&(_, d, t)| d == l && t == change).count(), 4, "{} as the decode side with {change:?}", l.name());
        }
    }
    failures
}

/// Eight pairs, every layout once on each side: `ALL[i]` into `ALL[(i + shift) % 8]`, TP
/// changing by `i` (P2→D1 for even `i`, P1→D2 for odd).
fn permutation(v: Variant, shift: usize) -> Vec<String> {
    let all = LayoutPreset::ALL;
    (0..all.len()).flat_map(|i| run_pairs(&v.setup(all[(i + shift) % all.len()], tp(i)), &[all[i]], v.expect)).collect()
}

#[test]
fn every_layout_into_every_other_over_tcp_with_tp_changing() {
    report("64 layout pairs over TCP", matrix(TCP));
}

#[test]
fn mla_between_layouts_with_tp_changing() {
    let mla = Variant { model: MLA, ..TCP };
    let mut failures = matrix(mla);
    failures.extend(permutation(Variant { page_size: 1, pad: 8, ..mla }, 2));
    report("MLA", failures);
}

/// V heads of another size than K's: every pair over TCP, and through the same-host ring and
/// directly (every layout once on each side), pages padded and of one token.
#[test]
fn v_heads_of_their_own_size() {
    let dv = Variant { model: GQA_DV, ..TCP };
    let mut failures = matrix(dv);
    failures.extend(permutation(Variant { model: GQA_DV, ..SHM_RING }, 1));
    failures.extend(permutation(Variant { model: GQA_DV, ..SHM_DIRECT }, 5));
    failures.extend(permutation(Variant { pad: 8, page_size: 1, ..dv }, 6));
    report("head_dim_v 8 of head_dim 12", failures);
}

/// Pages (blocks) padded by 40 bytes on both sides (not a multiple of a row, so a padded stride
/// applied at the wrong level lands on the wrong bytes); and pages of one token, padded or not
/// (a page then is one slot: pages are evenly spaced slots only where the page stride is the
/// token stride).
#[test]
fn padded_pages_on_both_sides() {
    let mut failures = matrix(Variant { pad: 40, ..TCP });
    failures.extend(permutation(Variant { pad: 8, page_size: 1, ..TCP }, 3));
    failures.extend(permutation(Variant { page_size: 1, ..TCP }, 7));
    report("padded pages", failures);
}

/// The same-host path through the decode ring (direct mode off) and directly into the decode
/// pool, every pair; padded pages and pages of one token directly.
#[test]
fn same_host_through_the_ring_and_directly() {
    let mut failures = matrix(SHM_RING);
    failures.extend(matrix(SHM_DIRECT));
    failures.extend(permutation(Variant { pad: 8, ..SHM_DIRECT }, 2));
    failures.extend(permutation(Variant { pad: 8, page_size: 1, ..SHM_DIRECT }, 4));
    report("same host", failures);
}

// --- engines in this process -----------------------------------------------------------------

struct Decode {
    engine: Engine,
    pool: HostPool,
    pages: Vec<u32>,
    room: RoomRef,
}

/// A prefill rank in this process: its sessions (each with the index of its decode rank), then
/// its engine and pool (fields drop in order: the sessions close before their engine).
struct Sender {
    sessions: Vec<(usize, Arc<SenderSession>)>,
    _engine: Engine,
    _pool: HostPool,
}

/// A request of `total` tokens whose first `prefix` the decode side holds, on a decode grid of
/// `chunk_tokens`; `direct`: over the same-host path straight into the decode pools (else TCP
/// through the ring); every pool padded by `pad` bytes a page.
#[derive(Clone, Copy, Debug)]
struct Request {
    total: u64,
    prefix: u64,
    chunk_tokens: u32,
    direct: bool,
    pad: u64,
}

/// A rank on either side: its shape and its pool's layout.
#[derive(Clone, Debug)]
struct Rank {
    shape: PoolShape,
    layout: LayoutPreset,
}

const CAPACITY: u64 = 40;
const ROOM: u64 = 21;

/// Moves `req` from the prefill ranks `src` to the decode ranks `dst` (stage by stage, TP rank
/// by TP rank), chunk by chunk as `chunk_span` places them, the chunks in reverse order; compares
/// every byte of every decode pool. Returns a line per failure.
fn move_request(what: &str, src: &[Rank], dst: &[Rank], req: Request) -> Vec<String> {
    let Request { total, prefix, chunk_tokens, direct, pad } = req;
    let options = EngineOptions { transport: if direct { TransportKind::Shm } else { TransportKind::Tcp }, same_host_direct: direct, ..EngineOptions::default() };
    let (sps, dps) = (src[0].shape.page_size, dst[0].shape.page_size);
    let what = format!(
        "{what}: prefill [{}] ps {sps} -> decode [{}] ps {dps}, {total} tokens, prefix {prefix}{}{}",
        src.iter().map(|r| format!("tp{}/pp{} {}", r.shape.tp_rank, r.shape.pp_rank, r.layout.name())).collect::<Vec<_>>().join(", "),
        dst.iter().map(|r| format!("tp{}/pp{} {}", r.shape.tp_rank, r.shape.pp_rank, r.layout.name())).collect::<Vec<_>>().join(", "),
        if pad > 0 { format!(", pages padded by {pad}") } else { String::new() },
        if direct { ", same host, direct" } else { ", TCP" }
    );
    let decodes: Vec<Decode> = dst
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let engine = Engine::new(options.clone()).unwrap();
            let pool = HostPool::with_layout(r.shape.clone(), CAPACITY, r.layout, pad, direct);
            engine.register_pool(pool.layout.clone()).unwrap_or_else(|e| panic!("{what}: decode {i}: {}", e.chain()));
            engine.register_staging(None, 1 << 20).unwrap();
            let pages = page_table((total - prefix).div_ceil(dps as u64) as usize, CAPACITY, 7 + i as u64, i % 2 == 0);
            let opening = RoomOpening { prefix_tokens: prefix, ..RoomOpening::new(ROOM, &pages, chunk_tokens) };
            let (key, _) = engine.receiver().open_room(opening).unwrap_or_else(|e| panic!("{what}: decode {i}: {}", e.chain()));
            Decode { engine, pool, pages, room: RoomRef { id: ROOM, key } }
        })
        .collect();
    // One shape per decode stage (its TP rank 0) for the pairing helper.
    let stages: Vec<PoolShape> = dst.iter().filter(|r| r.shape.tp_rank == 0).map(|r| r.shape.clone()).collect();
    let decode_of = |tp_rank: u32, pp_rank: u32| dst.iter().position(|r| r.shape.tp_rank == tp_rank && r.shape.pp_rank == pp_rank).expect("a decode rank");
    let src_pages = page_table(total.div_ceil(sps as u64) as usize, CAPACITY, 3, false);
    let prefills: Vec<Sender> = src
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let engine = Engine::new(options.clone()).unwrap();
            let mut pool = HostPool::with_layout(r.shape.clone(), CAPACITY, r.layout, pad, false);
            pool.fill(&src_pages, 0);
            engine.register_pool(pool.layout.clone()).unwrap_or_else(|e| panic!("{what}: prefill {i}: {}", e.chain()));
            let sessions = decode_peers(&r.shape, &stages)
                .unwrap_or_else(|e| panic!("{what}: {}", e.chain()))
                .iter()
                .map(|p| {
                    let d = decode_of(p.tp_rank, p.pp_rank);
                    (d, engine.connect(&decodes[d].engine.local_addr().to_string(), &format!("p{i}-d{d}"), None).unwrap())
                })
                .collect();
            Sender { sessions, _engine: engine, _pool: pool }
        })
        .collect();
    let mut failures = Vec::new();
    let chunks = chunk_span(total, prefix, sps, dps, chunk_tokens, 0).unwrap().num_chunks;
    assert!(chunks > 1, "{what}: the case should take several chunks");
    for chunk in (0..chunks).rev() {
        let span = chunk_span(total, prefix, sps, dps, chunk_tokens, chunk).unwrap();
        let first = span.src_first_page as usize;
        for (i, p) in prefills.iter().enumerate() {
            for (d, s) in &p.sessions {
                let desc = TransferDesc {
                    room: decodes[*d].room,
                    chunk,
                    pages: src_pages[first..first + span.src_num_pages as usize].to_vec(),
                    src_token_offset: span.src_token_offset,
                    num_tokens: span.num_tokens,
                    timeout: Some(Duration::from_secs(20)),
                    ..Default::default()
                };
                match s.transfer(&desc, &Op::new(s.waker())) {
                    Ok(Status::KVSTAGE_OK) => {}
                    other => failures.push(format!("{what}: prefill {i} -> decode {d}, chunk {chunk}: {:?}", other.map_err(|e| e.chain()))),
                }
            }
        }
    }
    for (i, d) in decodes.iter().enumerate() {
        if let Err(e) = d.engine.receiver().wait_room(d.room, Some(Duration::from_secs(20))) {
            failures.push(format!("{what}: decode {i}: {}", e.chain()));
            continue;
        }
        let (bad, first) = d.pool.verify_exact(&[(&d.pages, prefix, total - prefix)]);
        if bad != 0 {
            failures.push(format!("{what}: decode {i}: {bad} bytes differ from the reference; first: {}", first.unwrap_or_default()));
        }
        let sessions = prefills.iter().flat_map(|p| &p.sessions).filter(|(t, _)| *t == i).count() as u64;
        let want = if direct && can_go_direct(dst[i].layout, pad) { chunks as u64 * sessions } else { 0 };
        let got = d.engine.shm().direct_chunks();
        if got != want {
            failures.push(format!("{what}: decode {i}: {got} regions received directly, expected {want}"));
        }
    }
    failures
}

fn gqa(page_size: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, 4, 12, 2, page_size, 5)
}

/// Ranks of `tp` × the stages of `split`, layouts taken in turn from `layouts` from `first` on.
fn ranks(page_size: u32, tp: u32, split: &[Vec<u32>], layouts: &[LayoutPreset], first: usize) -> Vec<Rank> {
    let mut out = Vec::new();
    for (j, ids) in split.iter().enumerate() {
        for r in 0..tp {
            let shape = gqa(page_size).with_tp(r, tp).with_pp(j as u32, split.len() as u32, ids.clone());
            out.push(Rank { shape, layout: layouts[(first + out.len()) % layouts.len()] });
        }
    }
    out
}

/// Prefill TP 2 × PP 2 (layers 0-2 | 3-4) into decode TP 1 × PP 3 (0 | 1-3 | 4) and TP 2 × PP 2 (0-1 |
/// 2-4) into TP 1 × PP 2, every rank a layout of its own, rotated so that every layout takes part
/// on each side.
#[test]
fn a_pipeline_split_with_a_layout_per_rank() {
    let all = LayoutPreset::ALL;
    let mut failures = Vec::new();
    for rot in [0, 4] {
        let src = ranks(4, 2, &[vec![0, 1, 2], vec![3, 4]], &all, rot);
        let dst = ranks(4, 1, &[vec![0], vec![1, 2, 3], vec![4]], &all, rot + 5);
        failures.extend(move_request("PP", &src, &dst, Request { total: 24, prefix: 0, chunk_tokens: 8, direct: false, pad: 0 }));
        let src = ranks(4, 1, &[vec![0, 1], vec![2, 3, 4]], &all, rot + 2);
        let dst = ranks(4, 2, &[vec![0, 1, 2, 3], vec![4]], &all, rot + 1);
        failures.extend(move_request("PP", &src, &dst, Request { total: 24, prefix: 0, chunk_tokens: 8, direct: false, pad: 8 }));
    }
    report("pipeline splits", failures);
}

/// Prefill pages of 4 into decode pages of 8 and back (16 into 4 too), TP changing, a decode
/// prefix, the last chunk ending inside its page; over TCP through the ring and directly on the
/// same host; every layout on each side.
#[test]
fn page_sizes_differing_with_mixed_layouts() {
    let all = LayoutPreset::ALL;
    let whole = |ps: u32, tp: u32, layout: LayoutPreset| ranks(ps, tp, &[(0..5).collect()], &[layout], 0);
    let mut failures = Vec::new();
    for i in 0..all.len() {
        let (p, d) = (all[i], all[(i + 3) % all.len()]);
        let (stp, dtp) = tp(i);
        let direct = i >= all.len() / 2;
        let (sps, dps, total, prefix) = [(4, 8, 45, 8), (8, 4, 46, 4), (16, 4, 50, 12), (4, 16, 43, 16)][i % 4];
        failures.extend(move_request("page sizes", &whole(sps, stp, p), &whole(dps, dtp, d), Request { total, prefix, chunk_tokens: 16, direct, pad: 0 }));
    }
    // Pages of one token on one side, padded on both.
    for i in 0..all.len() {
        let (p, d) = (all[i], all[(i + 5) % all.len()]);
        let (stp, dtp) = tp(i + 1);
        let (sps, dps, total, prefix) = [(1, 4, 37, 8), (4, 1, 37, 5)][i % 2];
        failures.extend(move_request("page sizes", &whole(sps, stp, p), &whole(dps, dtp, d), Request { total, prefix, chunk_tokens: 16, direct: i % 4 >= 2, pad: 8 }));
    }
    report("page sizes", failures);
}

/// TP sizes that do not divide one another, so a decode rank's head groups differ in size: 6 KV
/// heads over P3→D2 (decode rank 0 takes 2 heads from prefill rank 0 and 1 from rank 1) and
/// P2→D3, 12 heads over P4→D6 and P6→D4; every layout on each side, a decode prefix, over TCP
/// and directly on the same host.
#[test]
fn tp_sizes_that_do_not_divide_one_another() {
    let all = LayoutPreset::ALL;
    let side = |heads: u32, tp: u32, layout: LayoutPreset| -> Vec<Rank> {
        (0..tp).map(|r| Rank { shape: PoolShape::new(ModelKind::Mha, heads, 12, 2, 4, 5).with_tp(r, tp), layout }).collect()
    };
    let mut failures = Vec::new();
    for i in 0..all.len() {
        let (p, d) = (all[i], all[(i + 3) % all.len()]);
        let (heads, stp, dtp) = [(6, 3, 2), (6, 2, 3), (12, 4, 6), (12, 6, 4)][i % 4];
        let req = Request { total: 45, prefix: 8, chunk_tokens: 16, direct: i >= all.len() / 2, pad: 0 };
        failures.extend(move_request("TP not dividing", &side(heads, stp, p), &side(heads, dtp, d), req));
    }
    report("TP sizes that do not divide one another", failures);
}
