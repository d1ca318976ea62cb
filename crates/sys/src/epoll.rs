//! `epoll(7)`: one thread waiting on many descriptors, each reported by a token of the
//! caller's. A descriptor may be watched once-only ([`Epoll::add_once`]): it reports once and
//! is then silent until [`Epoll::rearm`], so a ready descriptor its owner cannot act on yet does
//! not wake the waiter again and again.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// An epoll instance.
#[derive(Debug)]
pub struct Epoll {
    ep: OwnedFd,
}

/// Most events one [`Epoll::wait`] hands back.
pub const MAX_EVENTS: usize = 64;

impl Epoll {
    /// A new, empty instance (close-on-exec).
    pub fn new() -> io::Result<Self> {
        // SAFETY: a system call with an integer argument only.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: epoll_create1 returned a fresh descriptor, owned from here on.
        Ok(Epoll { ep: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    fn ctl(&self, op: libc::c_int, fd: BorrowedFd<'_>, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a valid epoll_event that outlives the call; `fd` is open (borrowed).
        if unsafe { libc::epoll_ctl(self.ep.as_raw_fd(), op, fd.as_raw_fd(), &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Watches `fd` for readability (or hang-up), reporting `token` while it is ready.
    pub fn add(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, libc::EPOLLIN as u32, token)
    }

    /// Watches `fd` once: the first time it is ready it reports `token`, and then nothing until
    /// [`rearm`](Self::rearm).
    pub fn add_once(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, (libc::EPOLLIN | libc::EPOLLONESHOT) as u32, token)
    }

    /// Watches a descriptor added with [`add_once`](Self::add_once) once more: reported at
    /// once if it is ready now.
    pub fn rearm(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, (libc::EPOLLIN | libc::EPOLLONESHOT) as u32, token)
    }

    /// Stops watching `fd`. Closing the last descriptor of a file stops it too; a caller that
    /// watches a descriptor it does not own keeps a copy open until it has called this, so the
    /// number cannot be reused under it.
    pub fn delete(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
    }

    /// Waits until something is ready or `timeout` passes (`None`: no limit) and calls `f`
    /// with the token of each that is (at most [`MAX_EVENTS`]); returns how many. An
    /// interrupted wait reports nothing.
    pub fn wait_with(&self, timeout: Option<Duration>, mut f: impl FnMut(u64)) -> io::Result<usize> {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; MAX_EVENTS];
        // Round up: a wait cut short by a millisecond would spin until the deadline.
        let ms = timeout.map_or(-1, |t| t.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as libc::c_int);
        // SAFETY: `evs` is a valid, writable array of MAX_EVENTS events.
        let n = unsafe { libc::epoll_wait(self.ep.as_raw_fd(), evs.as_mut_ptr(), MAX_EVENTS as libc::c_int, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(e) };
        }
        evs[..n as usize].iter().for_each(|e| f(e.u64));
        Ok(n as usize)
    }

    /// [`wait_with`](Self::wait_with), appending the tokens to `ready`.
    pub fn wait(&self, timeout: Option<Duration>, ready: &mut Vec<u64>) -> io::Result<usize> {
        self.wait_with(timeout, |t| ready.push(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn ring(fd: &OwnedFd) {
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
        assert_eq!(unsafe { libc::write(fd.as_raw_fd(), (&1u64 as *const u64).cast(), 8) }, 8);
    }

    fn eventfd() -> OwnedFd {
        // SAFETY: a system call with integer arguments only; the descriptor is fresh.
        unsafe { OwnedFd::from_raw_fd(libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK)) }
    }

    #[test]
    fn a_once_only_descriptor_reports_once_until_rearmed() {
        let ep = Epoll::new().unwrap();
        let (a, b) = (eventfd(), eventfd());
        ep.add_once(a.as_fd(), 7).unwrap();
        ep.add(b.as_fd(), 9).unwrap();
        ring(&a);
        let mut got = Vec::new();
        ep.wait(Some(Duration::from_millis(100)), &mut got).unwrap();
        assert_eq!(got, [7]);
        got.clear();
        // Still ready, but silent.
        assert_eq!(ep.wait(Some(Duration::from_millis(10)), &mut got).unwrap(), 0);
        ep.rearm(a.as_fd(), 8).unwrap();
        ep.wait(Some(Duration::from_millis(100)), &mut got).unwrap();
        assert_eq!(got, [8], "reported again, under the new token");
        got.clear();
        // A level-triggered one reports while ready, until it is deleted.
        ring(&b);
        ep.wait(Some(Duration::from_millis(100)), &mut got).unwrap();
        ep.wait(Some(Duration::from_millis(100)), &mut got).unwrap();
        assert_eq!(got, [9, 9]);
        ep.delete(b.as_fd()).unwrap();
        got.clear();
        assert_eq!(ep.wait(Some(Duration::ZERO), &mut got).unwrap(), 0);
    }
}
