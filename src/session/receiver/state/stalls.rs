//! What a chunk that holds ring space waits for, said in words: the decode side's half of
//! reporting a stuck request (its ring allocation holds back every later one of the ring).

use super::*;

impl State {
    /// Grants whose chunk still waits for writers (not freed, not scattering): the allocations
    /// a stall report may name, oldest ring position first.
    pub fn waiting_grants(&self) -> Vec<u64> {
        let mut ids: Vec<(u64, u64, u64)> = self
            .grants
            .iter()
            .filter(|(_, g)| !g.freeing)
            .filter(|(_, g)| {
                self.rooms.get(&g.room.id).filter(|r| r.key == g.room.key && r.live()).is_some_and(|r| {
                    r.chunks.get(g.chunk as usize).is_some_and(|c| c.phase == Phase::Waiting && c.grant == Some(g.grant.id))
                })
            })
            .map(|(id, g)| (g.grant.round, g.grant.offset, *id))
            .collect();
        ids.sort_unstable();
        ids.into_iter().map(|(_, _, id)| id).collect()
    }

    /// What grant `id`'s chunk waits for: its room and chunk, its ring range, each writer's
    /// progress (session, prefill rank, bytes landed, ready or not) and the head groups and layers
    /// no writer claimed yet. `None` once the grant's chunk no longer waits.
    pub fn grant_report(&self, id: u64) -> Option<String> {
        let g = self.grants.get(&id)?;
        let r = self.rooms.get(&g.room.id).filter(|r| r.key == g.room.key && r.live())?;
        let c = r.chunks.get(g.chunk as usize).filter(|c| c.phase == Phase::Waiting)?;
        let mut writers: Vec<String> = Vec::new();
        if let Some(layout) = &c.layout {
            for s in &c.slots {
                let w = &layout.writers[s.region as usize];
                let session = self.conns.get(&s.conn).map_or("(disconnected)", |i| i.session.as_str());
                let state = if s.arrived { "ready".to_owned() } else { format!("{} of {} bytes landed, not ready", s.written.total(), w.bytes) };
                writers.push(format!("session {session} (prefill tp {} pp {}): {state}", w.src_tp_rank, w.src_pp_rank));
            }
            if !layout.complete() {
                writers.push(format!(
                    "{} of {} (head group, layer) slabs claimed by no writer yet (a prefill rank that never asked)",
                    layout.unclaimed_slabs(),
                    layout.owed_slabs()
                ));
            }
        }
        let holds = match self.grant_description(id).and_then(|d| d.waits_behind) {
            Some(o) => format!("waits behind room {} chunk {} (the ring's oldest allocation) for the watermark", o.room, o.chunk),
            None => "holds it until the chunk completes (later allocations of the ring wait behind it)".to_owned(),
        };
        Some(format!(
            "[{}] room {} chunk {}: its allocation of ring round {} [{}, {}) {holds}; writers: {}",
            r.trace,
            g.room.id,
            g.chunk,
            g.grant.round,
            g.grant.offset,
            g.grant.end(),
            if writers.is_empty() { "none yet".to_owned() } else { writers.join("; ") }
        ))
    }
}
