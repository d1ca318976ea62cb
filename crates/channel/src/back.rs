//! The driver domain's end of a queue.

use std::os::fd::{AsRawFd, RawFd};

use bulkhead_block::{Request, Status};
use bulkhead_doorbell::EventFd;
use bulkhead_ring::{
    status_code, validate_request, ArenaSizes, BackRing, RequestError, ResponseSlot, RingError, RingLayout, ValidRequest,
    ARENA_WRITE,
};
use bulkhead_shmem::{Mapping, Protection, SliceList};

use crate::{BackQueueFds, ChannelError};

/// What [`BackQueue::pop`] found.
#[derive(Debug)]
pub enum Popped {
    /// A request that passed validation.
    Valid(ValidRequest),
    /// A malformed request: answer it with `Status::Invalid`.
    Invalid {
        /// Its id.
        id: u64,
        /// Its generation field.
        generation: u32,
        /// What was wrong.
        error: RequestError,
    },
}

/// The addresses of a driver end's arena mappings (see [`BackQueue::arena_windows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaWindows {
    /// Write arena: first address and length.
    pub write: (usize, usize),
    /// Read arena: first address and length.
    pub read: (usize, usize),
}

impl ArenaWindows {
    /// The segment naming `len` bytes at address `addr`, if they lie in the arena `arena`
    /// ([`ARENA_WRITE`] or [`bulkhead_ring::ARENA_READ`]).
    pub fn segment(&self, arena: u32, addr: usize, len: usize) -> Option<bulkhead_ring::Segment> {
        let (base, size) = if arena == ARENA_WRITE { self.write } else { self.read };
        let off = addr.checked_sub(base)?;
        if off.checked_add(len)? > size || len > u32::MAX as usize {
            return None;
        }
        Some(bulkhead_ring::Segment { arena, len: len as u32, offset: off as u64 })
    }
}

/// The driver end of one queue.
#[derive(Debug)]
pub struct BackQueue {
    ring: BackRing,
    warena: Mapping,
    rarena: Mapping,
    kick: EventFd,
    irq: EventFd,
    arenas: ArenaSizes,
    device_size: u64,
}

fn err(e: impl std::fmt::Display) -> ChannelError {
    ChannelError::Setup(e.to_string())
}

/// A queue's ring, mapped, with its geometry ([`BackQueue::map_ring`]).
#[derive(Debug)]
pub struct RingMap(Mapping, RingLayout);

impl BackQueue {
    /// Maps the descriptors received from the supervisor. The write arena is mapped read-only
    /// (its descriptor allows nothing else).
    pub fn from_fds(fds: BackQueueFds, nslots: u32, arenas: ArenaSizes, device_size: u64) -> Result<Self, ChannelError> {
        let ring = Self::map_ring(&fds, nslots)?;
        Self::from_mapped(ring, fds, arenas, device_size)
    }

    /// Maps the ring of a queue alone, for [`from_mapped`](Self::from_mapped). A domain maps
    /// all its queues' rings first, one after the other, so that they lie side by side: write
    /// capture shuts them for a guarded call in one range.
    pub fn map_ring(fds: &BackQueueFds, nslots: u32) -> Result<RingMap, ChannelError> {
        let layout = RingLayout::new(nslots).map_err(err)?;
        Ok(RingMap(Mapping::new(fds.ring.as_raw_fd(), layout.file_size(), Protection::ReadWrite).map_err(err)?, layout))
    }

    /// As [`from_fds`](Self::from_fds), over the ring [`map_ring`](Self::map_ring) mapped from
    /// `fds`.
    pub fn from_mapped(ring: RingMap, fds: BackQueueFds, arenas: ArenaSizes, device_size: u64) -> Result<Self, ChannelError> {
        for (fd, want) in [(&fds.write_arena, arenas.write), (&fds.read_arena, arenas.read)] {
            let have = bulkhead_shmem::memfd::size_of(fd.as_raw_fd()).map_err(err)?;
            if have < want {
                return Err(ChannelError::Setup(format!("arena of {have} bytes, expected {want}")));
            }
        }
        let RingMap(map, layout) = ring;
        let ring = BackRing::attach(map, layout).map_err(err)?;
        let warena = Mapping::new(fds.write_arena.as_raw_fd(), arenas.write as usize, Protection::ReadOnly).map_err(err)?;
        let rarena = Mapping::new(fds.read_arena.as_raw_fd(), arenas.read as usize, Protection::ReadWrite).map_err(err)?;
        Ok(BackQueue {
            ring,
            warena,
            rarena,
            kick: EventFd::from_owned(fds.kick).map_err(err)?,
            irq: EventFd::from_owned(fds.irq).map_err(err)?,
            arenas,
            device_size,
        })
    }

