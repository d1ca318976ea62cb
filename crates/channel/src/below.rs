//! The supervisor's line to a tap domain about the domain below it.
//!
//! When the driver domain below a tap domain dies, the supervisor replaces it alone: the tap
//! domain keeps running, with the requests it holds and its filters' state. The two agree on
//! the switch through one page of shared memory and a doorbell:
//!
//! 1. the supervisor reaps the old domain below, writes the next generation in the page
//!    ([`request_restart`](BelowControl::request_restart)) and rings the doorbell (and the
//!    doorbells the tap domain waits on for responses);
//! 2. the tap domain starts every queue below over as that generation
//!    ([`FrontQueue::restart`](crate::FrontQueue::restart)), reissues what had no answer, and
//!    writes the generation back ([`report_ready`](BelowControl::report_ready));
//! 3. the supervisor sees it ([`ready`](BelowControl::ready)) and starts the new domain below
//!    on the same queue files.
//!
//! The tap domain is untrusted: what it writes in the page only decides whether the supervisor
//! goes on to start the domain below, which validates the queues like any driver.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;

use bulkhead_doorbell::EventFd;
use bulkhead_shmem::{memfd, Mapping, Protection, PAGE_SIZE};

use crate::ChannelError;

/// Offset of the generation the supervisor asks for.
const WANTED: usize = 0;
/// Offset of the generation the tap domain has started over as.
const READY: usize = 8;

/// One end of the line (both ends have the same view).
#[derive(Debug)]
pub struct BelowControl {
    page: Mapping,
    page_fd: OwnedFd,
    wake: EventFd,
}

fn err(e: impl std::fmt::Display) -> ChannelError {
    ChannelError::Setup(format!("control of the domain below: {e}"))
}

impl BelowControl {
    /// A new page and doorbell, on the supervisor's side.
    pub fn create(name: &str) -> Result<Self, ChannelError> {
        let page_fd = memfd::create(&format!("bulkhead-{name}-below"), PAGE_SIZE as u64).map_err(err)?;
        memfd::seal_size(page_fd.as_raw_fd()).map_err(err)?;
        let page = Mapping::new(page_fd.as_raw_fd(), PAGE_SIZE, Protection::ReadWrite).map_err(err)?;
        Ok(BelowControl { page, page_fd, wake: EventFd::new().map_err(err)? })
    }

    /// Over descriptors handed to a tap domain: the page and the doorbell.
    pub fn attach(page_fd: OwnedFd, wake: OwnedFd) -> Result<Self, ChannelError> {
        let page = Mapping::new(page_fd.as_raw_fd(), PAGE_SIZE, Protection::ReadWrite).map_err(err)?;
        Ok(BelowControl { page, page_fd, wake: EventFd::from_owned(wake).map_err(err)? })
    }

    /// Duplicates of the page and the doorbell, for the tap domain.
    pub fn fds(&self) -> Result<[OwnedFd; 2], ChannelError> {
        Ok([self.page_fd.try_clone().map_err(err)?, self.wake.as_fd().try_clone_to_owned().map_err(err)?])
    }

    fn slot(&self, offset: usize) -> &std::sync::atomic::AtomicU64 {
        self.page.atomic_u64(offset).expect("slot inside the page")
    }

    /// Supervisor: asks the tap domain to start the channel below over as `generation` (the
    /// old domain below is gone), and wakes it.
    pub fn request_restart(&self, generation: u32) {
        self.slot(WANTED).store(u64::from(generation), Ordering::Release);
        self.wake.ring();
    }

    /// Supervisor: the generation the tap domain last reported having started over as.
    pub fn ready(&self) -> u64 {
        self.slot(READY).load(Ordering::Acquire)
    }

    /// Tap domain: the generation asked for, if it is not `current`.
    pub fn wanted(&self, current: u32) -> Option<u32> {
        let w = self.slot(WANTED).load(Ordering::Acquire);
        (w != 0 && w != u64::from(current)).then_some(w as u32)
    }

    /// Tap domain: reports the channel below started over as `generation`.
    pub fn report_ready(&self, generation: u32) {
        self.slot(READY).store(u64::from(generation), Ordering::Release);
    }

    /// The doorbell, for a loop that waits on several.
    pub fn wake_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// Clears the doorbell.
    pub fn drain(&self) {
        self.wake.drain();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_asked_for_is_seen_once_and_reported_back() {
        let sup = BelowControl::create("t").unwrap();
        let [page, wake] = sup.fds().unwrap();
        let tap = BelowControl::attach(page, wake).unwrap();
        assert_eq!(tap.wanted(1), None, "nothing asked yet");
        sup.request_restart(2);
        assert_eq!(tap.wanted(1), Some(2));
        assert_eq!(tap.wanted(2), None, "already there");
        assert_eq!(tap.wake.drain(), 1, "the tap domain was woken");
        tap.report_ready(2);
        assert_eq!(sup.ready(), 2);
    }
}
