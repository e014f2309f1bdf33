//! The engine: its options, life (new, shutdown, free), address, describe document and counters.

use std::ffi::c_char;

use super::args::{init_versioned, json, out_arg, read_versioned, str_arg, timeout, versioned, write_text, KVSTAGE_TIMEOUT_INFINITE};
use super::ffi_fn;
use super::handle::{self, kvstage_engine, Handle};
use crate::engine::{Engine, EngineOptions, Integrity, StallWarn, TransportKind};
use crate::error::{Error, Result, Status};

/// Which byte mover an engine uses.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_transport {
    /// The same-host path when the peer is on this host (unless `same_host` is OFF), else RDMA
    /// when a usable device exists on both sides, else TCP.
    KVSTAGE_TRANSPORT_AUTO = 0,
    KVSTAGE_TRANSPORT_TCP = 1,
    KVSTAGE_TRANSPORT_RDMA = 2,
    /// The same-host path (the sender writes into the receiver's ring mapped in its process), or
    /// an error at connect (`KVSTAGE_E_UNSUPPORTED` when the peer is on another host).
    KVSTAGE_TRANSPORT_SHM = 3,
}

/// Whether transport AUTO may use the same-host path (`kvstage_engine_options.same_host`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_same_host {
    /// Used when the peer is on this host and its ring is engine-owned (the default).
    KVSTAGE_SAME_HOST_AUTO = 0,
    /// Never: same-host peers use RDMA or TCP; nothing is counted as a downgrade.
    KVSTAGE_SAME_HOST_OFF = 1,
}

