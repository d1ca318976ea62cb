//! Test doubles and helpers shared by bulkhead's tests.
//!
//! - [`kernel`]: checks for root, FUSE and loop devices, and guards that detach loop devices,
//!   unmount and kill processes even when a test fails.
//! - [`hostile`]: a driver domain that breaks the ring protocol in each way the frontend must
//!   survive, and [`probe`]: an escape probe run from inside a confined domain. The test driver
//!   binary (`bulkhead-test-driver`, built with the `test-driver` feature of the `bulkhead`
//!   package) runs them; the shipped driver has no such modes.
#![deny(missing_docs)]

pub mod hostile;
pub mod kernel;
pub mod probe;
