//! io_uring instances the supervisor makes and lends to a domain.
//!
//! A domain's io_uring engine starts reads and writes the kernel finishes later. When the
//! domain is killed its process goes away, but a direct write already sent to the disk does
//! not: it lands when the disk completes it, which may be after the next generation has written
//! newer data at the same place (and a late direct read fills a buffer the frontend has since
//! reused). So the ring is not the domain's own. The supervisor creates it ([`lend`]),
//! restricted to the operations the engine needs, passes it to the domain at exec, and keeps a
//! [`RingWatch`] on it. The supervisor's reference keeps the ring alive after the domain dies,
//! the kernel keeps posting completions to it, and the watch counts the requests the kernel took
//! and has not completed. A restart waits for that count to reach zero before the next
//! generation starts.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use io_uring::{opcode, squeue, IoUring, Parameters};

/// Bytes of `struct io_uring_params`, as the supervisor passes them to the domain.
pub const PARAMS_BYTES: usize = 120;

/// Byte offsets in `struct io_uring_params` (a stable kernel ABI).
mod params_at {
    pub const SQ_ENTRIES: usize = 0;
    pub const CQ_ENTRIES: usize = 4;
    pub const FEATURES: usize = 20;
    /// `sq_off`: head, tail, ring_mask, ring_entries, flags, dropped, array.
    pub const SQ_OFF: usize = 40;
    /// `cq_off`: head, tail, ring_mask, ring_entries, overflow, cqes.
    pub const CQ_OFF: usize = 80;
}

const IORING_FEAT_SINGLE_MMAP: u32 = 1 << 0;
const IORING_SQ_CQ_OVERFLOW: u32 = 1 << 1;
const IORING_ENTER_GETEVENTS: u32 = 1 << 0;
const CQE_BYTES: usize = 16;

/// The `file` backend's io_uring engine: 128 entries; at most 4 + 4 io-wq workers (the
/// sandbox's task limit for that role counts on the bound).
pub const FILE_ENGINE: RingRecipe = RingRecipe { entries: 128, max_workers: 4 };

/// What a lent ring may do.
#[derive(Debug, Clone, Copy)]
pub struct RingRecipe {
    /// Submission queue entries (the kernel rounds up to a power of two).
    pub entries: u32,
    /// Most io-wq workers of each kind (bounded, unbounded) the borrowing task may use.
    pub max_workers: u32,
}

/// A ring for a domain: its descriptor, the eventfd the kernel rings on each completion, and
/// the parameters the kernel filled in at setup (the domain needs them to map the ring).
#[derive(Debug)]
pub struct LentRing {
    ring: OwnedFd,
    wake: OwnedFd,
    params: [u8; PARAMS_BYTES],
}

impl LentRing {
    /// The lent ring as a domain received it at exec.
    ///
    /// # Safety
    /// `ring`, `wake` and `params` must be those of one [`LentRing`] made by [`lend`], passed
    /// unaltered, and the descriptors owned by the caller alone.
    pub unsafe fn from_parts(ring: OwnedFd, wake: OwnedFd, params: [u8; PARAMS_BYTES]) -> Self {
        // SAFETY: nothing unsafe happens here; the caller's promise travels with the value to
        // `borrow`, which maps the ring by these parameters.
        LentRing { ring, wake, params }
    }

    /// The ring's descriptor, to pass to the domain.
    pub fn ring_fd(&self) -> &OwnedFd {
        &self.ring
    }

    /// The eventfd's descriptor, to pass to the domain.
    pub fn wake_fd(&self) -> &OwnedFd {
        &self.wake
    }

    /// The parameters, to pass to the domain.
    pub fn params(&self) -> &[u8; PARAMS_BYTES] {
        &self.params
    }

    /// Maps the ring for use: the ring and the eventfd it rings on each completion.
    pub fn borrow(self) -> io::Result<(IoUring, OwnedFd)> {
        // SAFETY: `Parameters` is a transparent wrapper over the plain-integer struct these
        // bytes hold, as the kernel filled it in for this very ring (`lend` or `from_parts`).
        let p = unsafe { std::mem::transmute_copy::<[u8; PARAMS_BYTES], Parameters>(&self.params) };
        // SAFETY: the descriptor is owned and is the ring the parameters describe (as above).
        let ring = unsafe { IoUring::from_fd(self.ring.into_raw_fd(), p) }?;
        Ok((ring, self.wake))
    }
}

