//! Creation of a queue's shared files on the trusted side.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use bulkhead_doorbell::{BudgetPolicy, EventFd, NotifyMode};
use bulkhead_ring::{ArenaSizes, FrontRing, RingLayout};
use bulkhead_shmem::{memfd, Mapping, Protection};

use crate::{BackQueue, ChannelError, FrontQueue};

/// Geometry and policy of a queue.
#[derive(Debug, Clone, Copy)]
pub struct QueueConfig {
    /// Slots per ring (power of two): the most requests in flight.
    pub nslots: u32,
    /// Bytes in each grant arena (at least the largest request).
    pub arena_bytes: usize,
    /// How the frontend waits for responses.
    pub mode: NotifyMode,
    /// Spin budget of adaptive mode.
    pub budget: BudgetPolicy,
    /// Channel generation.
    pub generation: u32,
}

impl QueueConfig {
    /// Bytes of each arena file: `arena_bytes` rounded up to whole pages.
    pub(crate) fn arena_len(&self) -> usize {
        self.arena_bytes.div_ceil(bulkhead_shmem::PAGE_SIZE) * bulkhead_shmem::PAGE_SIZE
    }
}

/// A new arena file of `bytes`, sealed against shrinking.
fn new_arena(name: &str, bytes: usize) -> Result<OwnedFd, ChannelError> {
    let fd = memfd::create(name, bytes as u64).map_err(setup_err)?;
    memfd::seal_size(fd.as_raw_fd()).map_err(setup_err)?;
    Ok(fd)
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            nslots: 64,
            arena_bytes: 8 << 20,
            mode: NotifyMode::Adaptive,
            budget: BudgetPolicy::DEFAULT_AUTO,
            generation: 1,
        }
    }
}

/// The descriptors a driver domain needs for one queue.
#[derive(Debug)]
pub struct BackQueueFds {
    /// Queue file (read-write).
    pub ring: OwnedFd,
    /// Write arena, reopened read-only.
    pub write_arena: OwnedFd,
    /// Read arena (read-write).
    pub read_arena: OwnedFd,
    /// Doorbell rung by the frontend.
    pub kick: OwnedFd,
    /// Doorbell rung by the driver.
    pub irq: OwnedFd,
}

impl BackQueueFds {
    /// Close-on-exec duplicates of every descriptor (for another domain on the same queue).
    pub fn try_clone(&self) -> Result<Self, ChannelError> {
        Ok(BackQueueFds {
            ring: dup(&self.ring)?,
            write_arena: dup(&self.write_arena)?,
            read_arena: dup(&self.read_arena)?,
            kick: dup(&self.kick)?,
            irq: dup(&self.irq)?,
        })
    }

    /// The descriptors in passing order: ring, write arena, read arena, kick, irq.
    pub fn as_array(&self) -> [&OwnedFd; 5] {
        [&self.ring, &self.write_arena, &self.read_arena, &self.kick, &self.irq]
    }
}

/// The descriptors of a forwarding frontend (a tap domain's end of the queue to the domain
/// below it): the queue file and the doorbells, and the arenas of the queue's own when it
/// does not share those of the channel above (see [`LowerQueue::create`]).
#[derive(Debug)]
pub struct ForwardQueueFds {
    /// Queue file (read-write).
    pub ring: OwnedFd,
    /// Doorbell the frontend rings.
    pub kick: OwnedFd,
    /// Doorbell rung by the driver.
    pub irq: OwnedFd,
    /// The queue's own write and read arenas (both read-write), if it has them.
    pub arenas: Option<[OwnedFd; 2]>,
}

impl ForwardQueueFds {
    /// The descriptors in passing order: ring, kick, irq.
    pub fn as_array(&self) -> [&OwnedFd; 3] {
        [&self.ring, &self.kick, &self.irq]
    }
}

/// The queue between a tap domain and the domain below it, for one queue of the channel above.
///
/// Shared (the usual way), its arenas are that queue's: the domain below gets the upper write
/// arena as the same read-only, write-sealed descriptor the tap domain has, and the upper read
/// arena, so the tap domain passes requests on by naming the windows they came in, and nothing
/// is copied. Only the queue file and the doorbells are new.
///
/// Private, it has arenas of its own, which the tap domain fills and reads and the domain
/// below sees as it would a frontend's: what the application wrote and reads stays in the
/// channel above, out of the domain below's reach, and only what the tap domain's filters
/// send down (a `crypt` filter's ciphertext, a `cow` filter's merged clusters) crosses. The
/// tap domain copies each request's data in and out. Its write arena is not sealed against
/// writing, for the tap domain maps it writable after the supervisor made it; the domain below
/// gets a read-only descriptor, as of every write arena.
#[derive(Debug)]
pub struct LowerQueue {
    ring: OwnedFd,
    kick: OwnedFd,
    irq: OwnedFd,
    write_arena: OwnedFd,
    read_arena: OwnedFd,
    /// A private queue's arenas as the tap domain gets them: write (read-write), read.
    own: Option<[OwnedFd; 2]>,
}

