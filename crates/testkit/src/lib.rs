//! Test doubles and helpers shared by bulkhead's tests.
//!
//! - [`kernel`]: checks for root, FUSE and loop devices, and guards that detach loop devices,
//!   unmount and kill processes even when a test fails.
#![deny(missing_docs)]

pub mod kernel;
