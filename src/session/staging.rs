//! The engine's send staging buffers: a bounded pool (count and total bytes), so chunks of
//! different sessions gather and write at the same time while memory stays bounded. A chunk waits
//! for a buffer only until its deadline; no lock is held while a buffer is in use. Buffers are host
//! memory, or device memory on a KV pool's device for sessions whose NIC reads GPU memory
//! (GPUDirect RDMA): the gather kernels write them and the NIC reads them, no host crossing.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::op::Op;
use super::Deadline;
use crate::copy::cuda::DeviceMemory;
use crate::copy::{CopyEngine, HostPin};
use crate::error::{Error, Result, Status};
use crate::transport::rdma::{NicMemory, Rdma, StagingRegistration};

/// Where a staging buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagingMemory {
    Host,
    /// Device memory of this CUDA device.
    Device(i32),
}

enum Memory {
    /// Page-locked for device pools (faster device-to-host copies), best effort; the pin is
    /// declared first: it ends before the bytes are freed.
    Host { _pin: Option<HostPin>, bytes: Vec<u8> },
    Device(DeviceMemory),
}

/// One staging buffer with, once an RDMA session took it, its registration with the engine's
/// RDMA devices.
struct Buffer {
    /// Held for its drop, which ends the registration before the memory is freed (declared
    /// first: dropped first).
    nic: Option<StagingRegistration>,
    memory: Memory,
    /// Registering it with the RDMA devices failed once: not tried again (each write from host
    /// memory registers its own range instead).
    nic_refused: bool,
}

impl Buffer {
    fn len(&self) -> usize {
        match &self.memory {
            Memory::Host { bytes, .. } => bytes.len(),
            Memory::Device(d) => d.bytes,
        }
    }

    fn kind(&self) -> StagingMemory {
        match &self.memory {
            Memory::Host { .. } => StagingMemory::Host,
            Memory::Device(d) => StagingMemory::Device(d.ordinal()),
        }
    }
}

#[derive(Default)]
struct State {
    idle: Vec<Buffer>,
    /// Buffers lent out.
    lent: usize,
    /// Bytes of every buffer, idle, lent or being freed.
    total: u64,
    /// Buffers evicted and being freed with the lock released (counted until they are gone).
    freeing: usize,
}

impl State {
    /// Buffers alive: idle, lent or being freed.
    fn buffers(&self) -> usize {
        self.idle.len() + self.lent + self.freeing
    }
}

pub struct StagingPool {
    state: Mutex<State>,
    returned: Condvar,
    max_buffers: usize,
    max_total: u64,
}

/// A buffer lent to one chunk; returned to the pool when dropped.
pub struct StagingLease<'a> {
    pool: &'a StagingPool,
    buffer: Option<Buffer>,
}

impl StagingLease<'_> {
    fn buffer(&mut self) -> &mut Buffer {
        self.buffer.as_mut().expect("a lease holds its buffer")
    }

    /// Registers the whole buffer with the RDMA devices until it is freed, once; device memory
    /// through its dma-buf (GPUDirect). Best effort for host memory (an RDMA write from memory
    /// without a registration registers its range for itself, and fails there with the cause if
    /// that fails too; logged once per buffer). A failure is returned (`Ok`: registered, or no
    /// device to register with), and not tried again for this buffer.
    pub fn register_with(&mut self, rdma: &Arc<Rdma>) -> Result<()> {
        let b = self.buffer();
        if b.nic.is_some() {
            return Ok(());
        }
        if b.nic_refused {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "this staging buffer could not be registered with the RDMA devices before"));
        }
        let len = b.len();
        let registered = match &mut b.memory {
            Memory::Host { bytes, .. } => rdma.register_staging(&NicMemory { ptr: bytes.as_mut_ptr(), len, dmabuf: None }),
            Memory::Device(d) => {
                let export = || crate::session::device_ring::dmabuf(d);
                rdma.register_staging(&NicMemory { ptr: d.ptr as *mut u8, len, dmabuf: Some(&export) })
            }
        };
        match registered {
            Ok(nic) => {
                b.nic = nic;
                Ok(())
            }
            Err(e) => {
                b.nic_refused = true;
                // A device buffer's failure is the session's to report (it stages in host memory).
                if b.kind() == StagingMemory::Host {
                    log::warn!("a send staging buffer of {len} bytes could not be registered with the RDMA devices: {}", e.chain());
                }
                Err(e)
            }
        }
    }

    /// The first `len` bytes of a host buffer (it holds at least the size asked for).
    pub fn bytes(&mut self, len: usize) -> Result<&mut [u8]> {
        match &mut self.buffer().memory {
            Memory::Host { bytes, .. } => Ok(&mut bytes[..len]),
            Memory::Device(_) => Err(Error::internal("the CPU cannot reach a device staging buffer")),
        }
    }

    /// The buffer's address: host or device memory (see [`memory`](Self::memory)).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match &mut self.buffer().memory {
            Memory::Host { bytes, .. } => bytes.as_mut_ptr(),
            Memory::Device(d) => d.ptr as *mut u8,
        }
    }

    pub fn memory(&self) -> StagingMemory {
        self.buffer.as_ref().expect("a lease holds its buffer").kind()
    }

    /// The first `len` bytes as the CPU sees them: borrowed from host memory, copied back from
    /// device memory (one device→host crossing).
    pub fn to_host(&mut self, len: usize) -> Result<std::borrow::Cow<'_, [u8]>> {
        match &mut self.buffer().memory {
            Memory::Host { bytes, .. } => Ok(std::borrow::Cow::Borrowed(&bytes[..len])),
            Memory::Device(d) => Ok(std::borrow::Cow::Owned(d.to_vec(0, len)?)),
        }
    }
}

