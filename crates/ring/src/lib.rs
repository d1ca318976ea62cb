//! The bulkhead ring protocol (see `docs/ring-protocol.md` for the numbered rules).
//!
//! A queue is one memory file holding a header page, a ring of fixed-size request slots and a
//! ring of fixed-size response slots. The frontend produces requests and consumes responses; the
//! driver domain does the opposite. Each side keeps private copies of the indexes it owns and
//! treats every value the peer can write as hostile: indexes are range-checked, slots are copied
//! out once ([`bulkhead_shmem::Mapping::read_obj`]) and the copy is validated.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod layout;
pub mod notify;
mod rings;
mod validate;
mod wire;

pub use layout::{HeaderOffsets, RingLayout, HEADER_SIZE, MAGIC, VERSION};
pub use notify::{IndexCell, PeerState};
pub use rings::{BackRing, FrontRing};
pub use validate::{validate_request, ArenaSizes, RequestError, ValidRequest};
pub use wire::{
    op_code, op_of_code, status_code, status_of_code, RequestSlot, ResponseSlot, Segment, ARENA_READ, ARENA_WRITE, FLAG_FUA,
    MAX_REQUEST_BYTES, MAX_SEGMENTS, REQ_SLOT_SIZE, RSP_SLOT_SIZE,
};

/// A violation of the ring protocol by the peer. Any of these marks the channel broken: the
/// supervisor restarts the driver domain (or, on the driver side, the domain stops serving).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The header does not describe a ring this version understands.
    #[error("bad ring header: {0}")]
    BadHeader(&'static str),
    /// The peer published a producer index that claims more entries than can exist.
    #[error("peer producer index {prod} is {ahead} entries ahead of consumer {cons} (ring holds {nslots})")]
    IndexOutOfRange {
        /// Producer index read.
        prod: u32,
        /// Our consumer index.
        cons: u32,
        /// Entries claimed.
        ahead: u32,
        /// Ring size.
        nslots: u32,
    },
    /// The ring is full; the caller must wait for completions (not a violation).
    #[error("ring full")]
    Full,
    /// Shared memory access failed (a bug, or a truncated file).
    #[error("shared memory: {0}")]
    Shm(String),
}

impl From<bulkhead_shmem::ShmError> for RingError {
    fn from(e: bulkhead_shmem::ShmError) -> Self {
        RingError::Shm(e.to_string())
    }
}
