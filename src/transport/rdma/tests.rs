//! RDMA pure parts and option checks (the engine-to-engine paths over the soft fabric are the
//! integration test tests/rdma_soft.rs, built with the feature `testing`).

use super::*;
use crate::engine::{Engine, EngineOptions, TransportKind};

#[test]
fn device_selection_parsing_and_limits() {
    assert_eq!(parse_devices("").unwrap(), vec![]);
    assert_eq!(
        parse_devices("mlx5_0:1, mlx5_1").unwrap(),
        vec![DeviceSel { name: "mlx5_0".into(), port: Some(1) }, DeviceSel { name: "mlx5_1".into(), port: None }]
    );
    for bad in ["mlx5_0:0", "mlx5_0:x", "a b", "mlx5_0,mlx5_0", ":1"] {
        let e = parse_devices(bad).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG, "{bad}");
        assert!(e.message().contains("options->rdma_devices"), "{bad}: {}", e.message());
    }
    let bad = |o: RdmaOptions, field: &str| {
        let e = o.validate().unwrap_err();
        assert!(e.message().contains(field), "{}", e.message());
    };
    bad(RdmaOptions { qps_per_device: 0, ..RdmaOptions::default() }, "rdma_qps_per_device");
    bad(RdmaOptions { wr_bytes: 100, ..RdmaOptions::default() }, "rdma_wr_bytes");
    bad(RdmaOptions { signal_every: 0, ..RdmaOptions::default() }, "rdma_signal_every");
    let many = RdmaOptions { devices: parse_devices("a,b,c,d,e").unwrap(), qps_per_device: 16, ..RdmaOptions::default() };
    bad(many, "exceeds 64");
    // A named device that does not exist (soft fabric: the list is known).
    let rdma = RdmaOptions { devices: parse_devices("softdown0").unwrap(), ..RdmaOptions::default() };
    let e = Engine::new(EngineOptions { transport: TransportKind::Rdma, rdma, ..EngineOptions::default() }).err().unwrap();
    assert_eq!(e.code(), Status::KVSTAGE_E_NO_DEVICE);
    assert!(e.chain().contains("softdown0:1 is DOWN"), "{}", e.chain());
}

/// Send staging registrations live exactly as long as their buffer: writes alternating between
/// two live buffers (two sessions at once) keep each buffer's keys valid, so neither write loses
/// its memory region under the other; a freed buffer's registration is gone, and memory later at
/// the same addresses is registered anew (never read through regions pinning the freed pages).
#[test]
fn staging_buffers_keep_their_own_registration_for_their_lifetime() {
    let options = RdmaOptions { devices: parse_devices("softib0").unwrap(), ..RdmaOptions::default() };
    let rdma = Rdma::open(RdmaMode::Required, options).unwrap();
    let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 8192]);
    let host = |m: &mut Vec<u8>| NicMemory { ptr: m.as_mut_ptr(), len: m.len(), dmabuf: None };
    let held_a = rdma.register_staging(&host(&mut a)).unwrap().expect("a device is open");
    let held_b = rdma.register_staging(&host(&mut b)).unwrap().expect("a device is open");
    let first_a = rdma.staging_keys(a[100..].as_mut_ptr(), 200).unwrap();
    let in_b = rdma.staging_keys(b.as_mut_ptr(), b.len()).unwrap();
    let again_a = rdma.staging_keys(a.as_mut_ptr(), a.len()).unwrap();
    assert_eq!(first_a.lkey(0), again_a.lkey(0), "one registration per buffer, reused by every write from it");
    assert_ne!(first_a.lkey(0), in_b.lkey(0));
    assert!(soft::registered(first_a.lkey(0)) && soft::registered(in_b.lkey(0)), "a write from one buffer deregistered the other");
    let key_a = first_a.lkey(0);
    drop((first_a, in_b, again_a));
    assert!(soft::registered(key_a), "the buffer still lives");
    drop(held_a);
    assert!(!soft::registered(key_a), "the registration outlived its buffer");
    // New memory at a's addresses (as an allocator may hand out): a registration of its own,
    // for this write only.
    let fresh = rdma.staging_keys(a.as_mut_ptr(), a.len()).unwrap();
    let fresh_key = fresh.lkey(0);
    assert!(fresh_key != key_a && soft::registered(fresh_key));
    drop(fresh);
    assert!(!soft::registered(fresh_key), "a write's own registration ends with the write");
    let key_b = rdma.staging_keys(b.as_mut_ptr(), 1).unwrap().lkey(0);
    drop(held_b);
    assert!(!soft::registered(key_b));
    // Without a device nothing is registered.
    assert!(Rdma::off().register_staging(&host(&mut b)).unwrap().is_none());
}

