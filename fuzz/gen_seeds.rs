//! Writes the committed seed corpus of the fuzz targets: valid frames of every type (and streams
//! of several), hello bodies both sides send, and fingerprints of assorted pools. Deterministic:
//! rerunning it rewrites the same files.
//!
//!     cargo run --manifest-path fuzz/Cargo.toml --bin gen_seeds
//!
//! Every seed is checked to decode before it is written.

use std::path::{Path, PathBuf};

use kvstage::geometry::Fingerprint;
use kvstage::protocol::{read_frame, Hello, Message, RoomRef, PROTOCOL_VERSION};
use kvstage::ring::Watermark;
use kvstage::session::receiver::verify_peer;

#[path = "checks.rs"]
mod checks;

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).expect("create the corpus directory");
    std::fs::write(dir.join(format!("seed-{name}")), bytes).expect("write a seed");
}

fn hellos() -> Vec<(String, Hello)> {
    let mut out = Vec::new();
    let locals = checks::local_shapes();
    let peers = checks::peer_shapes();
    for (i, shape) in peers.iter().enumerate() {
        // The sender's hello (no ring).
        out.push((
            format!("sender-{i}"),
            Hello {
                protocol_version: PROTOCOL_VERSION,
                library_version: kvstage::version_number(),
                session: format!("req-{i}/p{}-d0", shape.tp_rank),
                fingerprint: Fingerprint::of(shape).encode(),
                shape: shape.clone(),
                ring_bytes: 0,
                watermark: Watermark::default(),
                status: 0,
                reason: String::new(),
                token: if i % 2 == 0 { Vec::new() } else { b"cluster-secret".to_vec() },
                integrity: (i % 3) as u8,
                components: if i % 2 == 0 { checks::local_components() } else { Vec::new() },
            },
        ));
    }
    for (i, shape) in locals.iter().enumerate() {
        // The receiver's answer: its ring and watermark, accepted or refused with a reason.
        out.push((
            format!("receiver-{i}"),
            Hello {
                protocol_version: PROTOCOL_VERSION,
                library_version: kvstage::version_number(),
                session: "s".into(),
                fingerprint: Fingerprint::of(shape).encode(),
                shape: shape.clone(),
                ring_bytes: 1 << 30,
                watermark: Watermark { round: 3, offset: 4096 },
                status: if i % 2 == 0 { 0 } else { -10 },
                reason: if i % 2 == 0 { String::new() } else { "geometry mismatch (1 field): head_dim".into() },
                token: Vec::new(),
                integrity: 1,
                components: Vec::new(),
            },
        ));
    }
    out
}

fn messages() -> Vec<(String, Message)> {
    // A room as a frame names it: id and the key of its opening.
    const ROOM: RoomRef = RoomRef { id: 9, key: 0x6b65_7973_0000_0009 };
    let mut out: Vec<(String, Message)> = hellos().into_iter().map(|(n, h)| (format!("hello-{n}"), Message::Hello(h))).collect();
    out.extend([
        ("alloc-req".into(), Message::AllocReq { req: 7, room: ROOM, chunk: 2, writer: 1, tokens: 64, bytes: 4096, trace: "req-7".into(), pool_tokens: None, direct: false }),
        ("alloc-req-parts".into(), Message::AllocReq { req: 9, room: ROOM, chunk: 3, writer: 0, tokens: 17, bytes: 8192, trace: String::new(), pool_tokens: Some(vec![40, 8]), direct: false }),
        ("alloc-rsp-ok".into(), Message::AllocRsp { req: 7, status: 0, round: 1, offset: 8192, len: 4096, region: 2048, reason: String::new(), pages: Vec::new() }),
        ("alloc-rsp-direct".into(), Message::AllocRsp { req: 9, status: 0, round: 1, offset: 8192, len: 4096, region: 0, reason: String::new(), pages: vec![7, 2, 11] }),
        ("alloc-rsp-refused".into(), Message::AllocRsp { req: 8, status: -13, round: 0, offset: 0, len: 0, region: 0, reason: "chunk larger than the ring".into(), pages: Vec::new() }),
        ("data".into(), Message::Data { room: ROOM, chunk: 2, writer: 1, offset: 2048, len: 16 }),
        ("chunk-ready".into(), Message::ChunkReady { req: 10, room: ROOM, chunk: 2, writer: 1, checksum: Some(0x0123_4567_89ab_cdef) }),
        ("chunk-ready-unchecked".into(), Message::ChunkReady { req: 13, room: ROOM, chunk: 3, writer: 0, checksum: None }),
        ("arrived".into(), Message::Arrived { req: 10, status: 0, reason: String::new() }),
        ("arrived-rejected".into(), Message::Arrived { req: 11, status: -40, reason: "ready for chunk 2 after 0 of 4096 bytes".into() }),
        ("watermark".into(), Message::Watermark(Watermark { round: 5, offset: 6 })),
        ("abort-chunk".into(), Message::Abort { room: ROOM, chunk: 2, reason: "deadline passed".into() }),
        ("abort-room".into(), Message::Abort { room: ROOM, chunk: u32::MAX, reason: "canceled".into() }),
        ("slice".into(), Message::Slice { room: ROOM, chunk: 0, buffer: 3, token: 17, byte_offset: 256, len: 8 }),
        ("slice-done".into(), Message::SliceDone { req: 12, room: ROOM, chunk: 0 }),
        ("written".into(), Message::Written { room: ROOM, chunk: 2, writer: 1, offset: 2048, len: 4096, imm: 0 }),
        ("grid-req".into(), Message::GridReq { req: 14, room: ROOM }),
        ("grid-rsp".into(), Message::GridRsp { req: 14, status: 0, chunk_tokens: 64, num_chunks: 3, num_pages: 10, prefix_tokens: 128, reason: String::new() }),
        ("shm-offer".into(), Message::ShmOffer { socket: "kvstage-shm-42-00112233445566778899aabb".into(), nonce: vec![0x5a; 16], direct: None }),
        ("shm-answer".into(), Message::ShmAnswer { status: 0, local: true, ring_len: 1 << 20, reason: String::new() }),
        ("shm-answer-refused".into(), Message::ShmAnswer { status: -5, local: true, ring_len: 0, reason: "caller memory".into() }),
    ]);
    out
}

