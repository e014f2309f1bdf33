//! The staged path's transitions: allocation, payload writes (pinned), in-place reports, readiness
//! and aborts (the scatters they lead to: `streaming`).

use super::*;
use crate::session::receiver::extents::MAX_RANGES;

impl State {

    /// [`State::grant`] for a writer that writes through the ring.
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub fn allocate(&mut self, conn: ConnId, at: RoomRef, chunk: u32, claimed: u32, tokens: u32, bytes: u64, pool_tokens: Option<&[u32]>) -> Result<(Grant, u64)> {
        self.grant(conn, at, chunk, claimed, tokens, bytes, pool_tokens, false).map(|g| (g.grant, g.region))
    }

    /// An allocation request from `conn` for its region of (room, chunk): the grant and the
    /// region's offset within it. Errors are replied to the sender; none ends the session.
    /// `pool_tokens`: `Some` when the writer's region carries the request's parts (see
    /// [`State::check_parts`]). `direct`: the writer asks to write its region's KV straight into
    /// the pool's pages (it maps the pool): granted for a region without request parts on a
    /// connection set up for it, with the chunk's pages; the room's release then waits for the
    /// writer (its ready, abort, or the end of its mapping).
    #[allow(clippy::too_many_arguments)]
    pub fn grant(&mut self, conn: ConnId, at: RoomRef, chunk: u32, claimed: u32, tokens: u32, bytes: u64, pool_tokens: Option<&[u32]>, direct: bool) -> Result<Granted> {
        let info = self.claimant(conn)?.clone();
        let writer = info.pairing.frame_writer();
        if claimed != writer {
            return Err(protocol(format!("writer {claimed} claimed, this session is writer {writer}")));
        }
        // A same-host writer would write a grant of the new ring into its mapping of the old one.
        self.check_mapping(conn)?;
        let room = self.live_room(at).map(|_| at.id)?;
        self.check_prefill(room, &info.src)?;
        self.grant_checked(conn, &info, at, chunk, tokens, bytes, pool_tokens, direct)
    }

    /// A writer of the room's prefill geometry that cannot write its share of `chunk` (its tokens,
    /// its request parts or its size disagree with the room) leaves the chunk unfinishable: the
    /// room fails now, naming the writer and why, rather than at its deadline behind a grant
    /// nobody completes. `e` is returned to the writer.
    fn refuse_writer(&mut self, room: u64, chunk: u32, info: &ConnInfo, e: Error) -> Error {
        let who = format!(
            "writer {} (session {}, prefill tp rank {} pp rank {})",
            info.pairing.frame_writer(),
            info.session,
            info.src.tp_rank,
            info.src.pp_rank
        );
        self.fail_room(room, e.code(), format!("{who} was refused for chunk {chunk}: {}", e.chain()), &info.session);
        e
    }

