//! Test doubles and helpers shared by bulkhead's tests.
//!
//! - [`kernel`]: checks for root, FUSE and loop devices, and guards that detach loop devices,
//!   unmount and kill processes even when a test fails.
//! - [`hostile`]: a driver domain that breaks the ring protocol in each way the frontend must
//!   survive, and [`probe`]: an escape probe run from inside a confined domain. The test driver
//!   binary (`bulkhead-test-driver`, built with the `test-driver` feature of the `bulkhead`
//!   package) runs them; the shipped driver has no such modes. [`hostile_vdev`]: a `vdev`
//!   driver that abuses its card at register level, then wedges.
//! - `faults` (feature `faults`): the faults a guarded filter makes on purpose, which only
//!   the test driver and `bench guard --isolation` make; [`inject`]: what they are to be.
//! - [`memsearch`]: a driver domain's search of its own memory for a guest's secrets.
//! - [`memdev`]: a device served in this process from memory, for the exports' fuzz targets.
//! - [`pattern`]: deterministic bytes to write and check.
#![deny(missing_docs)]

use std::fmt;

/// What a test double could not do, in words for the failing test's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KitError(pub String);

impl fmt::Display for KitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KitError {}

// Test code only: any error a double meets ends the test with its words.
impl From<String> for KitError {
    fn from(s: String) -> Self {
        KitError(s)
    }
}

impl From<&str> for KitError {
    fn from(s: &str) -> Self {
        KitError(s.to_string())
    }
}

impl From<std::io::Error> for KitError {
    fn from(e: std::io::Error) -> Self {
        KitError(e.to_string())
    }
}

impl From<bulkhead_vdev::VdevError> for KitError {
    fn from(e: bulkhead_vdev::VdevError) -> Self {
        KitError(e.to_string())
    }
}

#[cfg(feature = "faults")]
pub mod faults;

pub mod hostile;
pub mod hostile_vdev;
pub mod inject;
pub mod kernel;
pub mod memdev;
pub mod memsearch;
pub mod probe;
/// A zeroed buffer of `len` bytes aligned to 4 KiB, what `O_DIRECT` needs: a slice of a vector
/// 4 KiB longer.
pub struct AlignedBuf {
    raw: Vec<u8>,
    at: usize,
    len: usize,
}

impl AlignedBuf {
    /// `len` zeroes.
    pub fn zeroed(len: usize) -> AlignedBuf {
        let raw = vec![0u8; len + 4096];
        let at = raw.as_ptr().align_offset(4096);
        AlignedBuf { raw, at, len }
    }

    /// A copy of `data`.
    pub fn from_slice(data: &[u8]) -> AlignedBuf {
        let mut b = AlignedBuf::zeroed(data.len());
        b.copy_from_slice(data);
        b
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.raw[self.at..self.at + self.len]
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.at..self.at + self.len]
    }
}

/// Deterministic pseudo-random bytes: the same `seed` and `len`, the same bytes.
pub use bulkhead_rng::pattern;