/// Engine options. Fill with `kvstage_engine_options_init`, then change fields.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvstage_engine_options {
    pub struct_size: usize,
    /// A `kvstage_transport` value (plain int so that a bad value is an error, not UB).
    pub transport: i32,
    /// "HOST:PORT" to listen on (port 0 picks a free port); NULL = "127.0.0.1:0".
    pub listen_address: *const c_char,
    /// Threads for gather/scatter (1..=256).
    pub worker_threads: u32,
    /// The engine's default timeout in milliseconds (> 0, or KVSTAGE_TIMEOUT_INFINITE): what a
    /// `timeout_ms` of 0 means in every call and descriptor (a transfer's deadline, a wait, a
    /// connect, a shutdown, a room release's bound).
    pub default_timeout_ms: u64,
    /// Receiver chunk grid in tokens when a room does not name one (rounded down to whole pages).
    pub chunk_tokens: u32,
    /// Largest send staging buffer in bytes; a chunk whose share is larger falls back.
    pub send_staging_bytes: u64,
    /// Shared secret both sides of a session must present (compared in constant time);
    /// NULL or "" = no authentication.
    pub cluster_token: *const c_char,
    /// A `kvstage_integrity` value: when chunks carry a checksum verified before the scatter.
    pub integrity: i32,
    /// RDMA devices to use, striped, as "mlx5_0:1,mlx5_1" (name[:port], comma-separated);
    /// NULL or "" = the first device with an ACTIVE port.
    pub rdma_devices: *const c_char,
    /// GID index for RoCE ports; -1 = automatic (a RoCE v2 GID holding an IPv4 address).
    pub rdma_gid_index: i32,
    /// Queue pairs per device and session (1..=16); a chunk is striped over all of them.
    pub rdma_qps_per_device: u32,
    /// Largest RDMA WRITE work request in bytes (4096..=1073741824).
    pub rdma_wr_bytes: u32,
    /// One signalled completion per this many work requests (1..=1024).
    pub rdma_signal_every: u32,
    /// Sender sessions open at once (default 1024): past it a newcomer whose handshake passed
    /// has the oldest idle session (holding no unfinished room, grant, lease or mapping) of the
    /// source with the most sessions cut for it, or is refused when none is idle. Connections,
    /// handshakes included, are bounded by `max_connections + max_handshakes`.
    pub max_connections: u32,
    /// Connections still in their handshake at once (default 64); when all are taken, the oldest
    /// handshake of the source holding the most is cut to serve a new connection.
    pub max_handshakes: u32,
    /// The whole handshake of an accepted connection must end within this (default 5000 ms).
    pub handshake_timeout_ms: u32,
    /// Room events (chunk and room) kept for polling; more are dropped and counted in
    /// `kvstage_engine_stats.events_dropped` (default 65536).
    pub max_events: u32,
    /// A peer that stops answering (a host that vanished) is declared gone after about this long:
    /// TCP keepalive and `TCP_USER_TIMEOUT` (>= 1000; default 15000; KVSTAGE_TIMEOUT_INFINITE:
    /// the OS defaults, about two hours).
    pub dead_peer_timeout_ms: u64,
    /// A decode room not complete this long after `kvstage_room_open` fails with
    /// `KVSTAGE_E_TIMEOUT` and returns its ring space (default 300000; KVSTAGE_TIMEOUT_INFINITE:
    /// never).
    pub room_timeout_ms: u64,
    /// Send staging buffers at most, all sessions together (default 4).
    pub send_staging_buffers: u32,
    /// Threads running asynchronous transfers, 1..=256 (default 4); one session uses at most half.
    pub transfer_threads: u32,
    /// Bytes all send staging buffers may hold together, at least `send_staging_bytes`
    /// (default 4 GiB, allocated on demand).
    pub send_staging_total_bytes: u64,
    /// A `kvstage_same_host` value: whether transport AUTO uses the same-host path (default AUTO;
    /// OFF with transport SHM is an error).
    pub same_host: i32,
    /// A transfer that waits this long without progress (for its allocation, the receiver's
    /// watermark, the acknowledgement, or layers to be marked ready) logs one WARN line naming the
    /// room, the chunk and what it waits on, once per wait. 0 (default): a quarter of the
    /// operation's deadline (10 s without one); KVSTAGE_TIMEOUT_INFINITE: never.
    pub stall_warn_ms: u64,
    /// A whole chunk goes out in pieces of about this many bytes (whole layers' slabs): from a
    /// host send staging buffer (RDMA, a CUDA pool, or `send_from_pool` 0) each written while the
    /// next is gathered, when that makes two pieces or more; from the pool over TCP with the
    /// session's stream free between them. 0 = one write (after the whole gather). Default 4 MiB.
    pub send_piece_bytes: u64,
    /// 1 (default): over TCP, a whole chunk of a host pool is written straight from the pool's
    /// rows, without a staging buffer or a gather copy; 0: gathered into a staging buffer first.
    pub send_from_pool: i32,
    /// 1 (default): same-host sessions use direct mode where both sides allow it (both KV pools
    /// in one kind of memory; a host decode pool in memory of `kvstage_shared_alloc`, a CUDA
    /// decode pool in device allocations that hold nothing but its buffers, which same-host
    /// senders then open whole through CUDA IPC): each chunk is copied from prefill page to decode
    /// page in one pass, without the decode ring and its scatter; 0: never (the ring path).
    /// Either side can rule it out. A decode engine with a CUDA pool should free that memory only
    /// after `kvstage_engine_free` returned without warning of a peer still holding the pool.
    pub same_host_direct: i32,
}

/// Per-chunk integrity checking (xxh3-64 of each writer's staged bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_integrity {
    KVSTAGE_INTEGRITY_OFF = 0,
    /// One chunk in 16 (chosen by room and chunk index): the default.
    KVSTAGE_INTEGRITY_SAMPLED = 1,
    KVSTAGE_INTEGRITY_ALWAYS = 2,
}

