//! Direct mode's memory: host allocations a same-host sender can map (`kvstage_shared_alloc`:
//! sealed memfds, registered here by address), a decode pool's share of them (which file and
//! offset holds each pool buffer), and the sender's mapping of that share.
//!
//! On the local socket, after the ring's greeting (which says how many files follow): one 8-byte
//! message per file (its size) with the file's descriptor attached, then the table: buffer count
//! (u32), bytes per buffer (u64), then per buffer its file (u32) and offset in it (u64).

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use parking_lot::Mutex;

use super::fdpass;
use super::memory::{map_peer_file, Mapping, SharedRing};
use crate::error::{Error, Result, Status};
use crate::geometry::{KvLayout, MemoryKind, PoolShape};

/// Files a pool share may hold. The receiver sends them all before its answer lets the sender
/// read, so they must fit the local socket's buffer together with the table (a pool spread over
/// more allocations is served through the ring).
pub const MAX_POOL_FILES: u32 = 64;
/// Buffers a pool share may describe (K and V of 2048 layers).
pub const MAX_POOL_BUFFERS: u32 = 4096;
const TABLE_ENTRY_BYTES: usize = 12;

/// Live shared allocations by address.
static ALLOCATIONS: Mutex<BTreeMap<usize, SharedRing>> = Mutex::new(BTreeMap::new());

/// `bytes` of zeroed host memory, resident and shareable with a same-host sender (a sealed memfd
/// mapped here, `memfd:kvstage-pool` in the process's mappings); freed by [`free`].
pub fn alloc(bytes: usize) -> Result<*mut u8> {
    if bytes == 0 {
        return Err(Error::invalid_arg("bytes", "0 (nothing to allocate)"));
    }
    let memory = SharedRing::create_named(c"kvstage-pool", bytes)?;
    let ptr = memory.ptr();
    ALLOCATIONS.lock().insert(ptr as usize, memory);
    Ok(ptr)
}

/// Frees an allocation of [`alloc`]. A sender that still maps it keeps its pages (not this
/// process's memory any more) until it unmaps.
pub fn free(ptr: *mut u8) -> Result<()> {
    match ALLOCATIONS.lock().remove(&(ptr as usize)) {
        Some(_) => Ok(()),
        None => Err(Error::invalid_arg("ptr", format!("{ptr:p} is not an allocation of kvstage_shared_alloc (or was freed already)"))),
    }
}

/// The shared allocation holding `[at, at + len)`: its address and size.
fn holding(all: &BTreeMap<usize, SharedRing>, at: usize, len: u64) -> Option<(usize, u64)> {
    let (&start, memory) = all.range(..=at).next_back()?;
    ((at - start) as u64).checked_add(len).filter(|&end| end <= memory.len() as u64).map(|_| (start, memory.len() as u64))
}

/// A decode pool that lies in shared allocations, as a same-host sender maps it.
#[derive(Debug)]
pub struct PoolShare {
    /// Each file once, with its size.
    files: Vec<(OwnedFd, u64)>,
    /// Per pool buffer: its file's index and its offset in it.
    buffers: Vec<(u32, u64)>,
    buffer_bytes: u64,
}

impl PoolShare {
    /// The share of a host pool whose every buffer lies in one shared allocation; `Err` says
    /// which buffer does not (the pool still works through the ring).
    pub fn of(pool: &KvLayout) -> std::result::Result<PoolShare, String> {
        if pool.memory != MemoryKind::Host {
            return Err("the KV pool is device memory".to_owned());
        }
        let buffer_bytes = pool.capacity_pages * pool.shape.page_bytes();
        let all = ALLOCATIONS.lock();
        let mut starts: Vec<(usize, u64)> = Vec::new();
        let mut buffers = Vec::with_capacity(pool.bases.len());
        for (i, &base) in pool.bases.iter().enumerate() {
            let Some((start, file_len)) = holding(&all, base, buffer_bytes) else {
                return Err(format!("pool buffer {i} at {base:#x} is not in memory of kvstage_shared_alloc"));
            };
            // One allocation is one file: its address tells it apart.
            let index = starts.iter().position(|&(s, _)| s == start).unwrap_or_else(|| {
                starts.push((start, file_len));
                starts.len() - 1
            });
            buffers.push((index as u32, (base - start) as u64));
        }
        if starts.len() as u32 > MAX_POOL_FILES || buffers.len() as u32 > MAX_POOL_BUFFERS {
            return Err(format!("the pool spans {} allocations and {} buffers (at most {MAX_POOL_FILES} and {MAX_POOL_BUFFERS})", starts.len(), buffers.len()));
        }
        let mut files = Vec::with_capacity(starts.len());
        for (start, len) in starts {
            let fd = all[&start].fd().try_clone_to_owned().map_err(|e| format!("cannot duplicate a pool allocation's descriptor: {e}"))?;
            files.push((fd, len));
        }
        Ok(PoolShare { files, buffers, buffer_bytes })
    }

