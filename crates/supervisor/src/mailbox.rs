//! Notes to the watcher from the threads that change devices: a claim let go of, a job that
//! wants another. Posting rings the watcher's doorbell.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::mpsc::Sender;
use std::sync::Mutex;
use std::time::Instant;

use bulkhead_doorbell::EventFd;

use crate::lifecycle::Disposition;

/// Where the result of an operator's change goes: the new driver pid, or why it failed.
pub(crate) type Reply = Sender<Result<u32, crate::error::Error>>;

/// A note to the watcher.
#[derive(Debug)]
pub(crate) enum Note {
    /// Device `0` was added: watch it.
    Added(usize),
    /// Device `0` is no longer served: stop watching it.
    Removed(usize),
    /// Device `0`'s claim was let go of: watch its domains again.
    Released(usize),
    /// A job on `device` ended wanting another (the claim is kept for it).
    Then { device: usize, disposition: Disposition, detected: Instant, reply: Option<Reply> },
}

/// The watcher's mailbox.
#[derive(Debug)]
pub(crate) struct Mailbox {
    notes: Mutex<Vec<Note>>,
    bell: EventFd,
}

impl Mailbox {
    /// An empty mailbox.
    pub fn new() -> std::io::Result<Mailbox> {
        Ok(Mailbox { notes: Mutex::new(Vec::new()), bell: EventFd::new()? })
    }

    /// Posts `note` and rings.
    pub fn post(&self, note: Note) {
        self.notes.lock().unwrap_or_else(|e| e.into_inner()).push(note);
        self.bell.ring();
    }

    /// Rings without a note (to wake the watcher, as at shutdown).
    pub fn ring(&self) {
        self.bell.ring();
    }

    /// Takes every note posted so far.
    pub fn take(&self) -> Vec<Note> {
        self.bell.drain();
        std::mem::take(&mut *self.notes.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The doorbell, to wait on.
    pub fn bell(&self) -> BorrowedFd<'_> {
        self.bell.as_fd()
    }
}
