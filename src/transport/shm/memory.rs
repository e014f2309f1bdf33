//! Shareable ring memory: a sealed memfd mapped `MAP_SHARED`. The receiver creates it; a
//! same-host sender maps the same pages through the descriptor it was passed.
//!
//! The seals (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) fix the size for good, so a mapping
//! can never fault on pages cut away underneath it. The pages live while any mapping or
//! descriptor does: a sender still mapping the ring after the receiver's engine is freed writes
//! into orphaned pages, never into memory that was returned to anyone.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result, Status};

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A `MAP_SHARED` mapping, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory; who writes where is decided by the receiver's state.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` read-write and shared, populated: the pages are allocated (or,
    /// for a peer's ring, their page tables filled) now, not by the first transfers' writes.
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Mapping> {
        Self::map_with(fd, len, true)
    }

    /// As [`map`](Self::map); `populate` false leaves the pages to be faulted in when touched.
    fn map_with(fd: BorrowedFd<'_>, len: usize, populate: bool) -> Result<Mapping> {
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        // SAFETY: a fresh mapping chosen by the kernel; the fd's size was checked by the caller.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(Error::new(Status::KVSTAGE_E_OUT_OF_MEMORY, format!("cannot map a shared ring of {len} bytes"))
                .with_source(std::io::Error::last_os_error()));
        }
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; nothing uses them after this.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A sealed memfd of `len` bytes and its mapping.
pub struct SharedRing {
    fd: OwnedFd,
    mapping: Mapping,
}

impl SharedRing {
    /// A staging ring (its mappings show as `memfd:kvstage-ring`).
    pub fn create(len: usize) -> Result<SharedRing> {
        Self::create_named(c"kvstage-ring", len)
    }

    /// Shared memory named `name` in the process's mappings (`memfd:<name>`).
    pub fn create_named(name: &std::ffi::CStr, len: usize) -> Result<SharedRing> {
        // SAFETY: a NUL-terminated name and flags.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(Error::new(Status::KVSTAGE_E_OUT_OF_MEMORY, "memfd_create failed").with_source(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain fcntl/ftruncate on our own descriptor.
        let sized = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } == 0
            && unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } == 0;
        if !sized {
            return Err(Error::new(Status::KVSTAGE_E_OUT_OF_MEMORY, format!("cannot size a shared ring of {len} bytes"))
                .with_source(std::io::Error::last_os_error()));
        }
        let mapping = Mapping::map(std::os::fd::AsFd::as_fd(&fd), len)?;
        Ok(SharedRing { fd, mapping })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.fd)
    }

    pub fn ptr(&self) -> *mut u8 {
        self.mapping.ptr()
    }

    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mapping.is_empty()
    }
}

/// Checks a descriptor a peer passed as its ring: a memfd whose size is `len` and sealed against
/// shrinking (so our mapping can never fault), then maps it populated.
pub fn map_peer_ring(fd: &OwnedFd, len: u64) -> Result<Mapping> {
    map_peer_file(fd, len, true)
}

/// As [`map_peer_ring`], for any shared memory file a peer passed; `populate` false maps it
/// without touching its pages.
pub fn map_peer_file(fd: &OwnedFd, len: u64, populate: bool) -> Result<Mapping> {
    // The seal first: once F_SEAL_SHRINK is set the size checked next can no longer drop (checked
    // the other way round, the peer could shrink the file between the two checks and then seal it).
    // SAFETY: fcntl/fstat on a descriptor we own.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("the peer's ring is not sealed against shrinking (seals {seals:#x})")));
    }
    // SAFETY: as above.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, "fstat of the peer's ring failed").with_source(std::io::Error::last_os_error()));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size as u64 != len {
        return Err(Error::new(
            Status::KVSTAGE_E_PROTOCOL,
            format!("the peer's ring descriptor is not a {len}-byte memory file (mode {:#o}, size {})", st.st_mode, st.st_size),
        ));
    }
    let len = usize::try_from(len).map_err(|_| Error::new(Status::KVSTAGE_E_PROTOCOL, format!("a ring of {len} bytes")))?;
    let mapping = Mapping::map_with(std::os::fd::AsFd::as_fd(fd), len, populate)?;
    // A child forked by the engine's process (multiprocessing, a helper) gets no copy of the
    // mapping: only this process, whose teardown the receiver waits for, can write the ring.
    // SAFETY: advice on our own mapping.
    unsafe { libc::madvise(mapping.ptr().cast(), mapping.len(), libc::MADV_DONTFORK) };
    Ok(mapping)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_mapping_sees_the_same_bytes() {
        let ring = SharedRing::create(1 << 16).unwrap();
        let fd = ring.fd().try_clone_to_owned().unwrap();
        let peer = map_peer_ring(&fd, 1 << 16).unwrap();
        // SAFETY: both mappings are 64 KiB; this test is their only user.
        unsafe {
            peer.ptr().add(4096).write(0x5a);
            assert_eq!(ring.ptr().add(4096).read(), 0x5a);
        }
        // The size is sealed: the ring can never shrink under a peer's mapping.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
    }

    #[test]
    fn a_wrong_size_or_an_unsealed_file_is_refused() {
        let ring = SharedRing::create(8192).unwrap();
        let fd = ring.fd().try_clone_to_owned().unwrap();
        assert_eq!(map_peer_ring(&fd, 4096).unwrap_err().code(), Status::KVSTAGE_E_PROTOCOL);
        let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
        assert_eq!(unsafe { libc::ftruncate(unsealed.as_raw_fd(), 8192) }, 0);
        assert!(map_peer_ring(&unsealed, 8192).unwrap_err().message().contains("sealed"));
    }
}
