//! The argument conventions every export shares (docs/c-api-conventions.md): strings, slices,
//! outputs, versioned structs and arrays of them, timeouts.

use std::ffi::{c_char, CStr};
use std::time::Duration;

use crate::error::{Error, Result, Status};

/// Reads a NUL-terminated UTF-8 string argument; NULL is an error naming `arg`.
pub unsafe fn str_arg<'a>(ptr: *const c_char, arg: &str) -> Result<&'a str> {
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, "is NULL"));
    }
    // SAFETY: non-NULL C strings are NUL-terminated by contract.
    unsafe { CStr::from_ptr(ptr) }.to_str().map_err(|_| Error::invalid_arg(arg, "is not valid UTF-8"))
}

/// Checks an output pointer.
///
/// # Safety
/// `ptr` is NULL or points to writable storage for a `T` that outlives `'a` (the C caller's
/// contract). A safe signature here would let safe code turn any pointer into `&mut T`.
pub unsafe fn out_arg<'a, T>(ptr: *mut T, arg: &str) -> Result<&'a mut T> {
    // SAFETY: non-NULL output pointers point to writable storage by contract.
    unsafe { ptr.as_mut() }.ok_or_else(|| Error::invalid_arg(arg, "is NULL"))
}

/// A slice argument `(ptr, len)`; `len == 0` accepts NULL.
pub unsafe fn slice_arg<'a, T>(ptr: *const T, len: usize, arg: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, format!("is NULL with length {len}")));
    }
    // SAFETY: the caller provides `len` readable elements by contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// The one convention of string outputs `(buf, capacity, needed)`: copies `text` NUL-terminated
/// into `buf` of `capacity` bytes; `*needed` (when not NULL) gets the size including the NUL, also
/// when the buffer is too small (then `KVSTAGE_E_INVALID_ARG` naming both sizes). A call with
/// `buf` NULL and `capacity` 0 is a size query: `KVSTAGE_OK` with `*needed` set.
pub unsafe fn write_text(text: &str, buf: *mut c_char, capacity: usize, needed: *mut usize) -> Result<Status> {
    let size = text.len() + 1;
    if unsafe { size_query(buf, capacity, needed, "needed", size) }? {
        return Ok(Status::KVSTAGE_OK);
    }
    if size > capacity {
        return Err(Error::invalid_arg("capacity", format!("{capacity} < {size} bytes needed")));
    }
    if buf.is_null() {
        return Err(Error::invalid_arg("buf", format!("is NULL with capacity {capacity}")));
    }
    // SAFETY: `capacity >= size` writable bytes at `buf` by contract.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, text.len());
        *buf.add(text.len()) = 0;
    }
    Ok(Status::KVSTAGE_OK)
}

/// Stores `size` in `*needed` (when not NULL); `Ok(true)` when the call is a size query (`out`
/// NULL, `capacity` 0: nothing more to do). A size query without `needed` asks for nothing.
pub unsafe fn size_query<T>(out: *mut T, capacity: usize, needed: *mut usize, needed_arg: &str, size: usize) -> Result<bool> {
    if !needed.is_null() {
        // SAFETY: a non-NULL `needed` points to writable storage by contract.
        unsafe { *needed = size };
    }
    if out.is_null() && capacity == 0 && size > 0 {
        if needed.is_null() {
            return Err(Error::invalid_arg(needed_arg, "is NULL in a size query (output NULL, capacity 0)"));
        }
        return Ok(true);
    }
    Ok(false)
}

/// The one convention of array outputs `(out, capacity, count)`: writes `items` into
/// `out[capacity]`; `*count` (may be NULL) receives their number, also when `capacity` is too
/// small (`KVSTAGE_E_INVALID_ARG` naming both); `out` NULL with `capacity` 0 is a count query.
pub unsafe fn write_array<T: Copy>(items: &[T], out: *mut T, capacity: usize, count: *mut usize, what: &str) -> Result<Status> {
    if unsafe { size_query(out, capacity, count, "count", items.len()) }? {
        return Ok(Status::KVSTAGE_OK);
    }
    if items.len() > capacity {
        return Err(Error::invalid_arg("capacity", format!("{capacity} < {} {what} to report", items.len())));
    }
    if items.is_empty() {
        return Ok(Status::KVSTAGE_OK);
    }
    if out.is_null() {
        return Err(Error::invalid_arg("out", format!("is NULL with capacity {capacity}")));
    }
    // SAFETY: `capacity >= items.len()` writable entries at `out` by contract.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    Ok(Status::KVSTAGE_OK)
}

/// The largest `struct_size` taken as meant (anything above is a caller's bug, not a struct).
const MAX_STRUCT_SIZE: usize = 1 << 20;

/// A struct that crosses the boundary by pointer, starts with `size_t struct_size` and only ever
/// grows by appending fields.
///
/// # Safety
/// `Self` is `repr(C)` and its first field is a `usize` `struct_size`.
pub unsafe trait Versioned: Copy + Default {
    /// Bytes of its first published version (API 0.4 for every struct then present): a caller's
    /// `struct_size` below it is refused. Pinned by [`versioned!`] to the end of the field that
    /// was last then, so appending fields does not move it.
    const FIRST_SIZE: usize;
}

