//! Wire messages of the control plane and their framed, versioned, bounds-checked codec.
//!
//! A frame is `u32 body_len | u8 type | body` (little endian). `Data` and `Slice` frames are followed
//! by `len` payload bytes that are not part of `body_len`, so the receiver can validate the target
//! range first and then read the payload straight into it (no intermediate copy).

use std::io::{Read, Write};

use crate::error::{Error, Result, Status};
use crate::geometry::{MemoryKind, ModelKind, PoolShape};
use crate::ring::Watermark;
pub use rdma_offer::{LinkLayer, Mtu, PortAttrs, QpEndpoint, RdmaOffer, MAX_ENDPOINTS, OFFER_VERSION};

use codec::{Dec, Enc};

pub mod codec;
pub mod fingerprint;
mod parts;
pub mod rdma_offer;
pub mod trace;

pub const MAGIC: [u8; 8] = *b"KVSTAGE\x01";
/// 2: the hello carries the integrity policy; late frames for closed rooms are discarded.
/// 3: an allocation reply says where the writer's region lies (regions follow the pipeline split);
/// a sender can ask for a room's chunk grid.
/// 4: the same-host exchange (`ShmOffer`, `ShmAnswer`); `Written` reports any in-place write.
/// 5: after an accepted RDMA offer the sender confirms (or refuses) its own QP setup with a second
/// `RdmaOffer` before either side uses RDMA.
/// 6: every frame that names a room names its opening too ([`RoomRef`]: id and key).
/// 7: an allocation request carries the request's trace id (the caller's; empty: derived).
/// 8: a hello carries the rank's components (aux, state, extra pools); an allocation request says
/// whether the writer sends request parts, and each pool span's token count.
/// 9: direct mode on one host: a same-host offer says whether the sender maps the decode pool, an
/// allocation request whether the writer writes that pool directly, and a grant for it carries
/// the chunk's decode pages.
/// 10: direct mode for device pools: a same-host offer names the memory of the pool the sender
/// writes from (host or CUDA), and the receiver shares its pool only in that memory (memfds, or
/// CUDA IPC handles of whole allocations).
/// 12: a same-host pool share carries the decode pool's capacity and strides (each side's pool has
/// a layout of its own: only the model must agree).
/// 13: a pool shape (hello, fingerprint) carries `head_dim_v`; a same-host pool share carries V's
/// strides as well as K's.
pub const PROTOCOL_VERSION: u16 = 13;
/// Largest control body accepted; anything larger is a protocol error, not an allocation.
pub const MAX_BODY: u32 = 1 << 20;
/// Largest hello body accepted from a peer that has not authenticated yet.
pub const MAX_HELLO_BODY: u32 = 64 << 10;
/// Largest number of decode pages a direct grant may name.
pub const MAX_GRANT_PAGES: u32 = 1 << 16;
/// Largest string or byte field of a frame (session id, reason, fingerprint, token).
const MAX_TEXT: usize = 16 << 10;
/// Largest number of layers a shape on the wire may carry.
const MAX_LAYERS: u32 = 4096;

/// A room as a frame names it: the decode side's room id and the key of the opening the sender
/// was given (`kvstage_room_open` returns a fresh, unguessable one each time the id is opened), so
/// a frame meant for an earlier request under the same id, or a guess at another tenant's room,
/// matches nothing. Displayed (and debug-printed) without the key: it is a capability and stays
/// out of logs and error messages.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RoomRef {
    pub id: u64,
    pub key: u64,
}

impl std::fmt::Display for RoomRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.id.fmt(f)
    }
}

impl std::fmt::Debug for RoomRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomRef").field("id", &self.id).finish_non_exhaustive()
    }
}

fn decode_room(d: &mut Dec) -> Result<RoomRef> {
    Ok(RoomRef { id: d.u64("room")?, key: d.u64("room_key")? })
}

