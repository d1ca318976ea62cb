//! A spare domain (`bulkhead spare`): started by the supervisor before any domain dies,
//! sandboxed as far as it can be without knowing its device ([`bulkhead_sandbox::spare`]), it
//! waits on its hand-over line until the supervisor gives it a device's spec and descriptors
//! ([`bulkhead_spec::handover`]), puts them where the spec says, and from then on is that
//! device's domain like one exec'd for it.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

use bulkhead_spec::handover;

use crate::DriverError;

/// Where a spare finds its hand-over line.
pub const LINE_FD: RawFd = 3;

fn setup(what: &str, e: impl std::fmt::Display) -> DriverError {
    DriverError::Setup(format!("spare: {what}: {e}"))
}

/// Sandboxes this process as a spare, says so on the line, and waits for a device. Returns
/// the device's spec as JSON, its descriptors at 3, 4, … as the spec numbers them and the
/// domain's output on 1 and 2; `Ok(None)` if the supervisor closed the line instead (it no
/// longer needs this spare, or is gone). The caller, having read the spec, shows the role in
/// `ps` ([`retitle_for`]).
///
/// # Safety
/// Descriptor [`LINE_FD`] must be this process's hand-over line, used by nothing else; and
/// nothing else in the process may hold descriptors at the numbers the spec gives.
pub unsafe fn wait_for_work() -> Result<Option<String>, DriverError> {
    // SAFETY: the caller guarantees the line is this process's alone.
    let line = unsafe { bulkhead_sys::claim_inherited(LINE_FD) }.map_err(|e| setup("the hand-over line", e))?;
    // The code a domain runs, in the page tables now rather than a fault at a time later.
    warm_up();
    // The spare's own descriptors stay clear of the numbers the device's will take.
    let line =
        bulkhead_sys::move_above(line, bulkhead_sandbox::spare::OWN_FDS_FROM).map_err(|e| setup("the hand-over line", e))?;
    bulkhead_sandbox::spare::prepare();
    let mut said = [handover::READY];
    // SAFETY: writes one byte from a local.
    if unsafe { libc::write(line.as_raw_fd(), said.as_mut_ptr().cast(), 1) } != 1 {
        return Ok(None);
    }
    // The header, the spec's first bytes and its first descriptors come in one message. Word
    // that one is on its way may come first: it has woken this process (and its CPU), which
    // sleeps again until the device comes, now sooner to wake.
    let mut buf = vec![0u8; handover::HEADER_LEN + handover::CHUNK];
    let (n, mut fds) = loop {
        let Some((n, fds)) = bulkhead_sys::recv_with_fds(line.as_fd(), &mut buf, true).map_err(|e| setup("the header", e))?
        else {
            return Ok(None);
        };
        if n == 0 {
            return Ok(None);
        }
        if n == 1 && buf[0] == handover::SOON && fds.is_empty() {
            continue;
        }
        break (n, fds);
    };
    if n == 0 {
        return Ok(None);
    }
    let (json_len, nfds) = buf
        .get(..handover::HEADER_LEN)
        .and_then(handover::parse_header)
        .filter(|&(j, f)| j <= handover::MAX_JSON && (1..=bulkhead_sandbox::spawn::MAX_FDS + 1).contains(&f) && fds.len() <= f)
        .ok_or_else(|| setup("the header", "not a hand-over header"))?;
    let mut json = Vec::with_capacity(json_len);
    json.extend_from_slice(&buf[handover::HEADER_LEN..n]);
    while json.len() < json_len || fds.len() < nfds {
        let got = bulkhead_sys::recv_with_fds(line.as_fd(), &mut buf, true).map_err(|e| setup("the spec", e))?;
        let Some((n, more)) = got.filter(|(n, _)| *n > 0) else {
            return Err(setup("the spec", "the supervisor hung up in the middle of the hand-over"));
        };
        if buf[0] != handover::MORE || json.len() + n - 1 > json_len || fds.len() + more.len() > nfds {
            return Err(setup("the spec", "more than the header announced"));
        }
        json.extend_from_slice(&buf[1..n]);
        fds.extend(more);
    }
    if json.len() != json_len {
        return Err(setup("the spec", "more than the header announced"));
    }
    drop(buf);
    drop(line);
    let output = fds.pop().ok_or_else(|| setup("the descriptors", "no output pipe"))?;
    place(fds, output)?;
    String::from_utf8(json).map(Some).map_err(|e| setup("the spec", e))
}

/// Shows in `ps` what this former spare is for `spec`'s device: `bulkhead standby DEVICE`
/// while it waits to take over (`standby`), `bulkhead driver DEVICE [tap]` once it serves. Does
/// nothing in a process that was never a spare (its arguments are the exec's, and no room was
/// left in them).
pub fn retitle_for(spec: &bulkhead_spec::DomainSpec, standby: bool) {
    let tap = matches!(spec.backend, bulkhead_spec::BackendSpec::Channel { .. });
    // Read once: the C library's argument strings are the ones `retitle` rewrites, and std
    // reads them anew each time.
    static SPARE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*SPARE.get_or_init(|| std::env::args_os().nth(1).is_some_and(|a| a == "spare")) {
        return;
    }
    if standby {
        retitle(&["standby", &spec.device]);
    } else {
        retitle(&["driver", &spec.device, if tap { "tap" } else { "" }]);
    }
}

