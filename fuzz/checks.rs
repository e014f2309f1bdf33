//! The properties the fuzz targets check, shared with the main crate's `tests/fuzz_corpus.rs`
//! (which runs them over the committed corpus in every `cargo test`). Included with `#[path]`;
//! uses only kvstage's public API. Every function panics when a property fails.
#![allow(dead_code)]

use kvstage::geometry::{self, Fingerprint, ModelKind, PoolShape};
use kvstage::protocol::{read_frame, Message};
use kvstage::session::receiver::verify_peer;
use kvstage::session::pairing;
use kvstage::Status;

/// The type byte of a `Hello` frame (the handshake).
pub const T_HELLO: u8 = 1;

/// Local (decode or prefill) pool shapes a peer's handshake is checked against: GQA with TP 1, 2
/// and 4, replication (2 KV heads on TP 4), a pipeline stage, MLA.
pub fn local_shapes() -> Vec<PoolShape> {
    vec![
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 32).with_tp(0, 1),
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 32).with_tp(1, 2),
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 32).with_tp(3, 4),
        PoolShape::new(ModelKind::Mha, 2, 64, 2, 4, 4).with_tp(2, 4),
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 32).with_tp(0, 2).with_pp(1, 2, (16..32).collect()),
        PoolShape::new(ModelKind::Mla, 1, 576, 2, 1, 61).with_tp(3, 8),
    ]
}

/// Components a rank may register (request parts besides the KV): what sender seeds carry, so the
/// fuzzer reaches the component diff and the state-carried check.
pub fn local_components() -> Vec<geometry::ComponentSpec> {
    use geometry::{ComponentKind, ComponentSpec, StateItem};
    vec![
        ComponentSpec { name: "output_ids".into(), kind: ComponentKind::Aux { row_bytes: 64 }, layer_ids: vec![], page_size: 0 },
        ComponentSpec {
            name: "conv".into(),
            kind: ComponentKind::State { item: StateItem { outer: 3, groups: vec![16, 16, 32], dtype_bytes: 2, replicated: false } },
            layer_ids: vec![0, 24],
            page_size: 0,
        },
        ComponentSpec { name: "swa".into(), kind: ComponentKind::Pool { unit_bytes: 256, head_sliced: true }, layer_ids: vec![1, 25], page_size: 8 },
    ]
}

/// Peers of `local_shapes()` that pass the handshake (other TP degree, other PP split), and one
/// that pairs with none of them.
pub fn peer_shapes() -> Vec<PoolShape> {
    vec![
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 32).with_tp(2, 4),
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 32).with_tp(0, 1),
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 32).with_tp(1, 2),
        PoolShape::new(ModelKind::Mha, 2, 64, 2, 4, 4).with_tp(1, 2),
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 32).with_tp(1, 4).with_pp(3, 4, (24..32).collect()),
        PoolShape::new(ModelKind::Mla, 1, 576, 2, 1, 61).with_tp(1, 2),
        PoolShape::new(ModelKind::Mha, 8, 128, 4, 1, 3).with_tp(0, 8).with_pp(0, 1, vec![0, 5, 9]),
    ]
}

/// `read_frame` over a stream of back-to-back frames, the `Data`/`Slice` payloads skipped as the
/// receiver does. Every input gives messages or a clean error (`PROTOCOL` for malformed bytes,
/// `PEER_GONE` for a stream cut inside a frame), never a panic or an allocation past the body
/// limit; every accepted message re-encodes to a frame that decodes to itself. Returns the number
/// of frames decoded.
pub fn frame(data: &[u8]) -> usize {
    let mut rest = data;
    let mut frames = 0;
    for _ in 0..256 {
        match read_frame(&mut rest) {
            Ok(None) => break,
            Ok(Some(msg)) => {
                frames += 1;
                let bytes = msg.encode();
                let again = read_frame(&mut &bytes[..]);
                assert!(matches!(&again, Ok(Some(m)) if *m == msg), "{msg:?} does not round-trip: {again:?}");
                assert_eq!(Message::decode(bytes[4], &bytes[5..]).ok().as_ref(), Some(&msg));
                let skip = msg.payload_len().min(rest.len() as u64) as usize;
                rest = &rest[skip..];
            }
            Err(e) => {
                assert!(
                    matches!(e.code(), Status::KVSTAGE_E_PROTOCOL | Status::KVSTAGE_E_PEER_GONE),
                    "unexpected code {:?}: {}",
                    e.code(),
                    e.chain()
                );
                break;
            }
        }
    }
    frames
}

/// The handshake: the body of a `Hello` frame from an untrusted peer, decoded with
/// `Message::decode`, then checked the way both sides check it — the receiver's `verify_peer`
/// (fingerprint decode, field-by-field diff, pairing) and the sender's view (fingerprint decode and
/// check, head group) — against every local shape. A peer the checks accept must yield a staging
/// layout with its head group inside it and, when it writes, a region. Returns whether the body
/// decoded.
pub fn handshake(data: &[u8]) -> bool {
    let hello = match Message::decode(T_HELLO, data) {
        Ok(Message::Hello(h)) => h,
        Ok(other) => panic!("a hello body decoded as {other:?}"),
        Err(e) => {
            assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL, "{}", e.chain());
            return false;
        }
    };
    for (ours, components) in local_shapes().into_iter().flat_map(|s| [(s.clone(), Vec::new()), (s, hello.components.clone())]) {
        // Receiver: the peer is a prefill rank writing to us (with or without our components).
        if verify_peer(&ours, &components, &hello).is_ok() {
            assert_eq!(components, hello.components, "a handshake passed with different components");
            let layout = geometry::staging_layout(&hello.shape, &ours, ours.page_size)
                .expect("an accepted peer has a staging layout");
            let p = pairing(&hello.shape, &ours).expect("an accepted peer is paired");
            // A replica of heads another rank sends is paired but writes nothing.
            assert!(p.writer.is_none_or(|w| w < layout.tp_writers()));
        }
        // Sender: the peer is the decode rank we write to.
        let Ok(theirs) = Fingerprint::decode(&hello.fingerprint) else { continue };
        if Fingerprint::of(&ours).check(&theirs).is_ok() {
            if let Ok(w) = pairing(&ours, &hello.shape).map(|p| p.writer) {
                let layout = geometry::staging_layout(&ours, &hello.shape, hello.shape.page_size)
                    .expect("a paired decode rank has a staging layout");
                assert!(w.is_none_or(|w| w < layout.tp_writers()));
            }
        }
    }
    true
}

/// `Fingerprint::decode` on arbitrary bytes: a validated fingerprint or `PROTOCOL`; an accepted one
/// re-encodes to bytes that decode to the same fingerprint, and its diff against every local shape
/// agrees with `check`. Returns whether the bytes decoded.
pub fn fingerprint(data: &[u8]) -> bool {
    match Fingerprint::decode(data) {
        Ok(fp) => {
            let again = Fingerprint::decode(&fp.encode()).expect("a re-encoded fingerprint decodes");
            assert_eq!(again, fp);
            for ours in local_shapes() {
                let local = Fingerprint::of(&ours);
                assert_eq!(local.diff(&fp).is_empty(), local.check(&fp).is_ok());
            }
            true
        }
        Err(e) => {
            assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL, "{}", e.chain());
            false
        }
    }
}
