//! Status codes, error classes and the crate's error type.
//!
//! Every failure is an [`Error`]: a stable [`Status`] code, a class, a one-line message, the session
//! it happened on (if any) and a `source()` chain of causes. The FFI layer flattens that chain into
//! the C `kvstage_error` struct, outermost first.

use std::error::Error as StdError;
use std::fmt;

/// Status codes returned by every `kvstage_*` function that can fail.
///
/// `0` is success, positive values are informational, negative values are errors grouped by family
/// (tens digit). Values are stable once released; retired codes stay reserved.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// Success.
    KVSTAGE_OK = 0,
    /// An asynchronous operation was started and has not finished yet.
    KVSTAGE_PENDING = 1,
    /// Staging is impossible for this chunk; nothing was allocated; the caller may use the slice path.
    KVSTAGE_FALLBACK = 2,

    /// An argument is NULL, out of range or inconsistent; the message names it.
    KVSTAGE_E_INVALID_ARG = -1,
    /// The operation or option is not supported by this build or on this host.
    KVSTAGE_E_UNSUPPORTED = -2,
    /// Memory could not be allocated.
    KVSTAGE_E_OUT_OF_MEMORY = -3,

    /// The two sides disagree on the KV geometry; the causes list every differing field.
    KVSTAGE_E_GEOMETRY_MISMATCH = -10,
    /// A KV layout is internally inconsistent or describes an unsupported combination.
    KVSTAGE_E_GEOMETRY_INVALID = -11,
    /// The staging ring or buffer is too small for the chunk.
    KVSTAGE_E_STAGING_TOO_SMALL = -12,
    /// The chunk is larger than the whole receiver ring (permanent for that chunk).
    KVSTAGE_E_OVERSIZED = -13,

    /// The operation's deadline passed before it completed.
    KVSTAGE_E_TIMEOUT = -20,
    /// The operation was canceled by the caller or by a room release.
    KVSTAGE_E_CANCELED = -21,
    /// The transfer names an opening of its room that is not the open one: the decode side
    /// released the room it was meant for (and may have opened the id again for another request),
    /// or the room key is wrong. Nothing was written; the decode room is not affected.
    KVSTAGE_E_STALE_ROOM = -22,

    /// A transport-level failure (socket error, connection refused, short write).
    KVSTAGE_E_TRANSPORT = -30,
    /// The peer disconnected or died.
    KVSTAGE_E_PEER_GONE = -31,

    /// The peer sent a malformed or unexpected message.
    KVSTAGE_E_PROTOCOL = -40,
    /// Transferred data failed its integrity check.
    KVSTAGE_E_INTEGRITY = -41,
    /// The peer was refused by authentication.
    KVSTAGE_E_AUTH = -42,

    /// A CUDA driver call failed.
    KVSTAGE_E_CUDA = -50,
    /// An RDMA verbs call failed.
    KVSTAGE_E_RDMA = -51,
    /// The requested device (GPU, RDMA NIC) or its driver library is not present.
    KVSTAGE_E_NO_DEVICE = -52,

    /// A Rust panic was caught at the C boundary; the handle involved is now poisoned.
    KVSTAGE_E_PANIC = -90,
    /// The handle was poisoned by an earlier panic and can only be freed.
    KVSTAGE_E_POISONED = -91,
    /// An internal invariant was violated (a bug in kvstage).
    KVSTAGE_E_INTERNAL = -92,
}

