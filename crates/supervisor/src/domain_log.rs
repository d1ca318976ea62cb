//! A driver domain's standard output and error.
//!
//! A domain is untrusted, and so is everything it prints. Its descriptors 1 and 2 are a pipe
//! that the supervisor reads — one thread for every domain, waiting on all their pipes at once —
//! and every line reaches serve's log:
//!
//! * prefixed with the device and the domain's pid, so it cannot pass for a line of serve's;
//! * with control characters (terminal escapes, carriage returns) shown escaped, never raw;
//! * cut at [`LINE_MAX`] characters, saying how much was cut;
//! * at most [`BURST`] lines at once and [`PER_SEC`] a second after that; lines over the rate
//!   are dropped and counted, and the count is logged when lines flow again.
//!
//! The thread drains each pipe however fast its domain writes, so a flooding domain spends its
//! own CPU time, never blocks on a full pipe while holding requests, and never grows the
//! supervisor's memory or its log beyond those bounds.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use bulkhead_sys::epoll::Epoll;

/// Longest line kept, in characters.
pub const LINE_MAX: usize = 1024;
/// Lines a domain may print at once.
pub const BURST: f64 = 100.0;
/// Lines a second after the burst.
pub const PER_SEC: f64 = 10.0;

/// A pipe for a domain's output: the read end stays here, the write end becomes the domain's
/// descriptors 1 and 2. Both ends are close-on-exec (the spawn places the write end itself).
pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    bulkhead_sys::pipe()
}

/// One domain's output being relayed.
struct Stream {
    src: std::fs::File,
    lines: Lines,
}

/// The relay: its epoll and the pipes it reads.
struct Relay {
    epoll: Epoll,
    streams: Mutex<HashMap<u64, Stream>>,
    /// Rung when a pipe reaches its end.
    ended: Condvar,
    next: std::sync::atomic::AtomicU64,
}

impl Relay {
    fn streams(&self) -> MutexGuard<'_, HashMap<u64, Stream>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The relay, started with the first domain.
fn relay_thread() -> io::Result<&'static Relay> {
    // The error is kept as its kind and words: an `io::Error` cannot be cloned for each caller.
    static RELAY: OnceLock<Result<&'static Relay, (io::ErrorKind, String)>> = OnceLock::new();
    let r = RELAY.get_or_init(|| {
        let start = || -> io::Result<&'static Relay> {
            let relay: &'static Relay = Box::leak(Box::new(Relay {
                epoll: Epoll::new()?,
                streams: Mutex::new(HashMap::new()),
                ended: Condvar::new(),
                next: std::sync::atomic::AtomicU64::new(0),
            }));
            std::thread::Builder::new().name("domain-log".into()).spawn(move || run(relay))?;
            Ok(relay)
        };
        start().map_err(|e| (e.kind(), e.to_string()))
    });
    r.as_ref().copied().map_err(|(kind, words)| io::Error::new(*kind, words.clone()))
}

fn emit(line: &str) {
    let mut err = io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.write_all(b"\n");
}

fn run(relay: &'static Relay) {
    let mut ready = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        ready.clear();
        if relay.epoll.wait(None, &mut ready).is_err() {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        for &token in &ready {
            let mut streams = relay.streams();
            let Some(stream) = streams.get_mut(&token) else { continue };
            // What is there now, without waiting: the pipe is non-blocking.
            let ended = loop {
                match stream.src.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(n) => stream.lines.feed(&buf[..n], Instant::now(), emit),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                    Err(_) => break true,
                }
            };
            if ended {
                let mut stream = streams.remove(&token).expect("looked up above");
                let _ = relay.epoll.delete(stream.src.as_fd());
                stream.lines.finish(emit);
                relay.ended.notify_all();
            }
        }
    }
}

/// Relays what domain `pid` of `device` prints to serve's standard error until it closes its
/// end.
pub(crate) fn relay(device: &str, pid: u32, read_end: OwnedFd) {
    let prefix = format!("bulkhead: device {device}: domain {pid}: ");
    let added = relay_thread().and_then(|relay| {
        bulkhead_sys::set_nonblocking(read_end.as_fd())?;
        let token = relay.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let src = std::fs::File::from(read_end);
        let mut streams = relay.streams();
        relay.epoll.add(src.as_fd(), token)?;
        streams.insert(token, Stream { src, lines: Lines::new(prefix) });
        Ok(())
    });
    if let Err(e) = added {
        log::warn!("device {device}: cannot relay the output of domain {pid}: {e}");
    }
}

