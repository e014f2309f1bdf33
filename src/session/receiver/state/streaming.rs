//! The staged path's scatters, layer by layer: a layer whose slabs from every writer landed goes
//! to the pool at once, while later layers are still on the wire (layer-wise senders), and the
//! chunk is done once every writer arrived and every scatter of it ended. A chunk that carries a
//! checksum is scattered only after the checksum was verified (one scatter of every layer).

use super::*;

impl Chunk {
    /// The layers not yet handed to a scatter whose slabs from every writer landed (`all`: every
    /// layer not yet handed, landed or not); marks them handed. `counts` says whether a slot's
    /// landed bytes count before it arrived.
    fn take_layers(&mut self, all: bool, counts: impl Fn(&Slot) -> bool) -> Vec<u32> {
        let Some(layout) = self.layout.as_ref().filter(|l| all || l.complete()) else { return Vec::new() };
        let mut taken = Vec::new();
        for (j, id) in layout.dst.layer_ids.iter().enumerate() {
            if self.layers_taken[j] {
                continue;
            }
            // Every placed region has its slot (placing and claiming happen together).
            let landed = all
                || self.slots.iter().all(|s| {
                    if !s.arrived && !counts(s) {
                        return false;
                    }
                    let w = &layout.writers[s.region as usize];
                    w.layer_ids.iter().position(|l| l == id).is_none_or(|idx| {
                        (0..layout.buffers_per_layer).all(|kv| {
                            let at = layout.slab_offset(s.region, kv, idx as u32);
                            s.written.contains(at, at + layout.slab_bytes(w.heads.num_heads, kv))
                        })
                    })
                });
            if landed {
                self.layers_taken[j] = true;
                taken.push(*id);
            }
        }
        taken
    }
}

impl State {
    /// Bytes of (`room`, `chunk`) landed: scatters the layers they completed, unless a checksum
    /// covers the chunk (its bytes reach the pool only once verified) or the room cannot take
    /// them any more.
    pub(super) fn scatter_landed(&mut self, room: u64, chunk: u32) {
        let Some(r) = self.rooms.get(&room).filter(|r| r.live()) else { return };
        let Some(c) = r.chunks.get(chunk as usize).filter(|c| c.phase == Phase::Waiting) else { return };
        // A writer whose connection is gone while the room lives has arrived (else the room
        // failed): its checksum, if any, was verified.
        let checksummed = c.slots.iter().any(|s| self.conns.get(&s.conn).is_some_and(|i| i.integrity.covers(room, chunk)));
        if checksummed {
            return;
        }
        // Bytes a connection read, or a same-host writer copied into its mapping before it
        // reported them, are in the ring; an RDMA writer's are bound to its ready's immediate
        // (waited for on arrival), and so are a same-host writer's once its mapping is gone (a
        // report after that cannot be true).
        let (conns, mapped) = (&self.conns, &self.mapped);
        let counts = |s: &Slot| conns.get(&s.conn).is_some_and(|i| !i.in_place || mapped.contains_key(&s.conn));
        let c = &mut self.rooms.get_mut(&room).expect("live").chunks[chunk as usize];
        let layers = c.take_layers(false, counts);
        if !layers.is_empty() {
            self.queue_scatter(room, chunk, layers, false);
        }
    }

    /// Every writer of (`room`, `chunk`) arrived: the chunk scatters its remaining layers (none
    /// when they all went already; the scatter still runs, and ends the chunk).
    pub(super) fn scatter_rest(&mut self, room: u64, chunk: u32) {
        let c = &mut self.rooms.get_mut(&room).expect("live").chunks[chunk as usize];
        c.phase = Phase::Scattering;
        let layers = c.take_layers(true, |_| true);
        self.queue_scatter(room, chunk, layers, true);
    }

    /// Queues a scatter of `layers`; it pins the grant and leases the room's pages until it ends.
    fn queue_scatter(&mut self, room: u64, chunk: u32, layers: Vec<u32>, last: bool) {
        let r = self.rooms.get_mut(&room).expect("live");
        let pages = r.chunk_pages(chunk).to_vec();
        let c = &mut r.chunks[chunk as usize];
        c.scatters += 1;
        let grant = c.grant.expect("a staged chunk has a grant");
        let job = ScatterJob {
            room,
            gen: r.gen,
            chunk,
            grant,
            ring_offset: self.grants[&grant].grant.offset,
            pages,
            layout: c.layout.clone().expect("a staged chunk has a layout"),
            layers,
            last,
            arrived: None,
            finished: None,
            parts: r.parts.clone().filter(|_| last && c.layout.as_ref().is_some_and(|l| l.tail_total > 0)),
            in_pool: c.slots.iter().filter(|s| s.lands.in_pool()).map(|s| s.region).collect(),
        };
        r.page_leases.push(None);
        self.grants.get_mut(&grant).expect("live").pins.push(None);
        self.fx.scatter.push(job);
    }

    /// A scatter of `job` ended: the chunk is done when its writers all arrived and it was the
    /// chunk's last scatter (or the room failed); the grant goes back once nothing uses it.
    /// A scatter that carried the room's parts hands back the aux rows it copied out.
    pub fn scatter_done(&mut self, job: &ScatterJob, result: Result<Option<AuxRows>>) {
        let mut retire = true;
        if let Some(r) = self.rooms.get_mut(&job.room).filter(|r| r.gen == job.gen) {
            if let Some(pos) = r.page_leases.iter().position(|l| l.is_none()) {
                r.page_leases.swap_remove(pos);
            }
            let ok = result.is_ok();
            match result {
                // While the chunk is not done, the room failure reports it as failed.
                Err(e) => self.fail_room(job.room, e.code(), e.chain(), e.session().unwrap_or("")),
                Ok(Some(rows)) => self.hold_aux(job.room, rows),
                Ok(None) => {}
            }
            let r = self.rooms.get_mut(&job.room).expect("present");
            let live = r.live();
            let c = &mut r.chunks[job.chunk as usize];
            c.scatters -= 1;
            c.arrived = c.arrived.or(job.arrived);
            let done = c.phase == Phase::Scattering && c.scatters == 0;
            // A live chunk still being written keeps its grant; a failed or released room's goes
            // back once unpinned (retired already unless the chunk was scattering: idempotent).
            retire = done || !live;
            if done {
                c.phase = Phase::Done;
                c.grant = None;
                let scatter_ns = match (c.arrived, job.finished) {
                    (Some(a), Some(f)) => (f.saturating_duration_since(a).as_nanos() as u64).max(1),
                    _ => 0,
                };
                if ok && live {
                    let m = &mut self.metrics;
                    m.chunks_received += 1;
                    if scatter_ns > 0 {
                        m.scatter_count += 1;
                        m.scatter_ns_sum += scatter_ns;
                        m.scatter_ns_max = m.scatter_ns_max.max(scatter_ns);
                    }
                    let (key, trace) = self.rooms.get(&job.room).map_or((0, "".into()), |r| (r.key, r.trace.as_str().into()));
                    self.chunk_done_event(ChunkEvent::chunk(job.room, key, job.chunk, Status::KVSTAGE_OK, trace, scatter_ns));
                }
            }
            self.drain_check(job.room);
        }
        self.unpin(job.grant, None);
        if retire {
            self.retire_grant(job.grant);
        }
        self.fx.changed = true;
    }
}
