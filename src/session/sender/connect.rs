//! Opening a session: the TCP connection and the handshake (both sides' checks), the same-host and
//! RDMA negotiations on the same stream, and the reader thread that routes the receiver's replies.

use super::*;

/// First and longest pause before asking a busy receiver again (doubling in between).
const BUSY_BACKOFF: (Duration, Duration) = (Duration::from_millis(10), Duration::from_millis(500));

impl SenderSession {
    /// Connects to a decode engine and runs the handshake.
    pub fn connect(resources: Arc<SendResources>, addr: SocketAddr, id: &str, timeout: Duration) -> Result<Arc<SenderSession>> {
        // A receiver at its connection or handshake limit is asked again, backing off, until the
        // timeout: a moment of load (or a flood from elsewhere) is not a failed session.
        let until = Instant::now() + timeout;
        let mut pause = BUSY_BACKOFF.0;
        let opened = loop {
            let left = until.saturating_duration_since(Instant::now());
            let mut busy = false;
            match Self::connect_inner(resources.clone(), addr, id, left, &mut busy) {
                Err(e) if busy && until.saturating_duration_since(Instant::now()) > pause => {
                    log::debug!(target: LOG_TARGET, session = id; "{addr} is busy ({}); asking again in {pause:?}", e.chain());
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(BUSY_BACKOFF.1);
                }
                other => break other,
            }
        };
        match opened {
            Ok(s) => {
                // "tcp", or "rdma mlx5_0:1 (2 QPs)" (the control stream's address is `addr`).
                let how = s.link.describe();
                let how = if how.starts_with("tcp ") { "tcp" } else { how.split(" via ").next().unwrap_or(&how) };
                log::info!(target: LOG_TARGET, session = id; "session opened to {addr} over {how} ({})", s.pair.describe());
                Ok(s)
            }
            Err(e) => {
                // The caller gets the error itself; the log keeps a trace of it.
                log::debug!(target: LOG_TARGET, session = id; "session to {addr} failed to open: {}", e.chain());
                Err(e.with_session(id))
            }
        }
    }