/// One rank's view of the handshake.
#[derive(Clone, Debug, PartialEq)]
pub struct Hello {
    pub protocol_version: u16,
    pub library_version: u32,
    pub session: String,
    pub fingerprint: Vec<u8>,
    pub shape: PoolShape,
    /// Receiver only: staging ring size (0 = no ring) and its current watermark.
    pub ring_bytes: u64,
    pub watermark: Watermark,
    /// Receiver only: status of the handshake (0 = accepted) and why not.
    pub status: i32,
    pub reason: String,
    /// The cluster token this side presents (empty: none).
    pub token: Vec<u8>,
    /// This side's integrity policy (0 off, 1 sampled, 2 always); the stronger one applies.
    pub integrity: u8,
    /// The rank's registered components (request parts besides the KV), in registration order.
    pub components: Vec<crate::geometry::ComponentSpec>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Hello(Hello),
    /// `pool_tokens`: `Some` when the writer's region carries request parts (the room's last
    /// chunk), with the token count of each extra pool span it sends.
    /// `direct`: the writer maps the decode pool and can write this region's KV straight into its
    /// pages (same host).
    AllocReq { req: u64, room: RoomRef, chunk: u32, writer: u32, tokens: u32, bytes: u64, trace: String, pool_tokens: Option<Vec<u32>>, direct: bool },
    /// `status` 0 = granted `[offset, offset + len)` of ring round `round`, the writer's region at
    /// `region` bytes into it; otherwise a `Status` code with `reason`.
    /// `pages`: not empty when the writer is to write its region's KV directly into these decode
    /// pages (the chunk's, in order) instead of the ring range (which stays granted).
    AllocRsp { req: u64, status: i32, round: u64, offset: u64, len: u64, region: u64, reason: String, pages: Vec<u32> },
    /// Header of a bulk write: `len` payload bytes follow, to land at `offset` within the allocation.
    Data { room: RoomRef, chunk: u32, writer: u32, offset: u64, len: u64 },
    /// Completion of one writer's data for a chunk; sent after its `Data` frames in the same stream.
    /// `checksum`: xxh3-64 of the writer's region, when integrity checking covers this chunk.
    ChunkReady { req: u64, room: RoomRef, chunk: u32, writer: u32, checksum: Option<u64> },
    /// Receiver's acknowledgement that a writer's data arrived (status 0) or was rejected.
    Arrived { req: u64, status: i32, reason: String },
    Watermark(Watermark),
    /// Abandon a chunk (or the whole room when `chunk == u32::MAX`).
    Abort { room: RoomRef, chunk: u32, reason: String },
    /// Slice path: header of one per-token head-slice write; `len` payload bytes follow.
    Slice { room: RoomRef, chunk: u32, buffer: u32, token: u32, byte_offset: u32, len: u32 },
    /// Slice path completion, acknowledged with `Arrived`.
    SliceDone { req: u64, room: RoomRef, chunk: u32 },
    /// RDMA: the sender's queue pairs and ports (after the handshake, before any transfer).
    RdmaOffer(RdmaOffer),
    /// RDMA: the receiver's queue pairs and registered ring, or why it cannot serve RDMA.
    RdmaAnswer(RdmaOffer),
    /// A writer's bytes were written into its region in place, by RDMA WRITE or through a
    /// same-host mapping of the ring (no payload follows); over RDMA `imm` is the immediate of the
    /// WRITE_WITH_IMM that completed them, 0 for a piece of a layer-wise region (whose immediate
    /// follows the last piece) and on the same-host path. Receivers do not rely on it.
    Written { room: RoomRef, chunk: u32, writer: u32, offset: u64, len: u64, imm: u32 },
    /// Same host: the sender listens on the abstract Unix socket `socket` and asks for the ring's
    /// descriptor there, presented with `nonce`.
    /// `direct`: the sender would also map the decode pool (direct mode) if it lies in this kind
    /// of memory (its own pool's: the copy runs between two pools of one kind).
    ShmOffer { socket: String, nonce: Vec<u8>, direct: Option<MemoryKind> },
    /// Same host: `local` = the receiver reached the socket; `status` 0 = it passed its ring of
    /// `ring_len` bytes there; otherwise a `Status` code with `reason`.
    ShmAnswer { status: i32, local: bool, ring_len: u64, reason: String },
    /// The sender asks for the chunk grid of a room open on the receiver.
    GridReq { req: u64, room: RoomRef },
    /// `status` 0: the room's pages split into `num_chunks` chunks of `chunk_tokens` tokens (the
    /// last one may be shorter); otherwise a `Status` code with `reason`.
    GridRsp { req: u64, status: i32, chunk_tokens: u32, num_chunks: u32, num_pages: u32, prefix_tokens: u64, reason: String },
}

