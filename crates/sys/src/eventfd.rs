//! eventfd doorbells and an epoll-based poller of many (used by the doorbell crate and the driver domain's loop).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// A doorbell: a non-blocking eventfd. Rings coalesce into a counter, so a storm of rings costs
/// the sleeper one wake-up.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new doorbell, close-on-exec (the supervisor clears that on the copy it passes).
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor owned by nothing else.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Wraps an inherited eventfd descriptor (made non-blocking here).
    pub fn from_owned(fd: OwnedFd) -> io::Result<Self> {
        // SAFETY: fcntl on a descriptor we own.
        let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        // SAFETY: as above.
        if fl < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(EventFd { fd })
    }

    /// Another descriptor for the same doorbell (one side rings it, the other waits on it).
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(EventFd { fd: self.fd.try_clone()? })
    }

    /// The descriptor, to pass to another process.
    pub fn into_owned(self) -> OwnedFd {
        self.fd
    }

    /// Rings. Never blocks: a counter at its maximum already means "rung".
    pub fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Consumes pending rings; returns how many were pending (0 if none).
    pub fn drain(&self) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a local.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n == 8 {
            v
        } else {
            0
        }
    }

    /// Blocks until rung or `timeout_ms` passes (-1: forever). Returns whether it was rung.
    pub fn wait(&self, timeout_ms: i32) -> io::Result<bool> {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(e);
        }
        Ok(rc > 0 && self.drain() > 0)
    }
}

impl std::os::fd::AsFd for EventFd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Blocks on many descriptors at once (level-triggered epoll), each reported by a token.
#[derive(Debug)]
pub struct Poller {
    ep: crate::epoll::Epoll,
}

impl Poller {
    /// A new, empty poller.
    pub fn new() -> io::Result<Self> {
        Ok(Poller { ep: crate::epoll::Epoll::new()? })
    }

    /// Watches `fd` for readability, reporting `token`.
    pub fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        // SAFETY: borrowed for the call only; a descriptor that is not open fails with EBADF.
        self.ep.add(unsafe { BorrowedFd::borrow_raw(fd) }, token)
    }

    /// Stops watching `fd` (closing the descriptor would do it too, unless another copy of it
    /// stays open).
    pub fn remove(&self, fd: RawFd) -> io::Result<()> {
        // SAFETY: as in `add`.
        self.ep.delete(unsafe { BorrowedFd::borrow_raw(fd) })
    }

    /// Waits up to `timeout_ms` (-1: forever) and calls `f` with each ready token.
    pub fn wait(&self, timeout_ms: i32, f: impl FnMut(u64)) -> io::Result<usize> {
        let timeout = u64::try_from(timeout_ms).ok().map(std::time::Duration::from_millis);
        self.ep.wait_with(timeout, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_coalesce_and_drain() {
        let e = EventFd::new().unwrap();
        assert_eq!(e.drain(), 0);
        for _ in 0..1000 {
            e.ring();
        }
        assert_eq!(e.drain(), 1000);
        assert!(!e.wait(0).unwrap());
    }

    #[test]
    fn wait_returns_when_rung_from_another_thread() {
        let e = std::sync::Arc::new(EventFd::new().unwrap());
        let e2 = e.clone();
        let t = std::thread::spawn(move || e2.ring());
        assert!(e.wait(5000).unwrap());
        t.join().unwrap();
    }

    #[test]
    fn poller_reports_ready_tokens() {
        let a = EventFd::new().unwrap();
        let b = EventFd::new().unwrap();
        let p = Poller::new().unwrap();
        p.add(a.as_raw_fd(), 1).unwrap();
        p.add(b.as_raw_fd(), 2).unwrap();
        b.ring();
        let mut got = vec![];
        p.wait(1000, |t| got.push(t)).unwrap();
        assert_eq!(got, vec![2]);
    }
}