impl Default for kvstage_engine_options {
    fn default() -> Self {
        let d = EngineOptions::default();
        kvstage_engine_options {
            struct_size: std::mem::size_of::<Self>(),
            transport: match d.transport {
                TransportKind::Auto => kvstage_transport::KVSTAGE_TRANSPORT_AUTO,
                TransportKind::Tcp => kvstage_transport::KVSTAGE_TRANSPORT_TCP,
                TransportKind::Rdma => kvstage_transport::KVSTAGE_TRANSPORT_RDMA,
                TransportKind::Shm => kvstage_transport::KVSTAGE_TRANSPORT_SHM,
            } as i32,
            listen_address: std::ptr::null(),
            worker_threads: d.worker_threads,
            default_timeout_ms: d.default_deadline_ms(),
            chunk_tokens: d.chunk_tokens,
            send_staging_bytes: d.send_staging_bytes,
            cluster_token: std::ptr::null(),
            integrity: kvstage_integrity::KVSTAGE_INTEGRITY_SAMPLED as i32,
            rdma_devices: std::ptr::null(),
            rdma_gid_index: -1,
            rdma_qps_per_device: d.rdma.qps_per_device,
            rdma_wr_bytes: d.rdma.wr_bytes,
            rdma_signal_every: d.rdma.signal_every,
            max_connections: d.listener.max_connections,
            max_handshakes: d.listener.max_handshakes,
            handshake_timeout_ms: d.listener.handshake_timeout.as_millis() as u32,
            max_events: d.max_events,
            dead_peer_timeout_ms: millis_or_infinite(d.dead_peer_timeout),
            room_timeout_ms: millis_or_infinite(d.room_timeout),
            send_staging_buffers: d.send_staging_buffers,
            transfer_threads: d.transfer_threads,
            send_staging_total_bytes: d.send_staging_total_bytes,
            same_host: if d.same_host { kvstage_same_host::KVSTAGE_SAME_HOST_AUTO } else { kvstage_same_host::KVSTAGE_SAME_HOST_OFF } as i32,
            stall_warn_ms: 0,
            send_piece_bytes: d.send_piece_bytes,
            send_from_pool: i32::from(d.send_from_pool),
            same_host_direct: i32::from(d.same_host_direct),
        }
    }
}

fn millis_or_infinite(d: Option<std::time::Duration>) -> u64 {
    d.map_or(KVSTAGE_TIMEOUT_INFINITE, |d| d.as_millis() as u64)
}

fn duration_or_infinite(ms: u64) -> Option<std::time::Duration> {
    (ms != KVSTAGE_TIMEOUT_INFINITE).then(|| std::time::Duration::from_millis(ms))
}

versioned!(kvstage_engine_options, same_host_direct: i32);

