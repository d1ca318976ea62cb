//! A filter's counters, in a page of shared memory the supervisor made.
//!
//! The supervisor creates one size-sealed memfd of [`STATE_BYTES`] per filter when the device
//! starts and hands the same one to every generation of the domain, so counters survive a
//! restart. The domain writes it; `bulkhead status` reads it. The domain is untrusted, so what
//! the supervisor reads there is only displayed, or, for the domain's beats, can at most keep
//! the watchdog from restarting that same domain.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use bulkhead_shmem::{Mapping, Protection, ShmError};

/// Size of a state page.
pub const STATE_BYTES: usize = 4096;

/// Counters in a state page.
pub const SLOTS: usize = STATE_BYTES / 8;

/// A mapped state page: [`SLOTS`] 64-bit counters.
#[derive(Debug)]
pub struct StatePage {
    map: Mapping,
}

impl StatePage {
    /// Maps the state page `fd`, writable (in the domain) or read-only (in the supervisor).
    pub fn map(fd: RawFd, writable: bool) -> Result<Self, ShmError> {
        let prot = if writable { Protection::ReadWrite } else { Protection::ReadOnly };
        Ok(StatePage { map: Mapping::new(fd, STATE_BYTES, prot)? })
    }

    fn slot(&self, i: usize) -> &AtomicU64 {
        assert!(i < SLOTS, "state slot {i} out of range");
        self.map.atomic_u64(i * 8).expect("slot inside the page")
    }

    /// Counter `i`.
    pub fn get(&self, i: usize) -> u64 {
        self.slot(i).load(Ordering::Relaxed)
    }

    /// Adds to counter `i` (one writer: the domain's service thread).
    pub fn add(&self, i: usize, v: u64) {
        let s = self.slot(i);
        s.store(s.load(Ordering::Relaxed).wrapping_add(v), Ordering::Relaxed);
    }

    /// Sets counter `i`.
    pub fn set(&self, i: usize, v: u64) {
        self.slot(i).store(v, Ordering::Relaxed);
    }
}

#[cfg(test)]
pub(crate) fn test_page() -> (std::os::fd::OwnedFd, StatePage) {
    use std::os::fd::AsRawFd;
    let fd = bulkhead_shmem::memfd::create("state", STATE_BYTES as u64).unwrap();
    let page = StatePage::map(fd.as_raw_fd(), true).unwrap();
    (fd, page)
}

/// A device below of the given size whose reads succeed and fill nothing, for layers that only ask its size.
#[cfg(test)]
pub(crate) struct SizeBelow(pub u64);

#[cfg(test)]
impl bulkhead_block::ReadBelow for SizeBelow {
    fn read(&mut self, _: u64, _: &mut [u8]) -> Result<(), bulkhead_block::BlockError> {
        Ok(())
    }
    fn size(&self) -> u64 {
        self.0
    }
}
