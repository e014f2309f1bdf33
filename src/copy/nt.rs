//! Copies with non-temporal stores (x86-64 SSE2, part of the baseline ISA); elsewhere `memcpy`.

#[cfg(target_arch = "x86_64")]
pub const AVAILABLE: bool = true;
#[cfg(not(target_arch = "x86_64"))]
pub const AVAILABLE: bool = false;

/// `len` bytes from `src` to `dst` (not overlapping): the unaligned head and the tail with
/// `memcpy`, the 16-byte aligned middle with streaming stores.
#[cfg(target_arch = "x86_64")]
#[inline]
pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // SAFETY: the caller guarantees `len` readable bytes at `src` and writable at `dst`.
    unsafe {
        let head = ((dst as usize).wrapping_neg() & 15).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut s, mut d, mut n) = (src.add(head), dst.add(head), len - head);
        while n >= 64 {
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
            s = s.add(64);
            d = d.add(64);
            n -= 64;
        }
        while n >= 16 {
            _mm_stream_si128(d as *mut __m128i, _mm_loadu_si128(s as *const __m128i));
            s = s.add(16);
            d = d.add(16);
            n -= 16;
        }
        std::ptr::copy_nonoverlapping(s, d, n);
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Hints the cache lines of `[at, at + len)` into the cache (never faults).
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn prefetch(at: usize, len: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let mut p = at & !63;
    while p < at + len {
        // SAFETY: prefetch is a hint; it does not fault on any address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
        p += 64;
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub fn prefetch(_at: usize, _len: usize) {}

#[cfg(target_arch = "x86_64")]
pub fn fence() {
    // SAFETY: sfence has no preconditions.
    unsafe { std::arch::x86_64::_mm_sfence() }
}

#[cfg(not(target_arch = "x86_64"))]
pub fn fence() {}
