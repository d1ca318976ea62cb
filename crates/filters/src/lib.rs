//! Filters: layers that trace, count, delay, fail, throttle, encrypt or copy-on-write block
//! requests on their way between the frontend and the backend (the block tap's soft devices).
//!
//! Each filter implements [`bulkhead_block::Layer`] and matches every [`Request`] in full.
//! A filter runs inside an untrusted domain, so it opens nothing itself: what it writes to —
//! a trace file, its counters — arrives as descriptors the supervisor opened, named in its
//! [`FilterSpec`]. Counters live in a small shared page per filter ([`state::StatePage`]), which
//! outlives the domain: a restarted domain carries on counting (and an `error` filter's
//! `count` stays spent), and `bulkhead status` reads it without asking the domain.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod cow;
pub mod crypt;
pub mod delay;
pub mod error;
pub mod scheduler;
pub mod spec;
pub mod state;
pub mod stats;
pub mod throttle;
pub mod trace;
pub mod trace_summary;
pub mod vpt;

pub use spec::{build, FilterFds, FilterReport, FilterSpec, GuardMode, GuardSpec};

use bulkhead_block::Request;

/// Why a filter could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// Its shared state page could not be mapped.
    #[error("filter {filter}: state page: {source}")]
    State {
        /// The filter type.
        filter: &'static str,
        /// What failed.
        #[source]
        source: bulkhead_shmem::ShmError,
    },
    /// A descriptor the spec needs is missing.
    #[error("filter {0}: a descriptor it needs was not passed")]
    MissingFd(&'static str),
    /// A value in the spec is unusable.
    #[error("filter {filter}: {message}")]
    Invalid {
        /// The filter type.
        filter: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// The bytes a request moves (its data length, or the range of a discard or write-zeroes).
pub(crate) fn bytes_of(req: &Request<'_>) -> u64 {
    req.range().1
}
