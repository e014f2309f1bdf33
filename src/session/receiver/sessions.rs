//! Which session to cut when the connection limit is reached: one that holds nothing (no
//! unfinished writer slot, grant pin, in-place quarantine, page lease or ring mapping), the
//! oldest of the source holding the most sessions. Silent sessions from one token-holding source
//! can then fill the limit without locking out a sender from anywhere else (the same shape as
//! the listener's handshake eviction).

use std::collections::HashMap;
use std::net::IpAddr;

use super::{ConnId, Receiver};

/// Picks the session to cut among `sessions` (id, source; a lower id is older): the oldest of
/// those `idle` allows, from the source with the most sessions (idle or not) that has one; ties
/// go to the source whose candidate is oldest. `(victim, its source, the source's sessions)`.
pub fn pick_idle(sessions: &[(ConnId, IpAddr)], idle: impl Fn(ConnId) -> bool) -> Option<(ConnId, IpAddr, usize)> {
    let mut by_source: HashMap<IpAddr, usize> = HashMap::new();
    for (_, source) in sessions {
        *by_source.entry(*source).or_default() += 1;
    }
    let mut oldest_idle: HashMap<IpAddr, ConnId> = HashMap::new();
    for &(id, source) in sessions.iter().filter(|(id, _)| idle(*id)) {
        oldest_idle.entry(source).and_modify(|o| *o = (*o).min(id)).or_insert(id);
    }
    oldest_idle
        .into_iter()
        .map(|(source, id)| (id, source, by_source[&source]))
        .max_by(|a, b| a.2.cmp(&b.2).then(b.0.cmp(&a.0)))
}

impl Receiver {
    /// A session that passed its handshake wants in while `max_connections` sessions are open:
    /// cuts the session [`pick_idle`] chooses (none being cut already), chosen and marked under
    /// one hold of the state's lock so that it claims nothing before its socket is shut down;
    /// `Some((its source, the source's sessions))` when one was cut. Its thread ends shortly;
    /// until then [`Receiver::sessions_ending`] counts it.
    pub fn evict_idle_session(&self) -> Option<(IpAddr, usize)> {
        let ending = self.evicted.lock().clone();
        let sessions: Vec<(ConnId, IpAddr)> = self.peers.lock().iter().filter(|(id, _)| !ending.contains(id)).map(|(id, p)| (*id, p.source)).collect();
        let (victim, source, held) = {
            let mut st = self.state.lock();
            let (victim, source, held) = pick_idle(&sessions, |id| st.holds_nothing(id))?;
            st.cut_idle(&[victim])?;
            (victim, source, held)
        };
        self.evicted.lock().insert(victim);
        match self.peers.lock().get(&victim) {
            Some(p) => p.link.shutdown(),
            // Ended meanwhile: nothing to cut, and nothing to wait for.
            None => {
                self.evicted.lock().remove(&victim);
            }
        }
        Some((source, held))
    }

    /// Sessions cut at the connection limit whose threads are still ending.
    pub fn sessions_ending(&self) -> usize {
        self.evicted.lock().len()
    }

    /// Makes room for one more session once its handshake passed (so only a peer that holds the
    /// cluster token, if one is set, can have another's idle session cut): at `max_connections`
    /// open sessions the oldest idle one of the biggest source is cut, else the newcomer is
    /// refused.
    pub(super) fn make_room_for_session(&self, peer: &str) -> crate::Result<()> {
        let max = self.config.listener.max_connections as usize;
        let open = self.peers.lock().len().saturating_sub(self.sessions_ending());
        if open < max {
            return Ok(());
        }
        let n = self.counters.connections_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let cut = (self.sessions_ending() < self.config.listener.max_handshakes as usize).then(|| self.evict_idle_session()).flatten();
        match cut {
            Some((source, held)) => {
                if let Some(suppressed) = self.log_limits.refused.allow() {
                    log::warn!("{max} sessions (max_connections): cut the oldest idle session of the {held} from {source} to serve {peer} ({n} refused or cut so far){suppressed}");
                }
                Ok(())
            }
            None => Err(crate::Error::new(crate::Status::KVSTAGE_E_TRANSPORT, format!("too many sessions (max_connections {max}), none of them idle"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    /// Against a reference written out case by case.
    #[test]
    fn the_oldest_idle_session_of_the_biggest_source_goes() {
        let s = [(1, ip(1)), (2, ip(2)), (3, ip(2)), (4, ip(2)), (5, ip(1)), (6, ip(3))];
        // Source 2 holds the most: its oldest idle one.
        assert_eq!(pick_idle(&s, |_| true), Some((2, ip(2), 3)));
        assert_eq!(pick_idle(&s, |id| id != 2), Some((3, ip(2), 3)));
        // The biggest source has nothing idle: the next biggest with something idle.
        assert_eq!(pick_idle(&s, |id| id == 5 || id == 6), Some((5, ip(1), 2)));
        // A tie in size: the source whose candidate is older.
        let tie = [(7, ip(1)), (3, ip(2)), (8, ip(1)), (4, ip(2))];
        assert_eq!(pick_idle(&tie, |_| true), Some((3, ip(2), 2)));
        // Busy sessions count toward their source's size; nothing idle: nothing cut.
        assert_eq!(pick_idle(&s, |_| false), None);
        assert_eq!(pick_idle(&[], |_| true), None);
    }
}
