//! Benchmarks behind `bulkhead bench`.
//!
//! Each benchmark runs the real pieces: the channel benchmark execs a real driver domain
//! (`bulkhead driver`) with a `ram` backend and drives it from this process; the fileio benchmark
//! runs `bulkhead serve` and the peers under sysbench, through the kernel; the tap benchmark
//! runs a supervisor in this process with and without filters, through the library and FUSE;
//! the surge benchmark reads files on ext4 over a `vpt` device per disk scheduler, beside the
//! simulator.
#![deny(missing_docs)]

pub mod channel;
pub mod fileio;
pub mod guard;
pub mod guard_filters;
pub mod images;
pub mod restart;
pub mod surge;
mod table;
pub mod tap;
pub mod vdev;

pub use table::Table;