unsafe fn engine_options(ptr: *const kvstage_engine_options) -> Result<EngineOptions> {
    let raw: kvstage_engine_options = unsafe { read_versioned(ptr, "options") }?;
    let transport = match raw.transport {
        0 => TransportKind::Auto,
        1 => TransportKind::Tcp,
        2 => TransportKind::Rdma,
        3 => TransportKind::Shm,
        other => return Err(Error::invalid_arg("options->transport", format!("{other} is not a kvstage_transport value"))),
    };
    let mut opts = EngineOptions {
        transport,
        worker_threads: raw.worker_threads,
        chunk_tokens: raw.chunk_tokens,
        send_staging_bytes: raw.send_staging_bytes,
        ..EngineOptions::default()
    };
    if !raw.listen_address.is_null() {
        opts.listen_address = unsafe { str_arg(raw.listen_address, "options->listen_address") }?.to_owned();
    }
    opts.set_default_deadline_ms(raw.default_timeout_ms);
    if !raw.cluster_token.is_null() {
        let token = unsafe { str_arg(raw.cluster_token, "options->cluster_token") }?;
        opts.cluster_token = (!token.is_empty()).then(|| token.to_owned());
    }
    opts.integrity = match raw.integrity {
        0 => Integrity::Off,
        1 => Integrity::Sampled,
        2 => Integrity::Always,
        other => return Err(Error::invalid_arg("options->integrity", format!("{other} is not a kvstage_integrity value"))),
    };
    if !raw.rdma_devices.is_null() {
        let text = unsafe { str_arg(raw.rdma_devices, "options->rdma_devices") }?;
        opts.rdma.devices = crate::transport::rdma::parse_devices(text)?;
    }
    opts.rdma.gid_index = match raw.rdma_gid_index {
        -1 => None,
        i if i >= 0 => Some(i as u32),
        other => return Err(Error::invalid_arg("options->rdma_gid_index", format!("{other} is neither -1 (automatic) nor an index"))),
    };
    opts.rdma.qps_per_device = raw.rdma_qps_per_device;
    opts.rdma.wr_bytes = raw.rdma_wr_bytes;
    opts.rdma.signal_every = raw.rdma_signal_every;
    opts.listener.max_connections = raw.max_connections;
    opts.listener.max_handshakes = raw.max_handshakes;
    opts.listener.handshake_timeout = std::time::Duration::from_millis(raw.handshake_timeout_ms.into());
    opts.max_events = raw.max_events;
    opts.dead_peer_timeout = duration_or_infinite(raw.dead_peer_timeout_ms);
    opts.room_timeout = duration_or_infinite(raw.room_timeout_ms);
    opts.send_staging_buffers = raw.send_staging_buffers;
    opts.transfer_threads = raw.transfer_threads;
    opts.send_staging_total_bytes = raw.send_staging_total_bytes;
    opts.same_host = match raw.same_host {
        0 => true,
        1 => false,
        other => return Err(Error::invalid_arg("options->same_host", format!("{other} is not a kvstage_same_host value"))),
    };
    opts.stall_warn = match raw.stall_warn_ms {
        0 => StallWarn::QuarterOfDeadline,
        KVSTAGE_TIMEOUT_INFINITE => StallWarn::Never,
        ms => StallWarn::After(std::time::Duration::from_millis(ms)),
    };
    opts.send_piece_bytes = raw.send_piece_bytes;
    opts.send_from_pool = match raw.send_from_pool {
        0 => false,
        1 => true,
        other => return Err(Error::invalid_arg("options->send_from_pool", format!("{other} is neither 0 nor 1"))),
    };
    opts.same_host_direct = match raw.same_host_direct {
        0 => false,
        1 => true,
        other => return Err(Error::invalid_arg("options->same_host_direct", format!("{other} is neither 0 nor 1"))),
    };
    Ok(opts)
}

/// Fills `options` with defaults: `size` is the caller's `sizeof(*options)`, so a program built
/// against an older or a newer header gets exactly its own struct filled (`struct_size` = `size`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_options_init(options: *mut kvstage_engine_options, size: usize) -> Status {
    ffi_fn!(status { unsafe { init_versioned(options, size, "options") } })
}