const T_HELLO: u8 = 1;
const T_ALLOC_REQ: u8 = 2;
const T_ALLOC_RSP: u8 = 3;
const T_DATA: u8 = 4;
const T_CHUNK_READY: u8 = 5;
const T_ARRIVED: u8 = 6;
const T_WATERMARK: u8 = 7;
const T_ABORT: u8 = 8;
const T_SLICE: u8 = 9;
const T_SLICE_DONE: u8 = 10;
const T_RDMA_OFFER: u8 = 11;
const T_RDMA_ANSWER: u8 = 12;
const T_WRITTEN: u8 = 13;
const T_GRID_REQ: u8 = 14;
const T_GRID_RSP: u8 = 15;
const T_SHM_OFFER: u8 = 16;
const T_SHM_ANSWER: u8 = 17;

fn malformed(what: impl Into<String>) -> Error {
    Error::new(Status::KVSTAGE_E_PROTOCOL, format!("malformed frame: {}", what.into()))
}

fn encode_shape(e: &mut Enc, s: &PoolShape) {
    e.u8(match s.kind {
        ModelKind::Mha => 0,
        ModelKind::Mla => 1,
    })
    .u32(s.page_size)
    .u32(s.local_heads)
    .u32(s.global_heads)
    .u32(s.head_dim)
    .u32(s.head_dim_v)
    .u32(s.dtype_bytes)
    .u32(s.tp_rank)
    .u32(s.tp_size)
    .u32(s.pp_rank)
    .u32(s.pp_size)
    .u32(s.layer_ids.len() as u32);
    for &l in &s.layer_ids {
        e.u32(l);
    }
}

fn decode_shape(d: &mut Dec) -> Result<PoolShape> {
    let kind = match d.u8("shape.kind")? {
        0 => ModelKind::Mha,
        1 => ModelKind::Mla,
        k => return Err(malformed(format!("unknown model kind {k}"))),
    };
    let mut s = PoolShape {
        kind,
        page_size: d.u32("shape.page_size")?,
        local_heads: d.u32("shape.local_heads")?,
        global_heads: d.u32("shape.global_heads")?,
        head_dim: d.u32("shape.head_dim")?,
        head_dim_v: d.u32("shape.head_dim_v")?,
        dtype_bytes: d.u32("shape.dtype_bytes")?,
        tp_rank: d.u32("shape.tp_rank")?,
        tp_size: d.u32("shape.tp_size")?,
        pp_rank: d.u32("shape.pp_rank")?,
        pp_size: d.u32("shape.pp_size")?,
        layer_ids: Vec::new(),
    };
    let n = d.u32("shape.num_layers")?;
    if n > MAX_LAYERS {
        return Err(malformed(format!("{n} layers exceeds the limit of {MAX_LAYERS}")));
    }
    for _ in 0..n {
        s.layer_ids.push(d.u32("shape.layer_id")?);
    }
    Ok(s)
}

