//! Pure parts of the RDMA transport: the QP-attribute exchange (its wire types are in
//! `protocol::rdma_offer`), MTU
//! negotiation, the side-by-side port-attribute diff shown when a QP cannot reach RTR, GID index
//! selection and `ibv_wc_status` names. No verbs call here: everything is unit-tested on any host.

use crate::error::{Error, FieldMismatch, Status};
pub use crate::protocol::rdma_offer::{LinkLayer, Mtu, PortAttrs, QpEndpoint, RdmaOffer, MAX_ENDPOINTS, OFFER_VERSION};

/// The path MTU both sides can use: the smaller of the two active MTUs.
pub fn negotiate_mtu(local: Mtu, remote: Mtu) -> Mtu {
    local.min(remote)
}

/// `enum ibv_port_state` names.
pub fn port_state_name(state: u32) -> &'static str {
    match state {
        0 => "NOP",
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "UNKNOWN",
    }
}

pub const PORT_ACTIVE: u32 = 4;

/// Formats a GID as eight groups of four hex digits ("fe80:0000:...").
pub fn gid_text(gid: &[u8; 16]) -> String {
    gid.chunks(2).map(|p| format!("{:02x}{:02x}", p[0], p[1])).collect::<Vec<_>>().join(":")
}

/// One row of the side-by-side comparison of both ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortRow {
    pub field: &'static str,
    pub local: String,
    pub remote: String,
    /// Why this attribute can make the RTR transition fail (None: it looks fine).
    pub problem: Option<String>,
}

/// Compares both sides' port attributes for an RC connection at `path_mtu`: every attribute side
/// by side, and for each one that can break the INIT→RTR transition, why.
pub fn port_diff(local: &PortAttrs, remote: &PortAttrs, path_mtu: Mtu) -> Vec<PortRow> {
    let mut rows = Vec::new();
    let mut row = |field: &'static str, l: String, r: String, problem: Option<String>| {
        rows.push(PortRow { field, local: l, remote: r, problem })
    };
    row("device:port", local.describe(), remote.describe(), None);
    let ll_problem = (local.link_layer != remote.link_layer).then(|| {
        "link layers differ: an InfiniBand port cannot reach an Ethernet (RoCE) port".to_owned()
    });
    row("link_layer", local.link_layer.to_string(), remote.link_layer.to_string(), ll_problem);
    let state = |s: u32| format!("{} ({s})", port_state_name(s));
    let state_problem = match (local.state == PORT_ACTIVE, remote.state == PORT_ACTIVE) {
        (true, true) => None,
        (false, _) => Some("the local port is not ACTIVE".to_owned()),
        (_, false) => Some("the remote port is not ACTIVE".to_owned()),
    };
    row("state", state(local.state), state(remote.state), state_problem);
    let mtu_problem = (path_mtu > local.active_mtu || path_mtu > remote.active_mtu)
        .then(|| format!("path MTU {path_mtu} exceeds an active MTU (the minimum must be used)"));
    row("active_mtu", local.active_mtu.to_string(), remote.active_mtu.to_string(), mtu_problem);
    let lid_problem = if remote.link_layer.uses_lid() && local.link_layer.uses_lid() {
        match (local.lid, remote.lid) {
            (0, _) => Some("the local LID is 0: no subnet manager configured the port".to_owned()),
            (_, 0) => Some("the remote LID is 0: no subnet manager configured the port".to_owned()),
            _ => None,
        }
    } else {
        None
    };
    row("lid", format!("{:#06x}", local.lid), format!("{:#06x}", remote.lid), lid_problem);
    let roce = local.link_layer == LinkLayer::Ethernet || remote.link_layer == LinkLayer::Ethernet;
    let gid_problem = if roce {
        match (local.gid == [0; 16], remote.gid == [0; 16]) {
            (true, _) => Some(format!("the local GID at index {} is empty (RoCE needs a GID: choose another gid_index)", local.gid_index)),
            (_, true) => Some(format!("the remote GID at index {} is empty (RoCE needs a GID)", remote.gid_index)),
            _ => None,
        }
    } else {
        None
    };
    row("gid_index", local.gid_index.to_string(), remote.gid_index.to_string(), None);
    row("gid", gid_text(&local.gid), gid_text(&remote.gid), gid_problem);
    rows
}

