//! Test-only exports (cargo feature `testing`): they drive failure paths from C tests. Each is
//! compiled only with the feature (the header declares them under `KVSTAGE_TESTING`).
#![cfg_attr(not(feature = "testing"), allow(unused_imports))]

use std::ffi::c_char;

use super::args::str_arg;
use super::ffi_fn;
use crate::engine::logging;
use crate::error::{Error, Status};

/// TEST BUILDS ONLY (cargo feature `testing`): the next chunk this process writes by RDMA does
/// something wrong on the wire, to run the failure paths on real verbs: `fault` 1 = a remote key
/// the receiver never issued, 2 = the granted range moved past the end of the registered ring,
/// 3 = QP 0 moved to the error state once the chunk's first work requests are posted, 4 = the
/// writer stops for 10 s once they are posted (to kill the process mid-write), 5 = the
/// write-with-immediate goes as a plain write (the ready arrives without its immediate); 0
/// disarms.
#[cfg(feature = "testing")]
#[no_mangle]
pub unsafe extern "C" fn kvstage_testing_rdma_fault(fault: u32) -> Status {
    ffi_fn!(status {
        use crate::transport::rdma::fault::{arm, WriteFault};
        let armed = WriteFault::from_code(fault)
            .ok_or_else(|| Error::invalid_arg("fault", format!("{fault} is not 0..=5")))?;
        arm(armed);
        Ok(Status::KVSTAGE_OK)
    })
}

/// TEST BUILDS ONLY (cargo feature `testing`): panics inside the export after borrowing `engine`,
/// to prove that a panic becomes `KVSTAGE_E_PANIC` and poisons the handle.
#[cfg(feature = "testing")]
#[no_mangle]
pub unsafe extern "C" fn kvstage_testing_panic(engine: *const super::handle::kvstage_engine) -> Status {
    ffi_fn!(status {
        let _engine = unsafe { super::handle::engine(engine) }?;
        panic!("kvstage_testing_panic was called");
    })
}

/// TEST BUILDS ONLY (cargo feature `testing`): logs `message` at `level` (a `kvstage_log_level`
/// value, 1..=5) with target "kvstage::testing" and `session` (NULL or "" for none), to test the
/// sinks without staging a failure.
#[cfg(feature = "testing")]
#[no_mangle]
pub unsafe extern "C" fn kvstage_testing_log(level: i32, session: *const c_char, message: *const c_char) -> Status {
    ffi_fn!(status {
        let level = logging::level_from_int(level)
            .and_then(|l| l.to_level())
            .ok_or_else(|| Error::invalid_arg("level", format!("{level} is not a record level (1..=5)")))?;
        let message = unsafe { str_arg(message, "message") }?;
        let session = if session.is_null() { "" } else { unsafe { str_arg(session, "session") }? };
        logging::init();
        ::log::log!(target: "kvstage::testing", level, session = session; "{message}");
        Ok(Status::KVSTAGE_OK)
    })
}