/// Declares a [`Versioned`] struct whose first published version ends with field `$last` of
/// type `$ty`.
macro_rules! versioned {
    ($t:ty, $last:ident: $ty:ty) => {
        unsafe impl $crate::ffi::args::Versioned for $t {
            const FIRST_SIZE: usize = std::mem::offset_of!($t, $last) + std::mem::size_of::<$ty>();
        }
    };
}
pub(crate) use versioned;

/// Reads the `size_t struct_size` a versioned struct starts with (no alignment assumed).
pub(super) unsafe fn struct_size_at(ptr: *const u8) -> usize {
    // SAFETY: the caller's struct starts with a `size_t struct_size` (by contract).
    unsafe { std::ptr::read_unaligned(ptr as *const usize) }
}

fn bad_size<T: Versioned>(arg: &str, given: usize, hint: &str) -> Error {
    Error::invalid_arg(
        &format!("{arg}->struct_size"),
        format!("{given} is not a valid size (expected {}..={MAX_STRUCT_SIZE}, {} in this library; {hint})", T::FIRST_SIZE, std::mem::size_of::<T>()),
    )
}

/// The `_init` of a versioned struct: `size` is the caller's `sizeof`. Writes the defaults into
/// exactly `size` bytes: a caller built against an older header (a smaller struct) gets the
/// fields it has, one built against a newer header gets zeros in the fields this library does
/// not know (read back as "not set"). `struct_size` becomes `size`.
pub unsafe fn init_versioned<T: Versioned>(ptr: *mut T, size: usize, arg: &str) -> Result<Status> {
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, "is NULL"));
    }
    if size < T::FIRST_SIZE || size > MAX_STRUCT_SIZE {
        return Err(Error::invalid_arg(
            "size",
            format!("{size} is not a valid size of `{arg}` (expected {}..={MAX_STRUCT_SIZE}: pass sizeof(*{arg}))", T::FIRST_SIZE),
        ));
    }
    unsafe { write_sized(ptr as *mut u8, size, &T::default()) };
    Ok(Status::KVSTAGE_OK)
}

/// Reads a versioned input struct: fields the caller's (older, smaller) struct lacks keep their
/// defaults; a newer caller's fields this library does not know must be zero (as `_init` left
/// them), otherwise the call is refused rather than the setting silently ignored.
pub unsafe fn read_versioned<T: Versioned>(ptr: *const T, arg: &str) -> Result<T> {
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, "is NULL"));
    }
    let given = unsafe { struct_size_at(ptr as *const u8) };
    unsafe { read_sized(ptr as *const u8, given, arg) }
}

/// [`read_versioned`] of a struct whose caller says it is `given` bytes.
unsafe fn read_sized<T: Versioned>(ptr: *const u8, given: usize, arg: &str) -> Result<T> {
    if given < T::FIRST_SIZE || given > MAX_STRUCT_SIZE {
        return Err(bad_size::<T>(arg, given, "call the _init function first"));
    }
    let full = std::mem::size_of::<T>();
    if given > full {
        // SAFETY: `given` bytes are readable (the caller said so).
        let tail = unsafe { std::slice::from_raw_parts(ptr.add(full), given - full) };
        if let Some(at) = tail.iter().position(|&b| b != 0) {
            return Err(Error::invalid_arg(
                arg,
                format!(
                    "sets a field this kvstage {} does not know (byte {} of {given}; its struct has {full}): load a newer libkvstage, or leave the field as _init set it",
                    env!("CARGO_PKG_VERSION"),
                    full + at
                ),
            ));
        }
    }
    let mut value = T::default();
    // SAFETY: `min(given, full)` bytes are readable from the caller's struct and writable in `value`.
    unsafe { std::ptr::copy_nonoverlapping(ptr, &mut value as *mut T as *mut u8, given.min(full)) };
    Ok(value)
}

/// Reads an array of `count` versioned structs. The caller's element size (its `sizeof`, so its
/// array stride) is the first element's `struct_size`, and every element must say the same: an
/// array built against another header than this library's is read where its elements really are.
pub unsafe fn read_versioned_array<T: Versioned>(ptr: *const T, count: usize, arg: &str) -> Result<Vec<T>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, format!("is NULL with length {count}")));
    }
    let base = ptr as *const u8;
    let stride = unsafe { struct_size_at(base) };
    if stride < T::FIRST_SIZE || stride > MAX_STRUCT_SIZE {
        return Err(bad_size::<T>(&format!("{arg}[0]"), stride, "call the _init function on every element"));
    }
    let mut items = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: the caller's array holds `count` elements of `stride` bytes (its struct_size).
        let at = unsafe { base.add(i * stride) };
        let size = unsafe { struct_size_at(at) };
        if size != stride {
            return Err(Error::invalid_arg(
                &format!("{arg}[{i}].struct_size"),
                format!("{size} != {stride} of {arg}[0] (the elements of one array have one size: call the _init function on every element)"),
            ));
        }
        items.push(unsafe { read_sized(at, stride, &format!("{arg}[{i}]")) }?);
    }
    Ok(items)
}

