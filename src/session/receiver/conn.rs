//! One accepted sender connection: the handshake (bounded in time and memory), then frame
//! dispatch. Every frame is checked by the state machine before a byte of payload is read, and
//! payload reads hold a lease so nothing frees or re-grants the range underneath them.

use std::cell::{Cell, RefCell};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::state::{ConnInfo, ConnId, Granted, ReadyLease, Target, WriteLease};
use super::{reply_deadline, Receiver};
use crate::error::{Error, Result, Status};
use crate::geometry::{ComponentSpec, CopyPlan, Fingerprint, KvLayout, ModelKind, PoolShape};
use crate::protocol::{Hello, Message, RoomRef, PROTOCOL_VERSION};
use crate::ring::Watermark;
use crate::session::{pairing, tokens_match, Deadline, Integrity};
use crate::transport::faults::FaultyTransport;
use crate::transport::tcp::{Inbound, TcpTransport};
use crate::transport::Transport;

/// How long a `ChunkReady` waits for its write-with-immediate (the sender sends it only after the
/// write completed, so this only bounds a broken or lying sender).
const RDMA_IMM_WAIT: Duration = Duration::from_secs(5);

/// A refusal sent in place of the handshake answer: our hello with `status` and `reason`.
pub fn refusal(receiver: &Receiver, session: &str, status: Status, reason: &str) -> Message {
    // Without a pool there is no shape to show; a placeholder keeps the frame well-formed.
    let shape = receiver.pool.lock().as_ref().map_or_else(|| PoolShape::new(ModelKind::Mha, 1, 1, 1, 1, 1), |p| p.shape.clone());
    Message::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        library_version: crate::version_number(),
        session: session.to_owned(),
        fingerprint: Fingerprint::of(&shape).encode(),
        shape,
        ring_bytes: 0,
        watermark: Watermark::default(),
        status: status.code(),
        reason: reason.to_owned(),
        token: Vec::new(),
        integrity: receiver.config.integrity.wire(),
        components: receiver.component_specs(),
    })
}

/// Checks a sender's hello against our shape and components (fingerprint diff, pairing,
/// component diff); its pairing.
pub fn verify_peer(ours: &PoolShape, components: &[ComponentSpec], hello: &Hello) -> Result<crate::session::Pairing> {
    let theirs = Fingerprint::decode(&hello.fingerprint)?;
    Fingerprint::of(ours).check(&theirs)?;
    let pair = pairing(&hello.shape, ours)?;
    crate::session::check_components(&hello.shape, ours, components, &hello.components)?;
    Ok(pair)
}

