//! In-flight I/O tracking (the vhost-user spec's `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`): a
//! memory file `serve` makes on `GET_INFLIGHT_FD` and the frontend keeps, in which each queue
//! records the heads it has taken and not yet returned. When `serve` dies, the frontend
//! (QEMU with `reconnect=1`) hands the file back to the next `serve` with `SET_INFLIGHT_FD`,
//! and the requests it records are served again, in the order they were taken.
//!
//! The layout is the spec's for split queues, one region per queue aligned to 64 bytes: a
//! header (`features: u64`, `version: u16`, `desc_num: u16`, `last_batch_head: u16`,
//! `used_idx: u16`) and `desc_num` entries (`inflight: u8`, 5 bytes padding, `next: u16`,
//! `counter: u64`). Each 8-byte word is written whole, with atomic stores, so that what a
//! killed `serve` leaves is never torn.
//!
//! Completing a request is four steps, each visible before the next: `last_batch_head` names
//! the head; the used ring gets it and its index moves; the entry's `inflight` clears; the
//! header's `used_idx` moves. A `serve` killed between the second and the fourth leaves the
//! two used indices apart, and recovery then knows the last head went back and clears it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bulkhead_shmem::{Mapping, Protection};

/// Bytes of a queue's header.
const HEADER: usize = 16;
/// Bytes of one descriptor's entry.
const ENTRY: usize = 16;
/// Alignment of each queue's region.
const ALIGN: usize = 64;
/// The layout's version.
const VERSION: u64 = 1;

/// Why an in-flight file was refused.
#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    /// The frontend asked for a shape the export does not serve.
    #[error("{queues} queues of {size} entries cannot be tracked")]
    Shape {
        /// Queues asked for.
        queues: u16,
        /// Entries of each.
        size: u16,
    },
    /// The file handed back is not one this layout fits.
    #[error("the in-flight file is {why}")]
    File {
        /// What is wrong.
        why: String,
    },
    /// Creating or mapping the file failed.
    #[error("in-flight file: {0}")]
    Io(#[from] bulkhead_shmem::ShmError),
}

/// Bytes of one queue's region.
fn queue_bytes(size: u16) -> usize {
    (HEADER + ENTRY * usize::from(size)).div_ceil(ALIGN) * ALIGN
}

/// The in-flight file of one frontend's device, mapped.
#[derive(Debug)]
pub struct Inflight {
    map: Mapping,
    queues: u16,
    size: u16,
}

impl Inflight {
    /// A zeroed file for `queues` queues of `size` entries, with its length (what
    /// `GET_INFLIGHT_FD` answers). The file is sealed against shrinking, so that no one
    /// holding it can make an access here fault.
    pub fn create(queues: u16, size: u16) -> Result<(Arc<Inflight>, File, u64), InflightError> {
        if queues == 0 || size == 0 || !size.is_power_of_two() || size > crate::virtq::MAX_QUEUE_SIZE {
            return Err(InflightError::Shape { queues, size });
        }
        let len = queue_bytes(size) * usize::from(queues);
        let fd = bulkhead_shmem::memfd::create("bulkhead-inflight", len as u64)?;
        bulkhead_shmem::memfd::seal_size(fd.as_raw_fd())?;
        let map = Mapping::new(fd.as_raw_fd(), len, Protection::ReadWrite)?;
        let me = Inflight { map, queues, size };
        for q in 0..queues {
            me.word(q, 8).store(VERSION | u64::from(size) << 16, Ordering::Relaxed);
        }
        let file = File::from(fd);
        Ok((Arc::new(me), file, len as u64))
    }

