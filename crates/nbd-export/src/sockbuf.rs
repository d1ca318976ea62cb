//! The read side of a client's socket: a deadline for negotiation, and a buffer for
//! transmission that can be filled without waiting.

use std::io::{self, BufReader, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

/// The socket's read side with a deadline: a read after the deadline fails. With the socket's
/// receive timeout as well, a client that trickles bytes is cut off within the deadline plus
/// one timeout, however it spaces them.
pub(crate) struct DeadlineReader {
    pub(crate) file: std::fs::File,
    pub(crate) deadline: Option<std::time::Instant>,
    /// Reads take only what is already here: `WouldBlock` rather than a wait.
    pub(crate) nonblocking: bool,
}

impl Read for DeadlineReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.deadline.is_some_and(|d| std::time::Instant::now() > d) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        if !self.nonblocking {
            return self.file.read(buf);
        }
        // What the socket (the client's, or the TLS relay's pair) holds now.
        bulkhead_sys::recv_now(self.file.as_fd(), buf)
    }
}

/// A failed read as the client should hear of it: a time limit names the phase it cut short.
pub(crate) fn timeout_says(e: io::Error, phase: &str) -> io::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            io::Error::new(io::ErrorKind::TimedOut, format!("{phase} did not finish in time"))
        }
        _ => e,
    }
}

pub(crate) type SockReader = BufReader<DeadlineReader>;

pub(crate) fn sock_file(fd: &Arc<OwnedFd>) -> io::Result<std::fs::File> {
    Ok(std::fs::File::from(fd.try_clone()?))
}

/// The socket's read side during transmission: a buffer that can also be filled without
/// waiting, and topped up when a request's header arrived in pieces.
pub(crate) struct SockBuf {
    r: DeadlineReader,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl SockBuf {
    pub(crate) const CAPACITY: usize = 64 << 10;

    /// Takes over negotiation's reader, with what it had read ahead.
    pub(crate) fn new(r: SockReader) -> Self {
        let mut buf = vec![0u8; Self::CAPACITY].into_boxed_slice();
        let ahead = r.buffer().len();
        buf[..ahead].copy_from_slice(r.buffer());
        SockBuf { r: r.into_inner(), buf, start: 0, end: ahead }
    }

    pub(crate) fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Until when the rest of a request may take to arrive (`None`: no limit, between requests).
    pub(crate) fn set_deadline(&mut self, deadline: Option<std::time::Instant>) {
        self.r.deadline = deadline;
    }

    pub(crate) fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
    }

    /// Reads into the buffer's free space, after moving what is buffered to its front;
    /// `Ok(0)`: the client closed (or the buffer is full).
    pub(crate) fn fill(&mut self) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            match self.r.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Adds what the socket holds now, without waiting: whether anything came (or the
    /// client closed, which the next read finds out).
    pub(crate) fn fill_now(&mut self) -> io::Result<bool> {
        self.r.nonblocking = true;
        let filled = match self.fill() {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e),
        };
        self.r.nonblocking = false;
        filled
    }
}

impl Read for SockBuf {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.start == self.end {
            if out.len() >= self.buf.len() {
                return self.r.read(out);
            }
            self.start = 0;
            self.end = 0;
            if self.fill()? == 0 {
                return Ok(0);
            }
        }
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}
