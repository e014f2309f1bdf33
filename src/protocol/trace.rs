//! Request trace ids: one id per request that both sides put in front of every log line about it,
//! in the describe documents and in completions, so that one `grep` over a prefill and a decode
//! process tells the story of one request. The caller's own id (an engine's request id) when it
//! gives one, else one derived from the room and its opening.

use super::RoomRef;

/// Longest trace id (bytes).
pub const MAX_TRACE: usize = 64;

/// The id both sides derive for an opening of a room: `<room id>#<16 bits of a mix of its key>`.
/// Openings of one room id differ (with odds 1 in 65536 of a repeat); the 16 bits say nothing
/// useful about the key, which stays a capability (a guesser still faces 2^48 keys).
pub fn derived_trace(room: RoomRef) -> String {
    let mixed = xxhash_rust::xxh3::xxh3_64_with_seed(&room.key.to_le_bytes(), 0x6b76_7374_7261_6365);
    format!("{}#{:04x}", room.id, mixed >> 48)
}

/// Why `trace` is not a trace id: at most [`MAX_TRACE`] bytes of ASCII letters, digits and
/// `. _ - : / @ + #` (it goes into log lines as it is), not empty.
pub fn check_trace(trace: &str) -> Result<(), String> {
    if trace.is_empty() || trace.len() > MAX_TRACE {
        return Err(format!("holds {} bytes (1 to {MAX_TRACE})", trace.len()));
    }
    match trace.bytes().position(|b| !(b.is_ascii_alphanumeric() || b"._-:/@+#".contains(&b))) {
        Some(i) => Err(format!("byte {i} ({:#04x}) is not a letter, digit or one of . _ - : / @ + #", trace.as_bytes()[i])),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ids_name_the_room_and_tell_openings_apart() {
        let a = derived_trace(RoomRef { id: 7, key: 1 });
        let b = derived_trace(RoomRef { id: 7, key: 2 });
        assert!(a.starts_with("7#") && a.len() == 6 && b.starts_with("7#"), "{a} {b}");
        assert_ne!(a, b);
        assert_eq!(a, derived_trace(RoomRef { id: 7, key: 1 }));
        check_trace(&a).unwrap();
    }

    #[test]
    fn trace_ids_are_short_and_printable() {
        check_trace("req-42/p0.d1:cmpl@x+y_z").unwrap();
        assert!(check_trace("").unwrap_err().contains("0 bytes"));
        assert!(check_trace(&"x".repeat(65)).unwrap_err().contains("65 bytes"));
        assert!(check_trace("a\nb").unwrap_err().contains("byte 1 (0x0a)"));
        assert!(check_trace("a b").unwrap_err().contains("byte 1"));
    }
}
