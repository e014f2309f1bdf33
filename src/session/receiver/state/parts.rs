//! Request parts on the decode side: what a room names besides its KV pages, which parts each
//! writer of the room's last chunk carries, and the aux rows written after everything else of the
//! room is in place (engines poll an aux row as the end of the transfer).

use super::*;
use crate::copy::Components;
use crate::geometry::parts::{replica_tail, writer_tail};
use crate::geometry::{RequestParts, TailPart, TailSides};

/// What a room names of its request besides the KV pages, and the components they lie in.
#[derive(Debug)]
pub struct RoomParts {
    pub request: RequestParts,
    pub components: Arc<Components>,
}

impl RoomParts {
    fn has_aux(&self) -> bool {
        self.components.list.iter().any(|c| matches!(c.spec.kind, geometry::ComponentKind::Aux { .. }))
    }
}

/// Aux rows copied out of the last chunk's tails, written into the aux buffers once the rest of
/// the room is in place: the bytes and the parts, their offsets into `bytes`.
#[derive(Clone, Debug, Default)]
pub struct AuxRows {
    pub bytes: Vec<u8>,
    pub parts: Vec<TailPart>,
}

/// Where a room is with its aux rows.
#[derive(Clone, Debug, Default)]
pub(super) enum Aux {
    /// The room names no aux rows.
    #[default]
    None,
    /// Not yet out of the last chunk.
    Owed,
    /// Out of the ring, waiting for the room's other chunks.
    Held(AuxRows),
    /// Being written (a lease on the room holds its release).
    Writing,
    Written,
}

/// Write a room's aux rows (after the lock is dropped), then report with [`State::aux_done`].
#[derive(Debug)]
pub struct AuxWrite {
    pub room: u64,
    pub gen: u64,
    pub parts: Arc<RoomParts>,
    pub rows: AuxRows,
}

impl Aux {
    pub(super) fn for_room(parts: Option<&RoomParts>) -> Aux {
        match parts {
            Some(p) if p.has_aux() => Aux::Owed,
            _ => Aux::None,
        }
    }

    /// For the room's describe document.
    pub(super) fn describe(&self) -> Option<&'static str> {
        match self {
            Aux::None => None,
            Aux::Owed => Some("owed"),
            Aux::Held(_) => Some("held"),
            Aux::Writing => Some("writing"),
            Aux::Written => Some("written"),
        }
    }

    pub(super) fn settled(&self) -> bool {
        matches!(self, Aux::None | Aux::Written)
    }
}

fn mismatch_of(room: u64, why: String) -> Error {
    Error::new(Status::KVSTAGE_E_GEOMETRY_MISMATCH, format!("room {room}: {why}"))
}

impl State {
    /// Checks what a writer of (`room`, `chunk`) says of the request's parts against what the
    /// room names: parts only with the last chunk, from every writer of it when the room names
    /// some, each pool span the same length on both sides. The room's parts when they apply.
    pub(super) fn check_parts(&self, room: u64, chunk: u32, info: &ConnInfo, pool_tokens: Option<&[u32]>) -> Result<Option<Arc<RoomParts>>> {
        let r = &self.rooms[&room];
        let last = chunk as usize + 1 == r.chunks.len();
        let named = r.parts.clone().filter(|_| last);
        match (named, pool_tokens) {
            (None, None) => Ok(None),
            (None, Some(_)) if r.parts.is_some() => Err(mismatch_of(
                room,
                format!("request parts travel with the room's last chunk ({}), not with chunk {chunk}", r.chunks.len() - 1),
            )),
            (None, Some(_)) => Err(mismatch_of(room, "the sender sends request parts (aux rows, state, pool pages) the room does not name (name them in kvstage_room_desc.parts when opening it)".into())),
            (Some(_), None) => Err(mismatch_of(
                room,
                format!("the room names request parts (aux row, state slots, pool pages) this writer does not send with the last chunk ({chunk}): pass them in its transfer"),
            )),
            (Some(p), Some(theirs)) => {
                if *info.dst_components != p.components.specs() {
                    return Err(mismatch_of(room, "this session's handshake predates the registration of the engine's components; reconnect it".into()));
                }
                let ours = p.request.pool_tokens();
                if theirs.len() != ours.len() {
                    return Err(mismatch_of(room, format!("the sender names {} pool spans, the room {}", theirs.len(), ours.len())));
                }
                let pools = p.components.list.iter().filter(|c| matches!(c.spec.kind, geometry::ComponentKind::Pool { .. }));
                for ((c, a), b) in pools.zip(&ours).zip(theirs) {
                    if a != b {
                        return Err(mismatch_of(room, format!("pool {:?}: the sender sends {b} tokens, the room's span holds {a}", c.spec.name)));
                    }
                }
                Ok(Some(p))
            }
        }
    }

