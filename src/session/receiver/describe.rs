//! `kvstage_room_describe` and the receiver's part of `kvstage_engine_describe`.

use std::time::Instant;

use super::state::{ReceiverDescription, RoomDescription};
use super::Receiver;
use crate::error::{Error, Result};

impl Receiver {
    fn page_size(&self) -> u32 {
        self.pool.lock().as_ref().map_or(0, |p| p.shape.page_size)
    }

    /// Room `room` with its chunks (`KVSTAGE_E_INVALID_ARG` when no room of that id is open).
    pub fn describe_room(&self, room: u64) -> Result<RoomDescription> {
        let page_size = self.page_size();
        self.state
            .lock()
            .describe_room(room, page_size, Instant::now())
            .ok_or_else(|| Error::invalid_arg("room", format!("{room} is not open (nor being released)")))
    }

    pub fn describe(&self) -> ReceiverDescription {
        self.state.lock().describe()
    }
}