/// The error for a QP that failed to reach `state`: the message names every disagreeing
/// attribute, the causes are the side-by-side table (one row per cause) and finally the OS error.
pub fn transition_error(
    state: &str,
    qpn: u32,
    local: &PortAttrs,
    remote: &PortAttrs,
    path_mtu: Mtu,
    peer: &str,
    os: &std::io::Error,
) -> Error {
    let rows = port_diff(local, remote, path_mtu);
    let suspects: Vec<String> =
        rows.iter().filter_map(|r| r.problem.as_ref().map(|p| format!("{} ({p})", r.field))).collect();
    let verdict = if suspects.is_empty() {
        "no port attribute disagrees (check the GID index, routing, and the peer's QP state)".to_owned()
    } else {
        format!("suspect: {}", suspects.join("; "))
    };
    let mut lines: Vec<String> = rows
        .iter()
        .map(|r| {
            let mark = if r.problem.is_some() { "  <-- DIFFERS" } else { "" };
            format!("{}: local {} | remote {}{mark}", r.field, r.local, r.remote)
        })
        .collect();
    lines.push(format!("path_mtu: {path_mtu}"));
    lines.push(format!("ibv_modify_qp: {os}"));
    let chain = crate::error::CauseChain::from_list(lines);
    let mut e = Error::new(
        Status::KVSTAGE_E_RDMA,
        format!("failed to modify QP {qpn:#x} on {} to {state} (peer {peer}): {verdict}", local.describe()),
    );
    if let Some(chain) = chain {
        e = e.with_source(chain);
    }
    e
}

/// The differing attributes as field mismatches (for callers that want the geometry-style diff).
pub fn port_mismatches(local: &PortAttrs, remote: &PortAttrs, path_mtu: Mtu) -> Vec<FieldMismatch> {
    port_diff(local, remote, path_mtu)
        .into_iter()
        .filter(|r| r.problem.is_some())
        .map(|r| FieldMismatch { field: r.field.to_owned(), local: r.local, remote: r.remote })
        .collect()
}

/// Chooses a GID index when none was configured. `entries`: (index, gid, is RoCE v2). InfiniBand:
/// index 0. Ethernet: the first RoCE v2 GID holding an IPv4-mapped address, else the first RoCE v2
/// GID, else the first non-empty one.
pub fn choose_gid_index(link_layer: LinkLayer, entries: &[(u32, [u8; 16], bool)]) -> Option<u32> {
    if link_layer.uses_lid() {
        return Some(0);
    }
    let non_empty = |e: &&(u32, [u8; 16], bool)| e.1 != [0; 16];
    let ipv4_mapped = |g: &[u8; 16]| g[..10] == [0; 10] && g[10] == 0xff && g[11] == 0xff;
    entries
        .iter()
        .filter(non_empty)
        .find(|e| e.2 && ipv4_mapped(&e.1))
        .or_else(|| entries.iter().filter(non_empty).find(|e| e.2))
        .or_else(|| entries.iter().find(non_empty))
        .map(|e| e.0)
}

/// `enum ibv_wc_status` names, as `ibv_wc_status_str` would identify them.
pub fn wc_status_name(status: u32) -> &'static str {
    const NAMES: [&str; 23] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
    ];
    match status {
        23 => "IBV_WC_TM_RNDV_INCOMPLETE",
        s => NAMES.get(s as usize).copied().unwrap_or("IBV_WC_UNKNOWN"),
    }
}

/// A hint for the usual causes of a failed work completion.
pub fn wc_status_hint(status: u32) -> &'static str {
    match status {
        5 => "flushed: the QP was already in the error state",
        10 => "the remote key or address is not valid for a remote write (ring re-registered or range outside it?)",
        12 => "no acknowledgement from the peer within the retry count (link down, wrong GID/LID, peer gone)",
        13 => "the receiver had no receive work request posted for the write-with-immediate",
        4 | 8 => "the local buffer is not covered by the registered memory region",
        _ => "see ibv_poll_cq(3)",
    }
}

