//! `kvstage_room_describe` and the receiver's part of `kvstage_engine_describe`.

use std::time::Instant;

use super::state::{ReceiverDescription, RoomDescription};
use super::Receiver;
use crate::error::{Error, Result};
use crate::protocol::RoomRef;

impl Receiver {
    fn page_size(&self) -> u32 {
        self.pool.lock().as_ref().map_or(0, |p| p.shape.page_size)
    }

    /// Room `room` with its chunks (`KVSTAGE_E_INVALID_ARG` when no room of that id is open).
    pub fn describe_room(&self, at: RoomRef) -> Result<RoomDescription> {
        let page_size = self.page_size();
        let st = self.state.lock();
        if !st.is_open(at) {
            return Err(super::state::not_open(at.id));
        }
        st.describe_room(at.id, page_size, Instant::now()).ok_or_else(|| Error::internal("an open room without a description"))
    }

    pub fn describe(&self) -> ReceiverDescription {
        self.state.lock().describe()
    }
}
