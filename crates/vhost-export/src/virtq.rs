//! The device's side of a split virtqueue in guest memory: the available ring read, descriptor
//! chains walked and checked, the used ring written, and notifications suppressed both ways.
//!
//! Everything here is read from memory the guest writes at the same time, and nothing read is
//! trusted: a head outside the ring, a chain longer than the queue (a loop), a buffer outside
//! guest memory, a nested or malformed indirect table, or a readable buffer after a writable
//! one is an error of the ring, which the caller answers by stopping it (see the worker).
//! Chains are walked here rather than with `virtio-queue`'s iterator because a restart must
//! walk the chains of heads it finds in the in-flight region, which that crate cannot do.

use std::num::Wrapping;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_ring::{
    VRING_AVAIL_F_NO_INTERRUPT, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::memory::GuestMem;

/// The largest queue the export accepts (QEMU's limit).
pub const MAX_QUEUE_SIZE: u16 = 1024;

/// Bytes of one descriptor.
const DESC_BYTES: u64 = 16;

/// Most descriptors in an indirect table. Linux fills one with `seg_max` buffers plus the
/// header and the status byte whatever the queue's size (QEMU allows the same).
pub const MAX_INDIRECT: u16 = 1024;

/// Why a virtqueue cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The size is not a power of two in 1..=1024.
    #[error("queue size {0} is not a power of two up to {MAX_QUEUE_SIZE}")]
    Size(u16),
    /// A ring area is misaligned or not inside one region of guest memory.
    #[error("the {0} area is misaligned or outside guest memory")]
    Area(&'static str),
    /// The driver made more buffers available than the ring holds.
    #[error("the available index ran {ahead} entries ahead of the device in a ring of {size}")]
    Runaway {
        /// Entries ahead.
        ahead: u16,
        /// Ring size.
        size: u16,
    },
    /// A head outside the descriptor table.
    #[error("head {0} is outside the descriptor table")]
    Head(u16),
    /// A `next` outside the table it is in.
    #[error("chain of head {head}: next {next} is outside its table of {len}")]
    Next {
        /// The chain's head.
        head: u16,
        /// The index named.
        next: u16,
        /// The table's length.
        len: u16,
    },
    /// A chain longer than its table: a loop.
    #[error("chain of head {0} is longer than its descriptor table (a loop)")]
    Loop(u16),
    /// A buffer or an indirect table outside guest memory.
    #[error("chain of head {head}: {len} bytes at {addr:#x} are outside guest memory")]
    Outside {
        /// The chain's head.
        head: u16,
        /// The buffer's guest address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// An indirect table that is nested, chained, empty, misaligned in length, or not offered.
    #[error("chain of head {head}: bad indirect table ({why})")]
    Indirect {
        /// The chain's head.
        head: u16,
        /// What is wrong.
        why: &'static str,
    },
    /// A device-readable buffer after a device-writable one.
    #[error("chain of head {0}: a readable buffer follows a writable one")]
    Order(u16),
    /// Guest memory could not be read or written where the ring said.
    #[error("guest memory access failed: {0}")]
    Memory(String),
}

/// A run of guest memory inside one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    /// Guest address.
    pub addr: GuestAddress,
    /// Bytes.
    pub len: u32,
}

/// A descriptor chain, its buffers split where guest memory regions end.
#[derive(Debug, Default, Clone)]
pub struct Chain {
    /// The head's index.
    pub head: u16,
    /// Device-readable buffers, in order.
    pub readable: Vec<Seg>,
    /// Device-writable buffers, in order.
    pub writable: Vec<Seg>,
}

impl Chain {
    fn clear(&mut self, head: u16) {
        self.head = head;
        self.readable.clear();
        self.writable.clear();
    }
}

/// Where a virtqueue's three areas are in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingAddrs {
    /// The descriptor table.
    pub desc: GuestAddress,
    /// The driver area (available ring).
    pub avail: GuestAddress,
    /// The device area (used ring).
    pub used: GuestAddress,
}

