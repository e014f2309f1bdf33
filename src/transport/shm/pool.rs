//! Direct mode's memory: host allocations a same-host sender can map (`kvstage_shared_alloc`:
//! sealed memfds, registered here by address), a decode pool's share (which allocation and offset
//! holds each pool buffer: memfds, or CUDA IPC exports of whole device allocations), and the
//! sender's mapping of that share.
//!
//! On the local socket, after the ring's greeting (which says how many allocations follow, and
//! in which memory): per allocation, a host pool's file as one 8-byte message (its size) with the
//! descriptor attached, or a device pool's allocation as its IPC handle (64 bytes), address and
//! size (u64 each); then the table: buffer count (u32), bytes per buffer (u64), then per buffer
//! its allocation (u32) and offset in it (u64).

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use parking_lot::Mutex;

use super::fdpass;
use super::greeting::PoolFiles;
use super::memory::{map_peer_file, Mapping, SharedRing};
use super::{DeviceExport, OpenDevice, PeerDevice, IPC_HANDLE_BYTES};
use crate::error::{Error, Result, Status};
use crate::geometry::{KvLayout, MemoryKind, PoolShape, Strides};

/// Allocations a pool share may hold. The receiver sends them all before its answer lets the
/// sender read, so they must fit the local socket's buffer together with the table (a pool spread
/// over more allocations is served through the ring).
pub const MAX_POOL_FILES: u32 = 64;
/// Buffers a pool share may describe (K and V of 2048 layers).
pub const MAX_POOL_BUFFERS: u32 = 4096;
const TABLE_ENTRY_BYTES: usize = 12;
/// The table's head: buffer count, capacity in pages, K's page, token and head strides, V's.
const TABLE_HEAD_BYTES: usize = 4 + 7 * 8;
/// A device allocation on the socket: IPC handle, address, size.
const DEVICE_ENTRY_BYTES: usize = IPC_HANDLE_BYTES + 16;

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

/// Allocations holding a registered KV pool (by address), with the number of engines whose pool
/// they hold: [`free`] refuses them. Locked after [`ALLOCATIONS`].
static PINNED: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// Frees an allocation of [`alloc`]. A sender that still maps it keeps its pages (not this
/// process's memory any more) until it unmaps. Refused while it holds a registered engine's KV
/// pool (a [`PoolPin`] lives).
pub fn free(ptr: *mut u8) -> Result<()> {
    let mut all = ALLOCATIONS.lock();
    if PINNED.lock().contains_key(&(ptr as usize)) {
        return Err(Error::invalid_arg(
            "ptr",
            format!("{ptr:p} holds the KV pool of a live engine (its sessions' peers may map it): free the engine first"),
        ));
    }
    match all.remove(&(ptr as usize)) {
        Some(_) => Ok(()),
        None => Err(Error::invalid_arg("ptr", format!("{ptr:p} is not an allocation of kvstage_shared_alloc (or was freed already)"))),
    }
}

/// The shared allocations holding a registered host pool's buffers, pinned against [`free`] for
/// as long as this lives (the engine's life).
#[derive(Debug)]
pub struct PoolPin(Vec<usize>);

impl PoolPin {
    pub fn new(pool: &KvLayout) -> PoolPin {
        if pool.memory != MemoryKind::Host {
            return PoolPin(Vec::new());
        }
        let all = ALLOCATIONS.lock();
        let mut starts: Vec<usize> = pool
            .bases
            .iter()
            .filter_map(|&base| all.range(..=base).next_back().filter(|(&start, m)| base < start + m.len()).map(|(&start, _)| start))
            .collect();
        starts.sort_unstable();
        starts.dedup();
        let mut pinned = PINNED.lock();
        for &s in &starts {
            *pinned.entry(s).or_default() += 1;
        }
        PoolPin(starts)
    }
}

impl Drop for PoolPin {
    fn drop(&mut self) {
        let mut pinned = PINNED.lock();
        for s in &self.0 {
            if let Some(n) = pinned.get_mut(s) {
                *n -= 1;
                if *n == 0 {
                    pinned.remove(s);
                }
            }
        }
    }
}

