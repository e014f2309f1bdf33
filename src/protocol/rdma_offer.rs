//! The RDMA offer and answer exchanged after the handshake: each side's queue pairs and ports,
//! and the receiver's registered ring. Wire types only; what is done with them is in
//! `transport::rdma`.

use std::fmt;

use super::codec::{Dec, Enc};
use crate::error::{Result, Status};

/// Version of the offer/answer body (inside the protocol's `RdmaOffer` / `RdmaAnswer` frames).
pub const OFFER_VERSION: u16 = 1;
/// Most queue pairs one session may ask for (NICs × QPs per NIC).
pub const MAX_ENDPOINTS: usize = 64;
const MAX_NAME: usize = 64;
const MAX_REASON: usize = 4096;

/// Path MTU, with the `enum ibv_mtu` codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    M256 = 1,
    M512 = 2,
    M1024 = 3,
    M2048 = 4,
    M4096 = 5,
}

impl Mtu {
    pub fn from_code(code: u32) -> Option<Mtu> {
        Some(match code {
            1 => Mtu::M256,
            2 => Mtu::M512,
            3 => Mtu::M1024,
            4 => Mtu::M2048,
            5 => Mtu::M4096,
            _ => return None,
        })
    }

    pub fn code(self) -> u32 {
        self as u32
    }

    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// Link layer of a port (`IBV_LINK_LAYER_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    Unspecified = 0,
    InfiniBand = 1,
    Ethernet = 2,
}

impl LinkLayer {
    pub fn from_code(code: u8) -> Option<LinkLayer> {
        Some(match code {
            0 => LinkLayer::Unspecified,
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            _ => return None,
        })
    }

    /// Ports whose addressing is by LID (InfiniBand; "unspecified" is InfiniBand in libibverbs).
    pub fn uses_lid(self) -> bool {
        self != LinkLayer::Ethernet
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::Unspecified => "unspecified",
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet (RoCE)",
        })
    }
}

/// One side's port as the other side needs to know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortAttrs {
    pub device: String,
    pub port: u8,
    pub link_layer: LinkLayer,
    pub active_mtu: Mtu,
    pub lid: u16,
    pub gid_index: u32,
    pub gid: [u8; 16],
    /// `enum ibv_port_state`.
    pub state: u32,
}

impl PortAttrs {
    pub fn describe(&self) -> String {
        format!("{}:{}", self.device, self.port)
    }
}

/// One queue pair of a session, as announced to the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    pub port: PortAttrs,
    /// Answer only: rkey of the receiver's staging ring on this QP's device (0 in an offer).
    pub rkey: u32,
}

/// The sender's offer (its QPs) or the receiver's answer (its QPs, matched by position, and its
/// staging ring). `status != 0` in an answer: the receiver cannot serve RDMA, `reason` says why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaOffer {
    pub version: u16,
    pub status: i32,
    pub reason: String,
    pub endpoints: Vec<QpEndpoint>,
    /// Answer only: virtual address and length of the receiver's registered staging ring.
    pub ring_addr: u64,
    pub ring_len: u64,
}

impl RdmaOffer {
    pub fn refusal(code: Status, reason: impl Into<String>) -> RdmaOffer {
        RdmaOffer { version: OFFER_VERSION, status: code.code(), reason: reason.into(), endpoints: Vec::new(), ring_addr: 0, ring_len: 0 }
    }

    /// The sender's confirmation, after an accepted offer, that its queue pairs reached RTS: the
    /// receiver treats the session as RDMA from here on (a setup failure is sent as a refusal).
    pub fn confirmation() -> RdmaOffer {
        RdmaOffer { version: OFFER_VERSION, status: 0, reason: String::new(), endpoints: Vec::new(), ring_addr: 0, ring_len: 0 }
    }

    /// Little-endian body (appended to `out`).
    pub fn encode(&self, out: &mut Enc) {
        out.u16(self.version).i32(self.status).str(&self.reason).u64(self.ring_addr).u64(self.ring_len);
        out.u32(self.endpoints.len() as u32);
        for e in &self.endpoints {
            out.u32(e.qpn).u32(e.psn).u32(e.rkey).str(&e.port.device);
            out.u8(e.port.port).u8(e.port.link_layer as u8).u8(e.port.active_mtu as u8);
            out.u16(e.port.lid).u32(e.port.gid_index).raw(&e.port.gid).u32(e.port.state);
        }
    }