impl Message {
    /// Encodes the frame header and body (payloads of `Data`/`Slice` are written by the caller).
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(0); // body length, patched below
        match self {
            Message::Hello(h) => {
                e.u8(T_HELLO);
                e.raw(&MAGIC);
                e.u16(h.protocol_version).u32(h.library_version).str(&h.session).bytes(&h.fingerprint);
                encode_shape(&mut e, &h.shape);
                e.u64(h.ring_bytes).u64(h.watermark.round).u64(h.watermark.offset).i32(h.status).str(&h.reason);
                e.bytes(&h.token).u8(h.integrity);
                parts::encode_components(&mut e, &h.components);
            }
            Message::AllocReq { req, room, chunk, writer, tokens, bytes, trace, pool_tokens, direct } => {
                e.u8(T_ALLOC_REQ).u64(*req).u64(room.id).u64(room.key).u32(*chunk).u32(*writer).u32(*tokens).u64(*bytes).str(trace);
                parts::encode_pool_tokens(&mut e, pool_tokens);
                e.u8(*direct as u8);
            }
            Message::AllocRsp { req, status, round, offset, len, region, reason, pages } => {
                e.u8(T_ALLOC_RSP).u64(*req).i32(*status).u64(*round).u64(*offset).u64(*len).u64(*region).str(reason);
                parts::encode_u32s(&mut e, pages);
            }
            Message::Data { room, chunk, writer, offset, len } => {
                e.u8(T_DATA).u64(room.id).u64(room.key).u32(*chunk).u32(*writer).u64(*offset).u64(*len);
            }
            Message::ChunkReady { req, room, chunk, writer, checksum } => {
                e.u8(T_CHUNK_READY).u64(*req).u64(room.id).u64(room.key).u32(*chunk).u32(*writer);
                match checksum {
                    Some(c) => e.u8(1).u64(*c),
                    None => e.u8(0),
                };
            }
            Message::Arrived { req, status, reason } => {
                e.u8(T_ARRIVED).u64(*req).i32(*status).str(reason);
            }
            Message::Watermark(w) => {
                e.u8(T_WATERMARK).u64(w.round).u64(w.offset);
            }
            Message::Abort { room, chunk, reason } => {
                e.u8(T_ABORT).u64(room.id).u64(room.key).u32(*chunk).str(reason);
            }
            Message::Slice { room, chunk, buffer, token, byte_offset, len } => {
                e.u8(T_SLICE).u64(room.id).u64(room.key).u32(*chunk).u32(*buffer).u32(*token).u32(*byte_offset).u32(*len);
            }
            Message::SliceDone { req, room, chunk } => {
                e.u8(T_SLICE_DONE).u64(*req).u64(room.id).u64(room.key).u32(*chunk);
            }
            Message::RdmaOffer(o) => {
                e.u8(T_RDMA_OFFER);
                o.encode(&mut e);
            }
            Message::RdmaAnswer(o) => {
                e.u8(T_RDMA_ANSWER);
                o.encode(&mut e);
            }
            Message::ShmOffer { socket, nonce, direct } => {
                e.u8(T_SHM_OFFER).str(socket).bytes(nonce).u8(parts::encode_memory(*direct));
            }
            Message::ShmAnswer { status, local, ring_len, reason } => {
                e.u8(T_SHM_ANSWER).i32(*status).u8(*local as u8).u64(*ring_len).str(reason);
            }
            Message::Written { room, chunk, writer, offset, len, imm } => {
                e.u8(T_WRITTEN).u64(room.id).u64(room.key).u32(*chunk).u32(*writer).u64(*offset).u64(*len).u32(*imm);
            }
            Message::GridReq { req, room } => {
                e.u8(T_GRID_REQ).u64(*req).u64(room.id).u64(room.key);
            }
            Message::GridRsp { req, status, chunk_tokens, num_chunks, num_pages, prefix_tokens, reason } => {
                e.u8(T_GRID_RSP).u64(*req).i32(*status).u32(*chunk_tokens).u32(*num_chunks).u32(*num_pages).u64(*prefix_tokens).str(reason);
            }
        }
        let body = (e.0.len() - 5) as u32;
        e.0[..4].copy_from_slice(&body.to_le_bytes());
        e.0
    }

    /// Decodes a frame's type byte and body (everything after the length prefix).
    pub fn decode(kind: u8, body: &[u8]) -> Result<Message> {
        let mut d = Dec::new(body, "frame");
        let msg = match kind {
            T_HELLO => {
                let magic = d.take(8, "magic")?;
                if magic != MAGIC {
                    return Err(malformed(format!("bad magic {magic:02x?} (not a kvstage peer?)")));
                }
                let protocol_version = d.u16("protocol_version")?;
                if protocol_version != PROTOCOL_VERSION {
                    return Err(Error::new(
                        Status::KVSTAGE_E_PROTOCOL,
                        format!("protocol version {protocol_version} != supported {PROTOCOL_VERSION}"),
                    ));
                }
                Message::Hello(Hello {
                    protocol_version,
                    library_version: d.u32("library_version")?,
                    session: d.str("session", MAX_TEXT)?,
                    fingerprint: d.bytes("fingerprint", MAX_TEXT)?,
                    shape: decode_shape(&mut d)?,
                    ring_bytes: d.u64("ring_bytes")?,
                    watermark: Watermark { round: d.u64("watermark.round")?, offset: d.u64("watermark.offset")? },
                    status: d.i32("status")?,
                    reason: d.str("reason", MAX_TEXT)?,
                    token: d.bytes("token", MAX_TEXT)?,
                    integrity: d.u8("integrity")?,
                    components: parts::decode_components(&mut d)?,
                })
            }
            T_ALLOC_REQ => Message::AllocReq {
                req: d.u64("req")?,
                room: decode_room(&mut d)?,
                chunk: d.u32("chunk")?,
                writer: d.u32("writer")?,
                tokens: d.u32("tokens")?,
                bytes: d.u64("bytes")?,
                trace: d.str("trace", trace::MAX_TRACE)?,
                pool_tokens: parts::decode_pool_tokens(&mut d)?,
                direct: parts::flag(&mut d, "direct")?,
            },
            T_ALLOC_RSP => Message::AllocRsp {
                req: d.u64("req")?,
                status: d.i32("status")?,
                round: d.u64("round")?,
                offset: d.u64("offset")?,
                len: d.u64("len")?,
                region: d.u64("region")?,
                reason: d.str("reason", MAX_TEXT)?,
                pages: parts::decode_u32s(&mut d, "pages", MAX_GRANT_PAGES)?,
            },
            T_DATA => Message::Data {
                room: decode_room(&mut d)?,
                chunk: d.u32("chunk")?,
                writer: d.u32("writer")?,
                offset: d.u64("offset")?,
                len: d.u64("len")?,
            },
            T_CHUNK_READY => Message::ChunkReady {
                req: d.u64("req")?,
                room: decode_room(&mut d)?,
                chunk: d.u32("chunk")?,
                writer: d.u32("writer")?,
                checksum: match d.u8("checksum flag")? {
                    0 => None,
                    1 => Some(d.u64("checksum")?),
                    f => return Err(malformed(format!("checksum flag {f} is neither 0 nor 1"))),
                },
            },
            T_ARRIVED => Message::Arrived { req: d.u64("req")?, status: d.i32("status")?, reason: d.str("reason", MAX_TEXT)? },
            T_WATERMARK => Message::Watermark(Watermark { round: d.u64("round")?, offset: d.u64("offset")? }),
            T_ABORT => Message::Abort { room: decode_room(&mut d)?, chunk: d.u32("chunk")?, reason: d.str("reason", MAX_TEXT)? },
            T_SLICE => Message::Slice {
                room: decode_room(&mut d)?,
                chunk: d.u32("chunk")?,
                buffer: d.u32("buffer")?,
                token: d.u32("token")?,
                byte_offset: d.u32("byte_offset")?,
                len: d.u32("len")?,
            },
            T_SLICE_DONE => Message::SliceDone { req: d.u64("req")?, room: decode_room(&mut d)?, chunk: d.u32("chunk")? },
            T_RDMA_OFFER => Message::RdmaOffer(RdmaOffer::decode(d.rest())?),
            T_RDMA_ANSWER => Message::RdmaAnswer(RdmaOffer::decode(d.rest())?),
            T_SHM_OFFER => Message::ShmOffer { socket: d.str("socket", MAX_TEXT)?, nonce: d.bytes("nonce", MAX_TEXT)?, direct: parts::memory(&mut d, "direct")? },
            T_SHM_ANSWER => Message::ShmAnswer {
                status: d.i32("status")?,
                local: match d.u8("local")? {
                    0 => false,
                    1 => true,
                    f => return Err(malformed(format!("local flag {f} is neither 0 nor 1"))),
                },
                ring_len: d.u64("ring_len")?,
                reason: d.str("reason", MAX_TEXT)?,
            },
            T_WRITTEN => Message::Written {
                room: decode_room(&mut d)?,
                chunk: d.u32("chunk")?,
                writer: d.u32("writer")?,
                offset: d.u64("offset")?,
                len: d.u64("len")?,
                imm: d.u32("imm")?,
            },
            T_GRID_REQ => Message::GridReq { req: d.u64("req")?, room: decode_room(&mut d)? },
            T_GRID_RSP => Message::GridRsp {
                req: d.u64("req")?,
                status: d.i32("status")?,
                chunk_tokens: d.u32("chunk_tokens")?,
                num_chunks: d.u32("num_chunks")?,
                num_pages: d.u32("num_pages")?,
                prefix_tokens: d.u64("prefix_tokens")?,
                reason: d.str("reason", MAX_TEXT)?,
            },
            other => return Err(malformed(format!("unknown frame type {other}"))),
        };
        d.finish()?;
        Ok(msg)
    }

    /// Payload bytes that follow this frame on the wire.
    pub fn payload_len(&self) -> u64 {
        match self {
            Message::Data { len, .. } => *len,
            Message::Slice { len, .. } => *len as u64,
            _ => 0,
        }
    }
}