    /// [`State::grant`] past the checks of the writer, the room's key and its prefill geometry.
    #[allow(clippy::too_many_arguments)]
    fn grant_checked(&mut self, conn: ConnId, info: &ConnInfo, at: RoomRef, chunk: u32, tokens: u32, bytes: u64, pool_tokens: Option<&[u32]>, direct: bool) -> Result<Granted> {
        let (room, writer) = (at.id, info.pairing.frame_writer());
        let r = self.live_room(at)?;
        let num_chunks = r.chunks.len();
        let c = r.chunks.get(chunk as usize).ok_or_else(|| {
            protocol(format!("chunk {chunk} is past room {room}'s {num_chunks} chunks (0 .. {})", num_chunks.saturating_sub(1)))
        })?;
        match c.mode {
            Mode::Slices => {
                return Err(Error::new(
                    Status::KVSTAGE_E_UNSUPPORTED,
                    format!("chunk {chunk} of room {room} is being sent by the slice path; one chunk cannot mix paths"),
                ))
            }
            _ if c.phase != Phase::Waiting => {
                return Err(protocol(format!("chunk {chunk} of room {room} is already complete")));
            }
            _ => {}
        }
        if c.slot_of(conn).is_some() {
            return Err(protocol(format!("writer {writer} requested chunk {chunk} twice")));
        }
        if let Some(first) = c.layout.as_ref().map(|l| l.tokens).filter(|&t| t != tokens) {
            let e = Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("chunk {chunk} of room {room}: this writer has {tokens} tokens, the chunk's first writer {first}"),
            );
            return Err(self.refuse_writer(room, chunk, info, e));
        }
        // A chunk fills its decode pages; the room's last may end inside its last page (the
        // request ends there), never before it.
        let ps = info.dst.page_size;
        let slots = r.chunk_pages(chunk).len() as u32 * ps;
        let last = chunk as usize + 1 == num_chunks;
        let fits = tokens == slots || (last && tokens < slots && tokens > slots - ps);
        if !fits {
            let accepted = if last && ps > 1 { format!("{}..={slots}", slots - ps + 1) } else { slots.to_string() };
            let grid = format!("{} chunks of {} tokens over {} pages of {ps}", num_chunks, r.grid_pages as u32 * ps, r.pages.len());
            let e = Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("chunk {chunk} of room {room}: sender has {tokens} tokens, receiver expects {accepted} (its grid: {grid})"),
            );
            return Err(self.refuse_writer(room, chunk, info, e));
        }
        let first_writer = c.layout.is_none();
        let mut layout = Self::chunk_layout(c, info, tokens)?;
        // A session whose handshake predates the components' registration may reconnect and
        // deliver: only a refusal of what the writer sends fails the room.
        if pool_tokens.is_some() && last && r.parts.as_ref().is_some_and(|p| *info.dst_components != p.components.specs()) {
            return Err(Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("room {room}: this session's handshake predates the registration of the engine's components; reconnect it"),
            ));
        }
        let parts = self.check_parts(room, chunk, info, pool_tokens).map_err(|e| self.refuse_writer(room, chunk, info, e))?;
        // A replica of heads another rank sends writes only its share of the request's parts.
        if info.pairing.writer.is_none() && parts.is_none() {
            info.pairing.writer()?;
        }
        let mut tail = Vec::new();
        if let Some(p) = parts.as_deref() {
            let (owed, carried) = Self::writer_tail(&layout, info, p).map_err(|e| self.refuse_writer(room, chunk, info, e))?;
            if first_writer {
                layout = layout.with_tail_total(owed);
            }
            tail = carried;
        }
        if bytes != layout.total_bytes {
            let of_parts = if layout.tail_total > 0 { format!(" ({} of them request parts)", layout.tail_total) } else { String::new() };
            let e = Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("allocation size {bytes} != expected {}{of_parts} for chunk {chunk}", layout.total_bytes),
            );
            return Err(self.refuse_writer(room, chunk, info, e));
        }
        if info.pairing.writer.is_none() && tail.is_empty() {
            return Err(protocol(format!("chunk {chunk} of room {room}: this replica carries no share of the request's parts")));
        }
        let region = self.claim(room, &mut layout, info, tail)?;
        // With every KV writer placed, a short tail is final, unless ranks replicating their heads
        // are still to bring their state shares.
        let replicas_owe = layout.tail_total > 0 && geometry::parts::carriers(&layout)?.iter().any(|c| c.head_group.is_none());
        if let Some((carried, owed)) = layout.tail_short().filter(|_| !replicas_owe) {
            let e = Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!(
                    "chunk {chunk} of room {room}: its writers carry {carried} of the {owed} bytes of request parts the room's components owe (a component layer is held by no prefill stage that sends this decode rank KV)"
                ),
            );
            self.fail_room(room, e.code(), e.message().to_owned(), &info.session);
            return Err(e);
        }
        let region_offset = layout.writers[region as usize].offset;
        let existing = self.rooms[&room].chunks[chunk as usize].grant;
        let id = match existing {
            Some(id) => id,
            None => {
                let ring = self.ring.as_mut().ok_or_else(|| Error::new(Status::KVSTAGE_E_STAGING_TOO_SMALL, "no staging ring registered"))?;
                let g = ring.assign(bytes).map_err(|e| Error::new(Status::KVSTAGE_E_OVERSIZED, e.to_string()))?;
                self.metrics.ring_high_water = self.metrics.ring_high_water.max(ring.occupied());
                self.grants.insert(g.id, GrantState { grant: g, room: at, chunk, pins: Vec::new(), remote_writers: Vec::new(), freeing: false });
                g.id
            }
        };
        self.record_prefill(room, &info.src);
        if info.in_place {
            self.grants.get_mut(&id).expect("live grant").remote_writers.push(conn);
        }
        let grant = self.grants[&id].grant;
        // A writer whose mapping ended (its lease closed) cannot write directly any more; a chunk
        // of more pages than a grant may name goes through the ring.
        let r = self.rooms.get_mut(&room).expect("checked");
        let direct = direct
            && info.direct
            && self.mapped.contains_key(&conn)
            && layout.writers[region as usize].tail.is_empty()
            && layout.writers[region as usize].layers > 0
            && r.chunk_pages(chunk).len() <= crate::protocol::MAX_GRANT_PAGES as usize;
        // Over a stream into a host pool, a region that carries only KV and has no checksum to
        // verify before its bytes may reach the pages is read straight into them (no ring copy,
        // no scatter) when its rows there come in long enough runs: a read into many short
        // pieces costs the kernel more than the scatter it saves.
        let read = !direct
            && !info.in_place
            && layout.tail_total == 0
            && layout.writers[region as usize].layers > 0
            && !info.integrity.covers(room, chunk);
        let read_plan = info
            .pool_read_min_run
            .filter(|_| read)
            .and_then(|min| {
                let plan = geometry::plan_scatter(&(&info.dst, info.dst_strides), r.chunk_pages(chunk), &layout, &layout.writers[region as usize]).ok()?;
                (plan.min_pool_run() >= min).then(|| Arc::new(plan))
            });
        let lands = match read_plan {
            _ if direct => Lands::Mapped,
            Some(plan) => Lands::Read(plan),
            None => Lands::Ring,
        };
        let pages = if direct {
            r.direct_writers.push((conn, chunk));
            r.chunk_pages(chunk).to_vec()
        } else {
            Vec::new()
        };
        let c = &mut r.chunks[chunk as usize];
        c.grant = Some(id);
        c.layers_taken.resize(layout.dst.layer_count() as usize, false);
        c.layout = Some(layout);
        c.mode = Mode::Staged;
        c.slots.push(Slot { conn, region, written: Extents::default(), coverage: None, arrived: false, lands });
        // The claim that completes the layout releases the layers other writers already landed.
        self.scatter_landed(room, chunk);
        Ok(Granted { grant, region: region_offset, pages })
    }

    /// Checks a staged write of `len` bytes at `offset` (allocation-relative) by `conn`. An `Err`
    /// ends the session (the frame lies about what this connection owns); a closed room's write
    /// is discarded.
    pub fn begin_data(&mut self, conn: ConnId, at: RoomRef, chunk: u32, claimed: u32, offset: u64, len: u64) -> Result<Target<WriteLease>> {
        let room = at.id;
        let (grant, slot, offset) = match self.check_write(conn, at, chunk, claimed, offset, len)? {
            Target::Land(v) => v,
            Target::Discard(e) => return Ok(Target::Discard(e)),
        };
        let r = self.rooms.get_mut(&room).expect("checked live");
        let c = &r.chunks[chunk as usize];
        let s = &c.slots[slot as usize];
        let into_pool = match &s.lands {
            // The mirror of `written_in_place`'s check: bytes on the stream would land in the
            // ring, which is never scattered for a region the writer was to copy into the pages.
            Lands::Mapped => {
                return Err(protocol(format!("a stream payload for chunk {chunk} of room {room}, whose region was granted to be written into the pool directly")));
            }
            Lands::Read(plan) => {
                let layout = c.layout.as_ref().expect("a granted chunk has a layout");
                Some((plan.clone(), offset - layout.writers[s.region as usize].offset))
            }
            _ => None,
        };
        if into_pool.is_some() {
            // The read writes the room's pages: they stay the room's until `end_data`.
            r.page_leases.push(Some(conn));
        }
        let gen = r.gen;
        let g = self.grants.get_mut(&grant).expect("a chunk's grant is live");
        g.pins.push(Some(conn));
        Ok(Target::Land(WriteLease {
            conn,
            grant,
            room,
            gen,
            chunk,
            slot,
            offset,
            ring_offset: g.grant.offset + offset,
            len,
            into_pool,
        }))
    }

    /// Validates a write and returns (grant id, slot, allocation-relative offset).
    fn check_write(&self, conn: ConnId, at: RoomRef, chunk: u32, claimed: u32, offset: u64, len: u64) -> Result<Target<(u64, u32, u64)>> {
        let writer = self.conn(conn)?.pairing.frame_writer();
        if claimed != writer {
            return Err(protocol(format!("data for writer {claimed} from writer {writer}")));
        }
        let room = at.id;
        let r = match self.live_room(at) {
            Ok(r) => r,
            Err(e) => return Ok(Target::Discard(e)),
        };
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("data for chunk {chunk} past room {room}")))?;
        let (Some(grant), Some(layout), Some((index, slot))) = (c.grant, c.layout.as_ref(), c.slot_of(conn)) else {
            return Err(protocol(format!("data for chunk {chunk} of room {room} without this connection's allocation")));
        };
        let region = &layout.writers[slot.region as usize];
        let (start, end) = (region.offset, region.offset + region.bytes);
        if slot.arrived || offset < start || offset.checked_add(len).is_none_or(|e| e > end) {
            return Err(protocol(format!(
                "write [{offset}, {}) outside this writer's region [{start}, {end}) of chunk {chunk}{}",
                offset.saturating_add(len),
                if slot.arrived { ", which already arrived" } else { "" }
            )));
        }
        if let Some((a, b)) = slot.written.overlap(offset, offset + len) {
            return Err(protocol(format!("write [{offset}, {}) of chunk {chunk} overlaps bytes already written [{a}, {b})", offset + len)));
        }
        // Overlap is checked against landed bytes only: a write still landing would escape it.
        if self.grants[&grant].pins.contains(&Some(conn)) {
            return Err(protocol(format!("write [{offset}, {}) of chunk {chunk} while this connection's previous write is still landing", offset + len)));
        }
        if slot.written.too_fragmented(offset, offset + len) {
            return Err(protocol(format!("chunk {chunk}: more than {MAX_RANGES} separate writes in one region")));
        }
        let g = &self.grants[&grant].grant;
        let wm = self.watermark();
        if !wm.permits(g.round, g.offset + region.offset + region.bytes) {
            return Err(protocol(format!("write to round {} before the watermark {wm:?} allowed it", g.round)));
        }
        Ok(Target::Land((grant, index, offset)))
    }

    /// The payload read of `lease` ended; `landed` when every byte arrived. Bytes for a room
    /// released or failed meanwhile do not count (the grant was returned once unpinned).
    pub fn end_data(&mut self, lease: WriteLease, landed: bool) {
        if lease.into_pool.is_some() {
            self.end_page_lease(lease.room, lease.gen, lease.conn);
        }
        if landed {
            if let Some(slot) = self.slot_mut(lease.room, lease.gen, lease.chunk, lease.slot, lease.conn) {
                slot.written.insert(lease.offset, lease.offset + lease.len);
                self.scatter_landed(lease.room, lease.chunk);
            }
        }
        self.unpin(lease.grant, Some(lease.conn));
    }

    /// An in-place write report (RDMA WRITE, same-host mapping): the bytes are already in the
    /// ring; count them if they were the connection's to write. `Err` ends the session.
    pub fn written_in_place(&mut self, conn: ConnId, at: RoomRef, chunk: u32, claimed: u32, offset: u64, len: u64) -> Result<()> {
        if !self.conn(conn)?.in_place {
            return Err(protocol("an in-place write report on a session that does not write in place"));
        }
        let room = at.id;
        if let Target::Land((_, index, _)) = self.check_write(conn, at, chunk, claimed, offset, len)? {
            let r = &self.rooms[&room];
            // A region granted to be read from the stream into the pool is not scattered from the
            // ring: bytes reported there would never reach the pages.
            if matches!(r.chunks[chunk as usize].slots[index as usize].lands, Lands::Read(_)) {
                return Err(protocol(format!("an in-place write report for chunk {chunk} of room {room}, whose region was granted to arrive on the stream")));
            }
            let gen = r.gen;
            if let Some(slot) = self.slot_mut(room, gen, chunk, index, conn) {
                slot.written.insert(offset, offset + len);
                self.scatter_landed(room, chunk);
            }
        }
        Ok(())
    }

    /// Whether the room a payload lands for is still live (not released, not failed): a read
    /// into its pages goes on only while it is.
    pub fn lands_live(&self, lease: &WriteLease) -> bool {
        self.rooms.get(&lease.room).is_some_and(|r| r.gen == lease.gen && r.live())
    }

    /// Ends one page lease `conn` took on the room (opening `gen`), which may let a release end.
    fn end_page_lease(&mut self, room: u64, gen: u64, conn: ConnId) {
        if let Some(r) = self.rooms.get_mut(&room).filter(|r| r.gen == gen) {
            if let Some(at) = r.page_leases.iter().position(|&l| l == Some(conn)) {
                r.page_leases.swap_remove(at);
            }
            self.drain_check(room);
        }
    }

    fn slot_mut(&mut self, room: u64, gen: u64, chunk: u32, slot: u32, conn: ConnId) -> Option<&mut Slot> {
        let r = self.rooms.get_mut(&room).filter(|r| r.gen == gen && r.live())?;
        r.chunks.get_mut(chunk as usize)?.slots.get_mut(slot as usize).filter(|s| s.conn == conn)
    }

    /// A writer says its region is complete. On success the region is pinned for the checksum
    /// check done outside the lock; [`State::finish_ready`] then counts the arrival. Errors are
    /// replied; a writer that owns the slot and lies about its bytes fails the room.
    pub fn begin_ready(&mut self, conn: ConnId, at: RoomRef, chunk: u32, claimed: u32) -> Result<ReadyLease> {
        let info = self.conn(conn)?;
        let (writer, session) = (info.pairing.frame_writer(), info.session.clone());
        // An in-place writer that reports ready has finished writing (over RDMA its immediate
        // arrived first; a same-host writer sends the report after its gather or direct copy
        // returned).
        self.release_remote_writer(conn, at, Some(chunk));
        if claimed != writer {
            return Err(protocol(format!("ready for writer {claimed} from writer {writer}")));
        }
        let room = at.id;
        let r = self.live_room(at)?;
        let gen = r.gen;
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("ready for chunk {chunk} past room {room}")))?;
        let (Some(grant), Some(layout), Some((index, slot))) = (c.grant, c.layout.as_ref(), c.slot_of(conn)) else {
            return Err(protocol(format!("ready for chunk {chunk} of room {room} without this connection's allocation")));
        };
        let region = &layout.writers[slot.region as usize];
        if !slot.written.covers_exactly(region.offset, region.offset + region.bytes) || slot.arrived {
            let why = format!("ready for chunk {chunk} after {} of {} bytes", slot.written.total(), region.bytes);
            self.fail_room(room, Status::KVSTAGE_E_PROTOCOL, why.clone(), &session);
            return Err(protocol(why));
        }
        let (ring_offset, len) = (self.grants[&grant].grant.offset + region.offset, region.bytes);
        let in_pool = slot.lands.in_pool().then(|| DirectRegion { pages: r.chunk_pages(chunk).to_vec(), layout: layout.clone(), region: slot.region });
        let mapped = slot.lands == Lands::Mapped;
        self.grants.get_mut(&grant).expect("live").pins.push(Some(conn));
        if in_pool.is_some() {
            // Its checksum reads the room's pages: they stay the room's until `finish_ready`.
            self.rooms.get_mut(&room).expect("live").page_leases.push(Some(conn));
        }
        Ok(ReadyLease { conn, grant, room, gen, chunk, slot: index, ring_offset, len, in_pool, mapped })
    }

    /// Counts the arrival checked by `verified` (the checksum result); when it was the chunk's
    /// last writer the scatter of its remaining layers is queued (in the effects).
    pub fn finish_ready(&mut self, lease: ReadyLease, verified: Result<()>, session: &str) -> Result<()> {
        self.unpin(lease.grant, Some(lease.conn));
        if lease.in_pool.is_some() {
            self.end_page_lease(lease.room, lease.gen, lease.conn);
        }
        match self.rooms.get(&lease.room) {
            Some(r) if r.gen == lease.gen && r.live() => {}
            Some(r) if r.gen == lease.gen => return Err(self.closed(lease.room)),
            _ => return Err(stale(lease.room)),
        }
        if let Err(e) = verified {
            self.fail_room(lease.room, e.code(), e.message().to_owned(), session);
            return Err(e);
        }
        let r = self.rooms.get_mut(&lease.room).expect("live");
        let c = &mut r.chunks[lease.chunk as usize];
        if let Some(s) = c.slots.get_mut(lease.slot as usize).filter(|s| s.conn == lease.conn) {
            s.arrived = true;
            self.metrics.bytes_received += lease.len;
            self.metrics.regions_read_into_pool += u64::from(matches!(s.lands, Lands::Read(_)));
        }
        if c.all_arrived() {
            self.scatter_rest(lease.room, lease.chunk);
        } else {
            // An RDMA writer's bytes count from its arrival on.
            self.scatter_landed(lease.room, lease.chunk);
        }
        Ok(())
    }

    /// A sender gives up on a chunk (`chunk == u32::MAX`: the whole room). Only a connection that
    /// holds a writer slot of it can fail the room; it also ends that writer's in-place quarantine.
    pub fn abort(&mut self, conn: ConnId, at: RoomRef, chunk: u32, reason: &str) {
        let Some(info) = self.conns.get(&conn) else { return };
        let session = info.session.clone();
        let which = (chunk != u32::MAX).then_some(chunk);
        self.release_remote_writer(conn, at, which);
        let room = at.id;
        let Some(r) = self.rooms.get(&room).filter(|r| r.key == at.key) else { return };
        let holds = r
            .chunks
            .iter()
            .enumerate()
            .any(|(i, c)| which.is_none_or(|w| w as usize == i) && c.slot_of(conn).is_some());
        if holds {
            let what = which.map_or_else(|| "the room".to_owned(), |c| format!("chunk {c}"));
            self.fail_room(room, Status::KVSTAGE_E_CANCELED, format!("sender aborted {what} (session {session}): {reason}"), &session);
        }
    }

    /// `conn` will not write (room, chunk) — every chunk of the room for `None` — in place any
    /// more: its quarantine of those grants ends, and its hold on the room's pages.
    fn release_remote_writer(&mut self, conn: ConnId, room: RoomRef, chunk: Option<u32>) {
        self.end_quarantine(conn, |g| g.room == room && chunk.is_none_or(|c| g.chunk == c));
        if let Some(r) = self.rooms.get_mut(&room.id).filter(|r| r.key == room.key) {
            r.direct_writers.retain(|&(w, c)| w != conn || chunk.is_some_and(|k| k != c));
            self.drain_check(room.id);
        }
    }
}