    /// One attempt; `busy` says whether the receiver refused it for load.
    fn connect_inner(resources: Arc<SendResources>, addr: SocketAddr, id: &str, timeout: Duration, busy: &mut bool) -> Result<Arc<SenderSession>> {
        let pool = resources.pool.lock().clone().ok_or_else(|| {
            Error::invalid_arg("engine", "no KV pool registered (kvstage_engine_register_pool) before connecting")
        })?;
        let components = resources.components.lock().clone().unwrap_or_default();
        let deadline = Deadline::after(Some(timeout));
        let stream = tcp::connect(addr, timeout, resources.options.dead_peer_timeout)?;
        let reader = stream.try_clone()?;
        // Until the reader thread starts, every read (the hello, the same-host and RDMA answers)
        // ends by the one deadline: a receiver that trickles bytes cannot stretch the connect.
        let mut handshake = tcp::DeadlineReader::new(&reader, &deadline, "waiting for the receiver's handshake and transport answers");
        let mut link: Arc<dyn Transport> = Arc::new(TcpTransport::new(stream)?);
        let options = &resources.options;
        if let Some(faults) = &options.faults {
            link = Arc::new(FaultyTransport::new(link, faults.clone(), 1));
        }
        let token = options.cluster_token.clone();
        let ours = Hello {
            protocol_version: PROTOCOL_VERSION,
            library_version: crate::version_number(),
            session: id.to_owned(),
            fingerprint: Fingerprint::of(&pool.shape).encode(),
            shape: pool.shape.clone(),
            ring_bytes: 0,
            watermark: Watermark::default(),
            status: 0,
            reason: String::new(),
            token: token.clone(),
            integrity: options.integrity.wire(),
            components: components.specs(),
        };
        link.send(&Message::Hello(ours), &deadline)?;
        let remote = protocol::read_hello(&mut handshake).map_err(|e| e.context(format!("handshake with {addr} failed")))?;
        // A refusal that is not about geometry (auth, limits, version) says it all; for geometry our
        // own diff gives every field and the peer's status covers what only it can check.
        let refused = Status::from_code(remote.status).filter(|s| *s != Status::KVSTAGE_OK);
        if let Some(code) = refused.filter(|c| !matches!(c, Status::KVSTAGE_E_GEOMETRY_MISMATCH | Status::KVSTAGE_E_GEOMETRY_INVALID)) {
            // The listener's limits are the one refusal with KVSTAGE_E_TRANSPORT.
            *busy = code == Status::KVSTAGE_E_TRANSPORT;
            return Err(Error::new(code, format!("{addr} refused the session: {}", remote.reason)));
        }
        let theirs = Fingerprint::decode(&remote.fingerprint)?;
        Fingerprint::of(&pool.shape).check(&theirs)?;
        let pair = pairing(&pool.shape, &remote.shape)?;
        crate::session::check_components(&pool.shape, &remote.shape, &components.specs(), &remote.components)?;
        if remote.status != 0 {
            let code = Status::from_code(remote.status).unwrap_or(Status::KVSTAGE_E_PROTOCOL);
            return Err(Error::new(code, format!("{addr} refused the session: {}", remote.reason)));
        }
        // Mutual: a receiver that does not know our cluster's token is not one of ours either.
        if !crate::session::tokens_match(&token, &remote.token) {
            return Err(Error::new(Status::KVSTAGE_E_AUTH, format!("{addr} did not present this cluster's token")));
        }
        // Transport auto/shm/rdma: the same-host path, then RDMA's QPs, are negotiated on this
        // stream before its reader starts.
        let mut early = Vec::new();
        let peer = addr.to_string();
        // A receiver's device ring is written from the device of our pool (registered: it resolves).
        let pool_device = (pool.memory == MemoryKind::Cuda).then(|| crate::copy::cuda::pool_device(&pool, None).ok()).flatten();
        let open_device = pool_device.map(|ordinal| move |x: &_, len, same_process| crate::session::device_ring::open(ordinal, x, len, same_process));
        let open_device = open_device.as_ref().map(|f| f as crate::transport::shm::OpenDevice<'_>);
        // Direct mode copies between two pools of one kind: the receiver's in our pool's memory.
        let direct = Some((&remote.shape, pool.memory));
        let shm = resources.shm.negotiate(&link, &mut handshake, &peer, id, remote.ring_bytes, open_device, direct, &deadline, &mut early)?;
        let (link, link_kind, downgraded) = match shm {
            Negotiated::Mapped(shm) => (shm, LinkKind::Shm, false),
            Negotiated::NotUsed { downgraded } => {
                let plain = link.clone();
                let (link, more) = resources.rdma.negotiate(link, &mut handshake, &peer, id, &deadline)?;
                early.extend(more);
                if Arc::ptr_eq(&plain, &link) {
                    // Transport auto on TCP: RDMA's downgrade was counted.
                    let rdma_downgraded = resources.rdma.mode() == crate::transport::rdma::RdmaMode::Auto;
                    (link, LinkKind::Tcp, downgraded || rdma_downgraded)
                } else {
                    (link, LinkKind::Rdma, downgraded)
                }
            }
        };
        let mut watermark = remote.watermark;
        for m in early {
            if let Message::Watermark(w) = m {
                if (w.round, w.offset) > (watermark.round, watermark.offset) {
                    watermark = w;
                }
            }
        }
        reader.set_read_timeout(None)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State { watermark, awaited: HashSet::new(), replies: HashMap::new(), replies_dropped: 0, dead: None }),
            cv: Condvar::new(),
        });
        let reader_shared = shared.clone();
        let reader_link = link.clone();
        let (reader_id, reader_peer) = (id.to_owned(), link.describe());
        let handle = std::thread::Builder::new()
            .name(format!("kvstage-send-{id}"))
            .spawn(move || {
                // A panic kills the session (its waiters fail at once) instead of hanging them.
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    read_replies(reader, &reader_shared, &reader_id, &reader_peer)
                }));
                if let Err(p) = outcome {
                    let e = Error::from_panic("the session reader thread panicked", &*p);
                    log::error!(target: LOG_TARGET, session = reader_id.as_str(); "{}", e.chain());
                    let mut st = reader_shared.state.lock();
                    st.dead.get_or_insert((e.code(), e.chain()));
                    reader_shared.cv.notify_all();
                }
                // The session is dead: the link goes too (a same-host mapping of the receiver's
                // ring is unmapped once a gather in progress ends, which ends its quarantine there).
                reader_link.shutdown();
            })
            .map_err(|e| Error::internal("cannot start the session reader thread").with_source(e))?;
        let integrity = options.integrity.stronger(Integrity::from_wire(remote.integrity));
        // GPUDirect: a CUDA pool's chunks are staged in device memory the NIC reads.
        let device_staging = pool_device.filter(|_| link_kind == LinkKind::Rdma && link.writes_device_memory());
        Ok(Arc::new(SenderSession {
            id: id.to_owned(),
            link,
            remote,
            pair,
            pool,
            components,
            shared,
            next_req: AtomicU64::new(1),
            reader: Mutex::new(Some(handle)),
            integrity,
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
            peer: addr,
            fallback_logged: AtomicBool::new(false),
            running: Mutex::new(HashSet::new()),
            metrics: SendMetrics { session: Arc::default(), engine: resources.counters.clone() },
            link_kind,
            downgraded,
            device_staging,
            gpudirect_refused: AtomicBool::new(false),
            resources,
        }))
    }
}