impl Drop for StagingLease<'_> {
    fn drop(&mut self) {
        let Some(b) = self.buffer.take() else { return };
        let mut st = self.pool.state.lock();
        st.lent -= 1;
        if b.nic_refused && b.kind() != StagingMemory::Host {
            // Device memory the NIC cannot read is of no use to anyone: freed (counted until it
            // is gone, with the lock released), not kept.
            st.freeing += 1;
            let len = b.len() as u64;
            MutexGuard::unlocked(&mut st, || drop(b));
            st.total -= len;
            st.freeing -= 1;
            drop(st);
            self.pool.returned.notify_all();
            return;
        }
        st.idle.push(b);
        drop(st);
        self.pool.returned.notify_one();
    }
}

/// Device staging buffers are allocated in multiples of this.
const DEVICE_UNIT: u64 = 64 << 10;

/// How often a waiting chunk looks at its cancel flag.
const CANCEL_POLL: Duration = Duration::from_millis(20);

impl StagingPool {
    pub fn new(max_buffers: usize, max_total: u64) -> StagingPool {
        StagingPool { state: Mutex::new(State::default()), returned: Condvar::new(), max_buffers: max_buffers.max(1), max_total }
    }

    /// A buffer of at least `len` bytes in `memory`, waiting for one to be returned until
    /// `deadline` (or the operation is canceled). Buffers are kept for reuse and grown or replaced
    /// on demand within the pool's bounds (host and device buffers count alike). `copy`
    /// page-locks new host buffers for device pools (best effort).
    pub fn acquire(&self, len: u64, memory: StagingMemory, deadline: &Deadline, op: &Op, copy: &Arc<dyn CopyEngine>) -> Result<StagingLease<'_>> {
        // Device buffers in whole units: a dma-buf export covers whole pages of the allocation
        // (and the bounds count what is allocated).
        let len = match memory {
            StagingMemory::Host => len,
            StagingMemory::Device(_) => len.next_multiple_of(DEVICE_UNIT),
        };
        if len > self.max_total {
            return Err(Error::new(
                Status::KVSTAGE_E_OUT_OF_MEMORY,
                format!("a chunk share of {len} bytes exceeds the send staging pool of {} bytes", self.max_total),
            ));
        }
        let mut st = self.state.lock();
        loop {
            // The smallest idle buffer that is large enough.
            let fits = |b: &Buffer| b.len() as u64 >= len && b.kind() == memory;
            if let Some(i) = st.idle.iter().enumerate().filter(|(_, b)| fits(b)).min_by_key(|(_, b)| b.len()).map(|(i, _)| i) {
                let b = st.idle.swap_remove(i);
                st.lent += 1;
                return Ok(StagingLease { pool: self, buffer: Some(b) });
            }
            // Make room: idle buffers that are too small go first.
            let mut evicted = Vec::new();
            while st.total + len > self.max_total || st.buffers() >= self.max_buffers {
                let Some(i) = st.idle.iter().enumerate().min_by_key(|(_, b)| b.len()).map(|(i, _)| i) else { break };
                evicted.push(st.idle.swap_remove(i));
                st.freeing += 1;
            }
            if !evicted.is_empty() {
                // Freed (their registration and page lock ended) with the lock released; they
                // count against the bounds until they are gone. Then look again.
                let (bytes, n) = (evicted.iter().map(|b| b.len() as u64).sum::<u64>(), evicted.len());
                MutexGuard::unlocked(&mut st, || drop(evicted));
                st.total -= bytes;
                st.freeing -= n;
                self.returned.notify_all();
                continue;
            }
            if st.total + len <= self.max_total && st.buffers() < self.max_buffers {
                st.total += len;
                st.lent += 1;
                drop(st);
                return match allocate(len, memory, copy) {
                    Ok(b) => Ok(StagingLease { pool: self, buffer: Some(b) }),
                    Err(e) => {
                        let mut st = self.state.lock();
                        st.total -= len;
                        st.lent -= 1;
                        Err(e)
                    }
                };
            }
            if op.is_canceled() {
                return Err(Error::new(Status::KVSTAGE_E_CANCELED, "canceled while waiting for a send staging buffer"));
            }
            let what = "waiting for a send staging buffer (all are in use by other chunks)";
            let slice = match deadline.remaining(what)? {
                Some(left) => left.min(CANCEL_POLL),
                None => CANCEL_POLL,
            };
            self.returned.wait_for(&mut st, slice);
        }
    }

    /// (buffers lent, bytes held by the pool).
    pub fn usage(&self) -> (usize, u64) {
        let st = self.state.lock();
        (st.lent, st.total)
    }
}