/// Reads one frame (not its payload). `Ok(None)` on a clean EOF between frames.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Message>> {
    read_frame_limited(r, MAX_BODY, None, false)
}

/// As [`read_frame`] on a stream with a read timeout that bounds stalls *inside* a frame: a
/// timeout before the first byte of a frame is an idle peer and the wait goes on.
pub fn read_frame_between_idle(r: &mut impl Read) -> Result<Option<Message>> {
    read_frame_limited(r, MAX_BODY, None, true)
}

/// The first frame of a connection: a hello of at most [`MAX_HELLO_BODY`] bytes. Anything else
/// is refused from its 5-byte header, before its body is read.
pub fn read_hello(r: &mut impl Read) -> Result<Hello> {
    match read_frame_limited(r, MAX_HELLO_BODY, Some(T_HELLO), false)? {
        Some(Message::Hello(h)) => Ok(h),
        Some(_) => unreachable!("only a hello passes the type check"),
        None => Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "connection closed before the hello")),
    }
}

fn read_frame_limited(r: &mut impl Read, max_body: u32, only: Option<u8>, idle_ok: bool) -> Result<Option<Message>> {
    let mut head = [0u8; 5];
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "connection closed inside a frame header")),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if idle_ok && got == 0 && matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(Error::from(e).context("reading a frame header failed")),
        }
    }
    let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
    if only.is_some_and(|t| t != head[4]) {
        return Err(malformed(format!("frame type {} where a hello was expected (not a kvstage peer?)", head[4])));
    }
    if len > max_body {
        return Err(malformed(format!("body length {len} exceeds the limit of {max_body}")));
    }
    // Grown as bytes arrive: a peer that announces a large body and sends little holds little.
    let mut body = Vec::with_capacity((len as usize).min(4096));
    r.take(len as u64).read_to_end(&mut body).map_err(|e| Error::from(e).context("reading a frame body failed"))?;
    if body.len() != len as usize {
        return Err(Error::new(
            Status::KVSTAGE_E_PEER_GONE,
            format!("connection closed inside a frame body ({} of {len} bytes)", body.len()),
        ));
    }
    Message::decode(head[4], &body).map(Some)
}