/// Where the device stands in a virtqueue: what it hands back to the frontend on
/// `GET_VRING_BASE`, and takes up from on `SET_VRING_BASE`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingPosition {
    /// The next available entry the device will take.
    pub next_avail: u16,
    /// The next used entry the device will write.
    pub next_used: u16,
}

/// The device's side of one split virtqueue.
#[derive(Debug)]
pub struct Vring {
    mem: Arc<GuestMem>,
    size: u16,
    addrs: RingAddrs,
    event_idx: bool,
    indirect: bool,
    next_avail: Wrapping<u16>,
    next_used: Wrapping<u16>,
    /// The used index at the last call to the driver, if any since start.
    signalled: Option<Wrapping<u16>>,
}

impl Vring {
    /// The virtqueue of `size` entries at `addrs`, taken up at `at`. `event_idx` and
    /// `indirect` say which of those features were negotiated.
    pub fn new(
        mem: Arc<GuestMem>,
        size: u16,
        addrs: RingAddrs,
        at: RingPosition,
        event_idx: bool,
        indirect: bool,
    ) -> Result<Vring, RingError> {
        if size == 0 || !size.is_power_of_two() || size > MAX_QUEUE_SIZE {
            return Err(RingError::Size(size));
        }
        let n = u64::from(size);
        let areas = [
            ("descriptor", addrs.desc, DESC_BYTES * n, 16),
            ("available", addrs.avail, 6 + 2 * n, 2),
            ("used", addrs.used, 6 + 8 * n, 4),
        ];
        for (name, addr, len, align) in areas {
            if addr.raw_value() % align != 0 || !mem.holds(addr, len) {
                return Err(RingError::Area(name));
            }
        }
        Ok(Vring {
            mem,
            size,
            addrs,
            event_idx,
            indirect,
            next_avail: Wrapping(at.next_avail),
            next_used: Wrapping(at.next_used),
            signalled: None,
        })
    }

    /// Entries in the ring.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Where the device stands.
    pub fn position(&self) -> RingPosition {
        RingPosition { next_avail: self.next_avail.0, next_used: self.next_used.0 }
    }

    /// Takes up at `next_avail` (after a restart, from the in-flight region).
    pub fn set_next_avail(&mut self, next_avail: u16) {
        self.next_avail = Wrapping(next_avail);
    }

    fn mem_err(e: impl std::fmt::Display) -> RingError {
        RingError::Memory(e.to_string())
    }

    fn load_u16(&self, addr: GuestAddress, order: Ordering) -> Result<u16, RingError> {
        self.mem.memory().load(addr, order).map_err(Self::mem_err)
    }

    fn store_u16(&self, v: u16, addr: GuestAddress, order: Ordering) -> Result<(), RingError> {
        self.mem.memory().store(v, addr, order).map_err(Self::mem_err)
    }

    /// The used index as it stands in guest memory.
    pub fn used_idx_in_memory(&self) -> Result<u16, RingError> {
        self.load_u16(self.addrs.used.unchecked_add(2), Ordering::Acquire)
    }

    /// How many entries the driver has made available that the device has not taken.
    pub fn pending(&self) -> Result<u16, RingError> {
        let idx = Wrapping(self.load_u16(self.addrs.avail.unchecked_add(2), Ordering::Acquire)?);
        let ahead = (idx - self.next_avail).0;
        if ahead > self.size {
            return Err(RingError::Runaway { ahead, size: self.size });
        }
        Ok(ahead)
    }

    /// Takes the next available head, if there is one.
    pub fn pop(&mut self) -> Result<Option<u16>, RingError> {
        if self.pending()? == 0 {
            return Ok(None);
        }
        let slot = u64::from(self.next_avail.0 % self.size);
        let head = self.load_u16(self.addrs.avail.unchecked_add(4 + 2 * slot), Ordering::Relaxed)?;
        if head >= self.size {
            return Err(RingError::Head(head));
        }
        self.next_avail += 1;
        Ok(Some(head))
    }