    /// Decodes a whole body; any inconsistency is `KVSTAGE_E_PROTOCOL` naming the field.
    pub fn decode(body: &[u8]) -> Result<RdmaOffer> {
        let mut d = Dec::new(body, "rdma offer");
        let version = d.u16("version")?;
        if version != OFFER_VERSION {
            return Err(d.error(format!("offer version {version} != supported {OFFER_VERSION}")));
        }
        let status = d.u32("status")? as i32;
        let reason = d.str("reason", MAX_REASON)?;
        let ring_addr = d.u64("ring_addr")?;
        let ring_len = d.u64("ring_len")?;
        let n = d.u32("endpoint count")? as usize;
        if n > MAX_ENDPOINTS {
            return Err(d.error(format!("{n} endpoints exceeds the limit of {MAX_ENDPOINTS}")));
        }
        let mut endpoints = Vec::with_capacity(n);
        for _ in 0..n {
            let qpn = d.u32("qpn")?;
            let psn = d.u32("psn")?;
            if psn > 0x00ff_ffff {
                return Err(d.error(format!("psn {psn:#x} is wider than 24 bits")));
            }
            let rkey = d.u32("rkey")?;
            let device = d.str("device", MAX_NAME)?;
            let port = d.u8("port")?;
            let ll = d.u8("link_layer")?;
            let link_layer = LinkLayer::from_code(ll).ok_or_else(|| d.error(format!("unknown link layer {ll}")))?;
            let m = d.u8("active_mtu")?;
            let active_mtu = Mtu::from_code(m as u32).ok_or_else(|| d.error(format!("unknown MTU code {m}")))?;
            let lid = d.u16("lid")?;
            let gid_index = d.u32("gid_index")?;
            let gid: [u8; 16] = d.take(16, "gid")?.try_into().expect("16 bytes");
            let state = d.u32("state")?;
            endpoints.push(QpEndpoint {
                qpn,
                psn,
                rkey,
                port: PortAttrs { device, port, link_layer, active_mtu, lid, gid_index, gid, state },
            });
        }
        d.finish()?;
        Ok(RdmaOffer { version, status, reason, endpoints, ring_addr, ring_len })
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn port(ll: LinkLayer, mtu: Mtu, lid: u16, gid: [u8; 16]) -> PortAttrs {
        PortAttrs { device: "mlx5_0".into(), port: 1, link_layer: ll, active_mtu: mtu, lid, gid_index: 3, gid, state: 4 }
    }

    fn encoded(o: &RdmaOffer) -> Vec<u8> {
        let mut e = Enc::default();
        o.encode(&mut e);
        e.0
    }

    fn offer() -> RdmaOffer {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 0, 0, 7]);
        RdmaOffer {
            version: OFFER_VERSION,
            status: 0,
            reason: String::new(),
            endpoints: vec![
                QpEndpoint { qpn: 0x1a4, psn: 0xabcdef, rkey: 0, port: port(LinkLayer::Ethernet, Mtu::M4096, 0, g) },
                QpEndpoint { qpn: 0x1a5, psn: 1, rkey: 77, port: port(LinkLayer::InfiniBand, Mtu::M2048, 9, [0; 16]) },
            ],
            ring_addr: 0x7f00_0000_1000,
            ring_len: 1 << 30,
        }
    }

    #[test]
    fn offer_round_trips() {
        for o in [offer(), RdmaOffer::refusal(Status::KVSTAGE_E_NO_DEVICE, "no device")] {
            let b = encoded(&o);
            assert_eq!(RdmaOffer::decode(&b).unwrap(), o);
        }
    }

    #[test]
    fn offer_decoder_names_what_is_wrong() {
        let b = encoded(&offer());
        let err = |bytes: &[u8]| RdmaOffer::decode(bytes).unwrap_err();
        assert!(err(&b[..b.len() - 1]).message().contains("state needs 4 bytes"));
        let mut v = b.clone();
        v[0] = 9;
        assert!(err(&v).message().contains("offer version 9"));
        let mut t = b.clone();
        t.push(0);
        assert!(err(&t).message().contains("1 trailing bytes"));
        let mut many = b.clone();
        let at = 2 + 4 + 4 + 8 + 8; // endpoint count
        many[at..at + 4].copy_from_slice(&1000u32.to_le_bytes());
        assert!(err(&many).message().contains("1000 endpoints exceeds"));
        assert_eq!(err(&many).code(), Status::KVSTAGE_E_PROTOCOL);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]
        #[test]
        fn offer_decoder_survives_garbage(body in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Err(e) = RdmaOffer::decode(&body) {
                prop_assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL);
            }
        }

        #[test]
        fn offer_decoder_survives_mutations(pos in any::<usize>(), val in any::<u8>()) {
            let mut b = encoded(&offer());
            let p = pos % b.len();
            b[p] = val;
            if let Ok(o) = RdmaOffer::decode(&b) {
                prop_assert_eq!(encoded(&o), b);
            }
        }
    }
}