/// The shared allocation holding `[at, at + len)`: its address and size.
fn holding(all: &BTreeMap<usize, SharedRing>, at: usize, len: u64) -> Option<(usize, u64)> {
    let (&start, memory) = all.range(..=at).next_back()?;
    ((at - start) as u64).checked_add(len).filter(|&end| end <= memory.len() as u64).map(|_| (start, memory.len() as u64))
}

/// The allocations of a pool share.
#[derive(Debug)]
enum Allocations {
    /// Host memory of [`alloc`]: each file once, with its size.
    Files(Vec<(OwnedFd, u64)>),
    /// CUDA device memory: each allocation's IPC export (offset 0, its base address) and size.
    Device(Vec<(DeviceExport, u64)>),
}

/// A decode pool that lies in allocations a same-host sender can map, as it maps them.
#[derive(Debug)]
pub struct PoolShare {
    allocations: Allocations,
    /// Per pool buffer: its allocation's index and its offset in it.
    buffers: Vec<(u32, u64)>,
    capacity_pages: u64,
    /// K's (or the latent's) strides, V's.
    strides: [Strides; 2],
}

/// Where a pool's buffers lie: each allocation once (start, size), and per buffer its
/// allocation's index and offset in it.
type Placed = (Vec<(usize, u64)>, Vec<(u32, u64)>);

/// Each buffer's allocation and offset, given `holding(i, base)`: the start and size of the
/// allocation holding buffer `i` at `base`.
fn place_buffers(pool: &KvLayout, mut holding: impl FnMut(usize, usize) -> std::result::Result<(usize, u64), String>) -> std::result::Result<Placed, String> {
    let mut starts: Vec<(usize, u64)> = Vec::new();
    let mut buffers = Vec::with_capacity(pool.bases.len());
    for (i, &base) in pool.bases.iter().enumerate() {
        let (start, len) = holding(i, base)?;
        // One allocation is one file (or IPC handle): its address tells it apart.
        let index = starts.iter().position(|&(s, _)| s == start).unwrap_or_else(|| {
            starts.push((start, len));
            starts.len() - 1
        });
        buffers.push((index as u32, (base - start) as u64));
    }
    if starts.len() as u32 > MAX_POOL_FILES || buffers.len() as u32 > MAX_POOL_BUFFERS {
        return Err(format!("the pool spans {} allocations and {} buffers (at most {MAX_POOL_FILES} and {MAX_POOL_BUFFERS})", starts.len(), buffers.len()));
    }
    Ok((starts, buffers))
}

/// The coverage rule: a peer given an allocation reaches all of it, so each of `starts` must
/// hold nothing but pool buffers, end to end (aux rows, state or anything else a caller put in
/// it would be exposed); `Err` names the first allocation that holds other bytes and where.
fn check_coverage(starts: &[(usize, u64)], buffers: &[(u32, u64)], pool: &KvLayout, what: &str, how: &str) -> std::result::Result<(), String> {
    for (index, &(start, len)) in starts.iter().enumerate() {
        let mut held: Vec<(u64, u64)> =
            buffers.iter().enumerate().filter(|(_, b)| b.0 as usize == index).map(|(i, b)| (b.1, b.1 + pool.buffer_bytes(i as u32))).collect();
        held.sort_unstable();
        let mut covered = 0;
        for (from, to) in held {
            if from > covered {
                break;
            }
            covered = covered.max(to);
        }
        if covered < len {
            return Err(format!(
                "the {len}-byte {what} at {start:#x} holds bytes that are no KV pool buffer (from offset {covered}): {how} would give the sender all of it \
                 (allocate the pool's buffers as allocations of their own, or one allocation of exactly the buffers)"
            ));
        }
    }
    Ok(())
}

impl PoolShare {
    /// The share of a host pool whose every buffer lies in a shared allocation that holds
    /// nothing but pool buffers; `Err` says which buffer or allocation does not (the pool still
    /// works through the ring).
    pub fn of(pool: &KvLayout) -> std::result::Result<PoolShare, String> {
        if pool.memory != MemoryKind::Host {
            return Err("the KV pool is device memory".to_owned());
        }
        let all = ALLOCATIONS.lock();
        let (starts, buffers) = place_buffers(pool, |i, base| {
            holding(&all, base, pool.buffer_bytes(i as u32)).ok_or_else(|| format!("pool buffer {i} at {base:#x} is not in memory of kvstage_shared_alloc"))
        })?;
        check_coverage(&starts, &buffers, pool, "shared allocation", "its file")?;
        let mut files = Vec::with_capacity(starts.len());
        for (start, len) in starts {
            let fd = all[&start].fd().try_clone_to_owned().map_err(|e| format!("cannot duplicate a pool allocation's descriptor: {e}"))?;
            files.push((fd, len));
        }
        Ok(PoolShare { allocations: Allocations::Files(files), buffers, capacity_pages: pool.capacity_pages, strides: [pool.strides, pool.v_strides] })
    }