/// Creates a ring restricted to `readv`, `writev` and `fsync` (and the drain flag): io_uring
/// operations do not pass through seccomp, so the ring is created disabled, restricted, then
/// enabled, before any domain sees it. Returns the ring to lend and the watch to keep.
pub fn lend(recipe: RingRecipe) -> io::Result<(LentRing, RingWatch)> {
    use io_uring::register::Restriction;
    let ring: IoUring = IoUring::builder().setup_r_disabled().build(recipe.entries)?;
    // Operations the kernel cannot finish inline go to io-wq worker threads of the task that
    // submits them; the kernel applies this bound to that task when it first uses the ring.
    let mut workers = [recipe.max_workers, recipe.max_workers];
    ring.submitter().register_iowq_max_workers(&mut workers)?;
    let wake = eventfd()?;
    ring.submitter().register_eventfd(wake.as_raw_fd())?;
    let mut allowed = [
        Restriction::sqe_op(opcode::Readv::CODE),
        Restriction::sqe_op(opcode::Writev::CODE),
        Restriction::sqe_op(opcode::Fsync::CODE),
        Restriction::sqe_flags_allowed(squeue::Flags::IO_DRAIN.bits()),
    ];
    ring.submitter().register_restrictions(&mut allowed)?;
    ring.submitter().register_enable_rings()?;
    // SAFETY: `Parameters` is a transparent wrapper over `struct io_uring_params`, plain
    // integers of exactly PARAMS_BYTES bytes; copying them out reads initialised memory.
    let params: [u8; PARAMS_BYTES] = unsafe { std::mem::transmute_copy::<Parameters, [u8; PARAMS_BYTES]>(ring.params()) };
    let fd = dup(ring.as_raw_fd())?;
    let watch = RingWatch::new(dup(fd.as_raw_fd())?, &params)?;
    // The builder's own mapping goes; `fd` and the watch's copy keep the ring.
    drop(ring);
    Ok((LentRing { ring: fd, wake, params }, watch))
}

fn field(params: &[u8; PARAMS_BYTES], at: usize) -> u32 {
    u32::from_ne_bytes(params[at..at + 4].try_into().expect("four bytes"))
}

fn dup(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl with integer arguments; a fresh close-on-exec descriptor on success.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: a system call with integer arguments only.
    let n = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// The supervisor's hold on a lent ring: it keeps the ring alive after the domain dies, so
/// requests the kernel still has complete into it, and counts them.
#[derive(Debug)]
pub struct RingWatch {
    fd: OwnedFd,
    map: NonNull<u8>,
    len: usize,
    sq_head: usize,
    sq_flags: usize,
    sq_dropped: usize,
    cq_head: usize,
    cq_tail: usize,
}

// SAFETY: the mapping is accessed only through atomics, from whichever thread holds the
// watch; it is unmapped only on drop.
unsafe impl Send for RingWatch {}

impl RingWatch {
    fn new(fd: OwnedFd, params: &[u8; PARAMS_BYTES]) -> io::Result<Self> {
        let features = field(params, params_at::FEATURES);
        if features & IORING_FEAT_SINGLE_MMAP == 0 {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "io_uring without IORING_FEAT_SINGLE_MMAP"));
        }
        let sq = |i: usize| field(params, params_at::SQ_OFF + 4 * i) as usize;
        let cq = |i: usize| field(params, params_at::CQ_OFF + 4 * i) as usize;
        let sq_entries = field(params, params_at::SQ_ENTRIES) as usize;
        let cq_entries = field(params, params_at::CQ_ENTRIES) as usize;
        // With a single mapping the completion queue shares the submission ring's pages.
        let len = (sq(6) + sq_entries * 4).max(cq(5) + cq_entries * CQE_BYTES);
        // SAFETY: a fresh shared mapping of the ring's control pages (offset 0 is
        // IORING_OFF_SQ_RING) at an address the kernel chooses; it aliases no Rust object.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = NonNull::new(p.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(RingWatch { fd, map, len, sq_head: sq(0), sq_flags: sq(4), sq_dropped: sq(5), cq_head: cq(0), cq_tail: cq(1) })
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        assert!(at.is_multiple_of(4) && at + 4 <= self.len, "ring field {at} outside the mapping");
        // SAFETY: inside the mapping (checked above) and 4-aligned (the kernel's offsets are);
        // the mapping lives as long as `self`, and the word is only accessed atomically here.
        unsafe { &*self.map.as_ptr().add(at).cast::<AtomicU32>() }
    }

    /// Requests the kernel took from the ring and has not completed, as far as the ring shows:
    /// those whose completions overflowed the completion queue are counted too.
    pub fn in_flight(&self) -> u32 {
        let taken =
            self.word(self.sq_head).load(Ordering::Acquire).wrapping_sub(self.word(self.sq_dropped).load(Ordering::Acquire));
        taken.wrapping_sub(self.word(self.cq_tail).load(Ordering::Acquire))
    }

    /// Once the borrower is gone: discards its completions, so the kernel can post those that
    /// overflowed, and returns the requests still in flight.
    pub fn settle(&self) -> u32 {
        let tail = self.word(self.cq_tail).load(Ordering::Acquire);
        self.word(self.cq_head).store(tail, Ordering::Release);
        if self.word(self.sq_flags).load(Ordering::Acquire) & IORING_SQ_CQ_OVERFLOW != 0 {
            // Flushes overflowed completions into the room just made; submits nothing.
            // SAFETY: a system call with integer arguments only (no argument struct).
            unsafe {
                libc::syscall(libc::SYS_io_uring_enter, self.fd.as_raw_fd(), 0u32, 0u32, IORING_ENTER_GETEVENTS, 0usize, 0usize)
            };
            let tail = self.word(self.cq_tail).load(Ordering::Acquire);
            self.word(self.cq_head).store(tail, Ordering::Release);
        }
        self.in_flight()
    }
}

