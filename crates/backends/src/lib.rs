//! Backends: the storage at the end of a driver domain's chain.
//!
//! Every backend receives descriptors opened for it by the supervisor; none opens a path itself
//! (the sandbox forbids it); the `nbd` backend gets a socket the supervisor connected.
#![deny(missing_docs)]

mod channel;
mod file;
mod nbd;
mod null;
mod qcow2;
mod ram;
mod rbd;

pub use channel::ChannelBackend;
pub use file::{Engine, FileBackend};
pub use nbd::NbdBackend;
pub use null::NullBackend;
pub use qcow2::{FdStorage, ImageLayer, Qcow2Backend};
pub use ram::RamBackend;
pub use rbd::{RbdBackend, RbdOptions};

/// Setup errors of a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A system call failed while setting up.
    #[error("{op}: {source}")]
    Sys {
        /// What was being done.
        op: &'static str,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A disk image could not be opened: the message names the image and the field.
    #[error("{0}")]
    Image(String),
    /// Mapping the ramdisk failed.
    #[error("ramdisk mapping: {0}")]
    Map(#[from] bulkhead_shmem::ShmError),
    /// What the backend reaches (a remote server, a cluster, the domain below a tap domain)
    /// failed it or broke the protocol: said in words, for the log and the next generation.
    #[error("{0}")]
    Link(String),
}

impl BackendError {
    /// [`BackendError::Link`].
    pub fn link(words: impl Into<String>) -> BackendError {
        BackendError::Link(words.into())
    }
}

pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}