/// Device memory (here as the fake driver makes it: a memfd mapped PROT_NONE at the "device
/// address") is registered through its dma-buf, the address as IOVA: the fabric reaches the memory
/// through the dma-buf at the right offset. Without a dma-buf, a plain registration of the
/// address fails as it does without a peer-memory module, and the error names both attempts; a
/// pointer the NIC can pin (what peer memory makes of device memory) registers plainly.
#[test]
fn device_memory_registers_by_dmabuf_else_as_a_plain_pointer_else_not_at_all() {
    use std::os::fd::{FromRawFd, OwnedFd};
    const LEN: usize = 64 << 10;
    let options = RdmaOptions { devices: parse_devices("softib0").unwrap(), ..RdmaOptions::default() };
    let rdma = Rdma::open(RdmaMode::Required, options).unwrap();
    // SAFETY: a fresh memfd and two mappings of it, unmapped at the end.
    let (memfd, device, host) = unsafe {
        let fd = libc::memfd_create(c"kvstage-test-device".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0 && libc::ftruncate(fd, LEN as libc::off_t) == 0);
        let device = libc::mmap(std::ptr::null_mut(), LEN, libc::PROT_NONE, libc::MAP_SHARED, fd, 0);
        let host = libc::mmap(std::ptr::null_mut(), LEN, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        assert!(device != libc::MAP_FAILED && host != libc::MAP_FAILED);
        (OwnedFd::from_raw_fd(fd), device as *mut u8, host as *mut u8)
    };
    let ring = device.wrapping_add(4096);
    let export = || Ok(DmaBuf { fd: memfd.try_clone()?, offset: 4096 });
    let keys = rdma.ring_keys(&NicMemory { ptr: ring, len: LEN - 4096, dmabuf: Some(&export) }).unwrap();
    let reached = soft::host_address(keys[0], ring as u64 + 10).expect("the IOVA lies in the region");
    // SAFETY: the fabric's mapping of the memfd, 4096 + 10 bytes in; `host` maps the same file.
    unsafe {
        (reached as *mut u8).write(0x5a);
        assert_eq!(host.add(4096 + 10).read(), 0x5a, "the fabric reaches the memory at the dma-buf's offset");
    }
    rdma.forget_ring();
    assert!(!soft::registered(keys[0]));

    let no_export = || Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "no dma-buf here"));
    let e = rdma.ring_keys(&NicMemory { ptr: ring, len: LEN - 4096, dmabuf: Some(&no_export) }).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_UNSUPPORTED);
    assert!(e.message().contains("no dma-buf here") && e.message().contains("peer-memory") && e.message().contains("ibv_reg_mr"), "{}", e.chain());
    // Pinnable memory (peer memory's case): registered as a plain pointer.
    let keys = rdma.ring_keys(&NicMemory { ptr: host, len: LEN, dmabuf: Some(&no_export) }).unwrap();
    assert_eq!(soft::host_address(keys[0], host as u64 + 5), Some(host as u64 + 5));
    rdma.forget_ring();
    // SAFETY: the mappings made above, no longer registered.
    unsafe {
        libc::munmap(device.cast(), LEN);
        libc::munmap(host.cast(), LEN);
    }
}