/// Checks a versioned output pointer for NULL without making a reference of it: the caller's
/// struct may be an older, smaller one than `T` (see [`write_versioned`]).
pub fn out_ptr<T>(ptr: *mut T, arg: &str) -> Result<*mut T> {
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, "is NULL"));
    }
    Ok(ptr)
}

/// The caller's size of an output struct (its `struct_size`, set before the call).
unsafe fn output_size<T: Copy>(out: *mut u8, arg: &str) -> Result<usize> {
    let given = unsafe { struct_size_at(out) };
    if given < std::mem::size_of::<usize>() || given > MAX_STRUCT_SIZE {
        return Err(Error::invalid_arg(
            &format!("{arg}->struct_size"),
            format!("{given} is not a valid size (set it to sizeof the struct, {} here)", std::mem::size_of::<T>()),
        ));
    }
    Ok(given)
}

/// Copies `value` into the `size` bytes at `out`: the fields the caller has, zeros in those this
/// library does not know; `struct_size` becomes `size`.
unsafe fn write_sized<T: Copy>(out: *mut u8, size: usize, value: &T) {
    let full = std::mem::size_of::<T>();
    // SAFETY: `size` bytes are writable at `out` (the caller said so) and `full` readable in
    // `value`; they do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(value as *const T as *const u8, out, size.min(full));
        if size > full {
            std::ptr::write_bytes(out.add(full), 0, size - full);
        }
        std::ptr::write_unaligned(out as *mut usize, size);
    }
}

/// Writes a versioned output struct: as many bytes as the caller's `struct_size` holds (set
/// before the call). Works on the raw pointer only: the caller's struct may be smaller than `T`
/// (built with an older header), so no `&mut T` over it may exist.
///
/// # Safety
/// `out` is NULL or points to at least `out->struct_size` writable bytes (the C caller's
/// contract), beginning with a `size_t struct_size`; no alignment is assumed.
pub unsafe fn write_versioned<T: Copy>(out: *mut T, value: T, arg: &str) -> Result<()> {
    let out = out_ptr(out, arg)? as *mut u8;
    let size = unsafe { output_size::<T>(out, arg) }?;
    unsafe { write_sized(out, size, &value) };
    Ok(())
}

/// Checks a versioned output struct before anything happens that it is to report: NULL or a bad
/// `struct_size` is refused while nothing is done yet.
pub unsafe fn checked_output<T: Copy>(ptr: *mut T, arg: &str) -> Result<*mut T> {
    let out = out_ptr(ptr, arg)?;
    unsafe { output_size::<T>(out as *mut u8, arg) }?;
    Ok(out)
}

/// The array-output convention `(out, capacity, count)` for versioned structs: the caller sets
/// `out[0].struct_size` (its `sizeof`, so its stride); each element is written as
/// [`write_versioned`] writes one. `out` NULL with `capacity` 0 is a count query; `arg` names
/// `out` in errors.
pub unsafe fn write_versioned_array<T: Copy>(items: &[T], out: *mut T, capacity: usize, count: *mut usize, arg: &str) -> Result<Status> {
    if unsafe { size_query(out, capacity, count, "count", items.len()) }? {
        return Ok(Status::KVSTAGE_OK);
    }
    if items.len() > capacity {
        return Err(Error::invalid_arg("capacity", format!("{capacity} < {} {arg} to report", items.len())));
    }
    if capacity == 0 {
        return Ok(Status::KVSTAGE_OK);
    }
    let base = out_ptr(out, arg)? as *mut u8;
    let stride = unsafe { output_size::<T>(base, &format!("{arg}[0]")) }?;
    for (i, item) in items.iter().enumerate() {
        // SAFETY: `capacity` elements of `stride` bytes are writable at `out` (by contract).
        unsafe { write_sized(base.add(i * stride), stride, item) };
    }
    Ok(Status::KVSTAGE_OK)
}

/// Timeouts in milliseconds mean one thing everywhere: 0 = the engine's default
/// (`kvstage_engine_options.default_timeout_ms`), `KVSTAGE_TIMEOUT_INFINITE` = no limit, any
/// other value that many milliseconds.
pub const KVSTAGE_TIMEOUT_INFINITE: u64 = u64::MAX;

/// The one converter of `timeout_ms` arguments and fields (see [`KVSTAGE_TIMEOUT_INFINITE`]).
pub fn timeout(ms: u64, engine_default: Option<Duration>) -> Option<Duration> {
    match ms {
        0 => engine_default,
        KVSTAGE_TIMEOUT_INFINITE => None,
        ms => Some(Duration::from_millis(ms)),
    }
}

/// A describe document as JSON text.
pub fn json(value: &impl serde::Serialize) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::internal("the describe document does not serialize").with_source(e))
}