    /// Maps a file the frontend hands back (`SET_INFLIGHT_FD`), checking it fits `queues`
    /// queues of `size` entries and was laid out for that size.
    pub fn open(file: &File, mmap_size: u64, mmap_offset: u64, queues: u16, size: u16) -> Result<Arc<Inflight>, InflightError> {
        let bad = |why: String| InflightError::File { why };
        if queues == 0 || size == 0 || !size.is_power_of_two() || size > crate::virtq::MAX_QUEUE_SIZE {
            return Err(InflightError::Shape { queues, size });
        }
        if mmap_offset != 0 {
            return Err(bad(format!("offered at offset {mmap_offset}, not 0 as it was made")));
        }
        let len = queue_bytes(size) * usize::from(queues);
        let actual = file.metadata().map_err(|e| bad(format!("not readable: {e}")))?.len();
        if mmap_size < len as u64 || actual < len as u64 {
            return Err(bad(format!("{actual} bytes, {len} needed")));
        }
        match bulkhead_shmem::memfd::seals(file.as_raw_fd()) {
            Ok(seals) if seals & libc::F_SEAL_SHRINK != 0 => {}
            _ => return Err(bad("not a memory file sealed against shrinking".into())),
        }
        let map = Mapping::new(file.as_raw_fd(), len, Protection::ReadWrite)?;
        let me = Inflight { map, queues, size };
        for q in 0..queues {
            let hdr = me.word(q, 8).load(Ordering::Acquire);
            let (version, desc_num) = (hdr & 0xffff, (hdr >> 16) & 0xffff);
            if version != VERSION || desc_num != u64::from(size) {
                return Err(bad(format!("queue {q}: version {version} with {desc_num} entries, not {VERSION} with {size}")));
            }
        }
        Ok(Arc::new(me))
    }

    /// Queues it tracks.
    pub fn queues(&self) -> u16 {
        self.queues
    }

    /// Entries of each queue.
    pub fn size(&self) -> u16 {
        self.size
    }

    fn word(&self, queue: u16, at: usize) -> &std::sync::atomic::AtomicU64 {
        self.map.atomic_u64(queue_bytes(self.size) * usize::from(queue) + at).expect("inside the queue's region")
    }

    fn entry(&self, queue: u16, head: u16) -> (&std::sync::atomic::AtomicU64, &std::sync::atomic::AtomicU64) {
        let at = HEADER + ENTRY * usize::from(head);
        (self.word(queue, at), self.word(queue, at + 8))
    }
}

/// One queue's part of an in-flight file.
#[derive(Debug, Clone)]
pub struct InflightQueue {
    file: Arc<Inflight>,
    queue: u16,
    counter: u64,
}

/// What a queue's record says to serve again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// Heads taken and not returned, oldest first.
    pub heads: Vec<u16>,
    /// The used index the record ends at.
    pub used_idx: u16,
}

impl InflightQueue {
    /// Queue `queue` of `file`.
    pub fn new(file: Arc<Inflight>, queue: u16) -> InflightQueue {
        assert!(queue < file.queues, "queue inside the file");
        InflightQueue { file, queue, counter: 0 }
    }

    fn header(&self) -> u64 {
        self.file.word(self.queue, 8).load(Ordering::Acquire)
    }

    fn set_header(&self, last_batch_head: u16, used_idx: u16) {
        let keep = self.header() & 0xffff_ffff;
        let v = keep | u64::from(last_batch_head) << 32 | u64::from(used_idx) << 48;
        self.file.word(self.queue, 8).store(v, Ordering::Release);
    }

    /// Reads the record a killed `serve` left, given the used index in guest memory: the
    /// heads to serve again in the order they were taken. Counting continues after them.
    pub fn recover(&mut self, used_in_memory: u16) -> Recovered {
        let hdr = self.header();
        let (last_batch_head, used_idx) = ((hdr >> 32) as u16, (hdr >> 48) as u16);
        if used_idx != used_in_memory {
            // Killed after the used ring took the last head and before its entry cleared.
            if last_batch_head < self.file.size {
                self.file.entry(self.queue, last_batch_head).0.store(0, Ordering::Release);
            }
            self.set_header(last_batch_head, used_in_memory);
        }
        let mut taken: Vec<(u64, u16)> = (0..self.file.size)
            .filter_map(|h| {
                let (flags, counter) = self.file.entry(self.queue, h);
                (flags.load(Ordering::Acquire) & 0xff != 0).then(|| (counter.load(Ordering::Acquire), h))
            })
            .collect();
        taken.sort_unstable();
        self.counter = taken.last().map_or(0, |t| t.0);
        Recovered { heads: taken.into_iter().map(|t| t.1).collect(), used_idx: used_in_memory }
    }

