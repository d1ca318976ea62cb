//! Test doubles and helpers shared by bulkhead's tests.
//!
//! - [`XorLayer`]: a test-only filter that transforms data on its way down and back, proving a
//!   chain really routes every request through a layer (a pass-through would leave the backend
//!   holding plain data).
//! - [`kernel`]: checks for root, FUSE and loop devices, and guards that detach loop devices,
//!   unmount and kill processes even when a test fails.
#![deny(missing_docs)]

pub mod kernel;

use std::os::fd::AsRawFd;

use bulkhead_block::{Backend, BlockError, Caps, Io, Layer, Request, SliceList};
use bulkhead_shmem::{memfd, Mapping, Protection};

/// XORs every data byte with a key. Writes go through a private bounce buffer (the write arena
/// is read-only to the driver), reads are transformed in place in the read arena.
pub struct XorLayer {
    key: u8,
    bounce: Mapping,
    /// Requests seen, by kind: read, write, flush, discard, write-zeroes.
    pub seen: [u64; 5],
}

impl XorLayer {
    /// A layer with `key` and a bounce buffer of `max_request` bytes.
    pub fn new(key: u8, max_request: usize) -> Self {
        let fd = memfd::create("xor-bounce", max_request as u64).expect("memfd");
        let bounce = Mapping::new(fd.as_raw_fd(), max_request, Protection::ReadWrite).expect("map");
        XorLayer { key, bounce, seen: [0; 5] }
    }

    fn xor_window(&self, w: &bulkhead_shmem::SharedSlice<'_>, scratch: &mut Vec<u8>) {
        scratch.resize(w.len(), 0);
        w.copy_to(scratch);
        for b in scratch.iter_mut() {
            *b ^= self.key;
        }
        w.copy_from(scratch).expect("writable window");
    }
}

impl Layer for XorLayer {
    fn name(&self) -> &'static str {
        "xor-test"
    }
    fn caps(&self, lower: Caps) -> Caps {
        lower
    }
    fn size(&self, lower: u64) -> u64 {
        lower
    }
    fn execute(&mut self, ios: &mut [Io<'_>], lower: &mut dyn Backend) {
        let mut scratch = Vec::new();
        for io in ios.iter_mut() {
            match io.req {
                Request::Read { .. } => {
                    self.seen[0] += 1;
                    lower.execute(std::slice::from_mut(io));
                    if let (Ok(_), Request::Read { bufs, .. }) = (&io.result, io.req) {
                        for w in bufs.iter() {
                            self.xor_window(&w, &mut scratch);
                        }
                    }
                }
                Request::Write { offset, bufs, fua } => {
                    self.seen[1] += 1;
                    let total = bufs.total_len() as usize;
                    if total > self.bounce.len() {
                        io.result = Err(BlockError::Invalid("request larger than the bounce buffer"));
                        continue;
                    }
                    let bounce = self.bounce.slice(0, total).expect("checked size");
                    let mut at = 0;
                    for w in bufs.iter() {
                        let dst = bounce.sub(at, w.len()).expect("inside bounce");
                        w.copy_to_shared(&dst).expect("bounce is writable");
                        at += w.len();
                    }
                    self.xor_window(&bounce, &mut scratch);
                    let mut down = [Io::new(Request::Write { offset, bufs: SliceList::one(bounce), fua })];
                    lower.execute(&mut down);
                    io.result = down[0].result.clone();
                }
                Request::Flush => {
                    self.seen[2] += 1;
                    lower.execute(std::slice::from_mut(io));
                }
                Request::Discard { .. } => {
                    self.seen[3] += 1;
                    lower.execute(std::slice::from_mut(io));
                }
                Request::WriteZeroes { .. } => {
                    // Zeroes below would read back as `key` bytes above: refuse rather than
                    // corrupt (the filter does not model holes).
                    self.seen[4] += 1;
                    io.result = Err(BlockError::NotSupported("write zeroes through xor-test"));
                }
            }
        }
    }
}
