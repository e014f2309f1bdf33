//! The slice path's transitions: one leased write per (buffer, token) row, coverage, completion.

use super::*;

/// Why slices for this chunk cannot be taken (the stream stays in sync: they are discarded).
fn slices_refused(info: &ConnInfo, r: &Room, room: u64, chunk: u32) -> Option<Error> {
    let c = &r.chunks[chunk as usize];
    if r.parts.is_some() && chunk as usize + 1 == r.chunks.len() {
        return Some(Error::new(
            Status::KVSTAGE_E_UNSUPPORTED,
            format!("chunk {chunk} of room {room} carries the request's parts (aux, state, pools), which travel by the staged path only"),
        ));
    }
    if !info.host_pool {
        return Some(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the slice path writes the KV pool from the CPU: host pools only"));
    }
    (c.mode == Mode::Staged).then(|| {
        Error::new(
            Status::KVSTAGE_E_UNSUPPORTED,
            format!("chunk {chunk} of room {room} is being sent staged; one chunk cannot mix paths"),
        )
    })
}

impl State {

    /// Checks one slice write (a token row of this writer's heads in one buffer). `Err` ends the
    /// session; a slice for a closed room, or for a chunk sent staged, is discarded.
    #[allow(clippy::too_many_arguments)]
    pub fn begin_slice(
        &mut self,
        conn: ConnId,
        at: RoomRef,
        chunk: u32,
        buffer: u32,
        token: u32,
        byte_offset: u32,
        len: u32,
    ) -> Result<Target<SliceLease>> {
        let info = self.claimant(conn)?.clone();
        let room = at.id;
        let r = match self.live_room(at) {
            Ok(r) => r,
            Err(e) => return Ok(Target::Discard(e)),
        };
        let gen = r.gen;
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("slice for chunk {chunk} past room {room}")))?;
        if let Some(why) = slices_refused(&info, r, room, chunk) {
            return Ok(Target::Discard(why));
        }
        if c.phase != Phase::Waiting {
            return Err(protocol(format!("slice for chunk {chunk} of room {room}, which is complete")));
        }
        let pages = r.chunk_pages(chunk);
        let dst = &info.dst;
        let ps = dst.page_size;
        let tokens = pages.len() as u32 * ps;
        let page = *pages.get((token / ps) as usize).ok_or_else(|| protocol(format!("slice token {token} past chunk {chunk}")))?;
        // The buffer's kind (checked against what the writer carries below): V's heads may be
        // another size than K's.
        let head_bytes = dst.head_bytes_of((buffer / dst.layer_count()).min(1));
        let heads = info.pairing.heads;
        let (row, head_off) = (heads.num_heads as u64 * head_bytes, heads.dst_head_start as u64 * head_bytes);
        if byte_offset as u64 != head_off || len as u64 != row {
            return Err(protocol(format!("slice [{byte_offset}, +{len}) is not this writer's head range [{head_off}, +{row})")));
        }
        info.pairing.writer()?;
        if let Some((_, s)) = c.slot_of(conn) {
            let cov = s.coverage.as_ref().expect("slice slots track coverage");
            if !cov.carries(buffer) {
                return Err(protocol(format!("slice buffer {buffer} is not one this writer carries")));
            }
            if cov.has(buffer, token) || s.arrived {
                return Err(protocol(format!("slice of buffer {buffer} token {token} written twice")));
            }
        }
        self.check_prefill(room, &info.src)?;
        if !Coverage::new(&info.src, dst, tokens).carries(buffer) {
            return Err(protocol(format!("slice buffer {buffer} is not one this writer carries")));
        }
        let placed = match c.slot_of(conn) {
            Some(_) => None,
            None => {
                // The connection's first slice of the chunk claims its layers for its head group.
                let mut layout = Self::chunk_layout(c, &info, tokens)?;
                let region = self.claim(room, &mut layout, &info, Vec::new())?;
                Some((layout, region))
            }
        };
        self.record_prefill(room, &info.src);
        let r = self.rooms.get_mut(&room).expect("checked");
        let c = &mut r.chunks[chunk as usize];
        c.mode = Mode::Slices;
        if let Some((layout, region)) = placed {
            c.layout = Some(layout);
            c.slots.push(Slot { conn, region, written: Extents::default(), coverage: Some(Coverage::new(&info.src, dst, tokens)), lands: Lands::Ring, arrived: false });
        }
        let (slot, _) = c.slot_of(conn).expect("claimed above");
        r.page_leases.push(Some(conn));
        let slot_index = page as u64 * ps as u64 + (token % ps) as u64;
        Ok(Target::Land(SliceLease { conn, room, gen, chunk, slot, token, buffer, pool_slot: slot_index, byte_offset: head_off, len: row }))
    }

    /// The slice payload read ended; `landed` when every byte arrived.
    pub fn end_slice(&mut self, lease: SliceLease, landed: bool) {
        self.finish_slice(lease, landed);
    }

    fn finish_slice(&mut self, lease: SliceLease, landed: bool) {
        let Some(r) = self.rooms.get_mut(&lease.room).filter(|r| r.gen == lease.gen) else { return };
        if let Some(pos) = r.page_leases.iter().position(|l| *l == Some(lease.conn)) {
            r.page_leases.swap_remove(pos);
        }
        if landed && r.live() {
            if let Some(cov) = r
                .chunks
                .get_mut(lease.chunk as usize)
                .and_then(|c| c.slots.get_mut(lease.slot as usize))
                .filter(|s| s.conn == lease.conn)
                .and_then(|s| s.coverage.as_mut())
            {
                cov.mark(lease.buffer, lease.token);
                self.metrics.bytes_received += lease.len;
            }
        }
        self.drain_check(lease.room);
        self.fx.changed = true;
    }

    /// A slice writer says its rows are complete: accepted only when every row it owes arrived.
    /// Errors are replied; a writer that owns the slot and is short fails the room.
    pub fn slice_done(&mut self, conn: ConnId, at: RoomRef, chunk: u32) -> Result<()> {
        let info = self.conn(conn)?;
        let session = info.session.clone();
        info.pairing.writer()?;
        let room = at.id;
        let r = self.live_room(at)?;
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("slices done for chunk {chunk} past room {room}")))?;
        if let Some(why) = slices_refused(info, r, room, chunk) {
            return Err(why);
        }
        let Some((index, slot)) = c.slot_of(conn) else {
            return Err(protocol(format!("slices done for chunk {chunk} of room {room} by a connection that sent none")));
        };
        if slot.arrived {
            return Err(protocol(format!("slices of chunk {chunk} completed twice")));
        }
        let (covered, expected) = slot.coverage.as_ref().expect("slice slot").progress();
        if covered != expected {
            let why = format!("slices done for chunk {chunk} after {covered} of {expected} rows");
            self.fail_room(room, Status::KVSTAGE_E_PROTOCOL, why.clone(), &session);
            return Err(protocol(why));
        }
        let r = self.rooms.get_mut(&room).expect("live");
        let c = &mut r.chunks[chunk as usize];
        c.slots[index as usize].arrived = true;
        if c.all_arrived() {
            c.phase = Phase::Done;
            self.metrics.chunks_received += 1;
            let trace = r.trace.as_str().into();
            self.chunk_done_event(ChunkEvent::chunk(room, at.key, chunk, Status::KVSTAGE_OK, trace, 0));
            self.fx.changed = true;
        }
        Ok(())
    }
}