/// Where this process's argument strings lie, checked once: their start (argv[0]), their
/// bytes in all, and where those after argv[0] begin.
static ARGS_AREA: std::sync::OnceLock<Option<(usize, usize, usize)>> = std::sync::OnceLock::new();

/// Makes `ps` show this process as `bulkhead WORDS…`: rewrites its arguments after argv[0] in
/// place (the kernel reads `/proc/PID/cmdline` from this memory). Does nothing if the words do
/// not fit, or the arguments are not where the C library says they start.
fn retitle(words: &[&str]) {
    extern "C" {
        static program_invocation_name: *mut libc::c_char;
    }
    let area = ARGS_AREA.get_or_init(|| {
        let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
        let argv0 = args.first()?;
        let area: usize = args.iter().map(|a| a.len() + 1).sum();
        // SAFETY: reads the pointer the C library set at start-up.
        let start = unsafe { program_invocation_name }.cast::<u8>();
        if start.is_null() {
            return None;
        }
        // SAFETY: the C library points `program_invocation_name` at argv[0], the first of the
        // argument strings the kernel laid out one after another, `area` bytes as `args` holds
        // them; they are compared with `args` before anything is written.
        let now = unsafe { std::slice::from_raw_parts(start, area) };
        let laid_out: Vec<u8> = args.iter().flat_map(|a| a.as_encoded_bytes().iter().copied().chain([0])).collect();
        (now == laid_out.as_slice()).then_some((start as usize, area, argv0.len() + 1))
    });
    let Some((start, area, first)) = *area else { return };
    let mut text = Vec::new();
    for w in words.iter().filter(|w| !w.is_empty()) {
        text.extend_from_slice(w.as_bytes());
        text.push(0);
    }
    if first + text.len() > area {
        return;
    }
    let start = start as *mut u8;
    // SAFETY: the argument strings checked above (`ARGS_AREA`); only bytes within them after
    // argv[0] are written. What else reads them (`std::env::args`) reads them after the spec is
    // taken, as the new title.
    unsafe {
        std::ptr::write_bytes(start.add(first), 0, area - first);
        std::ptr::copy_nonoverlapping(text.as_ptr(), start.add(first), text.len());
    }
}

/// Maps every page of this program's code and read-only data and of its libraries' now
/// (`MADV_POPULATE_READ`): a process that has not run a piece of code yet takes a page fault
/// for each page of it, and building a domain, confining it and serving its first requests
/// runs much code the spare has not. The pages are the page cache's, shared with every other
/// process running the program: no private memory. Nothing happens where the kernel lacks the
/// advice (before Linux 5.14).
fn warm_up() {
    const MADV_POPULATE_READ: libc::c_int = 22;
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return };
    for line in maps.lines() {
        // START-END PERMS OFFSET DEV INODE PATH
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(path)) = (f.next(), f.next(), f.nth(3)) else { continue };
        if !path.starts_with('/') || perms.starts_with("rw") || !perms.starts_with('r') {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else { continue };
        // SAFETY: advice on a mapping of this process, as /proc/self/maps lists it: it reads
        // the file's pages into the page tables and changes no memory.
        unsafe { libc::madvise(a as *mut libc::c_void, b - a, MADV_POPULATE_READ) };
    }
}

/// Puts `fds` at 3, 4, … and `output` on 1 and 2. Descriptors received take the lowest free
/// numbers, in order, and the spare holds none of its own below
/// [`bulkhead_sandbox::spare::OWN_FDS_FROM`]: they are usually where the spec says already,
/// and stay there. Otherwise each is first moved above the numbers it will take, so that none
/// is closed by a `dup2` onto it.
fn place(fds: Vec<OwnedFd>, output: OwnedFd) -> Result<(), DriverError> {
    if fds.iter().enumerate().all(|(i, fd)| fd.as_raw_fd() == LINE_FD + i as RawFd) {
        // The spec claims them by number (`claim_inherited`). They stay close-on-exec, as
        // received: a domain execs nothing.
        for fd in fds {
            let _ = fd.into_raw_fd();
        }
        return put_output(output);
    }
    let top = LINE_FD + fds.len() as RawFd;
    let high = |fd: OwnedFd| -> Result<OwnedFd, DriverError> {
        // SAFETY: duplicates a descriptor this function owns.
        let h = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, top) };
        if h < 0 {
            return Err(setup("move a descriptor", std::io::Error::last_os_error()));
        }
        // SAFETY: fcntl returned a fresh descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(h) })
    };
    let moved = fds.into_iter().map(high).collect::<Result<Vec<_>, _>>()?;
    for (i, fd) in moved.iter().enumerate() {
        // SAFETY: the target numbers are free (or held by nothing the process uses: the
        // caller's contract), and the spec claims them later.
        if unsafe { libc::dup2(fd.as_raw_fd(), LINE_FD + i as RawFd) } < 0 {
            return Err(setup("place a descriptor", std::io::Error::last_os_error()));
        }
    }
    put_output(output)
}

/// Puts `output` on 1 and 2.
fn put_output(output: OwnedFd) -> Result<(), DriverError> {
    for std_fd in [1, 2] {
        // SAFETY: replaces standard output and error with the output pipe.
        if unsafe { libc::dup2(output.as_raw_fd(), std_fd) } < 0 {
            return Err(setup("the output pipe", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}