impl Status {
    const ALL: [Status; 24] = [
        Status::KVSTAGE_OK,
        Status::KVSTAGE_PENDING,
        Status::KVSTAGE_FALLBACK,
        Status::KVSTAGE_E_INVALID_ARG,
        Status::KVSTAGE_E_UNSUPPORTED,
        Status::KVSTAGE_E_OUT_OF_MEMORY,
        Status::KVSTAGE_E_GEOMETRY_MISMATCH,
        Status::KVSTAGE_E_GEOMETRY_INVALID,
        Status::KVSTAGE_E_STAGING_TOO_SMALL,
        Status::KVSTAGE_E_OVERSIZED,
        Status::KVSTAGE_E_TIMEOUT,
        Status::KVSTAGE_E_CANCELED,
        Status::KVSTAGE_E_STALE_ROOM,
        Status::KVSTAGE_E_TRANSPORT,
        Status::KVSTAGE_E_PEER_GONE,
        Status::KVSTAGE_E_PROTOCOL,
        Status::KVSTAGE_E_INTEGRITY,
        Status::KVSTAGE_E_AUTH,
        Status::KVSTAGE_E_CUDA,
        Status::KVSTAGE_E_RDMA,
        Status::KVSTAGE_E_NO_DEVICE,
        Status::KVSTAGE_E_PANIC,
        Status::KVSTAGE_E_POISONED,
        Status::KVSTAGE_E_INTERNAL,
    ];

    pub fn all() -> &'static [Status] {
        &Status::ALL
    }

    pub fn code(self) -> i32 {
        self as i32
    }

    pub fn from_code(code: i32) -> Option<Status> {
        Status::ALL.iter().copied().find(|s| s.code() == code)
    }

    /// The enum value's name as it appears in the C header (NUL-terminated for the FFI).
    pub fn name_c(self) -> &'static str {
        match self {
            Status::KVSTAGE_OK => "KVSTAGE_OK\0",
            Status::KVSTAGE_PENDING => "KVSTAGE_PENDING\0",
            Status::KVSTAGE_FALLBACK => "KVSTAGE_FALLBACK\0",
            Status::KVSTAGE_E_INVALID_ARG => "KVSTAGE_E_INVALID_ARG\0",
            Status::KVSTAGE_E_UNSUPPORTED => "KVSTAGE_E_UNSUPPORTED\0",
            Status::KVSTAGE_E_OUT_OF_MEMORY => "KVSTAGE_E_OUT_OF_MEMORY\0",
            Status::KVSTAGE_E_GEOMETRY_MISMATCH => "KVSTAGE_E_GEOMETRY_MISMATCH\0",
            Status::KVSTAGE_E_GEOMETRY_INVALID => "KVSTAGE_E_GEOMETRY_INVALID\0",
            Status::KVSTAGE_E_STAGING_TOO_SMALL => "KVSTAGE_E_STAGING_TOO_SMALL\0",
            Status::KVSTAGE_E_OVERSIZED => "KVSTAGE_E_OVERSIZED\0",
            Status::KVSTAGE_E_TIMEOUT => "KVSTAGE_E_TIMEOUT\0",
            Status::KVSTAGE_E_CANCELED => "KVSTAGE_E_CANCELED\0",
            Status::KVSTAGE_E_STALE_ROOM => "KVSTAGE_E_STALE_ROOM\0",
            Status::KVSTAGE_E_TRANSPORT => "KVSTAGE_E_TRANSPORT\0",
            Status::KVSTAGE_E_PEER_GONE => "KVSTAGE_E_PEER_GONE\0",
            Status::KVSTAGE_E_PROTOCOL => "KVSTAGE_E_PROTOCOL\0",
            Status::KVSTAGE_E_INTEGRITY => "KVSTAGE_E_INTEGRITY\0",
            Status::KVSTAGE_E_AUTH => "KVSTAGE_E_AUTH\0",
            Status::KVSTAGE_E_CUDA => "KVSTAGE_E_CUDA\0",
            Status::KVSTAGE_E_RDMA => "KVSTAGE_E_RDMA\0",
            Status::KVSTAGE_E_NO_DEVICE => "KVSTAGE_E_NO_DEVICE\0",
            Status::KVSTAGE_E_PANIC => "KVSTAGE_E_PANIC\0",
            Status::KVSTAGE_E_POISONED => "KVSTAGE_E_POISONED\0",
            Status::KVSTAGE_E_INTERNAL => "KVSTAGE_E_INTERNAL\0",
        }
    }

    pub fn name(self) -> &'static str {
        let n = self.name_c();
        &n[..n.len() - 1]
    }

    /// The class an error of this code belongs to unless the error names another.
    pub fn default_class(self) -> ErrorClass {
        use Status::*;
        match self {
            KVSTAGE_OK | KVSTAGE_PENDING | KVSTAGE_FALLBACK => ErrorClass::KVSTAGE_CLASS_NONE,
            KVSTAGE_E_INVALID_ARG | KVSTAGE_E_UNSUPPORTED => ErrorClass::KVSTAGE_CLASS_CONFIG,
            KVSTAGE_E_GEOMETRY_MISMATCH
            | KVSTAGE_E_GEOMETRY_INVALID
            | KVSTAGE_E_STAGING_TOO_SMALL
            | KVSTAGE_E_OVERSIZED => ErrorClass::KVSTAGE_CLASS_GEOMETRY,
            KVSTAGE_E_TIMEOUT | KVSTAGE_E_CANCELED | KVSTAGE_E_STALE_ROOM => ErrorClass::KVSTAGE_CLASS_TIMEOUT,
            KVSTAGE_E_TRANSPORT | KVSTAGE_E_PEER_GONE => ErrorClass::KVSTAGE_CLASS_TRANSPORT,
            KVSTAGE_E_PROTOCOL | KVSTAGE_E_INTEGRITY | KVSTAGE_E_AUTH => {
                ErrorClass::KVSTAGE_CLASS_PROTOCOL
            }
            KVSTAGE_E_CUDA => ErrorClass::KVSTAGE_CLASS_CUDA,
            KVSTAGE_E_RDMA => ErrorClass::KVSTAGE_CLASS_RDMA,
            KVSTAGE_E_NO_DEVICE => ErrorClass::KVSTAGE_CLASS_CONFIG,
            KVSTAGE_E_OUT_OF_MEMORY
            | KVSTAGE_E_PANIC
            | KVSTAGE_E_POISONED
            | KVSTAGE_E_INTERNAL => ErrorClass::KVSTAGE_CLASS_INTERNAL,
        }
    }
}