impl LowerQueue {
    /// The queue below the upper queue whose driver descriptors are `upper`, of `cfg`'s ring
    /// geometry (the tap domain writes the header); `private`: with arenas of its own, of
    /// `cfg.arena_bytes` each.
    pub fn create(name: &str, cfg: &QueueConfig, upper: &BackQueueFds, private: bool) -> Result<Self, ChannelError> {
        let layout = RingLayout::new(cfg.nslots).map_err(setup_err)?;
        let ring = memfd::create(&format!("bulkhead-{name}-ring"), layout.file_size() as u64).map_err(setup_err)?;
        memfd::seal_size(ring.as_raw_fd()).map_err(setup_err)?;
        let kick = EventFd::new().map_err(setup_err)?;
        let irq = EventFd::new().map_err(setup_err)?;
        let (write_arena, read_arena, own) = if private {
            let w = new_arena(&format!("bulkhead-{name}-warena"), cfg.arena_len())?;
            let r = new_arena(&format!("bulkhead-{name}-rarena"), cfg.arena_len())?;
            let w_ro = memfd::reopen_readonly(w.as_raw_fd()).map_err(setup_err)?;
            (w_ro, dup(&r)?, Some([w, r]))
        } else {
            (dup(&upper.write_arena)?, dup(&upper.read_arena)?, None)
        };
        Ok(LowerQueue { ring, kick: dup(&kick)?, irq: dup(&irq)?, write_arena, read_arena, own })
    }

    /// Whether it has arenas of its own.
    pub fn is_private(&self) -> bool {
        self.own.is_some()
    }

    /// Descriptors for the tap domain, the forwarding frontend.
    pub fn front_fds(&self) -> Result<ForwardQueueFds, ChannelError> {
        let arenas = match &self.own {
            Some([w, r]) => Some([dup(w)?, dup(r)?]),
            None => None,
        };
        Ok(ForwardQueueFds { ring: dup(&self.ring)?, kick: dup(&self.kick)?, irq: dup(&self.irq)?, arenas })
    }

    /// Wakes the tap domain if it waits on this queue (rings the doorbell the domain below
    /// rings): for a supervisor replacing the domain below.
    pub fn interrupt_front(&self) {
        if let Ok(irq) = self.irq.try_clone().and_then(EventFd::from_owned) {
            irq.ring();
        }
    }

    /// Descriptors for the domain below. Call once the tap domain has written the header.
    pub fn back_fds(&self) -> Result<BackQueueFds, ChannelError> {
        let LowerQueue { ring, kick, irq, write_arena, read_arena, .. } = self;
        Ok(BackQueueFds {
            ring: dup(ring)?,
            write_arena: dup(write_arena)?,
            read_arena: dup(read_arena)?,
            kick: dup(kick)?,
            irq: dup(irq)?,
        })
    }
}

/// Creates a queue's files.
#[derive(Debug)]
pub struct QueueSetup;

fn setup_err(e: impl std::fmt::Display) -> ChannelError {
    ChannelError::Setup(e.to_string())
}

/// A close-on-exec duplicate (numbered 3 or above).
fn dup(fd: &impl AsFd) -> Result<OwnedFd, ChannelError> {
    fd.as_fd().try_clone_to_owned().map_err(setup_err)
}

impl QueueSetup {
    /// Creates ring, arenas and doorbells; returns the frontend end and the driver's descriptors.
    pub fn create(name: &str, cfg: &QueueConfig) -> Result<(FrontQueue, BackQueueFds), ChannelError> {
        let layout = RingLayout::new(cfg.nslots).map_err(setup_err)?;
        let arena = cfg.arena_len();
        let ring_fd = memfd::create(&format!("bulkhead-{name}-ring"), layout.file_size() as u64).map_err(setup_err)?;
        memfd::seal_size(ring_fd.as_raw_fd()).map_err(setup_err)?;
        let w_fd = new_arena(&format!("bulkhead-{name}-warena"), arena)?;
        let r_fd = new_arena(&format!("bulkhead-{name}-rarena"), arena)?;
        let ring_map = Mapping::new(ring_fd.as_raw_fd(), layout.file_size(), Protection::ReadWrite).map_err(setup_err)?;
        let w_map = Mapping::new(w_fd.as_raw_fd(), arena, Protection::ReadWrite).map_err(setup_err)?;
        let r_map = Mapping::new(r_fd.as_raw_fd(), arena, Protection::ReadWrite).map_err(setup_err)?;
        memfd::seal_future_write(w_fd.as_raw_fd()).map_err(setup_err)?;
        let w_ro = memfd::reopen_readonly(w_fd.as_raw_fd()).map_err(setup_err)?;
        let ring = FrontRing::create(ring_map, layout, cfg.generation).map_err(setup_err)?;
        let kick = EventFd::new().map_err(setup_err)?;
        let irq = EventFd::new().map_err(setup_err)?;
        let fds = BackQueueFds { ring: ring_fd, write_arena: w_ro, read_arena: r_fd, kick: dup(&kick)?, irq: dup(&irq)? };
        let front = FrontQueue::new(ring, w_map, r_map, kick, irq, cfg);
        Ok((front, fds))
    }
}

/// A frontend and a driver end in one process (tests, benchmarks of the ring alone).
pub fn pair(cfg: &QueueConfig, device_size: u64) -> Result<(FrontQueue, BackQueue), ChannelError> {
    let (front, fds) = QueueSetup::create("pair", cfg)?;
    let back = BackQueue::from_fds(
        fds,
        cfg.nslots,
        ArenaSizes { write: front.arena_bytes() as u64, read: front.arena_bytes() as u64 },
        device_size,
    )?;
    Ok((front, back))
}