/// The 24-bit initial PSN of a QP (any value is valid; varied so stale packets do not match).
pub fn initial_psn(qpn: u32, salt: u64) -> u32 {
    let x = (qpn as u64 ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((x >> 40) as u32) & 0x00ff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn port(ll: LinkLayer, mtu: Mtu, lid: u16, gid: [u8; 16]) -> PortAttrs {
        PortAttrs {
            device: "mlx5_0".into(),
            port: 1,
            link_layer: ll,
            active_mtu: mtu,
            lid,
            gid_index: 3,
            gid,
            state: PORT_ACTIVE,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]
        #[test]
        fn mtu_negotiation_is_the_minimum(a in 1u32..=5, b in 1u32..=5) {
            let (x, y) = (Mtu::from_code(a).unwrap(), Mtu::from_code(b).unwrap());
            let m = negotiate_mtu(x, y);
            prop_assert_eq!(m, negotiate_mtu(y, x));
            prop_assert_eq!(m.bytes(), x.bytes().min(y.bytes()));
            prop_assert!(m <= x && m <= y);
        }
    }

    #[test]
    fn mtu_codes_and_bytes() {
        assert_eq!(Mtu::M256.bytes(), 256);
        assert_eq!(Mtu::M4096.bytes(), 4096);
        assert_eq!(Mtu::from_code(0), None);
        assert_eq!(Mtu::from_code(6), None);
        assert_eq!(negotiate_mtu(Mtu::M4096, Mtu::M1024), Mtu::M1024);
    }

    #[test]
    fn diff_names_the_link_layer() {
        let ib = port(LinkLayer::InfiniBand, Mtu::M4096, 5, [0; 16]);
        let mut g = [0u8; 16];
        g[0] = 0xfe;
        g[1] = 0x80;
        let eth = port(LinkLayer::Ethernet, Mtu::M1024, 0, g);
        let bad = port_mismatches(&ib, &eth, Mtu::M1024);
        assert!(bad.iter().any(|m| m.field == "link_layer"), "{bad:?}");
        let os = std::io::Error::from_raw_os_error(libc::EINVAL);
        let e = transition_error("RTR", 0x1a4, &ib, &eth, Mtu::M1024, "10.0.0.2:7000", &os);
        assert_eq!(e.code(), Status::KVSTAGE_E_RDMA);
        assert!(e.message().contains("QP 0x1a4"), "{}", e.message());
        assert!(e.message().contains("to RTR"));
        assert!(e.message().contains("link_layer"));
        assert!(e.message().contains("10.0.0.2:7000"));
        let causes = e.causes();
        assert!(causes.iter().any(|c| c.starts_with("link_layer: local InfiniBand | remote Ethernet (RoCE)  <-- DIFFERS")), "{causes:?}");
        assert!(causes.iter().any(|c| c.starts_with("active_mtu: local 4096 | remote 1024") && !c.contains("DIFFERS")));
        assert!(causes.last().unwrap().contains("Invalid argument"), "{causes:?}");
    }

    #[test]
    fn diff_finds_lid_gid_state_and_mtu_problems() {
        let a = port(LinkLayer::InfiniBand, Mtu::M4096, 0, [0; 16]);
        let b = port(LinkLayer::InfiniBand, Mtu::M4096, 7, [0; 16]);
        let fields = |l: &PortAttrs, r: &PortAttrs, m| port_mismatches(l, r, m).into_iter().map(|m| m.field).collect::<Vec<_>>();
        assert_eq!(fields(&a, &b, Mtu::M4096), vec!["lid"]);
        assert!(fields(&b, &b, Mtu::M4096).is_empty());
        let mut down = b.clone();
        down.state = 1;
        assert_eq!(fields(&b, &down, Mtu::M4096), vec!["state"]);
        let small = port(LinkLayer::InfiniBand, Mtu::M1024, 7, [0; 16]);
        assert_eq!(fields(&b, &small, Mtu::M4096), vec!["active_mtu"]);
        assert!(fields(&b, &small, negotiate_mtu(b.active_mtu, small.active_mtu)).is_empty());
        let mut g = [0u8; 16];
        g[15] = 1;
        let e1 = port(LinkLayer::Ethernet, Mtu::M1024, 0, g);
        let e0 = port(LinkLayer::Ethernet, Mtu::M1024, 0, [0; 16]);
        assert_eq!(fields(&e1, &e0, Mtu::M1024), vec!["gid"]);
        assert!(fields(&e1, &e1, Mtu::M1024).is_empty(), "RoCE needs no LID");
        let os = std::io::Error::from_raw_os_error(libc::EINVAL);
        let ok = transition_error("RTR", 1, &e1, &e1, Mtu::M1024, "p", &os);
        assert!(ok.message().contains("no port attribute disagrees"));
    }

    #[test]
    fn gid_index_choice() {
        let v4 = {
            let mut g = [0u8; 16];
            g[10] = 0xff;
            g[11] = 0xff;
            g[12] = 192;
            g
        };
        let link_local = {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g
        };
        let z = [0u8; 16];
        assert_eq!(choose_gid_index(LinkLayer::InfiniBand, &[]), Some(0));
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &[]), None);
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &[(0, z, true)]), None);
        let table = [(0, link_local, false), (1, link_local, true), (2, v4, false), (3, v4, true)];
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &table), Some(3));
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &table[..3]), Some(1));
        assert_eq!(choose_gid_index(LinkLayer::Ethernet, &[(0, z, true), (4, link_local, false)]), Some(4));
    }

    #[test]
    fn wc_status_names() {
        assert_eq!(wc_status_name(0), "IBV_WC_SUCCESS");
        assert_eq!(wc_status_name(5), "IBV_WC_WR_FLUSH_ERR");
        assert_eq!(wc_status_name(10), "IBV_WC_REM_ACCESS_ERR");
        assert_eq!(wc_status_name(12), "IBV_WC_RETRY_EXC_ERR");
        assert_eq!(wc_status_name(13), "IBV_WC_RNR_RETRY_EXC_ERR");
        assert_eq!(wc_status_name(21), "IBV_WC_GENERAL_ERR");
        assert_eq!(wc_status_name(23), "IBV_WC_TM_RNDV_INCOMPLETE");
        assert_eq!(wc_status_name(99), "IBV_WC_UNKNOWN");
        assert!(wc_status_hint(10).contains("remote key"));
    }

    #[test]
    fn psn_is_24_bits_and_varies() {
        let a = initial_psn(0x1a4, 1);
        let b = initial_psn(0x1a5, 1);
        assert!(a <= 0xff_ffff && b <= 0xff_ffff);
        assert_ne!(a, b);
        assert_eq!(gid_text(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]), "fe80:0000:0000:0000:0000:0000:0000:0001");
    }
}
