//! The block request model shared by every layer of a driver domain.
//!
//! A domain runs a [`Chain`]: zero or more [`Layer`]s (filters, soft devices) over one
//! [`Backend`]. Work moves through it in batches of [`Io`]s, so an engine such as io_uring can
//! keep a whole batch in flight while every layer stays a plain synchronous function.
//!
//! Every layer matches [`Request`] in full: there is no default pass-through, because a filter
//! that forwards an operation it does not understand corrupts data.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use bulkhead_ring::Status;
pub use bulkhead_shmem::{SharedSlice, SliceList};

/// One block request. Data buffers are grant windows in shared memory.
#[derive(Debug, Clone, Copy)]
pub enum Request<'a> {
    /// Fill `bufs` from the device starting at `offset`.
    Read {
        /// Device byte offset.
        offset: u64,
        /// Destination windows (writable), in order.
        bufs: SliceList<'a>,
    },
    /// Write `bufs` to the device at `offset`.
    Write {
        /// Device byte offset.
        offset: u64,
        /// Source windows (read-only to the driver), in order.
        bufs: SliceList<'a>,
        /// Durable before acknowledgement.
        fua: bool,
    },
    /// Make every acknowledged write durable.
    Flush,
    /// Deallocate a range; its contents become unspecified.
    Discard {
        /// Device byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Make a range read back as zeroes.
    WriteZeroes {
        /// Device byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

impl Request<'_> {
    /// Bytes a successful completion transfers (0 for operations without data).
    pub fn transfer_len(&self) -> u64 {
        match self {
            Request::Read { bufs, .. } | Request::Write { bufs, .. } => bufs.total_len(),
            Request::Flush | Request::Discard { .. } | Request::WriteZeroes { .. } => 0,
        }
    }
}

/// A request with its result slot, as it moves through a chain.
#[derive(Debug)]
pub struct Io<'a> {
    /// The request.
    pub req: Request<'a>,
    /// Set by the layer that completes it. Starts as `Err(BlockError::NotDone)`.
    pub result: Result<u64, BlockError>,
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
            BlockError::NotSupported(_) => Status::NotSupported,
            BlockError::Invalid(_) => Status::Invalid,
            BlockError::ReadOnly => Status::ReadOnly,
            BlockError::NotDone | BlockError::Os { .. } | BlockError::Short { .. } => Status::IoError,
        }
    }
}

