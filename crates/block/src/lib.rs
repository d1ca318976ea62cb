//! The block request model shared by every layer of a driver domain.
//!
//! A domain runs a [`Chain`]: zero or more [`Layer`]s (filters, soft devices) over one
//! [`Backend`]. Each request in flight carries a [`Tag`]; a layer sees it on the way down
//! ([`Layer::submit`]) and decides with a [`Verdict`] to pass it on, answer it itself, or hold
//! it (a delay, a throttle) until its [`Layer::poll`] releases it, and sees its result on the
//! way up ([`Layer::complete`]). A layer that must change what goes below sends a [`Sub`] in
//! the request's place — moved, cut to a part, or with data from its own scratch memory (a
//! bounce buffer, private to the domain) — and may send another when that one completes. What
//! reaches the backend goes down in batches of [`Io`]s, or one by one to an asynchronous
//! engine that answers later, so one slow request holds up no other.
//!
//! Every layer matches [`Request`] in full: there is no default pass-through, because a filter
//! that forwards an operation it does not understand corrupts data.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub use bulkhead_shmem::{SharedSlice, SliceList};

/// A request in a domain: its data buffers are grant windows in shared memory (writable for a
/// read, read-only to the driver for a write).
pub type Request<'a> = Command<SliceList<'a>, SliceList<'a>>;

impl Request<'_> {
    /// The device range it touches: offset and bytes (0, 0 for a flush).
    pub fn range(&self) -> (u64, u64) {
        match *self {
            Command::Read { offset, into: bufs } | Command::Write { offset, from: bufs, .. } => (offset, bufs.total_len()),
            Command::Discard { offset, len } | Command::WriteZeroes { offset, len } => (offset, len),
            Command::Flush => (0, 0),
        }
    }

    /// Bytes a successful completion transfers (0 for operations without data).
    pub fn transfer_len(&self) -> u64 {
        match self {
            Command::Read { into: bufs, .. } | Command::Write { from: bufs, .. } => bufs.total_len(),
            Command::Flush | Command::Discard { .. } | Command::WriteZeroes { .. } => 0,
        }
    }
}

/// How a request ended: the bytes it transferred, or why it failed.
pub type Outcome = Result<u64, BlockError>;

/// A request with its result slot, as it moves through a chain.
#[derive(Debug)]
pub struct Io<'a> {
    /// The request.
    pub req: Request<'a>,
    /// Set by the layer that completes it. Starts as `Err(BlockError::NotDone)`.
    pub result: Outcome,
}

impl<'a> Io<'a> {
    /// A request not yet executed.
    pub fn new(req: Request<'a>) -> Self {
        Io { req, result: Err(BlockError::NotDone) }
    }
}

/// What a layer can do. A layer may hide or add capabilities of the layer below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Flush makes writes durable (false: writes are durable at once, flush is a no-op).
    pub flush: bool,
    /// FUA is honoured natively.
    pub fua: bool,
    /// Discard frees space.
    pub discard: bool,
    /// Write-zeroes is efficient (not a loop of writes).
    pub write_zeroes: bool,
    /// Writes are refused.
    pub read_only: bool,
}

impl Caps {
    /// A device whose writes are durable once done, as one in memory: nothing to flush, FUA
    /// for free, discard and write-zeroes supported.
    pub const DURABLE_AT_ONCE: Caps = Caps { flush: false, fua: true, discard: true, write_zeroes: true, read_only: false };
}

/// Why a layer or a backend could not get ready to serve (its [`Layer::open`] or
/// [`Remote::start`]), in the words the domain reports before it exits: nothing decides on it
/// but that the domain cannot serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SetupError(String);

impl SetupError {
    /// A failure to get ready, said in `words`.
    pub fn new(words: impl Into<String>) -> SetupError {
        SetupError(words.into())
    }

    /// A failure of a lower layer's, said as it says it.
    pub fn of(e: impl std::fmt::Display) -> SetupError {
        SetupError(e.to_string())
    }
}

/// Why a request failed. Maps to a small stable wire status; the message stays in the domain's
/// log, apart from the status sent on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// Not yet executed (initial state of an [`Io`]).
    #[error("not executed")]
    NotDone,
    /// The backend failed with an OS error.
    #[error("{op} at {offset}: os error {errno}")]
    Os {
        /// Operation.
        op: &'static str,
        /// Device offset.
        offset: u64,
        /// errno.
        errno: i32,
    },
    /// Unsupported operation.
    #[error("{0} not supported")]
    NotSupported(&'static str),
    /// Range or buffers invalid.
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// The device refuses writes.
    #[error("device is read-only")]
    ReadOnly,
    /// A short transfer.
    #[error("{op} at {offset}: short transfer of {done} of {want} bytes")]
    Short {
        /// Operation.
        op: &'static str,
        /// Device offset.
        offset: u64,
        /// Bytes done.
        done: u64,
        /// Bytes wanted.
        want: u64,
    },
}

impl BlockError {
    /// The status sent on the wire.
    pub fn status(&self) -> Status {
        match self {
            BlockError::Os { errno, .. } if *errno == 28 => Status::NoSpace,
            BlockError::Os { errno, .. } if *errno == 30 => Status::ReadOnly,
            BlockError::Os { errno, .. } if *errno == 95 => Status::NotSupported,
            BlockError::Os { errno, .. } if *errno == 22 => Status::Invalid,
            BlockError::NotSupported(_) => Status::NotSupported,
            BlockError::Invalid(_) => Status::Invalid,
            BlockError::ReadOnly => Status::ReadOnly,
            BlockError::NotDone | BlockError::Os { .. } | BlockError::Short { .. } => Status::IoError,
        }
    }
}

mod backend;
mod chain;
mod layer;
mod op;

pub use backend::{AsyncIo, Backend, Remote, Upkeep};
pub use chain::{Chain, StartError, LIST_ROOM};
pub use layer::{After, Data, Layer, ReadBelow, Sub, Tag, TagSpace, Verdict};
pub use op::{Command, Op, Status};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_stable_statuses() {
        assert_eq!(BlockError::Os { op: "write", offset: 0, errno: 28 }.status(), Status::NoSpace);
        assert_eq!(BlockError::Os { op: "write", offset: 0, errno: 5 }.status(), Status::IoError);
        assert_eq!(BlockError::Invalid("x").status(), Status::Invalid);
        assert_eq!(BlockError::NotDone.status(), Status::IoError);
    }
}