/// Broad family of an error, for callers that route failures (retry, fall back, alert).
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    KVSTAGE_CLASS_NONE = 0,
    KVSTAGE_CLASS_CONFIG = 1,
    KVSTAGE_CLASS_GEOMETRY = 2,
    KVSTAGE_CLASS_TRANSPORT = 3,
    KVSTAGE_CLASS_RDMA = 4,
    KVSTAGE_CLASS_CUDA = 5,
    KVSTAGE_CLASS_PROTOCOL = 6,
    KVSTAGE_CLASS_TIMEOUT = 7,
    KVSTAGE_CLASS_INTERNAL = 8,
}

type BoxedCause = Box<dyn StdError + Send + Sync + 'static>;

/// The crate's error: a code, a class, a message, an optional session and a cause chain.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    code: Status,
    class: ErrorClass,
    message: String,
    session: Option<String>,
    #[source]
    source: Option<BoxedCause>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(code: Status, message: impl Into<String>) -> Error {
        Error { code, class: code.default_class(), message: message.into(), session: None, source: None }
    }

    /// `KVSTAGE_E_INVALID_ARG` for the argument or field `name`.
    pub fn invalid_arg(name: &str, reason: impl fmt::Display) -> Error {
        Error::new(Status::KVSTAGE_E_INVALID_ARG, format!("invalid argument `{name}`: {reason}"))
    }

    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(Status::KVSTAGE_E_INTERNAL, message)
    }

    pub fn with_class(mut self, class: ErrorClass) -> Error {
        self.class = class;
        self
    }

    pub fn with_source(mut self, source: impl Into<BoxedCause>) -> Error {
        self.source = Some(source.into());
        self
    }

    /// Attaches the session id unless an inner layer already named one.
    pub fn with_session(mut self, session: &str) -> Error {
        if self.session.is_none() {
            self.session = Some(session.to_owned());
        }
        self
    }

    /// Wraps `self` as the cause of a new outer error that keeps this error's code, class and session.
    pub fn context(self, message: impl Into<String>) -> Error {
        Error {
            code: self.code,
            class: self.class,
            message: message.into(),
            session: self.session.clone(),
            source: Some(Box::new(self)),
        }
    }

    /// Wraps `self` as the cause of a new outer error with a different code.
    pub fn wrap(self, code: Status, message: impl Into<String>) -> Error {
        let session = self.session.clone();
        let mut outer = Error::new(code, message).with_source(self);
        outer.session = session;
        outer
    }

    pub fn code(&self) -> Status {
        self.code
    }

    pub fn class(&self) -> ErrorClass {
        self.class
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn session(&self) -> Option<&str> {
        self.session.as_deref()
    }

    /// Messages of every cause below this error, outermost first.
    pub fn causes(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut next = self.source();
        while let Some(cause) = next {
            out.push(cause.to_string());
            next = cause.source();
        }
        out
    }

    /// The message followed by every cause, joined with ": " (for logs and panics in tests).
    pub fn chain(&self) -> String {
        std::iter::once(self.message.clone()).chain(self.causes()).collect::<Vec<_>>().join(": ")
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        let code = match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Status::KVSTAGE_E_TIMEOUT,
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe => Status::KVSTAGE_E_PEER_GONE,
            _ => Status::KVSTAGE_E_TRANSPORT,
        };
        Error::new(code, "I/O error").with_source(e)
    }
}

