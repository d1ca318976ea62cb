//! The supervisor (device manager) inside `bulkhead serve`.
//!
//! For each configured device it opens or creates the backend's storage, creates the channel
//! (one [`bulkhead_channel::QueueSetup`] per queue), execs the device's domains (`bulkhead
//! driver DEVICE`) holding only those descriptors, and hands the frontend end to the exports
//! as a [`bulkhead_client::Device`]. The watcher learns of a domain's death through its pidfd,
//! of a broken channel through the device's alarm, and of a wedged domain through the
//! watchdog; the device's lifecycle (`lifecycle.rs`) decides what to do, and a worker does
//! it. `serve` answers the control socket (`bulkhead_control`) through it. What a domain prints reaches the log through
//! [`domain_log`], prefixed, sanitised and rate-limited.
//!
//! Modules depend one way: `state` (shared types) and `lifecycle` (the rules) are leaves;
//! `domains`, `launcher` and `device` hold processes and descriptors; `jobs` change them;
//! `watcher` and `supervisor` drive it all.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod attach;
mod chain;
mod device;
pub mod domain_log;
mod domains;
mod error;
mod hub;
mod jobs;
pub mod kept;
mod launcher;
mod lifecycle;
mod mailbox;
pub mod proc_info;
mod rbd;
mod reap;
mod spares;
mod spawn;
mod standby;
mod standing_by;
mod state;
mod status;
mod storage;
mod supervisor;
mod vdev;
mod views;
mod watcher;
mod workers;

pub use attach::AttachedStatus;
pub use bulkhead_sys::pidfd_open;
pub use device::DeviceRuntime;
pub use error::{Error, ErrorKind};
pub use spares::SpareCounts;
pub use spawn::spawn_domain;
pub use state::{DeviceState, RestartPolicy, GUARD_EXIT, LOST_EXIT};
pub use status::{DeviceStatus, FilterStatus, ProcessMemory, StatusReport};
pub use supervisor::{DeviceChange, Supervisor};
pub use vdev::CardStatus;
pub use views::{Controls, ViewRuntime, ViewStatus};
