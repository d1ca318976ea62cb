//! The FUSE export: `<run-dir>/fuse/<device>`, one regular file per device.
//!
//! The export speaks the FUSE protocol on `/dev/fuse` directly (no libfuse): it mounts with
//! `mount(2)`, clones the connection once per worker thread (`FUSE_DEV_IOC_CLONE`) so every
//! worker reads its own requests, and maps each file operation to a device request:
//!
//! | FUSE | device |
//! |---|---|
//! | `READ` | read (reply written straight from the grant window with `writev`) |
//! | `WRITE` | write, FUA when the file was opened `O_DSYNC`/`O_SYNC` |
//! | `FSYNC` | flush |
//! | `FALLOCATE` punch hole / zero range | discard / write-zeroes |
//!
//! Requests of any size the kernel sends work: `max_write` is 1 MiB with `FUSE_MAX_PAGES`,
//! and the kernel splits larger direct I/O (a 4 MiB write through a loop device arrives as four
//! 1 MiB writes). Files have a fixed size: truncation is refused, `O_TRUNC` is ignored as on a
//! block device.
#![deny(missing_docs)]

mod abi;
mod ops;
mod server;
mod uring;

pub use server::{serve_session, uring_ready, FuseError, FuseExport, FuseOptions, NoUring, Transport, UringMode, ENABLE_URING};
