//! The ramdisk: a sparse memfd created by the supervisor, so its contents outlive a driver
//! restart (like a hardware ramdisk outliving its driver) and a fresh device costs only what is
//! written to it.

use std::os::fd::{AsRawFd, OwnedFd};

use bulkhead_block::{Backend, BlockError, Caps, Io, Request};
use bulkhead_shmem::{Mapping, Protection};

use crate::{errno, BackendError};

/// A ramdisk over a memfd.
#[derive(Debug)]
pub struct RamBackend {
    fd: OwnedFd,
    map: Mapping,
    size: u64,
}

impl RamBackend {
    /// Maps the memfd `fd` of `size` bytes.
    pub fn new(fd: OwnedFd, size: u64) -> Result<Self, BackendError> {
        let map = Mapping::new(fd.as_raw_fd(), size as usize, Protection::ReadWrite)?;
        Ok(RamBackend { fd, map, size })
    }

    fn punch(&self, offset: u64, len: u64) -> Result<u64, BlockError> {
        // Punching a hole frees the pages; they read back as zeroes.
        // SAFETY: plain syscall on our descriptor.
        let rc = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc < 0 {
            return Err(BlockError::Os { op: "punch hole", offset, errno: errno() });
        }
        Ok(0)
    }

    fn one(&self, req: &Request<'_>) -> Result<u64, BlockError> {
        match *req {
            Request::Read { offset, into: bufs } => {
                let mut off = offset as usize;
                for b in bufs.iter() {
                    let src = self.map.slice(off, b.len()).map_err(|_| BlockError::Invalid("read beyond device"))?;
                    src.copy_to_shared(&b).map_err(|_| BlockError::Invalid("read into read-only buffer"))?;
                    off += b.len();
                }
                Ok(bufs.total_len())
            }
            Request::Write { offset, from: bufs, fua: _ } => {
                let mut off = offset as usize;
                for b in bufs.iter() {
                    let dst = self.map.slice(off, b.len()).map_err(|_| BlockError::Invalid("write beyond device"))?;
                    b.copy_to_shared(&dst).expect("ramdisk mapping is writable");
                    off += b.len();
                }
                Ok(bufs.total_len())
            }
            // Memory is as durable as this device gets: flush and FUA have nothing to do.
            Request::Flush => Ok(0),
            Request::Discard { offset, len } | Request::WriteZeroes { offset, len } => {
                if offset.checked_add(len).is_none_or(|e| e > self.size) {
                    return Err(BlockError::Invalid("range beyond device"));
                }
                self.punch(offset, len)
            }
        }
    }
}

impl Backend for RamBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Caps {
        Caps::DURABLE_AT_ONCE
    }
    fn execute(&mut self, ios: &mut [Io<'_>]) {
        for io in ios {
            io.result = self.one(&io.req);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_block::SliceList;
    use bulkhead_shmem::memfd;

    fn rss_of_fd(fd: &OwnedFd) -> u64 {
        // Blocks actually allocated to the memfd.
        // SAFETY: plain data for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid out pointer.
        unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
        st.st_blocks as u64 * 512
    }

    #[test]
    fn fresh_ramdisk_costs_nothing_and_discard_frees() {
        let fd = memfd::create("ram", 1 << 30).unwrap();
        let probe = fd.try_clone().unwrap();
        let mut b = RamBackend::new(fd, 1 << 30).unwrap();
        assert_eq!(rss_of_fd(&probe), 0, "1 GiB device allocates nothing until written");
        let mfd = memfd::create("buf", 1 << 20).unwrap();
        let m = Mapping::new(mfd.as_raw_fd(), 1 << 20, Protection::ReadWrite).unwrap();
        let w = m.slice(0, 1 << 20).unwrap();
        w.copy_from(&vec![0xab; 1 << 20]).unwrap();
        let mut ios = [Io::new(Request::Write { offset: 512 << 20, from: SliceList::one(w), fua: false })];
        b.execute(&mut ios);
        assert_eq!(ios[0].result, Ok(1 << 20));
        assert_eq!(rss_of_fd(&probe), 1 << 20);
        let mut ios = [Io::new(Request::Discard { offset: 512 << 20, len: 1 << 20 })];
        b.execute(&mut ios);
        assert_eq!(rss_of_fd(&probe), 0, "discard gave the memory back");
        let mut ios = [Io::new(Request::Read { offset: 512 << 20, into: SliceList::one(w) })];
        b.execute(&mut ios);
        let mut out = vec![1u8; 1 << 20];
        w.copy_to(&mut out);
        assert!(out.iter().all(|&x| x == 0));
    }

    #[test]
    fn ram_refuses_range_beyond_device() {
        let fd = memfd::create("ram", 1 << 20).unwrap();
        let mut b = RamBackend::new(fd, 1 << 20).unwrap();
        let mut ios = [Io::new(Request::WriteZeroes { offset: 1 << 20, len: 1 })];
        b.execute(&mut ios);
        assert!(matches!(ios[0].result, Err(BlockError::Invalid(_))));
    }
}