/// One field on which two descriptions disagree: `name`, ours, theirs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: local {local} != remote {remote}")]
pub struct FieldMismatch {
    pub field: String,
    pub local: String,
    pub remote: String,
}

/// A list of causes shown one per level (each the source of the previous): the field-by-field
/// diff of a geometry mismatch, or a cause chain re-created from its messages.
#[derive(Debug)]
pub struct CauseChain {
    head: String,
    rest: Option<Box<CauseChain>>,
}

/// The text of a caught panic's payload.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_string())
}

impl Error {
    /// `KVSTAGE_E_PANIC` with `what` as the message and the panic text as its cause.
    pub fn from_panic(what: impl Into<String>, payload: &(dyn std::any::Any + Send)) -> Error {
        let text = format!("panic: {}", panic_text(payload));
        let err = Error::new(Status::KVSTAGE_E_PANIC, what);
        match CauseChain::from_list(vec![text]) {
            Some(chain) => err.with_source(chain),
            None => err,
        }
    }
}

impl CauseChain {
    pub fn from_list<T: fmt::Display>(list: Vec<T>) -> Option<CauseChain> {
        let mut chain: Option<CauseChain> = None;
        for item in list.into_iter().rev() {
            chain = Some(CauseChain { head: item.to_string(), rest: chain.map(Box::new) });
        }
        chain
    }
}

impl fmt::Display for CauseChain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.head)
    }
}

impl StdError for CauseChain {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.rest.as_deref().map(|r| r as &(dyn StdError + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for s in Status::ALL {
            assert!(seen.insert(s.code()), "duplicate code {}", s.code());
            assert_eq!(Status::from_code(s.code()), Some(s));
            assert!(s.name().starts_with("KVSTAGE_"));
            assert!(!s.name().contains('\0'));
        }
        assert_eq!(Status::from_code(-1000), None);
    }

    #[test]
    fn context_keeps_code_and_builds_the_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Error::from(io).context("write to peer 127.0.0.1:9 failed").with_session("s1");
        let e = e.context("staged transfer failed");
        assert_eq!(e.code(), Status::KVSTAGE_E_TRANSPORT);
        assert_eq!(e.session(), Some("s1"));
        assert_eq!(e.causes(), vec!["write to peer 127.0.0.1:9 failed", "I/O error", "refused"]);
    }

    #[test]
    fn mismatch_chain_lists_every_field_in_order() {
        let list = vec![
            FieldMismatch { field: "head_dim".into(), local: "128".into(), remote: "64".into() },
            FieldMismatch { field: "dtype_bytes".into(), local: "2".into(), remote: "4".into() },
        ];
        let chain = CauseChain::from_list(list).unwrap();
        let e = Error::new(Status::KVSTAGE_E_GEOMETRY_MISMATCH, "geometry mismatch (2 fields)")
            .with_source(chain);
        assert_eq!(
            e.causes(),
            vec!["head_dim: local 128 != remote 64", "dtype_bytes: local 2 != remote 4"]
        );
    }
}
