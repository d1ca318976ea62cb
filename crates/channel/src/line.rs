//! A line between the supervisor and one domain: one page of shared memory holding a few
//! generation numbers, and a doorbell. [`BelowControl`](crate::BelowControl) and
//! [`AboveControl`](crate::AboveControl) are the two conversations held on it.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use bulkhead_doorbell::EventFd;
use bulkhead_shmem::{memfd, Mapping, Protection, PAGE_SIZE};

use crate::ChannelError;

/// One end of a line (both ends have the same view).
#[derive(Debug)]
pub(crate) struct Line {
    page: Mapping,
    page_fd: OwnedFd,
    wake: EventFd,
    /// What it is about, for errors.
    what: &'static str,
}

impl Line {
    fn err(what: &str, e: impl std::fmt::Display) -> ChannelError {
        ChannelError::Setup(format!("{what}: {e}"))
    }

    /// A new page and doorbell, on the supervisor's side; `name` names the memfd.
    pub(crate) fn create(name: &str, what: &'static str) -> Result<Self, ChannelError> {
        let page_fd = memfd::create(name, PAGE_SIZE as u64).map_err(|e| Self::err(what, e))?;
        memfd::seal_size(page_fd.as_raw_fd()).map_err(|e| Self::err(what, e))?;
        let page = Mapping::new(page_fd.as_raw_fd(), PAGE_SIZE, Protection::ReadWrite).map_err(|e| Self::err(what, e))?;
        Ok(Line { page, page_fd, wake: EventFd::new().map_err(|e| Self::err(what, e))?, what })
    }

    /// Over descriptors handed to a domain: the page and the doorbell.
    pub(crate) fn attach(page_fd: OwnedFd, wake: OwnedFd, what: &'static str) -> Result<Self, ChannelError> {
        let page = Mapping::new(page_fd.as_raw_fd(), PAGE_SIZE, Protection::ReadWrite).map_err(|e| Self::err(what, e))?;
        Ok(Line { page, page_fd, wake: EventFd::from_owned(wake).map_err(|e| Self::err(what, e))?, what })
    }

    /// Duplicates of the page and the doorbell, for the domain.
    pub(crate) fn fds(&self) -> Result<[OwnedFd; 2], ChannelError> {
        let what = self.what;
        Ok([
            self.page_fd.try_clone().map_err(|e| Self::err(what, e))?,
            self.wake.as_fd().try_clone_to_owned().map_err(|e| Self::err(what, e))?,
        ])
    }

    fn slot(&self, offset: usize) -> &AtomicU64 {
        self.page.atomic_u64(offset).expect("slot inside the page")
    }

    /// Writes generation `g` in the slot at `offset`.
    pub(crate) fn put(&self, offset: usize, g: u32) {
        self.slot(offset).store(u64::from(g), Ordering::Release);
    }

    /// The value in the slot at `offset` (written by either side: the domain's are untrusted).
    pub(crate) fn get(&self, offset: usize) -> u64 {
        self.slot(offset).load(Ordering::Acquire)
    }

    /// The generation in the slot at `offset`, if one is there and it is not `current`.
    pub(crate) fn changed(&self, offset: usize, current: u32) -> Option<u32> {
        let w = self.get(offset);
        (w != 0 && w != u64::from(current) && w <= u64::from(u32::MAX)).then_some(w as u32)
    }

    /// Rings the doorbell.
    pub(crate) fn ring(&self) {
        self.wake.ring();
    }

    /// The doorbell, for a loop that waits on several.
    pub(crate) fn wake_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// Clears the doorbell; returns how many rings it held.
    pub(crate) fn drain(&self) -> u64 {
        self.wake.drain()
    }
}

/// The methods every end of a line has, for a type `$ty { line: Line }`: made over a new page
/// (`create`, the supervisor's side) or descriptors handed over (`attach`), duplicated for the
/// domain (`fds`), and its doorbell (`wake_fd`, `drain`).
macro_rules! line_ends {
    ($ty:ident, $suffix:literal, $what:literal, $domain:literal) => {
        impl $ty {
            /// A new page and doorbell, on the supervisor's side.
            pub fn create(name: &str) -> Result<Self, ChannelError> {
                Ok($ty { line: Line::create(&format!(concat!("bulkhead-{}-", $suffix), name), $what)? })
            }

            #[doc = concat!("Over descriptors handed to ", $domain, ": the page and the doorbell.")]
            pub fn attach(page_fd: std::os::fd::OwnedFd, wake: std::os::fd::OwnedFd) -> Result<Self, ChannelError> {
                Ok($ty { line: Line::attach(page_fd, wake, $what)? })
            }

            #[doc = concat!("Duplicates of the page and the doorbell, for ", $domain, ".")]
            pub fn fds(&self) -> Result<[std::os::fd::OwnedFd; 2], ChannelError> {
                self.line.fds()
            }

            /// The doorbell, for a loop that waits on several.
            pub fn wake_fd(&self) -> std::os::fd::RawFd {
                self.line.wake_fd()
            }

            /// Clears the doorbell.
            pub fn drain(&self) {
                self.line.drain();
            }
        }
    };
}
pub(crate) use line_ends;
