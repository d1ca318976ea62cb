//! The vhost-user-blk export: every device (or those configured) as a virtio-blk disk that a
//! virtual machine's monitor (QEMU, cloud-hypervisor, crosvm) attaches over
//! `<run-dir>/vhost/<name>.sock`.
//!
//! The guest's memory is mapped here, in `serve`, and never in a driver domain: request data
//! is copied between guest buffers and the device channel's arenas, so a hostile or buggy
//! driver cannot read or write the guest. Every descriptor chain the guest writes is checked
//! before it is used ([`virtq`]), and parsed into a typed request ([`blk`]).
//!
//! The protocol's messages are parsed by rust-vmm's `vhost` crate; guest memory is reached
//! through `vm-memory`; descriptors and used elements are `virtio-queue`'s types and the
//! constants `virtio-bindings`'. The split virtqueue itself is walked here, not with
//! `virtio-queue`'s `Queue`: after `serve` is restarted, the requests recorded in the
//! in-flight file ([`inflight`]) are served again from their heads, and that crate builds
//! chains only from the available ring.
#![deny(missing_docs)]

mod backend;
pub mod blk;
pub mod dirty;
pub mod frontend;
pub mod inflight;
pub mod memory;
mod server;
pub mod virtq;
mod worker;

pub use server::{serve_frontend, socket_dir, socket_path, ExportStatus, QueueStatus, VhostError, VhostExport};
