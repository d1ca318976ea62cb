//! Whether the CPUs are crowded: more runnable threads than CPUs to run them.
//!
//! A spinning waiter is worth its CPU only while nobody else wants that CPU. On a small machine
//! the thread that makes the next request (the application, fio, the NBD client, the FUSE
//! daemon's other half) is often runnable at the same moment as two spinners, and then the
//! spinners take turns with it in scheduler slices: throughput falls and latency grows to
//! milliseconds (docs/BENCHMARKS.md, "NBD export"). So an adaptive frontend waiter looks,
//! every [`CHECK_EVERY_NS`] of spinning, at the kernel's count of runnable threads, and stops
//! spinning — sleeps on its doorbell — when they outnumber the online CPUs
//! (docs/ring-protocol.md, "Adaptive budget", for why the driver does not).
//!
//! The count is the fourth field of `/proc/loadavg` (`running/total`): the sum of every run
//! queue's length at the moment of the read, the reader included. It costs one `pread` of a
//! descriptor opened once (about a microsecond here), answers "is a thread waiting for a CPU
//! now", which is the question, and needs no privilege. The alternatives were measured or
//! weighed against it: PSI's `/proc/pressure/cpu` is cumulative stall time, so it needs two
//! reads a window apart and tells what happened, not what is; `/proc/stat` carries the same
//! count among a page of per-CPU figures; steal time says nothing about this guest's own
//! threads. The descriptor is opened at first use. Where the file cannot be read the check
//! answers "not crowded", and waiting is what it was before.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

/// How long a spinner spins before it first asks, ns.
pub const FIRST_LOOK_NS: u64 = 4_000;
/// How often it asks after that, ns.
pub const CHECK_EVERY_NS: u64 = 8_000;

/// The system's run-queue count, read on demand.
#[derive(Debug)]
pub struct Crowd {
    loadavg: Option<File>,
    cpus: u32,
}

static CROWD: OnceLock<Crowd> = OnceLock::new();

impl Crowd {
    /// The process's monitor, opened at first use.
    pub fn get() -> &'static Crowd {
        CROWD.get_or_init(|| Crowd { loadavg: File::open("/proc/loadavg").ok(), cpus: online_cpus() })
    }

    /// Whether the monitor can see the run queues (false where `/proc/loadavg` could not be
    /// opened: then it never reports a crowd).
    pub fn available(&self) -> bool {
        self.loadavg.is_some()
    }

    /// The online CPUs it compares with.
    pub fn cpus(&self) -> u32 {
        self.cpus
    }

    /// Runnable threads now, the caller included; `None` if it cannot tell.
    pub fn runnable(&self) -> Option<u32> {
        let f = self.loadavg.as_ref()?;
        let mut buf = [0u8; 128];
        let n = f.read_at(&mut buf, 0).ok()?;
        parse_running(&buf[..n])
    }

    /// Whether some runnable thread has no CPU now.
    pub fn crowded(&self) -> bool {
        self.runnable().is_some_and(|r| r > self.cpus)
    }
}

/// One waiter's view of the crowd. A single look is often crowded for a moment — the thread
/// that just sent a request is still finishing its own work before it sleeps — so a waiter
/// stops spinning only when its look finds a crowd and most of its recent looks did too (an
/// average that moves an eighth of the way with each look).
#[derive(Debug, Default, Clone)]
pub struct CrowdWatch {
    /// Share of recent looks that found a crowd, in 1/256.
    level: u32,
    /// When to look next.
    next: u64,
    /// Looks that said stop.
    stops: u64,
    /// Whether the latest look [`crowded_lately`](Self::crowded_lately) took saw a crowd.
    last: bool,
    /// Where looks are taken (`None`: the system's run queues, [`Crowd::get`]).
    source: Option<fn() -> bool>,
}

impl CrowdWatch {
    /// A watch whose looks ask `source` instead of the run queues: for a test that must
    /// decide what every look sees, where the kernel's count can dip below the truth for
    /// one read while threads move between run queues.
    pub fn with_source(source: fn() -> bool) -> Self {
        CrowdWatch { source: Some(source), ..CrowdWatch::default() }
    }