/// Creates an engine; `options` may be NULL for defaults. Writes `*out` only on success.
/// Transport RDMA without a usable device is `KVSTAGE_E_NO_DEVICE` (class RDMA; the causes end
/// with the OS error of the device list); AUTO without one uses TCP and counts each such session
/// in `kvstage_engine_stats.rdma_downgrades`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_new(
    options: *const kvstage_engine_options,
    out: *mut *mut kvstage_engine,
) -> Status {
    ffi_fn!(status {
        let out = out_arg(out, "out")?;
        let opts = if options.is_null() { EngineOptions::default() } else { unsafe { engine_options(options) }? };
        let engine = Engine::new(opts)?;
        *out = Handle::into_raw(engine)?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Stops and frees an engine (joins its threads). NULL is a no-op. When other threads are inside
/// calls on this engine, it returns at once; those calls end by their own rules and the last one
/// stops the engine as it returns, on its thread. Later calls with the pointer (and a second
/// free, which records it in the last error) fail with `KVSTAGE_E_INVALID_ARG`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_free(engine: *mut kvstage_engine) {
    ffi_fn!(value = (), { Handle::free(engine, "engine") })
}

/// Stops the engine as `kvstage_engine_free` does (its sessions closed, their operations and the
/// decode rooms' transfers failing, no new connection accepted, its threads joined), then waits
/// up to `timeout_ms` (0: the engine default, KVSTAGE_TIMEOUT_INFINITE: no limit) until no same-host peer
/// maps its device ring or KV pool any more — a peer unmapped (its sessions ended), or its process
/// ended. `KVSTAGE_OK`: the pool and ring memory are the caller's to free (a CUDA pool's IPC
/// mappings cannot be revoked: freeing it earlier lets a peer write memory the allocator reuses).
/// `KVSTAGE_E_TIMEOUT`: some still do; the message names their processes, `*still_mapped` (may be
/// NULL) receives how many; call again to wait more. The handle stays valid until
/// `kvstage_engine_free` (quick after `KVSTAGE_OK`; after a timeout it gives the peers 2 s more,
/// then logs them); calls that would start work on it fail with `KVSTAGE_E_CANCELED`. From inside
/// a callback (on a kvstage thread): `KVSTAGE_E_UNSUPPORTED`. Concurrent calls each return once
/// the engine is stopped.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_shutdown(engine: *const kvstage_engine, timeout_ms: u64, still_mapped: *mut usize) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        crate::session::notify::refuse_in_callback("kvstage_engine_shutdown")?;
        if std::thread::current().name().is_some_and(|n| n.starts_with("kvstage-")) {
            // A log callback on a library thread: the shutdown would join that very thread.
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "kvstage_engine_shutdown was called on a kvstage thread (from a callback), which it would wait for: call it from another thread"));
        }
        let held = engine.shutdown(timeout(timeout_ms, engine.default_timeout()));
        if !still_mapped.is_null() {
            // SAFETY: the caller passes a writable size_t or NULL.
            unsafe { *still_mapped = held.as_ref().err().map_or(0, |h| h.0.len()) };
        }
        held.map(|()| Status::KVSTAGE_OK).map_err(|h| {
            let waited = match timeout(timeout_ms, engine.default_timeout()) {
                None => String::new(),
                Some(t) => format!(" after {} ms", t.as_millis()),
            };
            Error::new(Status::KVSTAGE_E_TIMEOUT, format!("{h}{waited}: freeing that memory now would free it under them"))
        })
    })
}

/// Writes the address the engine listens on ("127.0.0.1:40123") into `buf` (NUL-terminated);
/// `*needed` (may be NULL) receives its size including the NUL. `buf` NULL with `capacity` 0 is a
/// size query (`KVSTAGE_OK`, `needed` required); a too small buffer is `KVSTAGE_E_INVALID_ARG`
/// naming both sizes.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_listen_address(
    engine: *const kvstage_engine,
    buf: *mut c_char,
    capacity: usize,
    needed: *mut usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        unsafe { write_text(&engine.local_addr().to_string(), buf, capacity, needed) }
    })
}

/// The whole engine as a JSON document (the string-output convention of
/// `kvstage_engine_listen_address`): its transport in one line (`transport`: the same-host path,
/// its sessions and direct mode, RDMA devices or why TCP, the last downgrades), the decode side's
/// staging ring (live allocations oldest first, with their rooms and chunks), accepted
/// connections and rooms (state and chunks done), and the sessions it opened (transport, bytes
/// sent, the chunks running, why one is dead). The document changes as the engine works: query
/// the size and fill in a loop until the fill succeeds.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_describe(engine: *const kvstage_engine, buf: *mut c_char, capacity: usize, needed: *mut usize) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let text = json(&engine.describe())?;
        unsafe { write_text(&text, buf, capacity, needed) }
    })
}