impl Receiver {
    /// Runs one accepted connection until it closes. Never unwinds: a panic fails the rooms the
    /// connection wrote to with `KVSTAGE_E_PANIC` and returns their ring space.
    pub fn serve(self: &Arc<Self>, stream: TcpStream, handshake_done: impl FnOnce()) {
        let conn: Cell<Option<ConnId>> = Cell::new(None);
        // The session id once the hello is read, for the log.
        let session = RefCell::new(String::new());
        let addr = stream.peer_addr().ok();
        let peer = addr.map_or_else(|| "an unknown peer".to_owned(), |a| a.to_string());
        let mut handshake_done = Some(handshake_done);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let source = addr.map_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), |a| a.ip());
            self.serve_inner(stream, &conn, &session, &peer, source, &mut || {
                if let Some(f) = handshake_done.take() {
                    f()
                }
            })
        }));
        if let Some(f) = handshake_done.take() {
            f();
        }
        let session = session.into_inner();
        let registered = conn.get().is_some();
        // Cut to serve a newcomer at the connection limit (logged once for the lot by the listener).
        let evicted = conn.get().is_some_and(|id| self.evicted.lock().contains(&id));
        let (code, reason) = match outcome {
            Ok(_) if evicted => {
                log::debug!(session = session.as_str(); "idle session from {peer} cut to serve a newcomer at the connection limit");
                (Status::KVSTAGE_E_PEER_GONE, "cut at the connection limit (the session held nothing)".to_owned())
            }
            Ok(Ok(())) => {
                if registered && self.closing() {
                    log::debug!(session = session.as_str(); "connection from {peer} closed at shutdown");
                } else if registered {
                    log::info!(session = session.as_str(); "session from {peer} closed by the sender");
                }
                (Status::KVSTAGE_E_PEER_GONE, "the sender closed the connection".to_owned())
            }
            Ok(Err(e)) => {
                let code = if e.code() == Status::KVSTAGE_E_PANIC { e.code() } else { Status::KVSTAGE_E_PEER_GONE };
                // Before the handshake's end the handshake logged it; at shutdown it is expected.
                if registered && self.closing() {
                    log::debug!(session = session.as_str(); "connection from {peer} ended at shutdown: {}", e.chain());
                } else if registered {
                    if let Some(suppressed) = self.log_limits.lost.allow() {
                        log::warn!(session = session.as_str(); "connection from {peer} lost: {}{suppressed}", e.chain());
                    }
                }
                (code, e.chain())
            }
            Err(p) => {
                self.counters.panics.fetch_add(1, Ordering::Relaxed);
                let e = Error::from_panic("a receiver connection thread panicked", &*p);
                log::error!(session = session.as_str(); "connection from {peer}: {}", e.chain());
                (e.code(), e.chain())
            }
        };
        if let Some(id) = conn.get() {
            if let Some(p) = self.peers.lock().remove(&id) {
                p.link.shutdown();
            }
            self.with_state(|st| st.conn_gone(id, code, &reason));
            self.evicted.lock().remove(&id);
        }
    }

    fn serve_inner(
        self: &Arc<Self>,
        stream: TcpStream,
        conn: &Cell<Option<ConnId>>,
        session_id: &RefCell<String>,
        peer: &str,
        source: std::net::IpAddr,
        handshake_done: &mut dyn FnMut(),
    ) -> Result<()> {
        crate::transport::tcp::tune(&stream, self.config.dead_peer_timeout)?;
        let mut inbound = Inbound::new(stream.try_clone()?, self.config.dead_peer_timeout);
        let mut link: Arc<dyn Transport> = Arc::new(TcpTransport::new(stream)?);
        if let Some(faults) = &self.config.faults {
            link = Arc::new(FaultyTransport::new(link, faults.clone(), 2));
        }
        let deadline = Deadline::after(Some(self.config.listener.handshake_timeout));
        let hello = match inbound.read_hello(&deadline) {
            Ok(h) => h,
            Err(e) => {
                self.counters.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                // Not even a hello (a port scanner, a health check, a stalled peer): debug only.
                log::debug!("no valid hello from {peer}: {}", e.chain());
                // Answered when the peer can still read it (a newer version learns why), then closed.
                let _ = link.send(&refusal(self, "", e.code(), &e.chain()), &Deadline::after(Some(Duration::from_millis(200))));
                link.shutdown();
                return Err(e);
            }
        };
        *session_id.borrow_mut() = hello.session.clone();
        let info = self.handshake(&hello, &link, peer, &deadline, handshake_done).inspect_err(|e| {
            self.counters.handshakes_failed.fetch_add(1, Ordering::Relaxed);
            // A sender of ours, misconfigured (token, geometry, version): an operator's matter.
            if let Some(suppressed) = self.log_limits.handshakes.allow() {
                log::warn!(session = hello.session.as_str(); "refused the session from {peer}: {}{suppressed}", e.chain());
            }
            link.shutdown();
        })?;
        let session = info.session.clone();
        log::info!(
            session = session.as_str();
            "session from {peer} accepted over tcp ({})",
            info.pairing.describe()
        );
        // Registered only now that the answer left: from here on it gets watermark broadcasts,
        // and one more watermark covers any change between the answer and the registration.
        let id = self.with_state(|st| st.add_conn(info));
        conn.set(Some(id));
        self.peers.lock().insert(id, super::Peer { link: link.clone(), source });
        let wm = self.ring_stats().2;
        link.send(&Message::Watermark(wm), &reply_deadline())?;
        self.read_loop(id, &session, &mut inbound, &link)
    }

    /// Validates the hello and answers with ours.
    /// `accepted` runs before an accepting answer goes out: from then on the connection no longer
    /// counts as a handshake in progress (the listener would cut it to serve a newer one).
    fn handshake(&self, hello: &Hello, link: &Arc<dyn Transport>, peer: &str, deadline: &Deadline, accepted: &mut dyn FnMut()) -> Result<ConnInfo> {
        let pool = self.pool();
        let components = self.component_specs();
        let token = &self.config.cluster_token;
        let (ring_bytes, _, watermark) = self.ring_stats();
        let checked = if !tokens_match(token, &hello.token) {
            Err(Error::new(Status::KVSTAGE_E_AUTH, "the sender did not present this cluster's token"))
        } else {
            pool.as_ref().map_err(|e| Error::new(e.code(), e.message())).and_then(|pool| {
                let pair = verify_peer(&pool.shape, &components, hello)?;
                Ok(ConnInfo {
                    session: hello.session.clone(),
                    src: hello.shape.clone(),
                    dst: pool.shape.clone(),
                    dst_strides: [pool.strides, pool.v_strides],
                    pairing: pair,
                    in_place: false,
                    host_pool: pool.memory == crate::geometry::MemoryKind::Host,
                    direct: false,
                    pool_read_min_run: (pool.memory == crate::geometry::MemoryKind::Host)
                        .then(|| self.config.faults.as_ref().and_then(|f| f.plan.pool_read_min_run).unwrap_or(super::POOL_READ_MIN_RUN)),
                    integrity: self.config.integrity.stronger(Integrity::from_wire(hello.integrity)),
                    src_components: Arc::new(hello.components.clone()),
                    dst_components: Arc::new(components.clone()),
                })
            })
        };
        let checked = checked.and_then(|info| self.make_room_for_session(peer).map(|()| info));
        let our_shape = pool.as_ref().map(|p| p.shape.clone()).unwrap_or_else(|_| hello.shape.clone());
        let (status, reason) = match &checked {
            Ok(_) => (Status::KVSTAGE_OK, String::new()),
            Err(e) => (e.code(), e.chain()),
        };
        let answer = Hello {
            protocol_version: PROTOCOL_VERSION,
            library_version: crate::version_number(),
            session: hello.session.clone(),
            fingerprint: Fingerprint::of(&our_shape).encode(),
            shape: our_shape,
            ring_bytes,
            watermark,
            status: status.code(),
            reason,
            token: if status == Status::KVSTAGE_E_AUTH { Vec::new() } else { token.clone() },
            integrity: self.config.integrity.wire(),
            components,
        };
        if checked.is_ok() {
            accepted();
        }
        link.send(&Message::Hello(answer), deadline)?;
        checked.map_err(|e| e.with_session(&hello.session))
    }

    fn read_loop(self: &Arc<Self>, id: ConnId, session: &str, inbound: &mut Inbound, link: &Arc<dyn Transport>) -> Result<()> {
        let stop_after = self.config.faults.as_ref().and_then(|f| f.plan.stop_reading_after);
        let mut frames = 0u64;
        let pool = self.pool()?;
        let integrity = self.config.integrity;
        // Set when the sender confirmed its RDMA queue pairs (its chunks then arrive by RDMA);
        // until then an accepted offer waits here with the ring it registered.
        let mut rdma_peer: Option<crate::transport::rdma::link::RdmaPeer> = None;
        let mut rdma_accepted: Option<(crate::transport::rdma::link::RdmaPeer, Option<Arc<super::memory::RingMemory>>)> = None;
        while let Some(msg) = inbound.next_frame()? {
            frames += 1;
            if stop_after.is_some_and(|n| frames > n) {
                return self.stall(link);
            }
            match msg {
                Message::AllocReq { req, room, chunk, writer, tokens, bytes, trace, pool_tokens, direct } => {
                    let allocated = self.with_state(|st| {
                        if !trace.is_empty() {
                            st.name_trace(room, &trace)?;
                        }
                        st.grant(id, room, chunk, writer, tokens, bytes, pool_tokens.as_deref(), direct)
                    });
                    let rsp = match allocated {
                        Ok(Granted { grant: g, region, pages }) => {
                            Message::AllocRsp { req, status: 0, round: g.round, offset: g.offset, len: g.len, region, reason: String::new(), pages }
                        }
                        Err(e) => Message::AllocRsp { req, status: e.code().code(), round: 0, offset: 0, len: 0, region: 0, reason: e.chain(), pages: Vec::new() },
                    };
                    link.send(&rsp, &reply_deadline())?;
                }
                Message::Data { room, chunk, writer, offset, len } => {
                    // The whole payload, landed or discarded, has a deadline of its own.
                    let until = inbound.payload_until(len);
                    match self.with_state(|st| st.begin_data(id, room, chunk, writer, offset, len))? {
                        Target::Land(lease) => {
                            // Bytes of the payload left unread when the room stopped being live
                            // during the read: they go once the lease is let go.
                            let read = match &lease.into_pool {
                                Some((plan, at)) => self.read_into_pool(inbound, &pool, plan, *at, &lease, until),
                                None => self.read_into_ring(inbound, &lease, until),
                            };
                            let left = read.as_ref().map_or(0, |&left| left);
                            self.with_state(|st| st.end_data(lease, matches!(read, Ok(0))));
                            read?;
                            if left > 0 {
                                inbound.discard(left, until)?;
                            }
                        }
                        Target::Discard(_) => inbound.discard(len, until)?,
                    }
                }
                Message::ChunkReady { req, room, chunk, writer, checksum } => {
                    // RDMA: the write-with-immediate (imm = req) must have completed first.
                    let landed = rdma_peer.as_ref().map_or(Ok(()), |p| p.wait_imm(req as u32, RDMA_IMM_WAIT));
                    // Arrival of the writer's last byte (decode-side timing: arrival to scatter
                    // done): the ready frame, and over RDMA the write's completion after it (a
                    // failed wait scatters nothing, so the stamp is unused then).
                    let arrived = std::time::Instant::now();
                    // A ready whose immediate never came: the peer's RDMA is broken or it lies
                    // about its writes. Refused, and the connection ends after the reply (its
                    // rooms fail now, not at their timeout).
                    let broken = landed.is_err();
                    let (result, mut fx) = match landed {
                        Err(e) => (Err(e), Default::default()),
                        Ok(()) => self.ready(id, session, room, chunk, writer, checksum, integrity),
                    };
                    for job in fx.scatter.iter_mut().filter(|j| j.last) {
                        job.arrived = Some(arrived);
                    }
                    let reply = match result {
                        Ok(()) => Message::Arrived { req, status: 0, reason: String::new() },
                        Err(e) => Message::Arrived { req, status: e.code().code(), reason: e.chain() },
                    };
                    // The ack goes first, so a caller who sees the room complete never races it;
                    // the chunk is scattered whether or not the ack gets out.
                    let sent = link.send(&reply, &reply_deadline());
                    self.apply(fx);
                    sent?;
                    if broken {
                        return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("a chunk ready (request {req}) came without its RDMA write-with-immediate on {}", link.describe())));
                    }
                }
                Message::Slice { room, chunk, buffer, token, byte_offset, len } => {
                    match self.with_state(|st| st.begin_slice(id, room, chunk, buffer, token, byte_offset, len))? {
                        Target::Land(lease) => {
                            let target = pool.slot_ranges(lease.buffer, lease.pool_slot, lease.byte_offset, lease.len);
                            let read = target.and_then(|ranges| {
                                // SAFETY: the state checked the slot lies in a page of this room
                                // and the bytes in this writer's head range; the lease keeps the
                                // room's pages from going back to the caller during the read.
                                unsafe { inbound.payload_into_ranges(&ranges, inbound.payload_until(lease.len), || true) }.map(|_| ())
                            });
                            let landed = read.is_ok();
                            self.with_state(|st| st.end_slice(lease, landed));
                            read?;
                        }
                        Target::Discard(_) => inbound.discard(len as u64, inbound.payload_until(len as u64))?,
                    }
                }
                Message::SliceDone { req, room, chunk } => {
                    let reply = match self.with_state(|st| st.slice_done(id, room, chunk)) {
                        Ok(()) => Message::Arrived { req, status: 0, reason: String::new() },
                        Err(e) => Message::Arrived { req, status: e.code().code(), reason: e.chain() },
                    };
                    link.send(&reply, &reply_deadline())?;
                }
                Message::RdmaOffer(confirm) if rdma_accepted.is_some() => {
                    // The sender's word on its own QP setup: RDMA from here on, or TCP for good.
                    // A ring registered again since the offer leaves the peer with a dead memory
                    // region: its first write fails loudly (remote access error), as for a ring
                    // replaced under a running RDMA session; both sides must agree on RDMA here.
                    let (peer, ring) = rdma_accepted.take().expect("checked");
                    if confirm.status == 0 && confirm.endpoints.is_empty() {
                        if let Some(r) = self.rdma.lock().as_ref() {
                            r.confirmed(session, &peer.desc);
                        }
                        self.with_state(|st| st.set_in_place(id, false));
                        if let Some(m) = &ring {
                            m.mark_nic_writes();
                        }
                        rdma_peer = Some(peer);
                    } else {
                        log::info!(session = session; "the sender could not complete its RDMA setup; the session stays on tcp: {}", confirm.reason);
                    }
                }
                Message::RdmaOffer(offer) => {
                    let ring = self.memory.lock().clone();
                    let rdma = self.rdma.lock().clone().unwrap_or_else(crate::transport::rdma::Rdma::off);
                    // A device ring is registered through its dma-buf (GPUDirect RDMA).
                    let export = ring.as_ref().filter(|m| m.device().is_some()).map(|m| move || m.dmabuf());
                    let nic_memory = ring.as_ref().map(|m| crate::transport::rdma::NicMemory {
                        ptr: m.base(),
                        len: m.size(),
                        dmabuf: export.as_ref().map(|f| f as &dyn Fn() -> crate::Result<crate::transport::rdma::DmaBuf>),
                    });
                    let (answer, p) = rdma.accept(&offer, nic_memory, &link.describe(), session);
                    // The ring may have been replaced while the offer was served: its registration
                    // (and the address the answer carries) then describe dead memory.
                    let current = self.memory.lock().clone();
                    let replaced = !super::memory::still_current(ring.as_ref(), current.as_ref());
                    let (answer, p) = if p.is_some() && replaced {
                        let same_memory = matches!((&ring, &current), (Some(a), Some(b)) if a.base() == b.base());
                        if let (Some(old), false) = (&ring, same_memory) {
                            rdma.forget_ring_at(old.base());
                        }
                        let why = "the staging ring was replaced during the RDMA exchange; reconnect";
                        (crate::protocol::RdmaOffer::refusal(Status::KVSTAGE_E_PEER_GONE, why.to_owned()), None)
                    } else {
                        (answer, p)
                    };
                    rdma_accepted = p.map(|p| (p, ring));
                    link.send(&Message::RdmaAnswer(answer), &reply_deadline())?;
                }
                Message::ShmOffer { socket, nonce, direct } => {
                    let answer = self.serve_same_host(id, &socket, &nonce, direct, session, &link.describe());
                    link.send(&answer, &reply_deadline())?;
                }
                Message::Written { room, chunk, writer, offset, len, imm: _ } => {
                    self.with_state(|st| st.written_in_place(id, room, chunk, writer, offset, len))?;
                }
                Message::Abort { room, chunk, reason } => {
                    self.with_state(|st| st.abort(id, room, chunk, &reason));
                }
                Message::GridReq { req, room } => {
                    let reply = match self.with_state(|st| st.room_grid(id, room)) {
                        Ok(g) => Message::GridRsp {
                            req,
                            status: 0,
                            chunk_tokens: g.chunk_tokens,
                            num_chunks: g.num_chunks,
                            num_pages: g.num_pages,
                            prefix_tokens: g.prefix_tokens,
                            reason: String::new(),
                        },
                        Err(e) => Message::GridRsp {
                            req,
                            status: e.code().code(),
                            chunk_tokens: 0,
                            num_chunks: 0,
                            num_pages: 0,
                            prefix_tokens: 0,
                            reason: e.chain(),
                        },
                    };
                    link.send(&reply, &reply_deadline())?;
                }
                other => {
                    return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("unexpected frame from sender: {other:?}")));
                }
            }
        }
        Ok(())
    }

    /// A writer's `ChunkReady`: checks the region (and its checksum, outside the lock), counts the
    /// arrival; the effects hold the scatter when it was the chunk's last writer.
    #[allow(clippy::too_many_arguments)]
    fn ready(
        &self,
        id: ConnId,
        session: &str,
        room: RoomRef,
        chunk: u32,
        writer: u32,
        checksum: Option<u64>,
        integrity: Integrity,
    ) -> (Result<()>, super::Effects) {
        let (lease, fx) = self.with_state_deferred(|st| st.begin_ready(id, room, chunk, writer));
        self.apply(fx);
        let lease = match lease {
            Ok(l) => l,
            Err(e) => return (Err(e), Default::default()),
        };
        let verified = match checksum {
            None if integrity.covers(room.id, chunk) => Err(Error::new(
                Status::KVSTAGE_E_INTEGRITY,
                format!("room {room} chunk {chunk} writer {writer} arrived without the checksum this receiver requires"),
            )),
            None => Ok(()),
            Some(sent) => self.region_checksum(&lease).and_then(|got| {
                if got == sent {
                    Ok(())
                } else {
                    Err(Error::new(
                        Status::KVSTAGE_E_INTEGRITY,
                        format!("integrity check failed for room {room} chunk {chunk} writer {writer}: sender checksum {sent:#018x} != received {got:#018x}"),
                    ))
                }
            }),
        };
        let direct = lease.mapped;
        let (result, fx) = self.with_state_deferred(|st| st.finish_ready(lease, verified, session));
        if let (Ok(()), true, Some(shm)) = (&result, direct, self.shm.lock().as_ref()) {
            shm.count_direct_chunk();
        }
        (result.map_err(|e| e.with_session(session)), fx)
    }

    /// Reads the payload of `lease` into its ring range. Stops when the room is no longer live
    /// (released, failed, expired) after a read: `Ok(bytes left unread)`, discarded by the caller
    /// once the range is unpinned, so a trickling writer of a dead room holds no ring space.
    fn read_into_ring(&self, inbound: &mut Inbound, lease: &WriteLease, until: std::time::Instant) -> Result<u64> {
        let mem = self.ring_memory()?;
        let mut left = lease.len;
        let mut stopped = false;
        let live = || self.with_state(|st| st.lands_live(lease));
        let read = |buf: &mut [u8]| {
            let n = buf.len() as u64;
            // SAFETY: `buf` is the leased range (or a bounce buffer for it), this read's alone.
            let rest = unsafe { inbound.payload_into_ranges(&[(buf.as_mut_ptr() as usize, buf.len())], until, &live) }?;
            left -= n - rest;
            stopped = rest > 0;
            if stopped {
                return Err(Error::new(Status::KVSTAGE_E_CANCELED, "the room stopped taking data during the payload"));
            }
            Ok(())
        };
        // SAFETY: the lease pins [ring_offset, +len), inside this writer's region of a live
        // grant: no other thread writes it, nothing frees or re-grants it until `end_data`.
        let landed = unsafe { mem.land(lease.ring_offset, lease.len, read) };
        match landed {
            Err(_) if stopped => Ok(left),
            other => other.map(|()| 0),
        }
    }

    /// Reads the payload of `lease` (at offset `at` of its region) straight into the pool rows it
    /// fills (`plan`'s rows in region order, as its scatter would copy them). Stops when the
    /// room is no longer live (released or failed) after a read: `Ok(bytes left unread)`, which
    /// the caller discards after it let the pages go, so that a release neither waits for a slow
    /// payload nor has to cut the session.
    fn read_into_pool(&self, inbound: &mut Inbound, pool: &KvLayout, plan: &CopyPlan, at: u64, lease: &WriteLease, until: std::time::Instant) -> Result<u64> {
        crate::copy::check_plan(plan, pool)?;
        if !crate::copy::rows::tiles_in_order(plan) {
            return Err(Error::internal("a scatter plan whose slabs are not in region order"));
        }
        let rows: Vec<(usize, usize)> = crate::copy::rows::clip(crate::copy::rows::pool_ranges(plan, pool), at, lease.len).collect();
        let covered: u64 = rows.iter().map(|&(_, n)| n as u64).sum();
        if covered != lease.len {
            return Err(Error::internal(format!("a payload of {} bytes at {at} of a region whose pool rows hold {covered} of them", lease.len)));
        }
        // SAFETY: the plan was checked against the host pool (a read into the pool needs one);
        // its rows are this writer's share of the room's pages, which the write lease keeps the
        // room's (nothing else writes them: the chunk is not complete, scatters skip the region).
        unsafe { inbound.payload_into_ranges(&rows, until, || self.with_state(|st| st.lands_live(lease))) }
    }

    /// The checksum of a writer's finished region: read back from the ring, or for a region that
    /// landed in the pool from the pool's rows its KV went to (in region order).
    fn region_checksum(&self, lease: &ReadyLease) -> Result<u64> {
        let Some(direct) = &lease.in_pool else {
            let mem = self.ring_memory()?;
            // SAFETY: the ready lease pins the writer's finished region; nothing writes it.
            let bytes = unsafe { mem.read_back(lease.ring_offset, lease.len) }?;
            return Ok(crate::session::checksum(&bytes));
        };
        let pool = self.pool()?;
        let plan = crate::geometry::plan_scatter(&*pool, &direct.pages, &direct.layout, &direct.layout.writers[direct.region as usize])?;
        crate::copy::check_plan(&plan, &pool)?;
        // SAFETY: the plan was checked against the pool; the rows are the room's pages, which
        // stay in the pool while the room is open (a release during the read makes the result
        // unused: the lease is stale then).
        unsafe { crate::session::rows_checksum(&*self.copy, &plan, &pool) }
    }

    /// Test fault "a peer that stops reading": the connection stays open, unread, until the
    /// engine shuts it down.
    fn stall(&self, link: &Arc<dyn Transport>) -> Result<()> {
        if let Some(f) = &self.config.faults {
            f.counters.stalled.fetch_add(1, Ordering::Relaxed);
        }
        while !self.closing() {
            std::thread::sleep(Duration::from_millis(10));
        }
        link.shutdown();
        Err(Error::new(Status::KVSTAGE_E_CANCELED, "fault injection: stopped reading"))
    }
}