    fn descriptor(&self, table: GuestAddress, index: u16) -> Result<Descriptor, RingError> {
        self.mem.memory().read_obj(table.unchecked_add(DESC_BYTES * u64::from(index))).map_err(Self::mem_err)
    }

    /// Walks the chain of `head` into `out`, checking it whole.
    pub fn chain(&self, head: u16, out: &mut Chain) -> Result<(), RingError> {
        out.clear(head);
        if head >= self.size {
            return Err(RingError::Head(head));
        }
        let (mut table, mut table_len) = (self.addrs.desc, self.size);
        let mut index = head;
        let mut in_indirect = false;
        // No table is walked longer than it is: more is a loop.
        let mut seen: u32 = 0;
        loop {
            seen += 1;
            if seen > u32::from(table_len) {
                return Err(RingError::Loop(head));
            }
            let d = self.descriptor(table, index)?;
            let flags = u32::from(d.flags());
            if flags & VRING_DESC_F_INDIRECT != 0 {
                let why = if !self.indirect {
                    Some("indirect descriptors were not negotiated")
                } else if in_indirect {
                    Some("nested")
                } else if flags & VRING_DESC_F_NEXT != 0 {
                    Some("chained with NEXT")
                } else if d.len() == 0 || u64::from(d.len()) % DESC_BYTES != 0 {
                    Some("length is not a whole number of descriptors")
                } else if u64::from(d.len()) / DESC_BYTES > u64::from(MAX_INDIRECT) {
                    Some("longer than 1024 descriptors")
                } else if d.addr().raw_value() % DESC_BYTES != 0 {
                    Some("misaligned")
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(RingError::Indirect { head, why });
                }
                if !self.mem.holds(d.addr(), u64::from(d.len())) {
                    return Err(RingError::Outside { head, addr: d.addr().raw_value(), len: u64::from(d.len()) });
                }
                table = d.addr();
                table_len = (u64::from(d.len()) / DESC_BYTES) as u16;
                index = 0;
                in_indirect = true;
                seen = 0;
                continue;
            }
            let writable = flags & VRING_DESC_F_WRITE != 0;
            if !writable && !out.writable.is_empty() {
                return Err(RingError::Order(head));
            }
            self.split(head, d.addr(), d.len(), if writable { &mut out.writable } else { &mut out.readable })?;
            if flags & VRING_DESC_F_NEXT == 0 {
                return Ok(());
            }
            let next = d.next();
            if next >= table_len {
                return Err(RingError::Next { head, next, len: table_len });
            }
            index = next;
        }
    }

    /// Adds the buffer of `len` bytes at `addr` to `segs`, split where regions end.
    fn split(&self, head: u16, addr: GuestAddress, len: u32, segs: &mut Vec<Seg>) -> Result<(), RingError> {
        let outside = || RingError::Outside { head, addr: addr.raw_value(), len: u64::from(len) };
        let mut at = addr;
        let mut left = u64::from(len);
        while left > 0 {
            let (region, offset) = self.mem.memory().to_region_addr(at).ok_or_else(outside)?;
            let room = region.len() - offset.raw_value();
            let take = left.min(room);
            segs.push(Seg { addr: at, len: take as u32 });
            left -= take;
            at = at.checked_add(take).ok_or_else(outside)?;
        }
        Ok(())
    }

    /// Returns `head` to the driver with `len` bytes written, visible at once (the used
    /// index moves entry by entry, which the in-flight region relies on).
    pub fn push_used(&mut self, head: u16, len: u32) -> Result<(), RingError> {
        let slot = u64::from(self.next_used.0 % self.size);
        // A used element: the head's index, then the bytes written, little-endian.
        let elem = u64::from(head) | u64::from(len) << 32;
        self.mem.memory().write_obj(elem.to_le(), self.addrs.used.unchecked_add(4 + 8 * slot)).map_err(Self::mem_err)?;
        self.next_used += 1;
        self.store_u16(self.next_used.0, self.addrs.used.unchecked_add(2), Ordering::Release)
    }