impl Drop for RingWatch {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of that length, unmapped once; no reference into
        // it outlives `self`.
        unsafe { libc::munmap(self.map.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    const RECIPE: RingRecipe = RingRecipe { entries: 8, max_workers: 2 };

    /// Settles `watch` until nothing is in flight or `limit` passes; what is left.
    fn drain(watch: &RingWatch, limit: Duration) -> u32 {
        let start = Instant::now();
        loop {
            let left = watch.settle();
            if left == 0 || start.elapsed() >= limit {
                return left;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn readv_sqe(fd: RawFd, buf: &mut [u8], iov: &mut libc::iovec, tag: u64) -> squeue::Entry {
        *iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        opcode::Readv::new(io_uring::types::Fd(fd), iov as *const libc::iovec, 1).build().user_data(tag)
    }

    #[test]
    fn the_watch_counts_requests_in_flight_until_they_complete_after_the_borrower_is_gone() {
        let (lent, watch) = lend(RECIPE).unwrap();
        let (mut ring, _wake) = lent.borrow().unwrap();
        let (r, w) = crate::pipe().unwrap();
        let mut bufs = [[0u8; 4]; 3];
        let mut iovs = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 3];
        // Reads of an empty pipe: the kernel holds them until it has data.
        for (i, (b, v)) in bufs.iter_mut().zip(iovs.iter_mut()).enumerate() {
            let e = readv_sqe(r.as_raw_fd(), b, v, i as u64);
            // SAFETY: the buffer and iovec outlive the request (they live to the test's end,
            // after the ring has completed every request or been closed).
            unsafe { ring.submission().push(&e).unwrap() };
        }
        ring.submit().unwrap();
        assert_eq!(watch.in_flight(), 3);
        // The borrower goes away with its requests still in the kernel.
        drop(ring);
        assert_eq!(watch.settle(), 3, "the watch's reference keeps them");
        assert_eq!(drain(&watch, Duration::from_millis(20)), 3, "not drained before data comes");
        // SAFETY: writes 12 bytes from a local array.
        assert_eq!(unsafe { libc::write(w.as_raw_fd(), [7u8; 12].as_ptr().cast(), 12) }, 12);
        assert_eq!(drain(&watch, Duration::from_secs(10)), 0);
        assert_eq!(bufs, [[7u8; 4]; 3]);
    }

    #[test]
    fn a_lent_ring_refuses_operations_outside_its_restrictions_and_the_refusal_completes() {
        let (lent, watch) = lend(RECIPE).unwrap();
        let (mut ring, _wake) = lent.borrow().unwrap();
        let nop = opcode::Nop::new().build().user_data(7);
        // SAFETY: a NOP carries no buffers.
        unsafe { ring.submission().push(&nop).unwrap() };
        ring.submit_and_wait(1).unwrap();
        let cqe = ring.completion().next().unwrap();
        assert_eq!(cqe.result(), -libc::EACCES, "a restricted ring refuses NOP (and openat, socket, …)");
        assert_eq!(watch.in_flight(), 0);
    }

    #[test]
    fn completions_that_overflowed_the_queue_are_counted_until_settled() {
        let (lent, watch) = lend(RingRecipe { entries: 4, max_workers: 1 }).unwrap();
        let (mut ring, _wake) = lent.borrow().unwrap();
        let cq = ring.params().cq_entries() as usize;
        let (r, w) = crate::pipe().unwrap();
        let n = cq + 4;
        let mut bufs = vec![[0u8; 1]; n];
        let mut iovs = vec![libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; n];
        let mut pushed = 0;
        for (i, (b, v)) in bufs.iter_mut().zip(iovs.iter_mut()).enumerate() {
            let e = readv_sqe(r.as_raw_fd(), b, v, i as u64);
            // SAFETY: as in the test above.
            while unsafe { ring.submission().push(&e) }.is_err() {
                ring.submit().unwrap();
            }
            pushed += 1;
        }
        ring.submit().unwrap();
        assert_eq!(pushed, n);
        assert_eq!(watch.in_flight(), n as u32);
        drop(ring);
        // More completions than the queue holds: some wait on the overflow list until the
        // watch makes room.
        let data = vec![1u8; n];
        // SAFETY: writes `n` bytes from `data`.
        assert_eq!(unsafe { libc::write(w.as_raw_fd(), data.as_ptr().cast(), n) }, n as isize);
        let t = Instant::now();
        while watch.in_flight() > (n - cq) as u32 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(watch.in_flight(), (n - cq) as u32, "a full queue holds the rest back");
        assert_eq!(drain(&watch, Duration::from_secs(10)), 0);
    }
}