    /// The share of a CUDA pool: `allocation(base)` names the device allocation holding the
    /// buffer at `base` (its start and size), `export(start)` exports an allocation by IPC. A
    /// peer that opens a handle reaches all of its allocation, so every allocation must hold
    /// nothing but the pool's buffers (a caller's allocator segment that also holds weights or
    /// activations is not shared; the pool still works through the ring); `Err` says which.
    pub fn device(
        pool: &KvLayout,
        allocation: impl Fn(usize) -> std::result::Result<(usize, u64), String>,
        export: impl Fn(usize) -> std::result::Result<DeviceExport, String>,
    ) -> std::result::Result<PoolShare, String> {
        if pool.memory != MemoryKind::Cuda {
            return Err("the KV pool is host memory".to_owned());
        }
        let (starts, buffers) = place_buffers(pool, |i, base| {
            let buffer_bytes = pool.buffer_bytes(i as u32);
            let (start, len) = allocation(base).map_err(|e| format!("pool buffer {i} at {base:#x}: {e}"))?;
            if base < start || (base - start) as u64 + buffer_bytes > len {
                return Err(format!("pool buffer {i} at {base:#x} ({buffer_bytes} bytes) does not lie in the {len}-byte allocation at {start:#x}"));
            }
            Ok((start, len))
        })?;
        check_coverage(&starts, &buffers, pool, "device allocation", "CUDA IPC")?;
        let exports = starts.iter().map(|&(start, len)| export(start).map(|x| (x, len))).collect::<std::result::Result<Vec<_>, String>>()?;
        Ok(PoolShare { allocations: Allocations::Device(exports), buffers, capacity_pages: pool.capacity_pages, strides: [pool.strides, pool.v_strides] })
    }

    /// What the greeting announces of this share.
    pub fn files(&self) -> PoolFiles {
        match &self.allocations {
            Allocations::Files(f) => PoolFiles { count: f.len() as u32, device: false },
            Allocations::Device(d) => PoolFiles { count: d.len() as u32, device: true },
        }
    }

    /// Sends the allocations and the table on `stream` (after the greeting that announced them).
    pub fn send(&self, stream: &UnixStream) -> Result<()> {
        let short = |e: std::io::Error| Error::new(Status::KVSTAGE_E_PEER_GONE, "sending the pool's share failed").with_source(e);
        match &self.allocations {
            Allocations::Files(files) => {
                for (fd, len) in files {
                    fdpass::send_fd(stream, std::os::fd::AsFd::as_fd(fd), &len.to_le_bytes())?;
                }
            }
            Allocations::Device(exports) => {
                let mut out = Vec::with_capacity(exports.len() * DEVICE_ENTRY_BYTES);
                for (x, len) in exports {
                    out.extend_from_slice(&x.handle);
                    out.extend_from_slice(&x.ptr.to_le_bytes());
                    out.extend_from_slice(&len.to_le_bytes());
                }
                fdpass::send_all(stream, &out).map_err(short)?;
            }
        }
        let mut table = Vec::with_capacity(TABLE_HEAD_BYTES + self.buffers.len() * TABLE_ENTRY_BYTES);
        table.extend_from_slice(&(self.buffers.len() as u32).to_le_bytes());
        let [k, v] = self.strides;
        for word in [self.capacity_pages, k.page, k.token, k.head, v.page, v.token, v.head] {
            table.extend_from_slice(&word.to_le_bytes());
        }
        for (file, offset) in &self.buffers {
            table.extend_from_slice(&file.to_le_bytes());
            table.extend_from_slice(&offset.to_le_bytes());
        }
        fdpass::send_all(stream, &table).map_err(short)
    }
}

