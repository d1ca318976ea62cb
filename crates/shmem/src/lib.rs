//! Shared memory for bulkhead device channels.
//!
//! This crate is the only owner of raw pointers into memory that another process can write. It
//! hands out:
//!
//! - [`memfd`] helpers that create sealed, sparse memory files and reopen them read-only;
//! - [`Mapping`], an `mmap` of such a file, with bounds-checked *copying* accessors: a slot is
//!   copied out once and the copy is validated by the caller; no `&[u8]` or `&T` is ever formed
//!   over shared bytes, except `&AtomicU32`/`&AtomicU64` for the ring indexes, which tolerate
//!   concurrent writers;
//! - [`SharedSlice`], a bounds-checked window of a mapping used as an I/O buffer;
//! - [`PageAllocator`], the lock-free-by-ownership allocator of grant arena pages.
#![deny(missing_docs)]

mod alloc;
mod mapping;
pub mod memfd;

pub use alloc::PageAllocator;
pub use mapping::{Mapping, Protection, SharedSlice, SliceList, MAX_SLICES};

/// Errors from creating, sealing or mapping shared memory.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Sys {
        /// The operation that failed.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An access fell outside a mapping.
    #[error("range {offset}+{len} is outside the mapping of {size} bytes")]
    OutOfBounds {
        /// Start of the access.
        offset: u64,
        /// Length of the access.
        len: u64,
        /// Size of the mapping.
        size: u64,
    },
    /// A write was attempted through a read-only mapping.
    #[error("mapping is read-only")]
    ReadOnly,
}

impl ShmError {
    pub(crate) fn last(op: &'static str) -> Self {
        ShmError::Sys { op, source: std::io::Error::last_os_error() }
    }
}

/// Size of a page on the platforms bulkhead runs on.
pub const PAGE_SIZE: usize = 4096;
