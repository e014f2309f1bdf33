//! A library must never kill its host with SIGPIPE. C and Python hosts keep SIGPIPE's default
//! action (terminate); Rust test binaries ignore it, so this test restores the default first, then
//! lets a decode peer vanish while large chunks are being written to it. The transfers must fail
//! with an error and the process must live.

use std::time::Duration;

use kvstage::engine::{Engine, EngineOptions};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{staging_layout, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage_testkit::HostPool;

#[test]
fn a_vanished_peer_mid_write_is_an_error_not_a_signal() {
    // SAFETY: setting a signal disposition to its default has no preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // 32 KiB per token: a 64-page chunk is 32 MiB, far more than the socket buffers hold.
    let shape = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 8);
    let pages: Vec<u32> = (0..64).collect();
    let chunk_tokens = 64 * 16;
    for round in 0..3 {
        let decode = Engine::new(EngineOptions::default()).unwrap();
        let dpool = HostPool::new(shape.clone(), 64);
        decode.register_pool(dpool.layout.clone()).unwrap();
        let chunk = staging_layout(&shape, &shape, chunk_tokens).unwrap().total_bytes;
        decode.register_staging(None, 2 * chunk as usize).unwrap();
        let (key, _) = decode.receiver().open_room(RoomOpening::new(1, &pages, chunk_tokens)).unwrap();

        let prefill = Engine::new(EngineOptions::default()).unwrap();
        let mut ppool = HostPool::new(shape.clone(), 64);
        ppool.fill(&pages, 0);
        prefill.register_pool(ppool.layout.clone()).unwrap();
        let session = prefill.connect(&decode.local_addr().to_string(), "sigpipe", None).unwrap();
        let chunk_pages = pages.clone();
        let sender = std::thread::spawn(move || {
            let desc = TransferDesc { room: RoomRef { id: 1, key }, chunk: 0, pages: chunk_pages, timeout: Some(Duration::from_secs(20)), ..Default::default() };
            let result = session.transfer(&desc, &Op::new(session.waker()));
            (result.map_err(|e| e.code()), prefill)
        });
        // Let the write start, then the decode engine goes away (its sockets close).
        std::thread::sleep(Duration::from_millis(20 + 15 * round));
        drop(decode);
        let (result, _prefill) = sender.join().expect("the sender thread ends");
        // Either the chunk made it before the close, or the transfer reports the peer gone; the
        // process (and this test) is still here either way.
        if let Err(code) = result {
            assert!(
                matches!(code, kvstage::Status::KVSTAGE_E_PEER_GONE | kvstage::Status::KVSTAGE_E_TRANSPORT | kvstage::Status::KVSTAGE_E_CANCELED),
                "round {round}: {code:?}"
            );
        }
    }
}

/// The same-host path's local socket: the receiver's greeting (a device ring's IPC export) and the
/// ring's descriptor go to a sender that may have closed its end. An error, not a signal.
#[test]
fn a_closed_local_socket_is_an_error_not_a_signal() {
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use kvstage::transport::shm::fdpass;
    // SAFETY: as above.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let (ours, theirs) = UnixStream::pair().unwrap();
    drop(theirs);
    let e = fdpass::send_all(&ours, &[7u8; 64]).expect_err("a write to a closed socket succeeded");
    assert_eq!(e.raw_os_error(), Some(libc::EPIPE), "{e}");
    let (ours, theirs) = UnixStream::pair().unwrap();
    drop(theirs);
    let passed = ours.try_clone().unwrap();
    assert!(fdpass::send_fd(&ours, passed.as_fd(), &[7u8; 64]).is_err());
}
