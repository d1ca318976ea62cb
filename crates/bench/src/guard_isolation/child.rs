//! The child process a fault is made in, and how its end is watched: the child's heap is
//! private memory, as every domain's is, so the word a fault aimed at is read from the child
//! itself, as it exits, before the kernel takes its memory away.
//!
//! Until its fault is due the child runs untraced. Once the fault's record has come, this
//! process seizes it (`PTRACE_SEIZE` with `PTRACE_O_TRACEEXIT`), and only then lets the write
//! go ahead: the signals the child gets on the way (a stopped write is a SIGBUS or a SIGSEGV the
//! guard handles) are passed on as they come, and at its exit stop, with its memory still
//! mapped, the word is read through `/proc/PID/mem`.

use std::cell::Cell;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::BenchError;

/// A child that has made no fault by then is stuck.
pub(super) const CHILD_LIMIT: Duration = Duration::from_secs(30);

/// A child process, forked from this one; ended and reaped when dropped, if it is not yet.
pub(super) struct Child {
    pid: i32,
    reaped: Cell<bool>,
}

/// What a child's memory held as it exited.
pub(super) struct End {
    /// The word its fault aimed at.
    pub(super) word: u64,
    /// Whether its runtime's heap space was in transparent huge pages.
    pub(super) huge: bool,
}

/// Whether a wait status is an end, not a stop.
fn is_end(status: i32) -> bool {
    libc::WIFEXITED(status) || libc::WIFSIGNALED(status)
}

impl Child {
    /// The child `pid` (returned by `fork`).
    pub(super) fn new(pid: i32) -> Child {
        Child { pid, reaped: Cell::new(false) }
    }

    /// Its wait status if it has ended (then reaped) or, when traced, stopped; `None` while it
    /// runs.
    fn try_wait(&self) -> Result<Option<i32>, BenchError> {
        let mut status = 0;
        // SAFETY: waits for this process's own child without blocking; `status` is a local.
        let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG | libc::__WALL) };
        match r {
            0 => Ok(None),
            r if r == self.pid => {
                self.reaped.set(is_end(status));
                Ok(Some(status))
            }
            _ => Err(BenchError::Run(format!("waitpid: {}", std::io::Error::last_os_error()))),
        }
    }

    /// Its wait status if it has ended or, traced, stopped ([`try_wait`](Self::try_wait)); an
    /// error, once it is ended and reaped, if it has run past [`CHILD_LIMIT`] since `started`.
    pub(super) fn ended(&self, started: Instant) -> Result<Option<i32>, BenchError> {
        if let Some(st) = self.try_wait()? {
            return Ok(Some(st));
        }
        if started.elapsed() > CHILD_LIMIT {
            self.kill();
            return Err(BenchError::Run(format!("the domain made no fault in {} s", CHILD_LIMIT.as_secs())));
        }
        Ok(None)
    }

    /// Ends it and reaps it.
    fn kill(&self) {
        if self.reaped.replace(true) {
            return;
        }
        // SAFETY: signals this process's own child, not reaped yet, so its pid is still its.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        loop {
            let mut status = 0;
            // SAFETY: waits for this process's own child; `status` is a local.
            if unsafe { libc::waitpid(self.pid, &mut status, libc::__WALL) } != self.pid || is_end(status) {
                return;
            }
            // A traced child may stop once more on its way out (its exit stop).
            // SAFETY: resumes this process's own traced child, stopped (seen just above).
            unsafe { libc::ptrace(libc::PTRACE_CONT, self.pid, 0, 0) };
        }
    }

    /// Traces it from now on, only so as to stop it as it exits (and to kill it if this
    /// process dies first).
    pub(super) fn watch_end(&self) -> Result<(), BenchError> {
        let opts = libc::PTRACE_O_TRACEEXIT | libc::PTRACE_O_EXITKILL;
        // SAFETY: seizes this process's own child, which is not traced yet; seizing does not
        // stop it.
        if unsafe { libc::ptrace(libc::PTRACE_SEIZE, self.pid, 0, opts) } < 0 {
            return Err(BenchError::Run(format!("ptrace(PTRACE_SEIZE): {}", std::io::Error::last_os_error())));
        }
        Ok(())
    }

    /// After [`watch_end`](Self::watch_end): lets it run to its end, passing on each signal
    /// it gets, and at its exit stop reads the 8 bytes at `addr` in its memory and whether the
    /// `runtime` heap space (start, length) is in huge pages. Its wait status and what it read.
    pub(super) fn end_reading(&self, addr: u64, runtime: (u64, u64), started: Instant) -> Result<(i32, End), BenchError> {
        loop {
            let Some(status) = self.ended(started)? else {
                std::thread::sleep(Duration::from_micros(50));
                continue;
            };
            if !libc::WIFSTOPPED(status) {
                return Err(BenchError::Run(format!("the domain ended ({}) without stopping at its exit", describe(status))));
            }
            let exiting = status >> 8 == libc::SIGTRAP | (libc::PTRACE_EVENT_EXIT << 8);
            // A signal it was sent goes on to it; a stop of another kind (a group stop) resumes
            // with none.
            let pass = if status >> 16 == 0 { libc::WSTOPSIG(status) } else { 0 };
            let end = exiting.then(|| -> Result<End, BenchError> {
                let huge = bulkhead_sys::thp::bytes_in(Some(self.pid as u32), runtime.0, runtime.1).map_err(|e| e.to_string())?;
                Ok(End { word: self.read_word(addr)?, huge: huge > 0 })
            });
            // SAFETY: resumes this process's own traced child, stopped (seen just above).
            if unsafe { libc::ptrace(libc::PTRACE_CONT, self.pid, 0, pass as libc::c_long) } < 0 {
                return Err(BenchError::Run(format!("ptrace(PTRACE_CONT): {}", std::io::Error::last_os_error())));
            }
            if let Some(end) = end {
                let end = end?;
                let mut status = 0;
                // SAFETY: reaps this process's own child, which is exiting; `status` is a local.
                if unsafe { libc::waitpid(self.pid, &mut status, libc::__WALL) } != self.pid {
                    return Err(BenchError::Run(format!("waitpid: {}", std::io::Error::last_os_error())));
                }
                self.reaped.set(true);
                return Ok((status, end));
            }
        }
    }

    /// The 8 bytes at `addr` in its memory (which this process may read as its tracer, shut
    /// pages and all).
    fn read_word(&self, addr: u64) -> Result<u64, BenchError> {
        let path = format!("/proc/{}/mem", self.pid);
        let mem = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        let mut word = [0u8; 8];
        mem.read_exact_at(&mut word, addr).map_err(|e| format!("{path} at {addr:#x}: {e}"))?;
        Ok(u64::from_le_bytes(word))
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // A child left running by an error on the way.
        self.kill();
    }
}

/// How the child ended, in words.
pub(super) fn describe(status: i32) -> String {
    if libc::WIFEXITED(status) {
        format!("exit status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status:#x}")
    }
}