fn allocate(len: u64, memory: StagingMemory, copy: &Arc<dyn CopyEngine>) -> Result<Buffer> {
    let memory = match memory {
        StagingMemory::Host => {
            let mut bytes = Vec::new();
            bytes
                .try_reserve_exact(len as usize)
                .map_err(|_| Error::new(Status::KVSTAGE_E_OUT_OF_MEMORY, format!("cannot allocate a send staging buffer of {len} bytes")))?;
            bytes.resize(len as usize, 0);
            // Page-locked for device pools (faster device-to-host copies); best effort.
            let pin = copy.pin_host(bytes.as_mut_ptr(), bytes.len()).ok().flatten();
            Memory::Host { _pin: pin, bytes }
        }
        StagingMemory::Device(ordinal) => Memory::Device(DeviceMemory::alloc(ordinal, len as usize)?),
    };
    Ok(Buffer { nic: None, memory, nic_refused: false })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::HostCopyEngine;
    use crate::session::op::Waker;

    struct NoWake;
    impl Waker for NoWake {
        fn wake(&self) {}
    }

    fn engine() -> Arc<dyn CopyEngine> {
        Arc::new(HostCopyEngine::new(1))
    }

    #[test]
    fn bounded_by_count_and_bytes_and_reused() {
        let pool = StagingPool::new(2, 1000);
        let (op, copy) = (Op::new(Arc::new(NoWake)), engine());
        let soon = || Deadline::after(Some(Duration::from_millis(50)));
        let a = pool.acquire(400, StagingMemory::Host, &soon(), &op, &copy).unwrap();
        let b = pool.acquire(400, StagingMemory::Host, &soon(), &op, &copy).unwrap();
        let e = pool.acquire(100, StagingMemory::Host, &soon(), &op, &copy).err().expect("a third buffer exceeds the count");
        assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT);
        drop(a);
        // Reused, not reallocated: still 800 bytes held.
        let c = pool.acquire(300, StagingMemory::Host, &soon(), &op, &copy).unwrap();
        assert_eq!(pool.usage(), (2, 800));
        drop((b, c));
        // A larger one replaces idle buffers within the byte bound.
        let d = pool.acquire(900, StagingMemory::Host, &soon(), &op, &copy).unwrap();
        assert_eq!(pool.usage(), (1, 900));
        drop(d);
        assert_eq!(pool.acquire(1001, StagingMemory::Host, &soon(), &op, &copy).err().unwrap().code(), Status::KVSTAGE_E_OUT_OF_MEMORY);
    }

    /// A chunk that evicts an idle buffer and still does not fit frees it and waits: the bytes
    /// count until the buffer is gone, then no more (no double count, nothing kept).
    #[test]
    fn an_eviction_that_does_not_make_room_frees_the_buffer_and_waits() {
        let pool = StagingPool::new(2, 1000);
        let (op, copy) = (Op::new(Arc::new(NoWake)), engine());
        let soon = || Deadline::after(Some(Duration::from_millis(50)));
        let lent = pool.acquire(600, StagingMemory::Host, &soon(), &op, &copy).unwrap();
        drop(pool.acquire(300, StagingMemory::Host, &soon(), &op, &copy).unwrap());
        assert_eq!(pool.usage(), (1, 900));
        let e = pool.acquire(500, StagingMemory::Host, &soon(), &op, &copy).err().expect("600 lent + 500 exceed 1000");
        assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT);
        assert_eq!(pool.usage(), (1, 600), "the idle buffer was evicted and freed");
        drop(lent);
        let _fits = pool.acquire(500, StagingMemory::Host, &soon(), &op, &copy).unwrap();
        assert_eq!(pool.usage(), (1, 600), "the idle 600 is large enough: reused");
    }

    #[test]
    fn a_waiter_gets_the_buffer_returned_by_another_thread_or_sees_its_cancel() {
        let pool = Arc::new(StagingPool::new(1, 100));
        let (op, copy) = (Op::new(Arc::new(NoWake)), engine());
        let held = pool.acquire(100, StagingMemory::Host, &Deadline::after(None), &op, &copy).unwrap();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| pool.acquire(50, StagingMemory::Host, &Deadline::after(Some(Duration::from_secs(10))), &op, &copy).map(|_| ()));
            std::thread::sleep(Duration::from_millis(50));
            drop(held);
            waiter.join().unwrap().unwrap();
        });
        let _again = pool.acquire(100, StagingMemory::Host, &Deadline::after(None), &op, &copy).unwrap();
        let canceled = Op::new(Arc::new(NoWake));
        canceled.cancel();
        let e = pool.acquire(10, StagingMemory::Host, &Deadline::after(None), &canceled, &copy).err().unwrap();
        assert_eq!(e.code(), Status::KVSTAGE_E_CANCELED);
    }
}
