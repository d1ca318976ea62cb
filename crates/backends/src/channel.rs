//! `channel`: the end of a tap domain's chain in `interpose` mode — the device channel to the
//! domain below, whose frontend this domain is.
//!
//! A batch is submitted to one of the lower queues (round robin across batches), writes copied
//! from the upper channel's write arena into the lower one's with volatile copies, and waited
//! for; what was read is copied from the lower read arena into the upper one. The domain below
//! is untrusted like any driver: every response is validated by [`FrontQueue`], and one that
//! breaks the protocol, or silence past the wait limit, makes the channel [`lost`](Backend::lost):
//! this domain then ends without answering the batch, and the supervisor restarts both domains,
//! the frontend reissuing every unanswered request.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bulkhead_block::{Backend, BlockError, Caps, Io, Request};
use bulkhead_channel::{FrontQueue, FrontRequest, SubmitError};

/// Longest one wait for the domain below, ms; the supervisor's watchdog decides before this.
const WAIT_SLICE_MS: i32 = 100;

/// The channel to the domain below.
#[derive(Debug)]
pub struct ChannelBackend {
    queues: Vec<FrontQueue>,
    size: u64,
    next: usize,
    lost: Option<String>,
    stop: Arc<AtomicBool>,
}

impl ChannelBackend {
    /// Over the frontend ends `queues` of a device of `size` bytes; `stop` (the domain's stop
    /// flag) ends a wait.
    pub fn new(queues: Vec<FrontQueue>, size: u64, stop: Arc<AtomicBool>) -> Self {
        assert!(!queues.is_empty(), "a channel has at least one queue");
        ChannelBackend { queues, size, next: 0, lost: None, stop }
    }

    fn push(q: &mut FrontQueue, req: &Request<'_>, user: u64) -> Result<(), SubmitError> {
        match *req {
            Request::Read { offset, bufs } => q.push(FrontRequest::Read { offset, len: bufs.total_len() }, user),
            Request::Write { offset, bufs, fua } => q.push_write_from(offset, &bufs, fua, user),
            Request::Flush => q.push(FrontRequest::Flush, user),
            Request::Discard { offset, len } => q.push(FrontRequest::Discard { offset, len }, user),
            Request::WriteZeroes { offset, len } => q.push(FrontRequest::WriteZeroes { offset, len }, user),
        }
    }
}

impl Backend for ChannelBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        // The domain below answers what it cannot do with its own status.
        Caps { flush: true, fua: true, discard: true, write_zeroes: true, read_only: false }
    }

    fn execute(&mut self, ios: &mut [Io<'_>]) {
        if self.lost.is_some() {
            return;
        }
        let qi = self.next;
        self.next = (self.next + 1) % self.queues.len();
        let q = &mut self.queues[qi];
        let (mut sent, mut pending) = (0, 0usize);
        while sent < ios.len() || pending > 0 {
            while sent < ios.len() {
                match Self::push(q, &ios[sent].req, sent as u64) {
                    Ok(()) => pending += 1,
                    Err(SubmitError::Full) if pending > 0 => break,
                    // Larger than the lower queue can ever carry (its arena is as large as the
                    // upper one's, so only a misconfiguration gets here).
                    Err(SubmitError::Full | SubmitError::TooLarge(_)) => {
                        ios[sent].result = Err(BlockError::Invalid("request larger than the channel below"))
                    }
                    Err(SubmitError::Broken(e)) => {
                        self.lost = Some(format!("channel to the domain below: {e}"));
                        return;
                    }
                }
                sent += 1;
            }
            q.publish();
            if pending == 0 {
                break;
            }
            match q.wait_or(WAIT_SLICE_MS, &self.stop) {
                Ok(_) => {}
                Err(e) => {
                    self.lost = Some(format!("channel to the domain below: {e}"));
                    return;
                }
            }
            if self.stop.load(std::sync::atomic::Ordering::Relaxed) {
                self.lost = Some("stopping".into());
                return;
            }
            let reaped = q.reap(|c| {
                let io = &mut ios[c.user as usize];
                io.result = match c.result {
                    Ok(n) => {
                        if let (Some(data), Request::Read { bufs, .. }) = (c.data, &io.req) {
                            let mut at = 0;
                            for w in bufs.iter() {
                                let part = data.sub(at, w.len()).expect("a read returns its whole length");
                                part.copy_to_shared(&w).expect("read windows are writable");
                                at += w.len();
                            }
                        }
                        Ok(n)
                    }
                    Err(status) => {
                        Err(BlockError::Os { op: io.req.kind().as_str(), offset: io.req.range().0, errno: status.errno() })
                    }
                };
            });
            match reaped {
                Ok(n) => pending -= n,
                Err(e) => {
                    self.lost = Some(format!("channel to the domain below: {e}"));
                    return;
                }
            }
        }
    }

    fn lost(&self) -> Option<&str> {
        self.lost.as_deref()
    }
}
