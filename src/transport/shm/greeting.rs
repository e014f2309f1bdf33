//! What a receiver sends a same-host sender on the local socket: the nonce of the sender's offer,
//! the ring's size and kind, for a device ring its CUDA IPC export (a host ring's memfd goes
//! as the attached descriptor), and how many allocations of the decode pool follow and in which
//! memory (direct mode; see `pool`). Fixed size, little-endian.

use std::os::fd::BorrowedFd;

use super::fdpass::NONCE_BYTES;
use crate::error::{Error, Result, Status};

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// A device ring as its receiver exports it to another process on the node: the IPC handle of
/// the allocation holding it, its offset in that allocation, and its address in the receiver
/// (usable as is only inside that very process: CUDA refuses to open a handle where it was made).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceExport {
    pub handle: [u8; IPC_HANDLE_BYTES],
    pub offset: u64,
    pub ptr: u64,
}

/// The nonce, the ring's size (u64), its kind ([`HOST_RING`], [`DEVICE_RING`]), then for a device
/// ring the export's offset and address (u64 each) and handle, zeros for a host ring; then the
/// number of the decode pool's allocations that follow (u32; 0: no direct mode) and their memory
/// (u8: 0 host memfds, 1 CUDA IPC exports).
pub const GREETING_BYTES: usize = NONCE_BYTES + 8 + 1 + 16 + IPC_HANDLE_BYTES + 4 + 1;
const POOL_FILES_AT: usize = GREETING_BYTES - 5;
const POOL_KIND_AT: usize = GREETING_BYTES - 1;
const HOST_RING: u8 = 0;
const DEVICE_RING: u8 = 1;
const KIND_AT: usize = NONCE_BYTES + 8;

/// The ring a receiver passes to a same-host sender.
pub enum OfferedRing<'a> {
    /// A host ring: its sealed memfd.
    Memfd(BorrowedFd<'a>),
    /// A CUDA device ring.
    Device(DeviceExport),
}

impl OfferedRing<'_> {
    /// The greeting that goes with this ring on the local socket.
    pub(super) fn greeting(&self, nonce: &[u8], ring_len: u64, pool: PoolFiles) -> [u8; GREETING_BYTES] {
        let mut g = [0u8; GREETING_BYTES];
        g[..NONCE_BYTES].copy_from_slice(nonce);
        g[NONCE_BYTES..KIND_AT].copy_from_slice(&ring_len.to_le_bytes());
        match self {
            OfferedRing::Memfd(_) => g[KIND_AT] = HOST_RING,
            OfferedRing::Device(x) => {
                g[KIND_AT] = DEVICE_RING;
                g[KIND_AT + 1..KIND_AT + 9].copy_from_slice(&x.offset.to_le_bytes());
                g[KIND_AT + 9..KIND_AT + 17].copy_from_slice(&x.ptr.to_le_bytes());
                g[KIND_AT + 17..POOL_FILES_AT].copy_from_slice(&x.handle);
            }
        }
        g[POOL_FILES_AT..POOL_KIND_AT].copy_from_slice(&pool.count.to_le_bytes());
        g[POOL_KIND_AT] = pool.device as u8;
        g
    }
}

/// The decode pool's allocations that follow a greeting (direct mode): how many (0: none), and
/// whether they are CUDA IPC exports (else memfds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolFiles {
    pub count: u32,
    pub device: bool,
}

/// Whether `greeting` carries `nonce` (compared in constant time).
pub(super) fn knows(greeting: &[u8; GREETING_BYTES], nonce: &[u8]) -> bool {
    nonce.len() == NONCE_BYTES && greeting[..NONCE_BYTES].iter().zip(nonce).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
}

/// What a greeting says of the ring.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Greeted {
    pub ring_len: u64,
    /// A device ring's export; `None`: a host ring (its descriptor attached).
    pub device: Option<DeviceExport>,
    /// The decode pool's allocations that follow the greeting.
    pub pool: PoolFiles,
}

/// Decodes a greeting (its nonce checked by [`knows`]). An unknown ring kind is a protocol error.
pub(super) fn parse(g: &[u8; GREETING_BYTES]) -> Result<Greeted> {
    let word = |at: usize| u64::from_le_bytes(g[at..at + 8].try_into().expect("8 bytes"));
    let ring = match g[KIND_AT] {
        HOST_RING => None,
        DEVICE_RING => Some(DeviceExport {
            offset: word(KIND_AT + 1),
            ptr: word(KIND_AT + 9),
            handle: g[KIND_AT + 17..POOL_FILES_AT].try_into().expect("the handle's bytes"),
        }),
        other => return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("unknown staging ring kind {other} on the local socket"))),
    };
    let count = u32::from_le_bytes(g[POOL_FILES_AT..POOL_KIND_AT].try_into().expect("4 bytes"));
    let device = match g[POOL_KIND_AT] {
        0 => false,
        1 => true,
        other => return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("unknown pool memory {other} on the local socket"))),
    };
    Ok(Greeted { ring_len: word(NONCE_BYTES), device: ring, pool: PoolFiles { count, device } })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greetings_round_trip_and_unknown_kinds_are_refused() {
        let nonce = [7u8; NONCE_BYTES];
        let export = DeviceExport { handle: [0xab; IPC_HANDLE_BYTES], offset: 4096, ptr: 0x7f00_0000_1000 };
        let device_pool = PoolFiles { count: 2, device: true };
        let g = OfferedRing::Device(export).greeting(&nonce, 1 << 20, device_pool);
        assert!(knows(&g, &nonce) && !knows(&g, &[8u8; NONCE_BYTES]) && !knows(&g, &nonce[1..]));
        assert_eq!(parse(&g).unwrap(), Greeted { ring_len: 1 << 20, device: Some(export), pool: device_pool });
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let host_pool = PoolFiles { count: 3, device: false };
        let g = OfferedRing::Memfd(std::os::fd::AsFd::as_fd(&a)).greeting(&nonce, 4096, host_pool);
        assert_eq!(parse(&g).unwrap(), Greeted { ring_len: 4096, device: None, pool: host_pool });
        let mut bad = g;
        bad[KIND_AT] = 9;
        assert_eq!(parse(&bad).unwrap_err().code(), Status::KVSTAGE_E_PROTOCOL);
        let mut bad = g;
        bad[POOL_KIND_AT] = 2;
        assert_eq!(parse(&bad).unwrap_err().code(), Status::KVSTAGE_E_PROTOCOL);
    }
}