    /// Whether the driver wants a call for what was used since the last one.
    pub fn needs_call(&mut self) -> Result<bool, RingError> {
        // The used index must be visible before the driver's wish is read.
        fence(Ordering::SeqCst);
        let new = self.next_used;
        if !self.event_idx {
            let flags = self.load_u16(self.addrs.avail, Ordering::Relaxed)?;
            return Ok(u32::from(flags) & VRING_AVAIL_F_NO_INTERRUPT == 0);
        }
        let old = self.signalled.replace(new);
        let Some(old) = old else { return Ok(true) };
        if old == new {
            return Ok(false);
        }
        let used_event =
            Wrapping(self.load_u16(self.addrs.avail.unchecked_add(4 + 2 * u64::from(self.size)), Ordering::Relaxed)?);
        // The virtio spec's vring_need_event: the driver asked to hear of entry `used_event`,
        // and it lies in (old, new].
        Ok((new - used_event - Wrapping(1)).0 < (new - old).0)
    }

    /// Whether the driver, by its event index, still waits to hear of an entry that is used
    /// already: it asked for a call at `used_event`, below the used index, and the call that
    /// crossed it either went before the driver asked (a driver whose barrier between writing
    /// its event index and reading the used index again did not hold) or was lost. Returns
    /// the driver's event index and the used index when so; always `None` without EVENT_IDX,
    /// where the driver's progress is not visible.
    pub fn call_missed(&self) -> Result<Option<(u16, u16)>, RingError> {
        if !self.event_idx {
            return Ok(None);
        }
        fence(Ordering::SeqCst);
        let used_event = self.load_u16(self.addrs.avail.unchecked_add(4 + 2 * u64::from(self.size)), Ordering::Relaxed)?;
        Ok((used_event != self.next_used.0).then_some((used_event, self.next_used.0)))
    }

    /// Asks the driver not to kick while the device polls.
    pub fn suppress_kicks(&self) -> Result<(), RingError> {
        if !self.event_idx {
            self.store_u16(VRING_USED_F_NO_NOTIFY as u16, self.addrs.used, Ordering::Relaxed)?;
        }
        // With EVENT_IDX the avail event stays where it was: the driver passed it already and
        // does not kick again until it is moved.
        Ok(())
    }

    /// Asks the driver to kick for the next entry, before the device sleeps. Returns whether
    /// entries arrived meanwhile (then the device must not sleep).
    pub fn enable_kicks(&self) -> Result<bool, RingError> {
        if self.event_idx {
            let at = self.addrs.used.unchecked_add(4 + 8 * u64::from(self.size));
            self.store_u16(self.next_avail.0, at, Ordering::Relaxed)?;
        } else {
            self.store_u16(0, self.addrs.used, Ordering::Relaxed)?;
        }
        // The request must be visible before the available index is read again.
        fence(Ordering::SeqCst);
        Ok(self.pending()? > 0)
    }