    /// Attaches again to this queue's ring, which a new frontend end (a replacement for the
    /// tap domain above) has started over as `generation`: nothing of the old frontend's is
    /// left, and this end's arenas stay as they are (they are the frontend's, kept across the
    /// switch). Call only once this end has stopped using the ring. A header that is not of
    /// this geometry and generation is an error, and the queue must not be used.
    pub fn reattach(&mut self, generation: u32) -> Result<(), ChannelError> {
        self.ring.reattach().map_err(|e| ChannelError::Protocol(format!("ring started over: {e}")))?;
        if self.ring.generation() != generation {
            return Err(ChannelError::Protocol(format!(
                "ring started over as generation {}, expected {generation}",
                self.ring.generation()
            )));
        }
        self.kick.drain();
        Ok(())
    }

    /// Takes and validates the next request. A ring-index violation is fatal for the queue.
    pub fn pop(&mut self) -> Result<Option<Popped>, ChannelError> {
        let slot = match self.ring.pop_request() {
            Ok(Some(s)) => s,
            Ok(None) => return Ok(None),
            Err(e @ RingError::IndexOutOfRange { .. }) => return Err(ChannelError::Protocol(e.to_string())),
            Err(e) => return Err(ChannelError::Protocol(e.to_string())),
        };
        Ok(Some(match validate_request(&slot, self.arenas, self.device_size, self.ring.generation()) {
            Ok(v) => Popped::Valid(v),
            Err(error) => Popped::Invalid { id: slot.id, generation: slot.generation, error },
        }))
    }

    /// The data windows of a validated request.
    pub fn buffers(&self, req: &ValidRequest) -> SliceList<'_> {
        let mut list = SliceList::new();
        for s in req.segments() {
            let arena = if s.arena == ARENA_WRITE { &self.warena } else { &self.rarena };
            list.push(arena.slice(s.offset as usize, s.len as usize).expect("validated against arena size"));
        }
        list
    }

    /// The block request a validated request stands for, over its data windows.
    pub fn request(&self, req: &ValidRequest) -> Request<'_> {
        req.command(|| self.buffers(req))
    }

    /// Queues a response (visible after [`publish`](Self::publish)).
    pub fn complete(&mut self, id: u64, generation: u32, status: Status, len: u64) {
        let rsp = ResponseSlot { id, generation, status: status_code(status), len, reserved: 0 };
        // The response ring is ours to write; a failure here means a broken mapping.
        let _ = self.ring.push(&rsp);
    }

    /// Rings the frontend's doorbell whether or not it sleeps (this crate's storm test).
    #[cfg(test)]
    pub(crate) fn ring_peer(&self) {
        self.irq.ring();
    }

    /// Publishes responses; rings the frontend if it sleeps.
    pub fn publish(&mut self) {
        if self.ring.publish() {
            self.irq.ring();
        }
    }

    /// Whether a request is waiting.
    pub fn pending(&self) -> bool {
        self.ring.request_pending()
    }

    /// Declares that the frontend never sleeps (`poll` mode): responses are then published
    /// without the sleep handshake's fence.
    pub fn set_peer_polls(&mut self, polls: bool) {
        self.ring.set_peer_polls(polls);
    }

    /// Announces SLEEPING; `true` if work is already pending (do not sleep).
    pub fn prepare_sleep(&self) -> bool {
        self.ring.prepare_sleep()
    }

    /// Announces RUNNING and clears the doorbell.
    pub fn set_running(&self) {
        self.ring.set_running();
        self.kick.drain();
    }

    /// The doorbell the frontend rings.
    pub fn kick_fd(&self) -> RawFd {
        self.kick.as_raw_fd()
    }

    /// Channel generation.
    pub fn generation(&self) -> u32 {
        self.ring.generation()
    }

    /// Where this end maps its arenas: the write arena's first address and length, the read
    /// arena's. A tap domain forwarding a request below names its windows by their offsets
    /// from these.
    pub fn arena_windows(&self) -> ArenaWindows {
        ArenaWindows {
            write: (self.warena.base_ptr() as usize, self.warena.len()),
            read: (self.rarena.base_ptr() as usize, self.rarena.len()),
        }
    }

    /// Slots of its rings: the most requests it can have in flight.
    pub fn nslots(&self) -> u32 {
        self.ring.nslots()
    }

    /// Responses produced.
    pub fn completed(&self) -> u64 {
        self.ring.completed()
    }

    /// Device size requests are checked against.
    pub fn device_size(&self) -> u64 {
        self.device_size
    }

    /// The ring's shared mapping as this end sees it: what a hostile driver writes raw
    /// response slots and indexes into (this crate's tests, the `frontend_response` fuzz
    /// target).
    pub fn ring_mapping(&self) -> &Mapping {
        self.ring.mapping()
    }

    /// Where the ring lies in this process, as (start, bytes) in whole pages: memory that
    /// write capture protects from a domain's filters.
    pub fn ring_region(&self) -> (u64, u64) {
        let m = self.ring.mapping();
        (m.base_ptr() as u64, (m.len() as u64).next_multiple_of(4096))
    }
}
