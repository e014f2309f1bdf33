//! Where a request is, said as data: the decode side's half of `kvstage_room_describe` and
//! `kvstage_engine_describe` (schema in README "Troubleshooting"). Built from the state alone, so
//! the state model test can check it against its own view in every state it reaches.

use serde::Serialize;

use super::*;

/// Chunks listed per room at most; the rest are counted (`chunks_omitted`).
pub const MAX_DESCRIBED_CHUNKS: usize = 256;
/// Rooms and ring allocations listed per engine at most; the rest are counted.
pub const MAX_DESCRIBED_ROOMS: usize = 256;

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct FailureDescription {
    pub code: &'static str,
    pub message: String,
    pub session: String,
}

/// A ring allocation: where it lies and what (if anything) keeps its writers waiting.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct GrantDescription {
    pub round: u64,
    pub offset: u64,
    pub bytes: u64,
    /// Position among the ring's live allocations, 0 = the oldest.
    pub ring_position: usize,
    /// The oldest live allocation, when no writer of this one may write yet (it starts past the
    /// receiver's watermark): its writers wait for that chunk to complete.
    pub waits_behind: Option<ChunkRef>,
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct ChunkRef {
    pub room: u64,
    pub chunk: u32,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct WriterDescription {
    pub session: String,
    pub prefill_tp_rank: u32,
    pub prefill_pp_rank: u32,
    /// Staged: bytes of its region landed so far; slice path: rows landed.
    pub landed: u64,
    /// Staged: its region's bytes; slice path: rows it owes.
    pub expected: u64,
    pub ready: bool,
    /// Its connection is gone (the room fails unless the chunk already arrived).
    pub disconnected: bool,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ChunkDescription {
    pub index: u32,
    /// `not_started` (no writer asked yet), `waiting_for_watermark` (granted behind an older
    /// allocation), `granted` (may be written, nothing landed), `writing`,
    /// `waiting_for_writers` (some writers ready or slabs unclaimed), `scattering`, `done`,
    /// `failed`.
    pub phase: &'static str,
    /// `staged`, `slices`, or null before the first writer.
    pub path: Option<&'static str>,
    pub tokens: Option<u32>,
    pub pages: usize,
    pub grant: Option<GrantDescription>,
    pub writers: Vec<WriterDescription>,
    /// (head group, layer) slabs no writer claimed yet: prefill ranks that never asked.
    pub unclaimed_slabs: u64,
    /// Who the chunk waits for: per missing head group its prefill TP rank, its PP rank (null
    /// when the prefill side has several stages) and the decode rank's layers not written; for a
    /// chunk no writer asked for yet, every writer (once any chunk of the room has one).
    pub missing_writers: Vec<crate::geometry::MissingWriter>,
    pub layers_scattered: u32,
    pub layers: u32,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RoomDescription {
    pub version: u32,
    pub room: u64,
    /// The request's trace id (the first writer's, else derived from the opening).
    pub trace: String,
    /// `open`, `complete`, `failed` or `releasing` (released, waiting for leases on its pages).
    pub state: &'static str,
    pub failure: Option<FailureDescription>,
    pub pages: usize,
    pub chunk_tokens: u32,
    pub chunks_done: usize,
    pub num_chunks: usize,
    /// Milliseconds until the room expires (`room_timeout_ms`), if it does.
    pub expires_in_ms: Option<u64>,
    pub chunks: Vec<ChunkDescription>,
    pub chunks_omitted: usize,
    /// Where the room's aux rows are (rooms that name request parts with aux rows): `owed` (the
    /// last chunk has not brought them), `held` (until every chunk is in place), `writing`,
    /// `written`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_rows: Option<&'static str>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct AllocationDescription {
    pub room: u64,
    pub chunk: u32,
    pub round: u64,
    pub offset: u64,
    pub bytes: u64,
    /// Pinned by a payload read or a scatter, or quarantined for an in-place writer.
    pub in_use: bool,
    /// Its chunk no longer needs it: it goes back once no write into it can happen.
    pub freeing: bool,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RingDescription {
    pub capacity: u64,
    pub used_bytes: u64,
    pub watermark_round: u64,
    pub watermark_offset: u64,
    /// Live allocations, oldest first (the first one holds every later one behind it once the
    /// ring wraps).
    pub allocations: Vec<AllocationDescription>,
    pub allocations_omitted: usize,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ConnectionDescription {
    pub session: String,
    pub prefill_tp_rank: u32,
    pub prefill_pp_rank: u32,
    /// Writes in place (RDMA, or a same-host mapping of the ring).
    pub in_place: bool,
}

/// A room in the engine's overview (`kvstage_room_describe` has its chunks).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RoomSummary {
    pub room: u64,
    pub trace: String,
    pub state: &'static str,
    pub chunks_done: usize,
    pub num_chunks: usize,
    pub failure: Option<FailureDescription>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ReceiverDescription {
    pub ring: Option<RingDescription>,
    pub connections: Vec<ConnectionDescription>,
    pub rooms: Vec<RoomSummary>,
    pub rooms_omitted: usize,
    pub events_queued: usize,
}

fn room_state(r: &Room) -> &'static str {
    if r.released {
        "releasing"
    } else if r.failure.is_some() {
        "failed"
    } else if r.complete() {
        "complete"
    } else {
        "open"
    }
}

fn failure_description(r: &Room) -> Option<FailureDescription> {
    r.failure.as_ref().map(|f| FailureDescription { code: f.code.name(), message: f.why.clone(), session: f.session.clone() })
}

fn chunk_phase(r: &Room, c: &Chunk, blocked: bool) -> &'static str {
    match c.phase {
        Phase::Done => "done",
        _ if r.failure.is_some() => "failed",
        Phase::Scattering => "scattering",
        Phase::Waiting if c.slots.is_empty() => "not_started",
        Phase::Waiting if c.slots.iter().any(|s| s.arrived) => "waiting_for_writers",
        Phase::Waiting if blocked => "waiting_for_watermark",
        Phase::Waiting if c.slots.iter().any(|s| s.written.total() > 0 || s.coverage.as_ref().is_some_and(|v| v.progress().0 > 0)) => "writing",
        Phase::Waiting => "granted",
    }
}

impl State {
    pub(super) fn grant_description(&self, id: u64) -> Option<GrantDescription> {
        let g = self.grants.get(&id)?;
        let ring = self.ring.as_ref()?;
        let ring_position = ring.live().position(|l| l.id == id)?;
        // Each writer is held until its own region may be written; no writer can start while
        // the grant's first byte may not be.
        let blocked = !ring.watermark().permits(g.grant.round, g.grant.offset + 1);
        let waits_behind = ring
            .live()
            .next()
            .filter(|oldest| blocked && oldest.id != id)
            .and_then(|oldest| self.grants.get(&oldest.id))
            .map(|o| ChunkRef { room: o.room.id, chunk: o.chunk });
        Some(GrantDescription { round: g.grant.round, offset: g.grant.offset, bytes: g.grant.len, ring_position, waits_behind })
    }

    fn chunk_description(&self, r: &Room, index: usize, c: &Chunk) -> ChunkDescription {
        let grant = c.grant.and_then(|id| self.grant_description(id));
        let blocked = grant.as_ref().is_some_and(|g| g.waits_behind.is_some());
        let mut writers = Vec::with_capacity(c.slots.len());
        if let Some(layout) = &c.layout {
            for s in &c.slots {
                let w = &layout.writers[s.region as usize];
                let info = self.conns.get(&s.conn);
                let (landed, expected) = match &s.coverage {
                    Some(cov) => cov.progress(),
                    None => (s.written.total(), w.bytes),
                };
                writers.push(WriterDescription {
                    session: info.map_or_else(String::new, |i| i.session.clone()),
                    prefill_tp_rank: w.src_tp_rank,
                    prefill_pp_rank: w.src_pp_rank,
                    landed,
                    expected,
                    ready: s.arrived,
                    disconnected: info.is_none(),
                });
            }
        }
        let unclaimed_slabs = c.layout.as_ref().map_or(0, StagingLayout::unclaimed_slabs);
        ChunkDescription {
            index: index as u32,
            phase: chunk_phase(r, c, blocked),
            path: match c.mode {
                Mode::Unset => None,
                Mode::Staged => Some("staged"),
                Mode::Slices => Some("slices"),
            },
            tokens: c.layout.as_ref().map(|l| l.tokens),
            pages: r.chunk_pages(index as u32).len(),
            grant,
            writers,
            unclaimed_slabs,
            missing_writers: r.missing_writers(c),
            layers_scattered: c.layers_taken.iter().filter(|t| **t).count() as u32,
            layers: c.layers_taken.len() as u32,
        }
    }

    fn room_description(&self, id: u64, r: &Room, page_size: u32, now: Instant) -> RoomDescription {
        let chunks = r.chunks.iter().enumerate().take(MAX_DESCRIBED_CHUNKS).map(|(i, c)| self.chunk_description(r, i, c)).collect();
        RoomDescription {
            version: crate::session::DESCRIBE_VERSION,
            room: id,
            trace: r.trace.clone(),
            state: room_state(r),
            failure: failure_description(r),
            pages: r.pages.len(),
            chunk_tokens: r.grid_pages as u32 * page_size,
            chunks_done: r.chunks.iter().filter(|c| c.phase == Phase::Done).count(),
            num_chunks: r.chunks.len(),
            expires_in_ms: r.expires.map(|e| e.saturating_duration_since(now).as_millis() as u64),
            aux_rows: r.aux.describe(),
            chunks,
            chunks_omitted: r.chunks.len().saturating_sub(MAX_DESCRIBED_CHUNKS),
        }
    }

    /// Room `room` as it stands (`page_size`: the decode pool's), or `None` when no room of
    /// that id is open or releasing.
    pub fn describe_room(&self, room: u64, page_size: u32, now: Instant) -> Option<RoomDescription> {
        self.rooms.get(&room).map(|r| self.room_description(room, r, page_size, now))
    }

    /// The ring, the connections and every room (bounded), rooms in id order.
    pub fn describe(&self) -> ReceiverDescription {
        let ring = self.ring.as_ref().map(|ring| {
            let allocations: Vec<AllocationDescription> = ring
                .live()
                .take(MAX_DESCRIBED_ROOMS)
                .filter_map(|l| {
                    let g = self.grants.get(&l.id)?;
                    Some(AllocationDescription {
                        room: g.room.id,
                        chunk: g.chunk,
                        round: l.round,
                        offset: l.offset,
                        bytes: l.len,
                        in_use: !g.pins.is_empty() || !g.remote_writers.is_empty(),
                        freeing: g.freeing,
                    })
                })
                .collect();
            RingDescription {
                capacity: ring.capacity(),
                used_bytes: ring.occupied(),
                watermark_round: ring.watermark().round,
                watermark_offset: ring.watermark().offset,
                allocations_omitted: ring.live_count().saturating_sub(allocations.len()),
                allocations,
            }
        });
        let mut conns: Vec<(&ConnId, &ConnInfo)> = self.conns.iter().collect();
        conns.sort_unstable_by_key(|(id, _)| **id);
        let connections = conns
            .into_iter()
            .map(|(_, i)| ConnectionDescription {
                session: i.session.clone(),
                prefill_tp_rank: i.src.tp_rank,
                prefill_pp_rank: i.src.pp_rank,
                in_place: i.in_place,
            })
            .collect();
        let mut ids: Vec<u64> = self.rooms.keys().copied().collect();
        ids.sort_unstable();
        let rooms = ids
            .iter()
            .take(MAX_DESCRIBED_ROOMS)
            .map(|id| {
                let r = &self.rooms[id];
                RoomSummary {
                    room: *id,
                    trace: r.trace.clone(),
                    state: room_state(r),
                    chunks_done: r.chunks.iter().filter(|c| c.phase == Phase::Done).count(),
                    num_chunks: r.chunks.len(),
                    failure: failure_description(r),
                }
            })
            .collect();
        ReceiverDescription { ring, connections, rooms, rooms_omitted: ids.len().saturating_sub(MAX_DESCRIBED_ROOMS), events_queued: self.events.len() }
    }
}