    /// Clears the record: every entry returned, at `used_idx` (a queue started afresh).
    pub fn reset(&mut self, used_idx: u16) {
        for h in 0..self.file.size {
            let (flags, counter) = self.file.entry(self.queue, h);
            flags.store(0, Ordering::Relaxed);
            counter.store(0, Ordering::Relaxed);
        }
        self.set_header(0, used_idx);
        self.counter = 0;
    }

    /// Records `head` as taken (before anything is done for it).
    pub fn taken(&mut self, head: u16) {
        self.counter += 1;
        let (flags, counter) = self.file.entry(self.queue, head);
        counter.store(self.counter, Ordering::Relaxed);
        flags.store(1, Ordering::Release);
    }

    /// Before the used ring gets `head`.
    pub fn returning(&self, head: u16, used_idx: u16) {
        self.set_header(head, used_idx);
    }

    /// After the used ring got `head` and its index moved to `used_idx`.
    pub fn returned(&self, head: u16, used_idx: u16) {
        self.file.entry(self.queue, head).0.store(0, Ordering::Release);
        self.set_header(head, used_idx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_survives_to_the_next_mapping_in_the_order_taken() {
        let (file, fd, len) = Inflight::create(2, 8).unwrap();
        assert_eq!(len, 2 * 192);
        let mut q = InflightQueue::new(file.clone(), 1);
        q.reset(0);
        for h in [5, 2, 7] {
            q.taken(h);
        }
        // Head 2 completes.
        q.returning(2, 0);
        q.returned(2, 1);
        drop(q);
        drop(file);
        let again = Inflight::open(&fd, len, 0, 2, 8).unwrap();
        let mut q = InflightQueue::new(again.clone(), 1);
        assert_eq!(q.recover(1), Recovered { heads: vec![5, 7], used_idx: 1 });
        // Counting continues after the recovered heads.
        q.taken(2);
        assert_eq!(q.recover(1).heads, vec![5, 7, 2]);
        // The other queue saw nothing.
        assert!(InflightQueue::new(again, 0).recover(0).heads.is_empty());
    }

    #[test]
    fn a_head_the_used_ring_took_before_the_kill_is_not_served_twice() {
        let (file, _fd, _) = Inflight::create(1, 8).unwrap();
        let mut q = InflightQueue::new(file, 0);
        q.taken(3);
        q.taken(4);
        // Killed after the used ring took head 3 (index 0 → 1) and before its entry cleared.
        q.returning(3, 0);
        assert_eq!(q.recover(1), Recovered { heads: vec![4], used_idx: 1 });
        // Killed before the used ring took it: served again.
        q.returning(4, 1);
        assert_eq!(q.recover(1), Recovered { heads: vec![4], used_idx: 1 });
    }

    #[test]
    fn refuses_files_of_another_shape() {
        let (_, fd, len) = Inflight::create(2, 8).unwrap();
        assert!(matches!(Inflight::open(&fd, len, 0, 2, 16), Err(InflightError::File { .. })));
        assert!(matches!(Inflight::open(&fd, len, 64, 2, 8), Err(InflightError::File { .. })));
        assert!(matches!(Inflight::open(&fd, len, 0, 2, 12), Err(InflightError::Shape { .. })));
        let plain = tempfile_of(len);
        assert!(matches!(Inflight::open(&plain, len, 0, 2, 8), Err(InflightError::File { .. })));
        assert!(Inflight::create(0, 8).is_err());
    }

    fn tempfile_of(len: u64) -> File {
        File::from(bulkhead_shmem::memfd::create("unsealed", len).unwrap())
    }
}
