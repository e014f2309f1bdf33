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
