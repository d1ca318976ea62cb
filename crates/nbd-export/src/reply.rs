//! Replies on their way out: a combining writer that sends every thread's replies of one
//! connection without a lock convoy, and the spare buffers large replies reuse.

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_nbd::proto::*;

use crate::budget::Held;
use crate::lock;

/// A reply on its way out: the bytes, and the payload grant its data holds until written.
pub(crate) struct Reply {
    pub(crate) bytes: Vec<u8>,
    pub(crate) _held: Option<Held>,
}

/// Replies queued, in order.
#[derive(Default)]
struct Pending {
    replies: Vec<Reply>,
    /// Bytes of the first reply already sent.
    sent: usize,
}

/// Writes replies for every thread of one connection without a lock convoy: a thread with a
/// reply queues it, and whichever thread finds nobody writing becomes the writer and sends
/// everything queued in as few `sendmsg` calls as it takes (flat combining). No thread ever
/// waits for another's write; a reply queued while a writer is busy goes out with its next
/// batch. A thread holding a device queue only writes what the socket takes now
/// ([`try_flush`](Self::try_flush)): a client that stops reading its replies must not keep a
/// queue others wait for.
pub(crate) struct Replier {
    sock: std::fs::File,
    structured: bool,
    pending: Mutex<Pending>,
    writing: AtomicBool,
    broken: AtomicBool,
    /// The socket took less than was queued at the last non-blocking write: the client is
    /// not reading its replies (or not as fast as they come).
    backed_up: AtomicBool,
    /// A client that takes no reply bytes for this long is broken off.
    write_timeout: Duration,
    /// Where large reply buffers go once sent.
    spare: Arc<Mutex<Spare>>,
}

/// Large buffers of replies sent and of writes the device has, kept for the next ones,
/// by the whole server: a 1 MiB buffer freshly allocated costs 256 page faults (the
/// allocator maps it anew, and unmaps it once freed).
#[derive(Default)]
pub(crate) struct Spare {
    bufs: Vec<Vec<u8>>,
    /// Their capacities together.
    bytes: usize,
}

/// Buffers smaller than this come from the allocator each time.
pub(crate) const SPARE_MIN: usize = 64 << 10;
/// Bytes of spare buffers the server keeps at most.
pub(crate) const SPARE_BYTES: usize = 8 << 20;

impl Spare {
    /// A buffer with room for `len` bytes: a spare one if one is large enough, still holding
    /// its old bytes (a caller that resizes it zeroes only what it grows by), else a new one.
    pub(crate) fn buffer(spare: &Mutex<Spare>, len: usize) -> Vec<u8> {
        if len >= SPARE_MIN {
            let mut sp = lock(spare);
            if let Some(i) = sp.bufs.iter().position(|b| b.capacity() >= len) {
                let b = sp.bufs.swap_remove(i);
                sp.bytes -= b.capacity();
                return b;
            }
        }
        Vec::with_capacity(len)
    }

    /// Keeps `b` if it is large and there is room.
    pub(crate) fn keep(&mut self, b: Vec<u8>) {
        if b.capacity() >= SPARE_MIN && self.bytes + b.capacity() <= SPARE_BYTES {
            self.bytes += b.capacity();
            self.bufs.push(b);
        }
    }
}

impl Replier {
    pub(crate) fn new(sock: std::fs::File, structured: bool, write_timeout: Duration, spare: Arc<Mutex<Spare>>) -> Self {
        Replier {
            sock,
            structured,
            pending: Mutex::new(Pending::default()),
            writing: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            backed_up: AtomicBool::new(false),
            write_timeout,
            spare,
        }
    }

    /// Queues a reply and sends what is queued, waiting for the socket if it must.
    pub(crate) fn send(&self, reply: Reply) {
        self.push(reply);
        self.flush();
    }

    /// Queues a reply, to go out with the next flush (this thread's or another's): a thread
    /// answering several requests at once sends them in one `sendmsg`.
    pub(crate) fn push(&self, reply: Reply) {
        lock(&self.pending).replies.push(reply);
    }

    /// Sends every queued reply, waiting for the socket to take them, unless another thread
    /// is writing (which then sends them). Only for a thread that holds no device queue.
    pub(crate) fn flush(&self) {
        self.write_out(true);
    }

    /// Sends what the socket takes now of the queued replies; the rest waits for the next
    /// flush. Returns whether the client keeps up ([`backed_up`](Self::backed_up) is clear).
    pub(crate) fn try_flush(&self) -> bool {
        self.write_out(false);
        !self.backed_up()
    }

    /// Whether a write failed: the connection is of no more use.
    pub(crate) fn broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Whether the last write found the socket full: the client is not reading its replies.
    pub(crate) fn backed_up(&self) -> bool {
        self.backed_up.load(Ordering::Acquire) && !self.broken.load(Ordering::Acquire)
    }

