//! `kvstage_engine_describe`: the whole engine as data, for an operator asking where requests are.

use serde::Serialize;

use super::{describe_transport, Engine};
use crate::session::receiver::state::ReceiverDescription;
use crate::session::sender::describe::SessionDescription;
use crate::session::DESCRIBE_VERSION;


#[derive(Clone, Debug, Serialize)]
pub struct EngineDescription {
    pub version: u32,
    pub listen_address: String,
    pub transport: String,
    /// The decode side: ring, accepted connections, rooms.
    pub receiver: ReceiverDescription,
    /// The prefill side: the sessions this engine opened and still holds.
    pub sessions: Vec<SessionDescription>,
}

impl Engine {
    pub fn describe(&self) -> EngineDescription {
        let sessions = self.sessions.lock().iter().filter_map(|w| w.upgrade()).collect::<Vec<_>>();
        EngineDescription {
            version: DESCRIBE_VERSION,
            listen_address: self.local_addr.to_string(),
            transport: describe_transport(&self.options, &self.rdma),
            receiver: self.receiver().describe(),
            sessions: sessions.iter().map(|s| s.describe()).collect(),
        }
    }
}