/// A frame followed by its payload (for `Data` and `Slice`), as on the wire.
fn wire(msg: &Message) -> Vec<u8> {
    let mut bytes = msg.encode();
    bytes.extend((0..msg.payload_len()).map(|i| (i * 7 + 1) as u8));
    bytes
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let msgs = messages();

    // frame: single frames, then the streams each side really sends.
    let frame_dir = root.join("frame");
    for (name, msg) in &msgs {
        let bytes = wire(msg);
        assert_eq!(read_frame(&mut &bytes[..]).expect("seed decodes").as_ref(), Some(msg), "{name}");
        assert_eq!(checks::frame(&bytes), 1, "{name}");
        write(&frame_dir, name, &bytes);
    }
    let find = |n: &str| msgs.iter().find(|(name, _)| name == n).map(|(_, m)| m.clone()).expect("named seed");
    let streams: [(&str, Vec<Message>); 3] = [
        ("stream-sender", vec![find("hello-sender-0"), find("alloc-req"), find("data"), find("chunk-ready"), find("abort-chunk")]),
        ("stream-receiver", vec![find("hello-receiver-0"), find("alloc-rsp-ok"), find("watermark"), find("arrived"), find("alloc-rsp-refused")]),
        ("stream-slices", vec![find("hello-sender-1"), find("slice"), find("slice"), find("slice-done")]),
    ];
    for (name, list) in &streams {
        let bytes: Vec<u8> = list.iter().flat_map(wire).collect();
        assert_eq!(checks::frame(&bytes), list.len(), "{name}");
        write(&frame_dir, name, &bytes);
    }

    // handshake: hello bodies (the frame minus its 5-byte header).
    let hs_dir = root.join("handshake");
    for (name, hello) in hellos() {
        let frame = Message::Hello(hello.clone()).encode();
        assert_eq!(Message::decode(frame[4], &frame[5..]).expect("seed decodes"), Message::Hello(hello.clone()));
        assert!(checks::handshake(&frame[5..]), "{name}");
        // Seeds reach past the fingerprint check: every sender hello but the last pairs with a
        // local shape (the last mismatches all of them).
        let pairs = checks::local_shapes().iter().any(|ours| verify_peer(ours, &hello.components, &hello).is_ok());
        assert_eq!(pairs, name != format!("sender-{}", checks::peer_shapes().len() - 1) || name.starts_with("receiver"), "{name}");
        write(&hs_dir, &name, &frame[5..]);
    }

    // fingerprint: every shape both sides use.
    let fp_dir = root.join("fingerprint");
    for (i, shape) in checks::local_shapes().iter().chain(checks::peer_shapes().iter()).enumerate() {
        let bytes = Fingerprint::of(shape).encode();
        assert_eq!(Fingerprint::decode(&bytes).expect("seed decodes").shape, *shape);
        assert!(checks::fingerprint(&bytes));
        write(&fp_dir, &format!("{i:02}"), &bytes);
    }
    println!("seeds written under {}", root.display());
}