    fn write_out(&self, wait: bool) {
        loop {
            if self.writing.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return; // the writer at work takes it
            }
            loop {
                let (batch, sent) = {
                    let mut p = lock(&self.pending);
                    (std::mem::take(&mut p.replies), std::mem::take(&mut p.sent))
                };
                if batch.is_empty() {
                    self.backed_up.store(false, Ordering::Release);
                    break;
                }
                let stopped = if self.broken.load(Ordering::Acquire) {
                    None
                } else {
                    match self.write_batch(&batch, sent, wait) {
                        Ok(stopped) => stopped,
                        Err(_) => {
                            self.broken.store(true, Ordering::Release);
                            None
                        }
                    }
                };
                let Some((first, sent)) = stopped else {
                    self.recycle(batch);
                    continue;
                };
                // The socket is full: what it did not take goes back ahead of what was
                // queued meanwhile.
                self.backed_up.store(true, Ordering::Release);
                let mut batch = batch;
                let rest = batch.split_off(first);
                self.recycle(batch);
                let mut p = lock(&self.pending);
                let newer = std::mem::replace(&mut p.replies, rest);
                p.replies.extend(newer);
                p.sent = sent;
                break;
            }
            self.writing.store(false, Ordering::Release);
            // A reply queued after the last look but before the flag dropped found the flag
            // still up and left: look once more (unless the socket is full and this thread
            // must not wait for it).
            if lock(&self.pending).replies.is_empty() || self.backed_up() && !wait {
                return;
            }
        }
    }

    /// A buffer with room for a reply of `len` bytes ([`Spare::buffer`]).
    pub(crate) fn buffer(&self, len: usize) -> Vec<u8> {
        Spare::buffer(&self.spare, len)
    }

    /// Gives the payload grants of replies sent back, and their large buffers to the spares.
    fn recycle(&self, batch: Vec<Reply>) {
        let mut spare = None;
        for Reply { bytes, _held } in batch {
            drop(_held);
            if bytes.capacity() >= SPARE_MIN {
                spare.get_or_insert_with(|| lock(&self.spare)).keep(bytes);
            }
        }
    }

    /// Writes `batch`, from byte `sent` of its first reply. Without `wait`, stops when the
    /// socket is full, returning where: the reply and the bytes of it sent.
    fn write_batch(&self, batch: &[Reply], mut sent: usize, wait: bool) -> io::Result<Option<(usize, usize)>> {
        const MAX_IOV: usize = 1024;
        let mut first = 0;
        let mut stalled: Option<Instant> = None;
        while first < batch.len() {
            let group = &batch[first..(first + MAX_IOV).min(batch.len())];
            let slices: Vec<io::IoSlice<'_>> = group
                .iter()
                .enumerate()
                .map(|(i, r)| io::IoSlice::new(if i == 0 { &r.bytes[sent..] } else { &r.bytes }))
                .collect();
            match bulkhead_sys::send_vectored_now(self.sock.as_fd(), &slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(mut n) => {
                    stalled = None;
                    // Past the replies sent whole, into the one sent in part.
                    while first < batch.len() && n >= batch[first].bytes.len() - sent {
                        n -= batch[first].bytes.len() - sent;
                        first += 1;
                        sent = 0;
                    }
                    sent += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !wait {
                        return Ok(Some((first, sent)));
                    }
                    // Until the socket takes more; a client that takes nothing for the request
                    // timeout is broken off.
                    let since = *stalled.get_or_insert_with(Instant::now);
                    let left = self.write_timeout.saturating_sub(since.elapsed());
                    if left.is_zero() {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the client took no reply within the request timeout",
                        ));
                    }
                    let mut fds = [libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 }];
                    bulkhead_sys::poll(&mut fds, left.as_millis().clamp(1, i32::MAX as u128) as i32)?;
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// A reply without data, sent: success or an error.
    pub(crate) fn done(&self, cookie: u64, error: u32) {
        self.send(self.status(cookie, error));
    }

    /// A reply without data.
    pub(crate) fn status(&self, cookie: u64, error: u32) -> Reply {
        let bytes = if !self.structured {
            simple_reply(error, cookie).to_vec()
        } else if error == 0 {
            chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0).to_vec()
        } else {
            let mut b = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6).to_vec();
            b.extend_from_slice(&error.to_be_bytes());
            b.extend_from_slice(&0u16.to_be_bytes());
            b
        };
        Reply { bytes, _held: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::OwnedFd;

    #[test]
    fn replies_a_client_does_not_read_wait_in_order_without_blocking_the_writer() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let replier =
            Replier::new(OwnedFd::from(ours).into(), false, Duration::from_secs(5), Arc::new(Mutex::new(Spare::default())));
        // Far more than the socket holds: replies of 1000 bytes, each filled with its number.
        let count = 2000u32;
        for i in 0..count {
            replier.push(Reply { bytes: vec![i as u8; 1000], _held: None });
        }
        assert!(!replier.try_flush(), "the socket cannot hold 2 MB: the writer must stop, not wait");
        assert!(replier.backed_up());
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            (&theirs).read_to_end(&mut all).unwrap();
            all
        });
        replier.flush();
        assert!(!replier.backed_up(), "all written");
        drop(replier);
        let all = reader.join().unwrap();
        assert_eq!(all.len(), count as usize * 1000);
        for (i, reply) in all.chunks(1000).enumerate() {
            assert!(reply.iter().all(|&b| b == i as u8), "reply {i} out of order or torn");
        }
    }

    #[test]
    fn a_client_that_takes_no_reply_for_the_timeout_is_broken_off() {
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let replier =
            Replier::new(OwnedFd::from(ours).into(), false, Duration::from_millis(200), Arc::new(Mutex::new(Spare::default())));
        for _ in 0..2000 {
            replier.push(Reply { bytes: vec![0; 1000], _held: None });
        }
        let t = Instant::now();
        replier.flush();
        assert!(replier.broken.load(Ordering::Acquire));
        assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }
}