/// The session's reader: routes replies to waiting operations and tracks the watermark. On any
/// error or EOF the session is dead and every waiter fails at once with `PEER_GONE`.
fn read_replies(mut stream: TcpStream, shared: &Shared, session: &str, peer: &str) {
    let why = loop {
        match protocol::read_frame(&mut stream) {
            Ok(Some(Message::Watermark(w))) => {
                // Watermarks only move forward; keeping the maximum makes a late one harmless.
                let mut st = shared.state.lock();
                if (w.round, w.offset) > (st.watermark.round, st.watermark.offset) {
                    st.watermark = w;
                }
                shared.cv.notify_all();
            }
            Ok(Some(msg @ (Message::AllocRsp { .. } | Message::Arrived { .. } | Message::GridRsp { .. }))) => {
                let req = match &msg {
                    Message::AllocRsp { req, .. } | Message::Arrived { req, .. } | Message::GridRsp { req, .. } => *req,
                    _ => unreachable!("matched above"),
                };
                let mut st = shared.state.lock();
                if st.awaited.contains(&req) {
                    st.replies.insert(req, msg);
                    shared.cv.notify_all();
                } else {
                    // Late (its waiter gave up), duplicated, or made up: bounded by dropping it.
                    st.replies_dropped += 1;
                    let n = st.replies_dropped;
                    drop(st);
                    if n.is_power_of_two() {
                        log::warn!(target: LOG_TARGET, session = session; "{n} replies from {peer} to requests nobody awaits dropped so far (request {req})");
                    }
                }
            }
            Ok(Some(other)) => break (Status::KVSTAGE_E_PROTOCOL, format!("unexpected frame from receiver: {other:?}")),
            Ok(None) => break (Status::KVSTAGE_E_PEER_GONE, "connection closed".to_owned()),
            Err(e) => {
                let code = if e.code() == Status::KVSTAGE_E_PROTOCOL { e.code() } else { Status::KVSTAGE_E_PEER_GONE };
                break (code, e.chain());
            }
        }
    };
    let text = format!("{} ({})", why.1, why.0.name());
    let mut st = shared.state.lock();
    // Already dead: closed here (freed, or its engine freed), so the end of the stream is expected.
    let expected = st.dead.is_some();
    // The first reason stays: a close or a reset here says why better than the stream's end.
    st.dead.get_or_insert(why);
    shared.cv.notify_all();
    drop(st);
    if expected {
        log::debug!(target: LOG_TARGET, session = session; "session reader ended: {text}");
    } else {
        log::warn!(target: LOG_TARGET, session = session; "connection to the receiver ({peer}) lost: {text}");
    }
}
