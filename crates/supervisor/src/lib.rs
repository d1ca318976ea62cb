//! The supervisor (device manager) inside `bulkhead serve`.
//!
//! For each configured device it creates the channel (one [`bulkhead_channel::QueueSetup`]
//! per queue), opens or creates the backend's storage, execs a driver domain
//! (`bulkhead driver --spec …`) holding only those descriptors, and hands the frontend end to
//! the exports as a [`bulkhead_client::Device`]. A watcher thread learns of a domain's death
//! through its pidfd. The control socket answers `status`. What a domain prints reaches the
//! log through [`domain_log`], prefixed, sanitised and rate-limited.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod attach;
mod chain;
pub mod control;
mod domain;
pub mod domain_log;
mod image;
mod lifecycle;
pub mod proc_info;
mod supervisor;
mod vdev;
mod views;

/// Exit status of a domain whose backend lost its remote server (EX_TEMPFAIL): the supervisor
/// reconnects and starts the next generation.
pub const LOST_EXIT: u8 = 75;
/// Exit status of a domain whose write capture stopped a filter's write
/// (`bulkhead_guard::VIOLATION_EXIT`): restarted like a crash, with the reason in the log.
pub const GUARD_EXIT: u8 = 86;

pub use attach::AttachedStatus;
pub use domain::{pidfd_open, spawn_domain, DeviceRuntime};
pub use supervisor::{DeviceChange, DeviceState, DeviceStatus, ProcessMemory, StatusReport, Supervisor, SupervisorError};
pub use vdev::CardStatus;
pub use views::{Controls, ViewRuntime, ViewStatus};
