//! The null device: reads return zeroes, writes are dropped. Useful to measure the channel alone.

use bulkhead_block::{Backend, BlockError, Caps, Io, Request};

/// A null device of a given size.
#[derive(Debug)]
pub struct NullBackend {
    size: u64,
}

impl NullBackend {
    /// A null device of `size` bytes.
    pub fn new(size: u64) -> Self {
        NullBackend { size }
    }
}

impl Backend for NullBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Caps {
        Caps::DURABLE_AT_ONCE
    }
    fn execute(&mut self, ios: &mut [Io<'_>]) {
        for io in ios {
            io.result = match io.req {
                Request::Read { into: bufs, .. } => {
                    let mut r = Ok(bufs.total_len());
                    for b in bufs.iter() {
                        if b.zero().is_err() {
                            r = Err(BlockError::Invalid("read into read-only buffer"));
                        }
                    }
                    r
                }
                Request::Write { from: bufs, .. } => Ok(bufs.total_len()),
                Request::Flush | Request::Discard { .. } | Request::WriteZeroes { .. } => Ok(0),
            };
        }
    }
}
