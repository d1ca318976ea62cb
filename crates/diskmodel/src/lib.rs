//! A modelled disk, and the disk schedulers that order requests for it.
//!
//! The model is the linear seek model of the virtual performance throttle: a request that
//! goes to the media takes `X = R/2 + S·d/D + transfer`, with `R` the rotation time, `S` the
//! full-stroke seek time, `d` the distance from where the previous request left the head and
//! `D` the size of the device, plus a shadow of the drive's segmented read cache, whose
//! predicted hits take the cache's service time instead ([`Model`]).
//!
//! The same model serves three users, so that what they predict agrees: the `vpt` filter,
//! which delays each completion until `k·X` after the request reached the modelled drive; the
//! `scheduler` filter, whose schedulers ([`sched`]) predict access times with it; and
//! `bulkhead sim`, a discrete-event simulator ([`sim`]) that runs a workload through a
//! scheduler and the model, with no device at all.
//!
//! Everything here is plain computation: no clock is read (time is always passed in, in
//! nanoseconds) and nothing is allocated per request once a queue has grown to its size.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod cache;
mod model;
pub mod opt;
pub mod sched;
pub mod sim;
pub mod surge;

/// A drive whose parameters cannot be: the one that is wrong, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidDrive(String);

pub use cache::{CacheGeometry, CacheShadow};
pub use model::{Access, Drive, Model, Service};