/// Waits up to `timeout` for every relay to reach the end of its domain's output (call once the
/// domains have ended, so their last lines are logged before the process exits).
pub(crate) fn finish_all(timeout: Duration) {
    let Ok(relay) = relay_thread() else { return };
    let deadline = Instant::now() + timeout;
    let mut streams = relay.streams();
    while !streams.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        streams = relay.ended.wait_timeout(streams, left).unwrap_or_else(|e| e.into_inner()).0;
    }
}

/// Splits a byte stream into sanitised, bounded, rate-limited log lines.
#[derive(Debug)]
pub(crate) struct Lines {
    prefix: String,
    /// The line being assembled (at most [`LINE_MAX`] characters of it).
    line: String,
    chars: usize,
    /// Bytes of the current line beyond [`LINE_MAX`].
    cut: usize,
    /// Undecoded bytes of a UTF-8 sequence split across reads.
    pending: Vec<u8>,
    tokens: f64,
    last: Option<Instant>,
    dropped: u64,
}

impl Lines {
    pub(crate) fn new(prefix: String) -> Self {
        Lines { prefix, line: String::new(), chars: 0, cut: 0, pending: Vec::new(), tokens: BURST, last: None, dropped: 0 }
    }

    /// Takes `bytes` read at `now`; calls `emit` for every line let through.
    pub(crate) fn feed(&mut self, bytes: &[u8], now: Instant, mut emit: impl FnMut(&str)) {
        if let Some(last) = self.last {
            self.tokens = (self.tokens + now.duration_since(last).as_secs_f64() * PER_SEC).min(BURST);
        }
        self.last = Some(now);
        for &b in bytes {
            if b == b'\n' {
                self.end_line(&mut emit);
                continue;
            }
            self.pending.push(b);
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    let c = s.chars().next().expect("one complete character");
                    self.pending.clear();
                    self.push_char(c);
                }
                // An incomplete sequence: wait for its next byte.
                Err(e) if e.error_len().is_none() && self.pending.len() < 4 => {}
                Err(_) => {
                    // Not UTF-8: show the bytes themselves.
                    for b in std::mem::take(&mut self.pending) {
                        self.push_escaped(&format!("\\x{b:02x}"), 1);
                    }
                }
            }
        }
    }

    fn push_char(&mut self, c: char) {
        if c.is_control() {
            let esc: String = c.escape_default().collect();
            self.push_escaped(&esc, c.len_utf8());
        } else if self.chars < LINE_MAX {
            self.line.push(c);
            self.chars += 1;
        } else {
            self.cut += c.len_utf8();
        }
    }

    fn push_escaped(&mut self, esc: &str, bytes: usize) {
        if self.chars + esc.len() <= LINE_MAX {
            self.line.push_str(esc);
            self.chars += esc.len();
        } else {
            self.chars = LINE_MAX;
            self.cut += bytes;
        }
    }

    fn end_line(&mut self, emit: &mut impl FnMut(&str)) {
        for b in std::mem::take(&mut self.pending) {
            self.push_escaped(&format!("\\x{b:02x}"), 1);
        }
        let mut text = std::mem::take(&mut self.line);
        if self.cut > 0 {
            text.push_str(&format!(" … ({} more bytes cut)", self.cut));
        }
        self.chars = 0;
        self.cut = 0;
        if self.tokens < 1.0 {
            self.dropped += 1;
            return;
        }
        self.tokens -= 1.0;
        self.report_dropped(emit);
        emit(&format!("{}{}", self.prefix, text));
    }

    fn report_dropped(&mut self, emit: &mut impl FnMut(&str)) {
        if self.dropped > 0 {
            emit(&format!(
                "{}{} lines dropped (a domain may print {} lines at once, then {} a second)",
                self.prefix, self.dropped, BURST, PER_SEC
            ));
            self.dropped = 0;
        }
    }

    /// The domain closed its output: flush a last unterminated line and the drop count.
    pub(crate) fn finish(&mut self, mut emit: impl FnMut(&str)) {
        if !self.line.is_empty() || !self.pending.is_empty() || self.cut > 0 {
            // A final line is let through even over the rate: it is often why the domain died.
            self.tokens = self.tokens.max(1.0);
            self.end_line(&mut emit);
        }
        self.report_dropped(&mut emit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[(&[u8], u64)]) -> Vec<String> {
        let t0 = Instant::now();
        let mut out = Vec::new();
        let mut l = Lines::new("P: ".into());
        for (bytes, ms) in chunks {
            l.feed(bytes, t0 + Duration::from_millis(*ms), |s| out.push(s.to_string()));
        }
        l.finish(|s| out.push(s.to_string()));
        out
    }

    #[test]
    fn lines_are_prefixed_and_split_across_reads() {
        let out = run(&[(b"hel", 0), (b"lo\nwor", 0), (b"ld\n", 0), (b"tail", 0)]);
        assert_eq!(out, ["P: hello", "P: world", "P: tail"]);
    }

    #[test]
    fn control_characters_are_escaped_never_raw() {
        let out = run(&[(b"\x1b[2J\rbulkhead: device x: restarted\x07\n", 0)]);
        assert_eq!(out.len(), 1);
        assert!(out[0].starts_with("P: \\u{1b}[2J\\rbulkhead: device x"), "{}", out[0]);
        assert!(!out[0].chars().any(|c| c.is_control()), "{:?}", out[0]);
    }

    #[test]
    fn utf8_split_across_reads_is_kept_and_bad_bytes_are_shown() {
        let s = "grüße".as_bytes();
        let out = run(&[(&s[..3], 0), (&s[3..], 0), (b"\n\xff\xfe ok\n", 0)]);
        assert_eq!(out, ["P: grüße", "P: \\xff\\xfe ok"]);
    }

    #[test]
    fn long_lines_are_cut_and_say_so() {
        let long = vec![b'a'; LINE_MAX + 1000];
        let mut input = long.clone();
        input.push(b'\n');
        let out = run(&[(&input, 0)]);
        assert_eq!(out.len(), 1);
        assert!(out[0].starts_with(&format!("P: {}", "a".repeat(LINE_MAX))));
        assert!(out[0].ends_with("(1000 more bytes cut)"), "{}", &out[0][out[0].len() - 40..]);
        // Escapes count towards the limit too.
        let out = run(&[(&[0x1b; 2 * LINE_MAX], 0), (b"\n", 0)]);
        assert!(out[0].len() < LINE_MAX + 60, "{}", out[0].len());
    }

    #[test]
    fn a_flood_is_cut_to_the_burst_then_the_rate_and_the_drop_is_counted() {
        let flood = b"x\n".repeat(100_000);
        // 100,000 lines at t=0, then one line 1 s later and the end.
        let out = run(&[(&flood, 0), (b"after\n", 1000)]);
        let plain = out.iter().filter(|s| *s == "P: x").count();
        assert_eq!(plain, BURST as usize);
        let n = 100_000 - BURST as u64;
        assert_eq!(out[BURST as usize], format!("P: {n} lines dropped (a domain may print 100 lines at once, then 10 a second)"));
        assert_eq!(out.last().unwrap(), "P: after");
    }

    #[test]
    fn the_rate_refills_with_time() {
        let mut chunks: Vec<(&[u8], u64)> = Vec::new();
        // Five lines a second for 60 s: under the rate, nothing is dropped.
        for i in 0..300u64 {
            chunks.push((b"tick\n", i * 200));
        }
        let out = run(&chunks);
        assert_eq!(out.len(), 300);
        assert!(out.iter().all(|s| s == "P: tick"));
    }

    #[test]
    fn the_last_line_of_a_dying_domain_is_kept_over_the_rate() {
        let flood = b"x\n".repeat(1000);
        let out = run(&[(&flood, 0), (b"panicked at the end", 0)]);
        assert!(out[out.len() - 2].contains("900 lines dropped"), "{:?}", out[out.len() - 2]);
        assert_eq!(out.last().unwrap(), "P: panicked at the end");
    }
}
