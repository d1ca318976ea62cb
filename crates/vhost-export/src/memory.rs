//! A guest's memory as its frontend shares it (`VHOST_USER_SET_MEM_TABLE`): each region's file
//! mapped here, in `serve`, and never in a driver domain. Rings and buffers are reached
//! through `vm-memory`, whose accesses are volatile: the guest changes this memory while it is
//! read.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use vhost::vhost_user::message::VhostUserMemoryRegion;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap};

use crate::dirty::{DirtyLog, RegionLog};

/// Guest memory as `serve` maps it: each region's writes marked in the session's dirty log.
pub type Memory = GuestMemoryMmap<RegionLog>;

/// Regions a frontend may share (the protocol's baseline; QEMU sends at most this many).
pub const MAX_REGIONS: usize = 8;

/// Why a memory table was refused.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The table and the descriptors that came with it disagree, or hold too many regions.
    #[error("{regions} memory regions with {files} descriptors (at most {MAX_REGIONS})")]
    Count {
        /// Regions in the table.
        regions: usize,
        /// Descriptors attached.
        files: usize,
    },
    /// A region is empty, or it wraps the address space.
    #[error("memory region {index}: {why}")]
    Region {
        /// Its position in the table.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// A region's file is smaller than the region: reaching past its end would kill `serve`
    /// with SIGBUS.
    #[error("memory region {index}: its file holds {file} bytes, the region needs {needed}")]
    ShortFile {
        /// Its position in the table.
        index: usize,
        /// The file's size.
        file: u64,
        /// Offset plus size of the region.
        needed: u64,
    },
    /// A memory file that could shrink under `serve` (a memfd without `F_SEAL_SHRINK`).
    #[error("memory region {index}: its memfd is not sealed against shrinking (QEMU's memory-backend-memfd seals it by default: keep seal=on)")]
    Unsealed {
        /// Its position in the table.
        index: usize,
    },
    /// Regions overlap in guest or frontend addresses.
    #[error("memory regions overlap")]
    Overlap,
    /// Mapping failed.
    #[error("cannot map memory region {index}: {source}")]
    Map {
        /// Its position in the table.
        index: usize,
        /// The error.
        source: vm_memory::mmap::MmapRegionError,
    },
}

/// One region as the frontend addresses it in its own process.
#[derive(Debug, Clone, Copy)]
struct UserRange {
    user: u64,
    len: u64,
    guest: u64,
}

/// A guest's memory, mapped.
#[derive(Debug)]
pub struct GuestMem {
    mem: Memory,
    user: Vec<UserRange>,
}

impl GuestMem {
    /// Maps the regions of a `SET_MEM_TABLE`, checking each file holds its region and that a
    /// memfd is sealed against shrinking, so no access can fault. Writes are marked in `log`.
    pub fn map(table: &[VhostUserMemoryRegion], files: Vec<File>, log: &Arc<DirtyLog>) -> Result<GuestMem, MemoryError> {
        if table.len() != files.len() || table.is_empty() || table.len() > MAX_REGIONS {
            return Err(MemoryError::Count { regions: table.len(), files: files.len() });
        }
        let mut regions = Vec::with_capacity(table.len());
        let mut user = Vec::with_capacity(table.len());
        for (index, (r, file)) in table.iter().zip(files).enumerate() {
            let bad = |why: &str| MemoryError::Region { index, why: why.to_string() };
            if r.memory_size == 0 {
                return Err(bad("empty"));
            }
            let end = |base: u64| base.checked_add(r.memory_size).ok_or_else(|| bad("wraps the address space"));
            end(r.guest_phys_addr)?;
            end(r.user_addr)?;
            let needed = end(r.mmap_offset)?;
            let size = usize::try_from(r.memory_size).map_err(|_| bad("larger than the address space"))?;
            let file_len = file.metadata().map_err(|e| bad(&format!("cannot stat its file: {e}")))?.len();
            if file_len < needed {
                return Err(MemoryError::ShortFile { index, file: file_len, needed });
            }
            // Only memory files carry seals; other files (hugetlbfs, tmpfs) answer EINVAL.
            if let Ok(seals) = bulkhead_shmem::memfd::seals(file.as_raw_fd()) {
                if seals & libc::F_SEAL_SHRINK == 0 {
                    return Err(MemoryError::Unsealed { index });
                }
            }
            let mapping = MmapRegionBuilder::new_with_bitmap(size, RegionLog::new(log.clone(), r.guest_phys_addr))
                .with_file_offset(FileOffset::new(file, r.mmap_offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_NORESERVE | libc::MAP_SHARED)
                .build()
                .map_err(|source| MemoryError::Map { index, source })?;
            let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_phys_addr))
                .ok_or_else(|| bad("wraps the guest's address space"))?;
            regions.push(region);
            user.push(UserRange { user: r.user_addr, len: r.memory_size, guest: r.guest_phys_addr });
        }
        let mut sorted = user.clone();
        sorted.sort_by_key(|u| u.user);
        if sorted.windows(2).any(|w| w[0].user + w[0].len > w[1].user) {
            return Err(MemoryError::Overlap);
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(|_| MemoryError::Overlap)?;
        Ok(GuestMem { mem, user })
    }

