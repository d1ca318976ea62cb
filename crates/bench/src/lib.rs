//! Benchmarks behind `bulkhead bench`.
//!
//! Each benchmark runs the real pieces: the channel benchmark execs a real driver domain
//! (`bulkhead driver`) with a `ram` backend and drives it from this process; the fileio benchmark
//! runs `bulkhead serve` and the peers under sysbench, through the kernel.
#![deny(missing_docs)]

pub mod channel;
pub mod fileio;
pub mod restart;
mod table;

pub use table::Table;