/// The receiver's KV pool mapped in this process: its layout (addresses of this process) and what
/// holds it (host mappings, or device allocations opened through CUDA IPC).
pub struct PeerPool {
    pub layout: KvLayout,
    _maps: Vec<Mapping>,
    _devices: Vec<Box<dyn PeerDevice>>,
}

impl std::fmt::Debug for PeerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerPool({:?}, {} buffers)", self.layout.memory, self.layout.bases.len())
    }
}

/// Receives `files` allocations and the table from `stream` and maps the pool of `shape` they
/// hold: host files mapped here, or device allocations opened with `open_device` (`None`: this
/// engine's pool is host memory, which a device pool is not written from; `same_process`: the
/// receiver is this process). Everything is checked before use: each file is a sealed memfd of
/// the size it is said to be, each device allocation opens on this pool's device and holds its
/// size, the table names exactly the shape's buffers, a valid layout (the receiver's own strides:
/// no two rows share a byte) with each buffer inside its allocation. Host files are mapped without populating them: this process touches only the pages
/// it is granted (a receiver's claimed sizes, sparse or not, cost nothing until then).
pub fn map_peer_pool(stream: &UnixStream, files: PoolFiles, shape: &PoolShape, open_device: Option<OpenDevice<'_>>, same_process: bool) -> Result<PeerPool> {
    let bad = |why: String| Error::new(Status::KVSTAGE_E_PROTOCOL, format!("the receiver's pool share: {why}"));
    let PoolFiles { count, device } = files;
    if count == 0 || count > MAX_POOL_FILES {
        return Err(bad(format!("{count} allocations (1 ..= {MAX_POOL_FILES})")));
    }
    let mut reader = stream;
    let short = |e: std::io::Error| Error::new(Status::KVSTAGE_E_PEER_GONE, "short read of the pool's share").with_source(e);
    let (mut maps, mut devices) = (Vec::new(), Vec::new());
    // Each allocation's first byte here and its size.
    let mut spans: Vec<(usize, u64)> = Vec::with_capacity(count as usize);
    for i in 0..count {
        if device {
            let Some(open_device) = open_device else {
                return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the receiver's KV pool is CUDA device memory and this engine's is host memory"));
            };
            let mut entry = [0u8; DEVICE_ENTRY_BYTES];
            reader.read_exact(&mut entry).map_err(short)?;
            let word = |at: usize| u64::from_le_bytes(entry[at..at + 8].try_into().expect("8 bytes"));
            let export = DeviceExport { handle: entry[..IPC_HANDLE_BYTES].try_into().expect("the handle's bytes"), offset: 0, ptr: word(IPC_HANDLE_BYTES) };
            let len = word(IPC_HANDLE_BYTES + 8);
            let len = usize::try_from(len).map_err(|_| bad(format!("allocation {i} of {len} bytes")))?;
            let opened = open_device(&export, len, same_process).map_err(|e| e.context(format!("the receiver's pool allocation {i}")))?;
            if opened.bytes() != len {
                return Err(Error::internal(format!("a pool allocation of {} bytes was opened for {len}", opened.bytes())));
            }
            spans.push((opened.ptr() as usize, len as u64));
            devices.push(opened);
        } else {
            let mut len = [0u8; 8];
            let fd = fdpass::recv_fd(stream, &mut len)?.ok_or_else(|| bad(format!("file {i} came without its descriptor")))?;
            let map = map_peer_file(&fd, u64::from_le_bytes(len), false).map_err(|e| e.context(format!("the receiver's pool file {i}")))?;
            spans.push((map.ptr() as usize, map.len() as u64));
            maps.push(map);
        }
    }
    let mut head = [0u8; TABLE_HEAD_BYTES];
    reader.read_exact(&mut head).map_err(short)?;
    let buffers = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
    let word = |k: usize| u64::from_le_bytes(head[4 + 8 * k..12 + 8 * k].try_into().expect("8 bytes"));
    let (capacity_pages, strides, v_strides) = (word(0), Strides { page: word(1), token: word(2), head: word(3) }, Strides { page: word(4), token: word(5), head: word(6) });
    let expected = shape.buffers_per_layer() as u64 * shape.layer_ids.len() as u64;
    if buffers as u64 != expected {
        return Err(bad(format!("{buffers} buffers, its hello's shape has {expected}")));
    }
    // Checked as a layout before any base is known: strides that nest, a size that fits.
    let memory = if device { MemoryKind::Cuda } else { MemoryKind::Host };
    let sized = KvLayout::new(shape.clone(), capacity_pages, memory, Vec::new()).with_strides(strides).with_v_strides(v_strides);
    let mut table = vec![0u8; buffers as usize * TABLE_ENTRY_BYTES];
    reader.read_exact(&mut table).map_err(short)?;
    let mut bases = Vec::with_capacity(buffers as usize);
    for (i, entry) in table.chunks_exact(TABLE_ENTRY_BYTES).enumerate() {
        let file = u32::from_le_bytes(entry[..4].try_into().expect("4 bytes"));
        let offset = u64::from_le_bytes(entry[4..].try_into().expect("8 bytes"));
        let &(at, len) = spans.get(file as usize).ok_or_else(|| bad(format!("buffer {i} in allocation {file} of {count}")))?;
        let buffer_bytes = sized.buffer_bytes(i as u32);
        if offset.checked_add(buffer_bytes).is_none_or(|end| end > len) {
            return Err(bad(format!("buffer {i} at [{offset}, +{buffer_bytes}) outside its {len}-byte allocation")));
        }
        bases.push(at + offset as usize);
    }
    let layout = KvLayout { bases, ..sized };
    layout.validate().map_err(|e| bad(e.chain()))?;
    Ok(PeerPool { layout, _maps: maps, _devices: devices })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::ModelKind;

    fn shape() -> PoolShape {
        PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 3)
    }

    /// A pool in two shared allocations crosses a socket pair and is mapped at other addresses
    /// holding the same bytes; a pool in ordinary memory has no share, nor one whose allocation
    /// holds anything besides its buffers (the peer would reach all of it).
    #[test]
    fn a_pool_in_shared_memory_maps_on_the_other_side() {
        let shape = shape();
        let buffer = (4 * shape.page_bytes()) as usize;
        let (a, b) = (alloc(buffer * 4).unwrap(), alloc(buffer * 2).unwrap());
        let bases = vec![a as usize, a as usize + buffer, b as usize, a as usize + 2 * buffer, a as usize + 3 * buffer, b as usize + buffer];
        let pool = KvLayout::new(shape.clone(), 4, MemoryKind::Host, bases.clone());
        let share = PoolShare::of(&pool).unwrap();
        assert_eq!(share.files(), PoolFiles { count: 2, device: false });
        let (tx, rx) = UnixStream::pair().unwrap();
        share.send(&tx).unwrap();
        let peer = map_peer_pool(&rx, share.files(), &shape, None, false).unwrap();
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
        let past = KvLayout { bases: vec![b as usize + buffer + 1; 6], ..pool.clone() };
        assert!(PoolShare::of(&past).is_err());
        // Other bytes in an allocation (a caller's aux rows before the buffers, or after them):
        // named with where they start.
        let c = alloc(buffer * 2 + 64).unwrap();
        let before = KvLayout { bases: vec![a as usize, a as usize + buffer, c as usize + 64, a as usize + 2 * buffer, a as usize + 3 * buffer, c as usize + 64 + buffer], ..pool.clone() };
        let e = PoolShare::of(&before).unwrap_err();
        assert!(e.contains(&format!("the {}-byte shared allocation at {c:p} holds bytes that are no KV pool buffer (from offset 0)", buffer * 2 + 64)), "{e}");
        let after = KvLayout { bases: vec![a as usize, a as usize + buffer, c as usize, a as usize + 2 * buffer, a as usize + 3 * buffer, c as usize + buffer], ..pool.clone() };
        let e = PoolShare::of(&after).unwrap_err();
        assert!(e.contains(&format!("(from offset {})", buffer * 2)), "{e}");
        drop(peer);
        // A registered pool's allocations are not freed under it.
        let pin = PoolPin::new(&pool);
        let e = free(a).unwrap_err();
        assert!(e.code() == Status::KVSTAGE_E_INVALID_ARG && e.message().contains("holds the KV pool of a live engine"), "{}", e.chain());
        drop(pin);
        free(a).unwrap();
        free(b).unwrap();
        free(c).unwrap();
        assert_eq!(free(a).unwrap_err().code(), Status::KVSTAGE_E_INVALID_ARG);
    }

    /// The largest share goes out whole before anyone reads the socket (the receiver sends it
    /// before its answer lets the sender read): it fits the local socket's buffer.
    #[test]
    fn the_largest_share_fits_the_socket_before_it_is_read() {
        let a = alloc(4096).unwrap();
        let fd = || ALLOCATIONS.lock()[&(a as usize)].fd().try_clone_to_owned().unwrap();
        let share = PoolShare {
            allocations: Allocations::Files((0..MAX_POOL_FILES).map(|_| (fd(), 4096)).collect()),
            buffers: vec![(0, 0); MAX_POOL_BUFFERS as usize],
            capacity_pages: 1,
            strides: [Strides { page: 4096, token: 256, head: 64 }; 2],
        };
        let (tx, rx) = UnixStream::pair().unwrap();
        tx.set_write_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        share.send(&tx).expect("the whole share fits unread");
        drop(rx);
        free(a).unwrap();
    }

    /// Host memory standing in for a peer's device allocation, as `open_device` returns it.
    struct Opened(Vec<u8>);

    impl PeerDevice for Opened {
        fn ptr(&self) -> u64 {
            self.0.as_ptr() as u64
        }

        fn bytes(&self) -> usize {
            self.0.len()
        }

        fn to_vec(&self, at: usize, len: usize) -> Result<Vec<u8>> {
            Ok(self.0[at..at + len].to_vec())
        }
    }

    /// A CUDA pool is shared only when every allocation holding its buffers holds nothing else
    /// (a peer that opens an IPC handle reaches all of it); the share crosses the socket as IPC
    /// exports and opens on the other side at the opened addresses.
    #[test]
    fn a_device_pool_is_shared_only_when_its_allocations_hold_nothing_else() {
        let shape = shape();
        let buffer = 4 * shape.page_bytes() as usize;
        let (a, b) = (0x7000_0000usize, 0x7100_0000usize);
        let pool_at = |bases: Vec<usize>| KvLayout::new(shape.clone(), 4, MemoryKind::Cuda, bases);
        // Allocation a holds buffers 0, 1, 3, 4 back to back; b holds 2 and 5.
        let pool = pool_at(vec![a, a + buffer, b, a + 2 * buffer, a + 3 * buffer, b + buffer]);
        let allocations = |sizes: (u64, u64)| {
            move |base: usize| match base {
                x if (a..a + 0x100_0000).contains(&x) => Ok((a, sizes.0)),
                x if (b..b + 0x100_0000).contains(&x) => Ok((b, sizes.1)),
                x => Err(format!("{x:#x} is no allocation")),
            }
        };
        let export = |start: usize| Ok(DeviceExport { handle: [start as u8; IPC_HANDLE_BYTES], offset: 0, ptr: start as u64 });
        let exact = (4 * buffer as u64, 2 * buffer as u64);
        let share = PoolShare::device(&pool, allocations(exact), export).unwrap();
        assert_eq!(share.files(), PoolFiles { count: 2, device: true });
        // 64 bytes past b's buffers: something else lives there.
        let e = PoolShare::device(&pool, allocations((exact.0, exact.1 + 64)), export).unwrap_err();
        assert!(e.contains(&format!("holds bytes that are no KV pool buffer (from offset {})", 2 * buffer)), "{e}");
        // A hole between buffers (buffer 3 moved past the end of a's others).
        let holed = pool_at(vec![a, a + buffer, b, a + 3 * buffer, a + 4 * buffer, b + buffer]);
        let e = PoolShare::device(&holed, allocations((5 * buffer as u64, exact.1)), export).unwrap_err();
        assert!(e.contains(&format!("from offset {}", 2 * buffer)), "{e}");
        // A buffer running past its allocation, memory the driver does not know, a host pool.
        assert!(PoolShare::device(&pool, allocations((exact.0 - 1, exact.1)), export).unwrap_err().contains("does not lie in"));
        assert!(PoolShare::device(&pool_at(vec![0x10; 6]), allocations(exact), export).unwrap_err().contains("is no allocation"));
        assert!(PoolShare::device(&KvLayout { memory: MemoryKind::Host, ..pool.clone() }, allocations(exact), export).is_err());

        // Across the socket: each allocation opened once, buffers at their offsets there.
        let opened = Mutex::new(Vec::new());
        let open = |x: &DeviceExport, len: usize, same_process: bool| -> Result<Box<dyn PeerDevice>> {
            assert!(!same_process);
            opened.lock().push((x.handle[0], x.ptr, len));
            Ok(Box::new(Opened(vec![0u8; len])))
        };
        let (tx, rx) = UnixStream::pair().unwrap();
        share.send(&tx).unwrap();
        let peer = map_peer_pool(&rx, share.files(), &shape, Some(&open), false).unwrap();
        assert_eq!(*opened.lock(), vec![(a as u8, a as u64, exact.0 as usize), (b as u8, b as u64, exact.1 as usize)]);
        assert_eq!(peer.layout.memory, MemoryKind::Cuda);
        assert_eq!(peer.layout.capacity_pages, 4);
        let (pa, pb) = (peer._devices[0].ptr() as usize, peer._devices[1].ptr() as usize);
        assert_eq!(peer.layout.bases, vec![pa, pa + buffer, pb, pa + 2 * buffer, pa + 3 * buffer, pb + buffer]);
        // A host engine cannot write a device pool; an allocation that opens smaller than said is refused.
        let (tx, rx) = UnixStream::pair().unwrap();
        share.send(&tx).unwrap();
        assert_eq!(map_peer_pool(&rx, share.files(), &shape, None, false).unwrap_err().code(), Status::KVSTAGE_E_UNSUPPORTED);
        let (tx, rx) = UnixStream::pair().unwrap();
        share.send(&tx).unwrap();
        let short = |_: &DeviceExport, len: usize, _: bool| -> Result<Box<dyn PeerDevice>> { Ok(Box::new(Opened(vec![0u8; len - 1]))) };
        assert!(map_peer_pool(&rx, share.files(), &shape, Some(&short), false).is_err());
    }

    /// A lying table (a buffer outside its file, another shape's count) is refused.
    #[test]
    fn a_table_that_lies_is_refused() {
        let shape = shape();
        let buffer = shape.page_bytes() as usize;
        let a = alloc(buffer * 6).unwrap();
        let pool = KvLayout::new(shape.clone(), 1, MemoryKind::Host, (0..6).map(|i| a as usize + i * buffer).collect());
        let share = PoolShare::of(&pool).unwrap();
        let (tx, rx) = UnixStream::pair().unwrap();
        share.send(&tx).unwrap();
        let fewer_layers = PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 2);
        assert!(map_peer_pool(&rx, share.files(), &fewer_layers, None, false).unwrap_err().message().contains("6 buffers"));
        let (tx, rx) = UnixStream::pair().unwrap();
        let Allocations::Files(files) = &share.allocations else { panic!("a host pool shared as device memory") };
        let tm = [Strides::token_major_of(&shape, 0), Strides::token_major_of(&shape, 1)];
        let lying = PoolShare { allocations: Allocations::Files(vec![(files[0].0.try_clone().unwrap(), files[0].1)]), buffers: vec![(0, (buffer * 5 + 1) as u64); 6], capacity_pages: 1, strides: tm };
        lying.send(&tx).unwrap();
        assert!(map_peer_pool(&rx, lying.files(), &shape, None, false).unwrap_err().message().contains("outside its"));
        // A receiver lying about its strides (K's or V's): rows that share bytes, or that reach
        // past the buffers it shares, are refused before any byte is written.
        let Allocations::Files(files) = &share.allocations else { panic!("a host pool shared as device memory") };
        let squeezed = Strides { token: tm[0].head, ..tm[0] };
        let past = Strides { token: tm[1].token * 64, ..tm[1] };
        for (strides, says) in [([squeezed, tm[1]], "field `head_stride`"), ([tm[0], squeezed], "field `v_head_stride`"), ([tm[0], past], "outside its")] {
            let (tx, rx) = UnixStream::pair().unwrap();
            let lie = PoolShare { allocations: Allocations::Files(vec![(files[0].0.try_clone().unwrap(), files[0].1)]), buffers: share.buffers.clone(), capacity_pages: share.capacity_pages, strides };
            lie.send(&tx).unwrap();
            let e = map_peer_pool(&rx, lie.files(), &shape, None, false).unwrap_err();
            assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL, "{}", e.chain());
            assert!(e.chain().contains(says), "{says}: {}", e.chain());
        }
        free(a).unwrap();
    }
}