    pub fn file_count(&self) -> u32 {
        self.files.len() as u32
    }

    /// Sends the files and the table on `stream` (after the greeting that announced them).
    pub fn send(&self, stream: &UnixStream) -> Result<()> {
        for (fd, len) in &self.files {
            fdpass::send_fd(stream, std::os::fd::AsFd::as_fd(fd), &len.to_le_bytes())?;
        }
        let mut table = Vec::with_capacity(12 + self.buffers.len() * TABLE_ENTRY_BYTES);
        table.extend_from_slice(&(self.buffers.len() as u32).to_le_bytes());
        table.extend_from_slice(&self.buffer_bytes.to_le_bytes());
        for (file, offset) in &self.buffers {
            table.extend_from_slice(&file.to_le_bytes());
            table.extend_from_slice(&offset.to_le_bytes());
        }
        fdpass::send_all(stream, &table).map_err(|e| Error::new(Status::KVSTAGE_E_PEER_GONE, "sending the pool's table failed").with_source(e))
    }
}

/// The receiver's KV pool mapped in this process: its layout (addresses of this process) and the
/// mappings that hold it.
#[derive(Debug)]
pub struct PeerPool {
    pub layout: KvLayout,
    _maps: Vec<Mapping>,
}

/// Receives `files` files and the table from `stream` and maps the pool of `shape` they hold.
/// Everything is checked before use: each file is a sealed memfd of the size it is said to be,
/// the table names exactly the shape's buffers, each of whole pages and inside its file. The files
/// are mapped without populating them: this process touches only the pages it is granted (a
/// receiver's claimed sizes, sparse or not, cost nothing until then).
pub fn map_peer_pool(stream: &UnixStream, files: u32, shape: &PoolShape) -> Result<PeerPool> {
    let bad = |why: String| Error::new(Status::KVSTAGE_E_PROTOCOL, format!("the receiver's pool share: {why}"));
    if files == 0 || files > MAX_POOL_FILES {
        return Err(bad(format!("{files} files (1 ..= {MAX_POOL_FILES})")));
    }
    let mut maps = Vec::with_capacity(files as usize);
    for i in 0..files {
        let mut len = [0u8; 8];
        let fd = fdpass::recv_fd(stream, &mut len)?.ok_or_else(|| bad(format!("file {i} came without its descriptor")))?;
        maps.push(map_peer_file(&fd, u64::from_le_bytes(len), false).map_err(|e| e.context(format!("the receiver's pool file {i}")))?);
    }
    let mut head = [0u8; 12];
    let mut reader = stream;
    let short = |e: std::io::Error| Error::new(Status::KVSTAGE_E_PEER_GONE, "short read of the pool's table").with_source(e);
    reader.read_exact(&mut head).map_err(short)?;
    let count = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
    let buffer_bytes = u64::from_le_bytes(head[4..].try_into().expect("8 bytes"));
    let expected = shape.buffers_per_layer() as u64 * shape.layer_ids.len() as u64;
    if count as u64 != expected {
        return Err(bad(format!("{count} buffers, its hello's shape has {expected}")));
    }
    let page_bytes = shape.page_bytes();
    if buffer_bytes == 0 || !buffer_bytes.is_multiple_of(page_bytes) {
        return Err(bad(format!("buffers of {buffer_bytes} bytes, not whole pages of {page_bytes}")));
    }
    let mut table = vec![0u8; count as usize * TABLE_ENTRY_BYTES];
    reader.read_exact(&mut table).map_err(short)?;
    let mut bases = Vec::with_capacity(count as usize);
    for (i, entry) in table.chunks_exact(TABLE_ENTRY_BYTES).enumerate() {
        let file = u32::from_le_bytes(entry[..4].try_into().expect("4 bytes"));
        let offset = u64::from_le_bytes(entry[4..].try_into().expect("8 bytes"));
        let map = maps.get(file as usize).ok_or_else(|| bad(format!("buffer {i} in file {file} of {files}")))?;
        if offset.checked_add(buffer_bytes).is_none_or(|end| end > map.len() as u64) {
            return Err(bad(format!("buffer {i} at [{offset}, +{buffer_bytes}) outside its {}-byte file", map.len())));
        }
        bases.push(map.ptr() as usize + offset as usize);
    }
    let layout = KvLayout { shape: shape.clone(), capacity_pages: buffer_bytes / page_bytes, memory: MemoryKind::Host, bases };
    Ok(PeerPool { layout, _maps: maps })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::ModelKind;

    fn shape() -> PoolShape {
        PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 3)
    }

    /// A pool in two shared allocations crosses a socket pair and is mapped at other addresses
    /// holding the same bytes; a pool in ordinary memory has no share.
    #[test]
    fn a_pool_in_shared_memory_maps_on_the_other_side() {
        let shape = shape();
        let buffer = (4 * shape.page_bytes()) as usize;
        let (a, b) = (alloc(buffer * 4).unwrap(), alloc(buffer * 2 + 64).unwrap());
        let bases = vec![a as usize, a as usize + buffer, b as usize + 64, a as usize + 2 * buffer, a as usize + 3 * buffer, b as usize + 64 + buffer];
        let pool = KvLayout { shape: shape.clone(), capacity_pages: 4, memory: MemoryKind::Host, bases: bases.clone() };
        let share = PoolShare::of(&pool).unwrap();
        assert_eq!(share.file_count(), 2);
        let (tx, rx) = UnixStream::pair().unwrap();
        share.send(&tx).unwrap();
        let peer = map_peer_pool(&rx, 2, &shape).unwrap();
        assert_eq!(peer.layout.capacity_pages, 4);
        for (i, (&here, &there)) in bases.iter().zip(&peer.layout.bases).enumerate() {
            assert_ne!(here, there);
            // SAFETY: inside both mappings of buffer i (checked above); this test is their only user.
            unsafe {
                (there as *mut u8).add(buffer - 1).write(i as u8 + 1);
                assert_eq!((here as *const u8).add(buffer - 1).read(), i as u8 + 1);
            }
        }
        let mut other = vec![0u8; buffer * 6];
        let plain = KvLayout { bases: (0..6).map(|i| other.as_mut_ptr() as usize + i * buffer).collect(), ..pool.clone() };
        assert!(PoolShare::of(&plain).unwrap_err().contains("pool buffer 0"));
        // A buffer running past its allocation has no share either.
        let past = KvLayout { bases: vec![b as usize + buffer + 65; 6], ..pool };
        assert!(PoolShare::of(&past).is_err());
        drop(peer);
        free(a).unwrap();
        free(b).unwrap();
        assert_eq!(free(a).unwrap_err().code(), Status::KVSTAGE_E_INVALID_ARG);
    }

    /// The largest share goes out whole before anyone reads the socket (the receiver sends it
    /// before its answer lets the sender read): it fits the local socket's buffer.
    #[test]
    fn the_largest_share_fits_the_socket_before_it_is_read() {
        let a = alloc(4096).unwrap();
        let fd = || ALLOCATIONS.lock()[&(a as usize)].fd().try_clone_to_owned().unwrap();
        let share = PoolShare {
            files: (0..MAX_POOL_FILES).map(|_| (fd(), 4096)).collect(),
            buffers: vec![(0, 0); MAX_POOL_BUFFERS as usize],
            buffer_bytes: 4096,
        };
        let (tx, rx) = UnixStream::pair().unwrap();
        tx.set_write_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        share.send(&tx).expect("the whole share fits unread");
        drop(rx);
        free(a).unwrap();
    }

    /// A lying table (a buffer outside its file, another shape's count) is refused.
    #[test]
    fn a_table_that_lies_is_refused() {
        let shape = shape();
        let buffer = shape.page_bytes() as usize;
        let a = alloc(buffer * 6).unwrap();
        let pool = KvLayout { shape: shape.clone(), capacity_pages: 1, memory: MemoryKind::Host, bases: (0..6).map(|i| a as usize + i * buffer).collect() };
        let share = PoolShare::of(&pool).unwrap();
        let (tx, rx) = UnixStream::pair().unwrap();
        share.send(&tx).unwrap();
        let fewer_layers = PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 2);
        assert!(map_peer_pool(&rx, 1, &fewer_layers).unwrap_err().message().contains("6 buffers"));
        let (tx, rx) = UnixStream::pair().unwrap();
        let lying = PoolShare { files: vec![(share.files[0].0.try_clone().unwrap(), share.files[0].1)], buffers: vec![(0, (buffer * 5 + 1) as u64); 6], buffer_bytes: buffer as u64 };
        lying.send(&tx).unwrap();
        assert!(map_peer_pool(&rx, 1, &shape).unwrap_err().message().contains("outside its"));
        free(a).unwrap();
    }
}