    /// The guest memory the ring lives in.
    pub fn memory(&self) -> &Arc<GuestMem> {
        &self.mem
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::AsRawFd;
    use vhost::vhost_user::message::VhostUserMemoryRegion;

    pub(crate) fn guest(size: u64) -> Arc<GuestMem> {
        let fd = bulkhead_shmem::memfd::create("guest", size).unwrap();
        bulkhead_shmem::memfd::seal_size(fd.as_raw_fd()).unwrap();
        let table = [VhostUserMemoryRegion::new(0, size, 0x7000_0000_0000, 0)];
        Arc::new(GuestMem::map(&table, vec![File::from(fd)], &Arc::default()).unwrap())
    }

    const DESC: GuestAddress = GuestAddress(0x1000);
    const AVAIL: GuestAddress = GuestAddress(0x2000);
    const USED: GuestAddress = GuestAddress(0x3000);

    fn ring(mem: &Arc<GuestMem>, event_idx: bool) -> Vring {
        let addrs = RingAddrs { desc: DESC, avail: AVAIL, used: USED };
        Vring::new(mem.clone(), 16, addrs, RingPosition::default(), event_idx, true).unwrap()
    }

    fn put_desc(mem: &GuestMem, table: GuestAddress, i: u16, d: Descriptor) {
        mem.memory().write_obj(d, table.unchecked_add(16 * u64::from(i))).unwrap();
    }

    fn offer(mem: &GuestMem, heads: &[u16]) {
        let m = mem.memory();
        let idx: u16 = m.read_obj(AVAIL.unchecked_add(2)).unwrap();
        for (k, &h) in heads.iter().enumerate() {
            let slot = (idx as usize + k) % 16;
            m.write_obj(h, AVAIL.unchecked_add(4 + 2 * slot as u64)).unwrap();
        }
        m.write_obj(idx.wrapping_add(heads.len() as u16), AVAIL.unchecked_add(2)).unwrap();
    }

    const NEXT: u16 = VRING_DESC_F_NEXT as u16;
    const WRITE: u16 = VRING_DESC_F_WRITE as u16;
    const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

    #[test]
    fn walks_a_chain_of_readable_then_writable_buffers() {
        let mem = guest(1 << 20);
        put_desc(&mem, DESC, 0, Descriptor::new(0x10000, 16, NEXT, 1));
        put_desc(&mem, DESC, 1, Descriptor::new(0x11000, 4096, NEXT | WRITE, 2));
        put_desc(&mem, DESC, 2, Descriptor::new(0x12000, 1, WRITE, 0));
        offer(&mem, &[0]);
        let mut r = ring(&mem, false);
        assert_eq!(r.pending(), Ok(1));
        let head = r.pop().unwrap().unwrap();
        let mut c = Chain::default();
        r.chain(head, &mut c).unwrap();
        assert_eq!(c.readable, vec![Seg { addr: GuestAddress(0x10000), len: 16 }]);
        assert_eq!(c.writable.len(), 2);
        assert_eq!(r.pop(), Ok(None));
        r.push_used(head, 4097).unwrap();
        let used: [u32; 2] = mem.memory().read_obj(USED.unchecked_add(4)).unwrap();
        assert_eq!(used, [0, 4097]);
        assert_eq!(r.used_idx_in_memory(), Ok(1));
    }

    #[test]
    fn follows_an_indirect_table() {
        let mem = guest(1 << 20);
        let table = GuestAddress(0x8000);
        put_desc(&mem, table, 0, Descriptor::new(0x10000, 16, NEXT, 1));
        put_desc(&mem, table, 1, Descriptor::new(0x12000, 1, WRITE, 0));
        put_desc(&mem, DESC, 3, Descriptor::new(0x8000, 32, INDIRECT, 0));
        offer(&mem, &[3]);
        let mut r = ring(&mem, false);
        let head = r.pop().unwrap().unwrap();
        let mut c = Chain::default();
        r.chain(head, &mut c).unwrap();
        assert_eq!((c.head, c.readable.len(), c.writable.len()), (3, 1, 1));
    }

    #[test]
    fn an_indirect_table_may_be_longer_than_the_queue() {
        let mem = guest(1 << 20);
        let r = ring(&mem, false);
        let table = GuestAddress(0x20000);
        // Linux's: the header, 128 data buffers and the status byte, in a queue of 16.
        put_desc(&mem, table, 0, Descriptor::new(0x10000, 16, NEXT, 1));
        for i in 1..=128u16 {
            put_desc(&mem, table, i, Descriptor::new(0x40000 + 4096 * u64::from(i), 4096, NEXT | WRITE, i + 1));
        }
        put_desc(&mem, table, 129, Descriptor::new(0x12000, 1, WRITE, 0));
        put_desc(&mem, DESC, 0, Descriptor::new(table.raw_value(), 130 * 16, INDIRECT, 0));
        let mut c = Chain::default();
        r.chain(0, &mut c).unwrap();
        assert_eq!((c.readable.len(), c.writable.len()), (1, 129));
        put_desc(&mem, DESC, 0, Descriptor::new(table.raw_value(), 1025 * 16, INDIRECT, 0));
        assert!(matches!(r.chain(0, &mut c), Err(RingError::Indirect { .. })));
    }

    #[test]
    fn refuses_loops_heads_outside_memory_and_bad_tables() {
        let mem = guest(1 << 20);
        let r = ring(&mem, false);
        let mut c = Chain::default();
        // A loop of two.
        put_desc(&mem, DESC, 0, Descriptor::new(0x10000, 16, NEXT, 1));
        put_desc(&mem, DESC, 1, Descriptor::new(0x10000, 16, NEXT, 0));
        assert_eq!(r.chain(0, &mut c), Err(RingError::Loop(0)));
        // A next outside the table, a head outside the ring.
        put_desc(&mem, DESC, 2, Descriptor::new(0x10000, 16, NEXT, 99));
        assert!(matches!(r.chain(2, &mut c), Err(RingError::Next { next: 99, .. })));
        assert_eq!(r.chain(16, &mut c), Err(RingError::Head(16)));
        // A buffer beyond guest memory, and one wrapping the address space.
        put_desc(&mem, DESC, 3, Descriptor::new((1 << 20) - 8, 16, 0, 0));
        assert!(matches!(r.chain(3, &mut c), Err(RingError::Outside { .. })));
        put_desc(&mem, DESC, 3, Descriptor::new(u64::MAX - 4, 16, 0, 0));
        assert!(matches!(r.chain(3, &mut c), Err(RingError::Outside { .. })));
        // Readable after writable.
        put_desc(&mem, DESC, 4, Descriptor::new(0x10000, 16, NEXT | WRITE, 5));
        put_desc(&mem, DESC, 5, Descriptor::new(0x10000, 16, 0, 0));
        assert_eq!(r.chain(4, &mut c), Err(RingError::Order(4)));
        // Indirect: nested, chained, ragged, outside memory.
        let t = GuestAddress(0x8000);
        put_desc(&mem, t, 0, Descriptor::new(0x8000, 16, INDIRECT, 0));
        put_desc(&mem, DESC, 6, Descriptor::new(0x8000, 16, INDIRECT, 0));
        assert!(matches!(r.chain(6, &mut c), Err(RingError::Indirect { why: "nested", .. })));
        put_desc(&mem, DESC, 6, Descriptor::new(0x8000, 16, INDIRECT | NEXT, 0));
        assert!(matches!(r.chain(6, &mut c), Err(RingError::Indirect { .. })));
        put_desc(&mem, DESC, 6, Descriptor::new(0x8000, 24, INDIRECT, 0));
        assert!(matches!(r.chain(6, &mut c), Err(RingError::Indirect { .. })));
        put_desc(&mem, DESC, 6, Descriptor::new(1 << 20, 32, INDIRECT, 0));
        assert!(matches!(r.chain(6, &mut c), Err(RingError::Outside { .. })));
        // An indirect table looping on itself is bounded by the queue size too.
        put_desc(&mem, t, 0, Descriptor::new(0x10000, 16, NEXT, 1));
        put_desc(&mem, t, 1, Descriptor::new(0x10000, 16, NEXT, 0));
        put_desc(&mem, DESC, 6, Descriptor::new(0x8000, 32, INDIRECT, 0));
        assert_eq!(r.chain(6, &mut c), Err(RingError::Loop(6)));
    }

    #[test]
    fn a_runaway_available_index_is_an_error() {
        let mem = guest(1 << 20);
        mem.memory().write_obj(17u16, AVAIL.unchecked_add(2)).unwrap();
        let mut r = ring(&mem, false);
        assert_eq!(r.pop(), Err(RingError::Runaway { ahead: 17, size: 16 }));
        mem.memory().write_obj(1u16, AVAIL.unchecked_add(2)).unwrap();
        mem.memory().write_obj(40u16, AVAIL.unchecked_add(4)).unwrap();
        assert_eq!(r.pop(), Err(RingError::Head(40)));
    }

    #[test]
    fn refuses_rings_outside_memory() {
        let mem = guest(1 << 20);
        let bad = RingAddrs { desc: GuestAddress((1 << 20) - 64), avail: AVAIL, used: USED };
        assert_eq!(
            Vring::new(mem.clone(), 16, bad, RingPosition::default(), false, false).unwrap_err(),
            RingError::Area("descriptor")
        );
        let odd = RingAddrs { desc: DESC, avail: GuestAddress(0x2001), used: USED };
        assert_eq!(
            Vring::new(mem.clone(), 16, odd, RingPosition::default(), false, false).unwrap_err(),
            RingError::Area("available")
        );
        let addrs = RingAddrs { desc: DESC, avail: AVAIL, used: USED };
        assert_eq!(Vring::new(mem, 12, addrs, RingPosition::default(), false, false).unwrap_err(), RingError::Size(12));
    }

    #[test]
    fn event_idx_calls_only_when_the_driver_asked() {
        let mem = guest(1 << 20);
        let mut r = ring(&mem, true);
        let used_event = AVAIL.unchecked_add(4 + 2 * 16);
        r.push_used(0, 1).unwrap();
        assert_eq!(r.needs_call(), Ok(true), "the first completion always calls");
        // The driver asks to hear when entry 3 is used (used index passes 3).
        mem.memory().write_obj(3u16, used_event).unwrap();
        r.push_used(1, 1).unwrap();
        assert_eq!(r.needs_call(), Ok(false));
        r.push_used(2, 1).unwrap();
        r.push_used(3, 1).unwrap();
        assert_eq!(r.needs_call(), Ok(true));
        assert_eq!(r.needs_call(), Ok(false), "nothing new");
        // Kicks: the avail event follows the device before it sleeps.
        assert_eq!(r.enable_kicks(), Ok(false));
        let avail_event: u16 = mem.memory().read_obj(USED.unchecked_add(4 + 8 * 16)).unwrap();
        assert_eq!(avail_event, 0);
    }

    #[test]
    fn a_driver_that_asked_too_late_is_seen_waiting_for_a_used_entry() {
        let mem = guest(1 << 20);
        let mut r = ring(&mem, true);
        let used_event = AVAIL.unchecked_add(4 + 2 * 16);
        r.push_used(0, 1).unwrap();
        assert_eq!(r.needs_call(), Ok(true));
        mem.memory().write_obj(1u16, used_event).unwrap();
        assert_eq!(r.call_missed(), Ok(None), "the driver has taken everything used");
        // Entries 1 and 2 are used while the driver's event index still reads 0: no call is
        // due. The driver then asks for entry 1, after the device looked: had its barrier
        // held it would have seen entries 1 and 2 itself; it did not, and waits.
        mem.memory().write_obj(0u16, used_event).unwrap();
        r.push_used(1, 1).unwrap();
        r.push_used(2, 1).unwrap();
        assert_eq!(r.needs_call(), Ok(false));
        mem.memory().write_obj(1u16, used_event).unwrap();
        assert_eq!(r.needs_call(), Ok(false), "nothing new was used");
        assert_eq!(r.call_missed(), Ok(Some((1, 3))), "it waits to hear of entry 1, used already");
        mem.memory().write_obj(3u16, used_event).unwrap();
        assert_eq!(r.call_missed(), Ok(None));
        // Without the event index nothing of the driver's progress shows.
        let r = ring(&guest(1 << 20), false);
        assert_eq!(r.call_missed(), Ok(None));
    }

    #[test]
    fn flags_suppress_without_event_idx() {
        let mem = guest(1 << 20);
        let mut r = ring(&mem, false);
        r.suppress_kicks().unwrap();
        let flags: u16 = mem.memory().read_obj(USED).unwrap();
        assert_eq!(flags, 1);
        r.enable_kicks().unwrap();
        let flags: u16 = mem.memory().read_obj(USED).unwrap();
        assert_eq!(flags, 0);
        r.push_used(0, 1).unwrap();
        mem.memory().write_obj(VRING_AVAIL_F_NO_INTERRUPT as u16, AVAIL).unwrap();
        assert_eq!(r.needs_call(), Ok(false));
    }
}
