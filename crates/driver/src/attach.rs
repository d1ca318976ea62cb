//! The domain's end of the attach line: queues of applications attached while the domain
//! runs, added to and removed from the slots the spec reserved (see
//! [`bulkhead_spec::AttachSpec`]).
//!
//! The supervisor checked every descriptor before sending it (memory files sealed against
//! shrinking, of the sizes the geometry needs; eventfds); the domain maps them as it maps the
//! queues it started with, and the ring is validated as any frontend's.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use bulkhead_channel::{BackQueue, BackQueueFds};
use bulkhead_ring::ArenaSizes;
use bulkhead_spec::attach_line::{FromDomain, ToDomain, MAX_MESSAGE};

/// A request read from the line.
#[derive(Debug)]
pub(crate) enum Asked {
    /// Serve this queue in `slot`.
    Add { slot: usize, queue: BackQueue },
    /// Let go of the queue in `slot`.
    Remove { slot: usize },
    /// A request that could not be followed: answered as refused.
    Refused { slot: u32, why: String },
}

/// The line and what the slots may hold.
#[derive(Debug)]
pub(crate) struct AttachLine {
    sock: OwnedFd,
    /// Index of the first slot among the domain's queues.
    pub(crate) first: usize,
    /// Each slot's size limit (its view's size, or the device's).
    sizes: Vec<u64>,
    nslots: u32,
    arena_bytes: u64,
    /// The supervisor hung up: no more requests will come.
    closed: bool,
}

impl AttachLine {
    /// The line `sock`, for slots (from queue index `first` on) of these sizes and geometry.
    pub(crate) fn new(sock: OwnedFd, first: usize, sizes: Vec<u64>, nslots: u32, arena_bytes: u64) -> Self {
        AttachLine { sock, first, sizes, nslots, arena_bytes, closed: false }
    }

    /// Its descriptor, readable when a request waits.
    pub(crate) fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// The next request, without blocking.
    pub(crate) fn next(&mut self) -> Option<Asked> {
        if self.closed {
            return None;
        }
        let mut buf = [0u8; MAX_MESSAGE];
        let (n, fds) = match bulkhead_sys::recv_with_fds(self.sock.as_fd(), &mut buf, false) {
            Ok(Some((0, _))) | Err(_) => {
                self.closed = true;
                return None;
            }
            Ok(None) => return None,
            Ok(Some(got)) => got,
        };
        let msg: ToDomain = match serde_json::from_slice(&buf[..n]) {
            Ok(m) => m,
            Err(e) => return Some(Asked::Refused { slot: u32::MAX, why: format!("unreadable request: {e}") }),
        };
        let (slot, adding) = match msg {
            ToDomain::Add { slot } => (slot, true),
            ToDomain::Remove { slot } => (slot, false),
        };
        let Some(&size) = self.sizes.get(slot as usize) else {
            return Some(Asked::Refused { slot, why: format!("no slot {slot} (the domain has {})", self.sizes.len()) });
        };
        if !adding {
            return Some(Asked::Remove { slot: slot as usize });
        }
        let Ok([ring, write_arena, read_arena, kick, irq]) = <[OwnedFd; 5]>::try_from(fds) else {
            return Some(Asked::Refused { slot, why: "a queue comes with five descriptors".into() });
        };
        let fds = BackQueueFds { ring, write_arena, read_arena, kick, irq };
        let arenas = ArenaSizes { write: self.arena_bytes, read: self.arena_bytes };
        match BackQueue::from_fds(fds, self.nslots, arenas, size) {
            Ok(queue) => Some(Asked::Add { slot: slot as usize, queue }),
            Err(e) => Some(Asked::Refused { slot, why: e.to_string() }),
        }
    }

    /// Answers the supervisor (a hung-up line is left be: the domain is ending).
    pub(crate) fn answer(&self, msg: &FromDomain) {
        let bytes = serde_json::to_vec(msg).expect("answer serialises");
        if let Err(e) = bulkhead_sys::send_with_fds(self.sock.as_fd(), &bytes, &[], false) {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                eprintln!("bulkhead driver: attach line: cannot answer: {e}");
            }
        }
    }
}
