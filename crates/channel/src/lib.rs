//! One queue of a bulkhead device channel: a ring file, two grant arenas and two doorbells.
//!
//! [`QueueSetup::create`] makes the files on the trusted side; it yields the frontend's
//! [`FrontQueue`] and the [`BackQueueFds`] to hand to a driver domain, which turns them into a
//! [`BackQueue`]. The write arena reaches the driver only as a read-only descriptor of a file
//! sealed against new writable mappings; every file is sealed against shrinking, so a hostile
//! driver cannot make the frontend fault.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod above;
mod back;
mod below;
mod front;
mod line;
mod setup;
#[cfg(test)]
mod tests;

pub use above::AboveControl;
pub use back::{ArenaWindows, BackQueue, Popped, RingMap};
pub use below::BelowControl;
pub use bulkhead_shmem::{SharedSlice, SliceList};
pub use front::{Completion, FrontQueue, FrontRequest, QueueStats, STORM_DAMP_MS, STORM_WAKES};
pub use setup::{pair, BackQueueFds, ForwardQueueFds, LowerQueue, QueueConfig, QueueSetup};

pub use bulkhead_block::{Command, Op, Status};
pub use bulkhead_doorbell::{BudgetPolicy, NotifyMode};
pub use bulkhead_ring::{ArenaSizes, Segment, ARENA_READ, ARENA_WRITE};

/// Why a channel stopped being usable. The frontend marks the channel broken on any of these;
/// the supervisor restarts the domain and has the frontend reissue what had no response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChannelError {
    /// The peer broke the ring protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The peer sent a response that does not match an outstanding request.
    #[error("bad response id {id:#x}: {why}")]
    BadResponse {
        /// The id in the response.
        id: u64,
        /// What was wrong.
        why: &'static str,
    },
    /// No response within the caller's deadline.
    #[error("no response within {0} ms")]
    Timeout(u64),
    /// Shared-memory or doorbell setup failed.
    #[error("setup: {0}")]
    Setup(String),
}

impl ChannelError {
    /// Whether restarting the driver domain is the remedy (every error but setup).
    pub fn should_restart(&self) -> bool {
        !matches!(self, ChannelError::Setup(_))
    }
}

/// Why a submission was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Ring or arena space is exhausted: reap completions, then retry.
    #[error("queue full")]
    Full,
    /// The request can never fit (longer than an arena or the protocol limit).
    #[error("request of {0} bytes exceeds the queue's limit")]
    TooLarge(u64),
    /// The channel is broken.
    #[error(transparent)]
    Broken(#[from] ChannelError),
    /// The caller could not fill a write's window ([`FrontQueue::push_write_with`]): nothing
    /// was placed.
    #[error("the write's data could not be read: {0}")]
    Fill(#[from] FillError),
}

/// Why a write's data could not be put in its window: the source failed (a file that could
/// not be read, say), in its words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FillError(pub String);