    /// The memory, for reads and writes by guest address.
    pub fn memory(&self) -> &Memory {
        &self.mem
    }

    /// The guest address of `len` bytes at the frontend's virtual address `user` (how
    /// `SET_VRING_ADDR` names the rings), if one region holds them all.
    pub fn guest_of_user(&self, user: u64, len: u64) -> Option<GuestAddress> {
        self.user.iter().find_map(|r| {
            let off = user.checked_sub(r.user)?;
            (off.checked_add(len)? <= r.len).then_some(GuestAddress(r.guest + off))
        })
    }

    /// Whether one region holds `len` bytes at `addr`.
    pub fn holds(&self, addr: GuestAddress, len: u64) -> bool {
        let Ok(len) = usize::try_from(len) else { return false };
        self.mem.get_slice(addr, len).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    fn memfd(len: u64, seal: bool) -> File {
        let fd = bulkhead_shmem::memfd::create("guest", len).unwrap();
        if seal {
            bulkhead_shmem::memfd::seal_size(fd.as_raw_fd()).unwrap();
        }
        File::from(fd)
    }

    fn region(guest: u64, size: u64, user: u64) -> VhostUserMemoryRegion {
        VhostUserMemoryRegion::new(guest, size, user, 0)
    }

    #[test]
    fn maps_regions_and_translates_frontend_addresses() {
        let table = [region(0, 1 << 20, 0x7f00_0000_0000), region(1 << 30, 1 << 20, 0x7f10_0000_0000)];
        let mem = GuestMem::map(&table, vec![memfd(1 << 20, true), memfd(1 << 20, true)], &Arc::default()).unwrap();
        assert_eq!(mem.guest_of_user(0x7f00_0000_1000, 16), Some(GuestAddress(0x1000)));
        assert_eq!(mem.guest_of_user(0x7f10_0000_0000, 4096), Some(GuestAddress(1 << 30)));
        assert_eq!(mem.guest_of_user(0x7f00_000f_fff0, 32), None, "runs past the region");
        assert_eq!(mem.guest_of_user(0x1000, 1), None);
        mem.memory().write_obj(0xabcd_u32, GuestAddress((1 << 30) + 8)).unwrap();
        assert_eq!(mem.memory().read_obj::<u32>(GuestAddress((1 << 30) + 8)).unwrap(), 0xabcd);
        assert!(mem.holds(GuestAddress(0), 1 << 20));
        assert!(!mem.holds(GuestAddress(4096), 1 << 20));
    }

    #[test]
    fn refuses_short_unsealed_and_overlapping_tables() {
        let t = [region(0, 1 << 20, 0x1000_0000)];
        assert!(matches!(GuestMem::map(&t, vec![memfd(4096, true)], &Arc::default()), Err(MemoryError::ShortFile { .. })));
        assert!(matches!(GuestMem::map(&t, vec![memfd(1 << 20, false)], &Arc::default()), Err(MemoryError::Unsealed { .. })));
        assert!(matches!(GuestMem::map(&t, vec![], &Arc::default()), Err(MemoryError::Count { .. })));
        let overlap = [region(0, 1 << 20, 0x1000_0000), region(1 << 20, 1 << 20, 0x1008_0000)];
        assert!(matches!(
            GuestMem::map(&overlap, vec![memfd(1 << 20, true), memfd(1 << 20, true)], &Arc::default()),
            Err(MemoryError::Overlap)
        ));
        let guest_overlap = [region(0, 1 << 20, 0x1000_0000), region(4096, 1 << 20, 0x2000_0000)];
        assert!(GuestMem::map(&guest_overlap, vec![memfd(1 << 20, true), memfd(1 << 20, true)], &Arc::default()).is_err());
        let empty = [region(0, 0, 0x1000_0000)];
        assert!(matches!(GuestMem::map(&empty, vec![memfd(4096, true)], &Arc::default()), Err(MemoryError::Region { .. })));
    }
}
