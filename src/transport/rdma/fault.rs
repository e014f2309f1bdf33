//! Test builds (feature `testing`): a fault the next RDMA write of this process injects on the
//! wire, so the failure paths run on real verbs (soft-RoCE in the rdma_vm ctest), not only on the
//! in-process fabric. Without the feature nothing is ever armed and the checks fold away.

/// What the next chunk written by RDMA does wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteFault {
    None,
    /// Every work request carries a remote key the receiver never issued.
    BadRkey,
    /// Every work request targets the granted range moved past the end of the registered ring.
    PastTheRing,
    /// QP 0 is moved to the error state once the chunk's first work requests are posted.
    QpErrorMidChunk,
    /// The writer stops for [`PAUSE`] once the chunk's first work requests are posted (a test
    /// kills the process meanwhile: a peer gone mid-write).
    PauseMidChunk,
    /// The chunk's write-with-immediate goes as a plain write: its ready arrives without the
    /// immediate that binds it to the data (a lying or broken peer).
    NoImmediate,
}

/// How long [`WriteFault::PauseMidChunk`] holds the write.
pub const PAUSE: std::time::Duration = std::time::Duration::from_secs(10);

impl WriteFault {
    const ALL: [WriteFault; 6] = [
        WriteFault::None,
        WriteFault::BadRkey,
        WriteFault::PastTheRing,
        WriteFault::QpErrorMidChunk,
        WriteFault::PauseMidChunk,
        WriteFault::NoImmediate,
    ];

    /// The fault of code `code` (its position in the list above: 0 = none).
    pub fn from_code(code: u32) -> Option<WriteFault> {
        Self::ALL.get(code as usize).copied()
    }
}

#[cfg(feature = "testing")]
static ARMED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Arms `fault` for the next RDMA chunk written by this process.
#[cfg(feature = "testing")]
pub fn arm(fault: WriteFault) {
    let code = WriteFault::ALL.iter().position(|f| *f == fault).expect("listed") as u32;
    ARMED.store(code, std::sync::atomic::Ordering::SeqCst);
}

/// Test builds: whether the armed write fault is still waiting for its chunk.
#[cfg(feature = "testing")]
pub fn armed() -> bool {
    ARMED.load(std::sync::atomic::Ordering::SeqCst) != 0
}

/// The armed fault, disarmed (one chunk only).
pub(super) fn take() -> WriteFault {
    #[cfg(feature = "testing")]
    {
        WriteFault::from_code(ARMED.swap(0, std::sync::atomic::Ordering::SeqCst)).unwrap_or(WriteFault::None)
    }
    #[cfg(not(feature = "testing"))]
    WriteFault::None
}

#[cfg(feature = "testing")]
static SENDER_RTR_FAILS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Test builds: the next sender of this process fails its QPs' transition to RTR after the
/// receiver accepted its offer (a setup failure on the sender's side only).
#[cfg(feature = "testing")]
pub fn arm_sender_rtr_failure() {
    SENDER_RTR_FAILS.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Whether a sender-side RTR failure is armed (disarmed by the call).
pub(super) fn take_sender_rtr_failure() -> bool {
    #[cfg(feature = "testing")]
    {
        SENDER_RTR_FAILS.swap(false, std::sync::atomic::Ordering::SeqCst)
    }
    #[cfg(not(feature = "testing"))]
    false
}