    /// Whether a waiter that started spinning at `since` should sleep now (`now`); looks at the
    /// run queues at most every `CHECK_EVERY_NS`, and not before `FIRST_LOOK_NS` of spinning.
    pub fn should_sleep(&mut self, since: u64, now: u64) -> bool {
        self.look(since, now).is_some_and(|crowded| self.judge(crowded))
    }

    /// Whether the CPUs were crowded at the latest look, for a waiter that started at `since`
    /// and keeps waiting while they are: looks when [`should_sleep`](Self::should_sleep) would,
    /// and between looks answers what the last one saw. One look is enough here, unlike there:
    /// a crowd seen for a moment only keeps the waiter yielding until the next look, which
    /// costs the crowd nothing, where a sleep taken on it costs a wake-up.
    pub fn crowded_lately(&mut self, since: u64, now: u64) -> bool {
        if let Some(crowded) = self.look(since, now) {
            self.last = crowded;
            self.weigh(crowded);
        }
        self.last
    }

    /// Looks at the run queues if one is due at `now` for a waiter that started at `since`
    /// (at most every [`CHECK_EVERY_NS`], and not before [`FIRST_LOOK_NS`]); what it saw.
    fn look(&mut self, since: u64, now: u64) -> Option<bool> {
        if now < self.next.max(since + FIRST_LOOK_NS) {
            return None;
        }
        self.next = now + CHECK_EVERY_NS;
        Some(self.source.map_or_else(|| Crowd::get().crowded(), |look| look()))
    }

    /// Takes one look's answer into the average.
    fn weigh(&mut self, crowded: bool) {
        self.level = self.level - self.level / 8 + if crowded { 32 } else { 0 };
    }

    /// Takes one look's answer into the average; whether to stop.
    fn judge(&mut self, crowded: bool) -> bool {
        self.weigh(crowded);
        let stop = crowded && self.level >= 64;
        self.stops += stop as u64;
        stop
    }

    /// Times it said stop.
    pub fn stops(&self) -> u64 {
        self.stops
    }
}

/// The `running` of `/proc/loadavg`'s `running/total` field.
fn parse_running(text: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(text).ok()?;
    let field = text.split_ascii_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

fn online_cpus() -> u32 {
    u32::try_from(bulkhead_sys::cpus_online()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn the_running_count_is_read_from_the_fourth_field() {
        assert_eq!(parse_running(b"1.67 1.61 1.93 1/77 17438\n"), Some(1));
        assert_eq!(parse_running(b"0.00 0.01 0.05 12/1024 99\n"), Some(12));
        assert_eq!(parse_running(b"0.00 0.01 0.05\n"), None);
        assert_eq!(parse_running(b"0.00 0.01 0.05 x/1 2\n"), None);
        assert_eq!(parse_running(b"\xff\xfe"), None);
    }

    #[test]
    fn a_waiter_stops_on_a_lasting_crowd_not_on_a_passing_one() {
        let mut w = CrowdWatch::default();
        assert!(!w.judge(true), "one crowded look alone");
        assert!(!w.judge(false));
        assert!(!w.judge(true), "crowded now and then");
        assert!(w.judge(true), "crowded three looks of four");
        for _ in 0..20 {
            w.judge(false);
        }
        assert!(!w.judge(true), "a quiet spell is forgotten slowly, then a single look is not enough");
        assert_eq!(w.stops(), 1);
        // The first look waits for some spinning; later ones are spaced.
        let mut w = CrowdWatch::default();
        assert!(!w.should_sleep(1_000_000, 1_000_000 + FIRST_LOOK_NS - 1));
        assert_eq!(w.level, 0, "no look before FIRST_LOOK_NS");
    }

    #[test]
    fn busy_threads_beyond_the_cpus_make_a_crowd() {
        let c = Crowd::get();
        assert!(c.available(), "/proc/loadavg is readable on Linux");
        assert!(c.runnable().is_some_and(|r| r >= 1), "the reader itself is running");
        // Two more spinning threads than CPUs: some are always waiting for one.
        let stop = Arc::new(AtomicBool::new(false));
        let spinners: Vec<_> = (0..c.cpus() + 2)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let started = std::time::Instant::now();
        let mut seen = false;
        while !seen && started.elapsed() < std::time::Duration::from_secs(10) {
            seen = c.crowded();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
        for s in spinners {
            s.join().unwrap();
        }
        assert!(seen, "never saw more runnable threads than {} CPUs", c.cpus());
    }
}