/// Counters of an engine (a snapshot). The snapshot is not atomic across counters: each is read
/// on its own while transfers may be ending, so a concurrent read may see, for instance, a
/// transfer already counted in `transfers_ok` but still in `transfers_in_flight`, or its result
/// counted before its `timings_sum`. It is consistent for every transfer whose end the caller
/// has seen (its `kvstage_transfer` returned, or `kvstage_op_wait` / `kvstage_room_wait` or the
/// completion callback reported it).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct kvstage_engine_stats {
    pub struct_size: usize,
    /// Size of the registered staging ring in bytes (0 = none).
    pub ring_capacity: u64,
    /// Allocations currently live in the ring (0 when idle: nothing leaked).
    pub ring_live_allocations: u64,
    pub watermark_round: u64,
    pub watermark_offset: u64,
    /// Sessions this engine opened on TCP although its transport is AUTO (no RDMA device here or
    /// at the peer, or the RDMA exchange failed); the `transport` of `kvstage_engine_describe` says why.
    pub rdma_downgrades: u64,
    /// Sessions connected over RDMA, opened or accepted by this engine.
    pub rdma_sessions: u64,
    /// Sender connections accepted and past their handshake, now.
    pub connections: u64,
    /// Failed `accept` calls (EMFILE, ENOMEM, …); the listener retries with backoff.
    pub accept_errors: u64,
    /// Connections refused by `max_connections` or `max_handshakes`, and handshakes cut to serve a
    /// newer connection.
    pub connections_refused: u64,
    /// Handshakes that failed: malformed or oversized hello, unsupported protocol version,
    /// wrong cluster token, geometry mismatch, deadline passed.
    pub handshakes_failed: u64,
    /// Room events dropped because `max_events` were waiting to be polled.
    pub events_dropped: u64,
    /// Rooms failed with `KVSTAGE_E_TIMEOUT` by `room_timeout_ms`.
    pub rooms_expired: u64,
    /// Panics caught in library threads (each failed the rooms involved with `KVSTAGE_E_PANIC`).
    pub thread_panics: u64,
    /// Metrics, appended from here on (a caller whose `struct_size` ends at `thread_panics` gets
    /// the fields above only). Sender side, every session this engine opened (freed ones
    /// included), as in `kvstage_session_stats`: payload bytes written completely to receivers.
    pub bytes_sent: u64,
    /// Chunks whose bytes were written completely (acknowledged or not).
    pub chunks_sent: u64,
    /// Transfers acknowledged (`KVSTAGE_OK`).
    pub transfers_ok: u64,
    /// Transfers answered `KVSTAGE_FALLBACK`.
    pub transfers_fallback: u64,
    /// Failed transfers = `transfers_timeout + transfers_canceled + transfers_peer_gone +
    /// transfers_failed_other`.
    pub transfers_failed: u64,
    pub transfers_timeout: u64,
    pub transfers_canceled: u64,
    pub transfers_peer_gone: u64,
    pub transfers_failed_other: u64,
    /// Transfers in progress now (synchronous calls, asynchronous operations queued or running).
    pub transfers_in_flight: u64,
    /// Ended transfers whose phase timings are summed in `timings_sum`.
    pub timed_transfers: u64,
    /// Phase timings summed over those transfers.
    pub timings_sum: super::timings::kvstage_transfer_timings,
    /// Receiver side: payload bytes received: staged writer shares counted once complete (their ready frame
    /// accepted), slice payloads once landed.
    pub bytes_received: u64,
    /// Chunks that reached the KV pool (scattered from the ring, or completed by the slice path).
    pub chunks_received: u64,
    /// Staged chunks timed from arrival to scatter done: from the arrival of the chunk's last
    /// writer (its ready frame: every byte in the ring) to the end of its scatter into the pool
    /// (checksum, acknowledgement, scatter queue and scatter). Count, sum and largest, in ns.
    pub scatter_count: u64,
    pub scatter_ns_sum: u64,
    pub scatter_ns_max: u64,
    /// Bytes of the staging ring held by live allocations now: from the oldest live allocation to
    /// the end of the newest, wrap-around included (at most `ring_capacity`).
    pub ring_used_bytes: u64,
    /// The largest `ring_used_bytes` since the current ring was registered (the ring's high-water
    /// mark; registering a new ring starts it again from 0).
    pub ring_high_water_bytes: u64,
    /// Sessions that used the same-host path, opened or accepted by this engine.
    pub shm_sessions: u64,
    /// Sessions this engine opened to a peer on this host that could not use the same-host path
    /// although transport AUTO allowed it (the peer's ring is caller memory, its transport rules
    /// it out, mapping failed); the `transport` of `kvstage_engine_describe` says why. Peers on other
    /// hosts and `same_host` OFF are not counted.
    pub shm_downgrades: u64,
    /// RDMA sessions this engine opened for a KV pool in GPU memory that stage its chunks in host
    /// memory (a device→host copy before each write) because their device staging memory could
    /// not be allocated or registered with the NIC (no GPUDirect RDMA);
    /// the `transport` of `kvstage_engine_describe` says why.
    pub rdma_host_staging_sessions: u64,
    /// Same-host sessions in direct mode (the prefill maps the decode pool), opened or accepted
    /// by this engine.
    pub shm_direct_sessions: u64,
    /// Chunk regions copied straight from prefill pages into decode pages (direct mode): written
    /// by this engine (prefill) plus received into its pool (decode).
    pub shm_direct_chunks: u64,
    /// Writer regions this engine read from a TCP stream straight into its KV pool, without the
    /// ring and its scatter (host pool, no checksum on the chunk, rows there in runs of 16 KiB or
    /// more: whole token slots of pages that large).
    pub regions_read_into_pool: u64,
}