/// Writes one frame (header and body) in one call.
pub fn write_frame(w: &mut impl Write, msg: &Message) -> Result<()> {
    w.write_all(&msg.encode()).map_err(|e| Error::from(e).context("writing a frame failed"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape() -> PoolShape {
        PoolShape {
            kind: ModelKind::Mha,
            page_size: 16,
            local_heads: 2,
            global_heads: 8,
            head_dim: 128,
            head_dim_v: 128,
            dtype_bytes: 2,
            tp_rank: 1,
            tp_size: 4,
            pp_rank: 0,
            pp_size: 1,
            layer_ids: vec![0, 1, 2],
        }
    }

    fn rdma_offer() -> RdmaOffer {
        use super::rdma_offer::{LinkLayer, Mtu, PortAttrs, QpEndpoint, OFFER_VERSION};
        let port = PortAttrs {
            device: "mlx5_0".into(),
            port: 1,
            link_layer: LinkLayer::Ethernet,
            active_mtu: Mtu::M4096,
            lid: 0,
            gid_index: 3,
            gid: [7; 16],
            state: 4,
        };
        RdmaOffer {
            version: OFFER_VERSION,
            status: 0,
            reason: String::new(),
            endpoints: vec![QpEndpoint { qpn: 0x1a4, psn: 0x123456, port, rkey: 9 }],
            ring_addr: 0x1000,
            ring_len: 1 << 20,
        }
    }

    fn sample_components() -> Vec<crate::geometry::ComponentSpec> {
        use crate::geometry::{ComponentKind, ComponentSpec, StateItem};
        vec![
            ComponentSpec { name: "output_ids".into(), kind: ComponentKind::Aux { row_bytes: 64 }, layer_ids: vec![], page_size: 0 },
            ComponentSpec {
                name: "conv".into(),
                kind: ComponentKind::State { item: StateItem { outer: 3, groups: vec![8, 8, 16], dtype_bytes: 2, replicated: false } },
                layer_ids: vec![0, 2],
                page_size: 0,
            },
            ComponentSpec { name: "swa".into(), kind: ComponentKind::Pool { unit_bytes: 32, head_sliced: true }, layer_ids: vec![1], page_size: 16 },
        ]
    }

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                library_version: 0x100,
                session: "s-1".into(),
                fingerprint: vec![1, 2, 3],
                shape: shape(),
                ring_bytes: 1 << 30,
                watermark: Watermark { round: 3, offset: 99 },
                status: 0,
                reason: String::new(),
                token: b"secret".to_vec(),
                integrity: 2,
                components: sample_components(),
            }),
            Message::AllocReq { req: 7, room: RoomRef { id: 9, key: 0x5eed_0009 }, chunk: 2, writer: 1, tokens: 64, bytes: 4096, trace: "req-9".into(), pool_tokens: None, direct: false },
            Message::AllocReq { req: 8, room: RoomRef { id: 9, key: 0x5eed_0009 }, chunk: 3, writer: 0, tokens: 9, bytes: 4096, trace: String::new(), pool_tokens: Some(vec![9, 4]), direct: true },
            Message::AllocRsp { req: 7, status: -13, round: 1, offset: 2, len: 3, region: 4, reason: "too big".into(), pages: Vec::new() },
            Message::AllocRsp { req: 8, status: 0, round: 1, offset: 2, len: 3, region: 4, reason: String::new(), pages: vec![9, 3, 4] },
            Message::Data { room: RoomRef { id: 1, key: 0x5eed_0001 }, chunk: 2, writer: 3, offset: 4, len: 5 },
            Message::ChunkReady { req: 1, room: RoomRef { id: 2, key: 0x5eed_0002 }, chunk: 3, writer: 4, checksum: Some(0xfeed) },
            Message::ChunkReady { req: 1, room: RoomRef { id: 2, key: 0x5eed_0002 }, chunk: 3, writer: 4, checksum: None },
            Message::Arrived { req: 1, status: 0, reason: String::new() },
            Message::Watermark(Watermark { round: 5, offset: 6 }),
            Message::Abort { room: RoomRef { id: 1, key: 0x5eed_0001 }, chunk: u32::MAX, reason: "canceled".into() },
            Message::Slice { room: RoomRef { id: 1, key: 0x5eed_0001 }, chunk: 0, buffer: 3, token: 17, byte_offset: 256, len: 512 },
            Message::SliceDone { req: 4, room: RoomRef { id: 1, key: 0x5eed_0001 }, chunk: 0 },
            Message::RdmaOffer(rdma_offer()),
            Message::RdmaAnswer(RdmaOffer::refusal(Status::KVSTAGE_E_NO_DEVICE, "no device")),
            Message::Written { room: RoomRef { id: 1, key: 0x5eed_0001 }, chunk: 2, writer: 3, offset: 4, len: 5, imm: 6 },
            Message::ShmOffer { socket: "kvstage-shm-1-ab".into(), nonce: vec![7; 16], direct: None },
            Message::ShmOffer { socket: "kvstage-shm-1-ab".into(), nonce: vec![7; 16], direct: Some(MemoryKind::Host) },
            Message::ShmOffer { socket: "kvstage-shm-1-ab".into(), nonce: vec![7; 16], direct: Some(MemoryKind::Cuda) },
            Message::ShmAnswer { status: 0, local: true, ring_len: 1 << 20, reason: String::new() },
            Message::GridReq { req: 7, room: RoomRef { id: 8, key: 0x5eed_0008 } },
            Message::GridRsp { req: 9, status: 0, chunk_tokens: 64, num_chunks: 3, num_pages: 10, prefix_tokens: 128, reason: String::new() },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for msg in samples() {
            let bytes = msg.encode();
            let back = read_frame(&mut &bytes[..]).unwrap().unwrap();
            assert_eq!(back, msg);
        }
    }

    #[test]
    fn rejects_bad_magic_version_length_and_trailing_bytes() {
        let hello = samples().remove(0).encode();
        let mut bad_magic = hello.clone();
        bad_magic[5] ^= 0xff;
        assert!(read_frame(&mut &bad_magic[..]).unwrap_err().message().contains("bad magic"));
        let mut bad_version = hello.clone();
        bad_version[13] = 99;
        assert!(read_frame(&mut &bad_version[..]).unwrap_err().message().contains("protocol version 99"));
        let mut huge = hello.clone();
        huge[..4].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
        assert!(read_frame(&mut &huge[..]).unwrap_err().message().contains("exceeds the limit"));
        let mut trailing = Message::Watermark(Watermark::default()).encode();
        trailing.push(0);
        trailing[..4].copy_from_slice(&17u32.to_le_bytes());
        assert!(read_frame(&mut &trailing[..]).unwrap_err().message().contains("trailing"));
        let truncated = &hello[..hello.len() - 1];
        assert_eq!(read_frame(&mut &truncated[..]).unwrap_err().code(), Status::KVSTAGE_E_PEER_GONE);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Arbitrary bytes never panic the decoder: every input is a message or a protocol error.
        #[test]
        fn decoder_survives_garbage(kind in 0u8..16, body in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Err(e) = Message::decode(kind, &body) {
                prop_assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL);
            }
        }

        /// Mutating one byte of a valid frame gives the same message, another message or an error.
        #[test]
        fn decoder_survives_mutations(which in 0usize..14, pos in any::<usize>(), val in any::<u8>()) {
            let mut bytes = samples()[which].encode();
            let p = 4 + pos % (bytes.len() - 4);
            bytes[p] = val;
            let _ = Message::decode(bytes[4], &bytes[5..]);
        }
    }
}
