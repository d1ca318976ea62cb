//! The driver-domain runtime.
//!
//! A domain is a separate process (`bulkhead driver`, exec'd by the supervisor) that holds only
//! the descriptors it was given: each queue's ring, arenas and doorbells, and its backend's
//! files. [`spec::DomainSpec`] says which descriptor is which; [`Domain`] serves every queue of
//! the device from one thread, round-robin, one batch per queue per turn, through a
//! [`bulkhead_block::Chain`].
#![deny(missing_docs)]

pub mod hostile;
mod runtime;
pub mod spec;

pub use runtime::{Domain, DomainStats, HEARTBEAT, HELD};

/// Why a domain stopped.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The frontend broke the ring protocol on a queue.
    #[error("queue {queue}: {source}")]
    Channel {
        /// Queue index.
        queue: usize,
        /// What happened.
        #[source]
        source: bulkhead_channel::ChannelError,
    },
    /// The backend lost something outside the domain it depends on (its remote server). The
    /// last batch was not answered; the supervisor reconnects and the frontend reissues it.
    #[error("backend lost: {0}")]
    BackendLost(String),
    /// The spec or a descriptor in it was unusable.
    #[error("setup: {0}")]
    Setup(String),
}