/// Fills `out` (set `out->struct_size` first, to `sizeof(kvstage_engine_stats)`) with the
/// engine's counters. A smaller `struct_size` (a caller built with an older header, whose struct
/// ends at `thread_panics`: `offsetof(kvstage_engine_stats, bytes_sent)`) gets the fields it holds;
/// nothing past it is written.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_stats_get(engine: *const kvstage_engine, out: *mut kvstage_engine_stats) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let out = super::args::out_ptr(out, "out")?;
        let r = engine.stats();
        let f = super::timings::send_fields(&r.send);
        let stats = kvstage_engine_stats {
            struct_size: std::mem::size_of::<kvstage_engine_stats>(),
            ring_capacity: r.ring_capacity,
            ring_live_allocations: r.ring_live_allocations,
            watermark_round: r.watermark.round,
            watermark_offset: r.watermark.offset,
            rdma_downgrades: r.rdma_downgrades,
            rdma_sessions: r.rdma_sessions,
            connections: r.connections,
            accept_errors: r.accept_errors,
            connections_refused: r.connections_refused,
            handshakes_failed: r.handshakes_failed,
            events_dropped: r.events_dropped,
            rooms_expired: r.rooms_expired,
            thread_panics: r.thread_panics,
            bytes_sent: f.bytes_sent,
            chunks_sent: f.chunks_sent,
            transfers_ok: f.transfers_ok,
            transfers_fallback: f.transfers_fallback,
            transfers_failed: f.transfers_failed,
            transfers_timeout: f.transfers_timeout,
            transfers_canceled: f.transfers_canceled,
            transfers_peer_gone: f.transfers_peer_gone,
            transfers_failed_other: f.transfers_failed_other,
            transfers_in_flight: f.transfers_in_flight,
            timed_transfers: f.timed_transfers,
            timings_sum: f.timings_sum,
            bytes_received: r.receive.bytes_received,
            chunks_received: r.receive.chunks_received,
            scatter_count: r.receive.scatter_count,
            scatter_ns_sum: r.receive.scatter_ns_sum,
            scatter_ns_max: r.receive.scatter_ns_max,
            ring_used_bytes: r.ring_used_bytes,
            ring_high_water_bytes: r.receive.ring_high_water,
            shm_sessions: r.shm_sessions,
            shm_downgrades: r.shm_downgrades,
            rdma_host_staging_sessions: r.rdma_host_staging_sessions,
            shm_direct_sessions: r.shm_direct_sessions,
            shm_direct_chunks: r.shm_direct_chunks,
            regions_read_into_pool: r.receive.regions_read_into_pool,
        };
        unsafe { super::args::write_versioned(out, stats, "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
}