/// The end of a chain: owns the storage.
pub trait Backend: Send {
    /// Device size in bytes.
    fn size(&self) -> u64;
    /// What the backend can do.
    fn caps(&self) -> Caps;
    /// Executes every request of the batch, setting each `result`. Requests in one batch may
    /// complete in any order, except that a `Flush` covers every write before it in the batch.
    fn execute(&mut self, ios: &mut [Io<'_>]);
    /// Called once the domain is confined, before the first request: a backend that talks to
    /// something outside the domain (a remote server) connects here. An error is the same as
    /// [`lost`](Self::lost).
    fn start(&mut self) -> Result<(), String> {
        Ok(())
    }
    /// Something the backend depends on outside the domain is gone (the remote server closed
    /// the connection). The results of the last batch must then not be sent: the domain ends
    /// and the supervisor starts the next generation on a fresh connection, to which the
    /// frontend reissues every unanswered request.
    fn lost(&self) -> Option<&str> {
        None
    }
}

/// A filter or soft device between the frontend and the backend.
pub trait Layer: Send {
    /// Short name for logs and status.
    fn name(&self) -> &'static str;
    /// Capabilities seen from above, given those below.
    fn caps(&self, lower: Caps) -> Caps;
    /// Size seen from above, given the size below.
    fn size(&self, lower: u64) -> u64;
    /// Executes a batch, forwarding to `lower` as it sees fit.
    fn execute(&mut self, ios: &mut [Io<'_>], lower: &mut dyn Backend);
}

/// Layers over a backend, itself usable as a backend.
pub struct Chain {
    layers: Vec<Box<dyn Layer>>,
    backend: Box<dyn Backend>,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain").field("layers", &self.layer_names()).finish()
    }
}

impl Chain {
    /// `layers[0]` is nearest the frontend.
    pub fn new(layers: Vec<Box<dyn Layer>>, backend: Box<dyn Backend>) -> Self {
        Chain { layers, backend }
    }

    /// Names of the layers, top first.
    pub fn layer_names(&self) -> Vec<&'static str> {
        self.layers.iter().map(|l| l.name()).collect()
    }
}

struct Rest<'c> {
    layers: &'c mut [Box<dyn Layer>],
    backend: &'c mut dyn Backend,
}

impl Backend for Rest<'_> {
    fn size(&self) -> u64 {
        self.layers.iter().rev().fold(self.backend.size(), |s, l| l.size(s))
    }
    fn caps(&self) -> Caps {
        self.layers.iter().rev().fold(self.backend.caps(), |c, l| l.caps(c))
    }
    fn execute(&mut self, ios: &mut [Io<'_>]) {
        match self.layers.split_first_mut() {
            None => self.backend.execute(ios),
            Some((top, rest)) => top.execute(ios, &mut Rest { layers: rest, backend: &mut *self.backend }),
        }
    }
}

impl Backend for Chain {
    fn size(&self) -> u64 {
        self.layers.iter().rev().fold(self.backend.size(), |s, l| l.size(s))
    }
    fn caps(&self) -> Caps {
        self.layers.iter().rev().fold(self.backend.caps(), |c, l| l.caps(c))
    }
    fn execute(&mut self, ios: &mut [Io<'_>]) {
        Rest { layers: &mut self.layers, backend: &mut *self.backend }.execute(ios)
    }
    fn start(&mut self) -> Result<(), String> {
        self.backend.start()
    }
    fn lost(&self) -> Option<&str> {
        self.backend.lost()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counting(u64);
    impl Backend for Counting {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn caps(&self) -> Caps {
            Caps { flush: true, fua: false, discard: true, write_zeroes: true, read_only: false }
        }
        fn execute(&mut self, ios: &mut [Io<'_>]) {
            for io in ios {
                self.0 += 1;
                io.result = Ok(io.req.transfer_len());
            }
        }
    }

    struct HideDiscard;
    impl Layer for HideDiscard {
        fn name(&self) -> &'static str {
            "hide-discard"
        }
        fn caps(&self, lower: Caps) -> Caps {
            Caps { discard: false, ..lower }
        }
        fn size(&self, lower: u64) -> u64 {
            lower / 2
        }
        fn execute(&mut self, ios: &mut [Io<'_>], lower: &mut dyn Backend) {
            for io in ios.iter_mut() {
                match io.req {
                    Request::Discard { .. } => io.result = Err(BlockError::NotSupported("discard")),
                    Request::Read { .. } | Request::Write { .. } | Request::Flush | Request::WriteZeroes { .. } => {
                        lower.execute(std::slice::from_mut(io))
                    }
                }
            }
        }
    }

    #[test]
    fn chain_folds_caps_and_size_through_layers() {
        let chain = Chain::new(vec![Box::new(HideDiscard), Box::new(HideDiscard)], Box::new(Counting(0)));
        assert_eq!(chain.size(), 1 << 18);
        assert!(!chain.caps().discard);
        assert!(chain.caps().flush);
        assert_eq!(chain.layer_names(), vec!["hide-discard", "hide-discard"]);
    }

    #[test]
    fn chain_routes_requests_through_each_layer() {
        let mut chain = Chain::new(vec![Box::new(HideDiscard)], Box::new(Counting(0)));
        let mut ios = [Io::new(Request::Flush), Io::new(Request::Discard { offset: 0, len: 4096 })];
        chain.execute(&mut ios);
        assert_eq!(ios[0].result, Ok(0));
        assert_eq!(ios[1].result, Err(BlockError::NotSupported("discard")));
    }

    #[test]
    fn errors_map_to_stable_statuses() {
        assert_eq!(BlockError::Os { op: "write", offset: 0, errno: 28 }.status(), Status::NoSpace);
        assert_eq!(BlockError::Os { op: "write", offset: 0, errno: 5 }.status(), Status::IoError);
        assert_eq!(BlockError::Invalid("x").status(), Status::Invalid);
        assert_eq!(BlockError::NotDone.status(), Status::IoError);
    }
}