    /// The tail sides of `info`'s pair for `parts`.
    fn sides<'a>(info: &'a ConnInfo, tokens: &'a [u32]) -> TailSides<'a> {
        TailSides {
            src: &info.src_components,
            dst: &info.dst_components,
            src_tp: info.src.tp_size,
            dst_tp: info.dst.tp_size,
            dst_rank: info.dst.tp_rank,
            pool_tokens: tokens,
        }
    }

    /// What `info`'s region carries of `parts`, and what the whole allocation owes (see
    /// [`writer_tail`]): `(owed, tail)`.
    pub(super) fn writer_tail(layout: &StagingLayout, info: &ConnInfo, parts: &RoomParts) -> Result<(u64, Vec<TailPart>)> {
        let tokens = parts.request.pool_tokens();
        let sides = Self::sides(info, &tokens);
        match layout.region_of(&info.src)? {
            Some(region) => writer_tail(&sides, layout, &region),
            None => replica_tail(&sides, layout, info.src.tp_rank),
        }
    }

    /// The last chunk of `room` scattered and left its aux rows: held until every chunk is done.
    pub(super) fn hold_aux(&mut self, room: u64, rows: AuxRows) {
        if let Some(r) = self.rooms.get_mut(&room) {
            if matches!(r.aux, Aux::Owed) {
                r.aux = Aux::Held(rows);
            }
        }
    }

    /// A chunk of `room` is done: its event goes out, unless it completed the room's KV and the
    /// room's aux rows are still to be written (they go out now): then it is held until they are.
    pub(super) fn chunk_done_event(&mut self, event: ChunkEvent) {
        if self.release_aux(event.room) {
            if let Some(r) = self.rooms.get_mut(&event.room) {
                r.held_event = Some(event);
                return;
            }
        }
        self.push_event(event);
    }

    /// Every chunk of a live `room` is done and its aux rows are not written: they go out (a
    /// lease holds the room's release until they are written). `true` when the room now waits
    /// for them.
    fn release_aux(&mut self, room: u64) -> bool {
        let Some(r) = self.rooms.get_mut(&room) else { return false };
        if r.aux.settled() || !r.live() || !r.chunks.iter().all(|c| c.phase == Phase::Done) {
            return false;
        }
        match std::mem::replace(&mut r.aux, Aux::Writing) {
            Aux::Held(rows) => {
                r.page_leases.push(None);
                let parts = r.parts.clone().expect("aux rows belong to a room with parts");
                self.fx.aux.push(AuxWrite { room, gen: r.gen, parts, rows });
                true
            }
            Aux::Writing => true,
            other => {
                r.aux = other;
                self.fail_room(room, Status::KVSTAGE_E_INTERNAL, "every chunk is done but the aux rows never arrived".to_owned(), "");
                false
            }
        }
    }

    /// The aux rows of (`room`, `gen`) were written (or not): the room completes (or fails), and
    /// its last chunk's event, held for them, goes out.
    pub fn aux_done(&mut self, write: &AuxWrite, result: Result<()>) {
        let Some(r) = self.rooms.get_mut(&write.room).filter(|r| r.gen == write.gen) else { return };
        if let Some(pos) = r.page_leases.iter().position(|l| l.is_none()) {
            r.page_leases.swap_remove(pos);
        }
        match result {
            Ok(()) if r.live() => {
                r.aux = Aux::Written;
                if let Some(e) = r.held_event.take() {
                    self.push_event(e);
                }
            }
            // Failed or released meanwhile: its failure reported the held event.
            Ok(()) => {}
            Err(e) => {
                r.aux = Aux::Owed;
                self.fail_room(write.room, e.code(), format!("writing the aux rows failed: {}", e.chain()), "");
            }
        }
        self.drain_check(write.room);
        self.fx.changed = true;
    }
}
