//! `bulkhead-bench restart --kill serve` and `--upgrade`: the pause an application sees when
//! `serve` itself is killed (and its keeper starts another that takes over) or upgraded, next
//! to the pause of a driver-domain kill measured the same way.
//!
//! A real `bulkhead serve` with `[keeper] enabled` serves one `ram` device. Load threads open
//! its FUSE file with O_DIRECT and, without pause, write a 4 KiB block of their own and read it
//! back, checking every byte; each completion's time is recorded. Rounds alternate: a driver
//! domain killed, then `serve` killed (or upgraded), again and again, with the load running
//! on between them. A round's pause is the longest time without any completion from its
//! start until the device serves again: what an application waiting on a request sees.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::{BenchError, BenchServe, Table};

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Rounds of each kind.
    pub rounds: usize,
    /// Upgrade `serve` instead of killing it.
    pub upgrade: bool,
    /// Load threads.
    pub threads: usize,
}

/// The pauses of one kind of round.
#[derive(Debug, Clone, Serialize)]
pub struct Kind {
    /// `driver kill`, `serve kill` or `upgrade`.
    pub what: String,
    /// Rounds measured.
    pub rounds: usize,
    /// Median pause, ms.
    pub pause_p50_ms: f64,
    /// 99th percentile pause, ms.
    pub pause_p99_ms: f64,
    /// Longest pause, ms.
    pub pause_max_ms: f64,
}

/// Results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Each kind of round.
    pub kinds: Vec<Kind>,
    /// Requests the load completed (a write and a read each count).
    pub requests: u64,
    /// Requests that failed, or read back other bytes than written: the goal is 0.
    pub errors: u64,
    /// Load threads.
    pub threads: usize,
}

/// The `serve` this benchmark started: the keeper, whose child is the real `serve`.
struct Keeper(BenchServe);

impl Keeper {
    fn run_dir(&self) -> PathBuf {
        self.0.run_dir()
    }

    fn log_tail(&self) -> String {
        self.0.log_tail()
    }

    /// The `serve` the keeper runs now.
    fn serve_pid(&self) -> Option<u32> {
        let k = self.0.child.id();
        let children = std::fs::read_to_string(format!("/proc/{k}/task/{k}/children")).ok()?;
        children.split_whitespace().next()?.parse().ok()
    }
}

const CONFIG: &str = "[keeper]\nenabled = true\n\n[nbd]\nenabled = false\n\n\
    [[device]]\nname = \"d\"\nsize = \"256M\"\n[device.backend]\ntype = \"ram\"\n";

fn start(exe: &Path) -> Result<Keeper, BenchError> {
    let s = BenchServe::start(exe, "serve-restart", CONFIG, &[], &[], |s| {
        s.run_dir().join("fuse/d").exists() && hello(&s.run_dir()).is_some()
    })?;
    Ok(Keeper(s))
}

/// The pid of the `serve` answering on `run_dir`.
fn hello(run_dir: &Path) -> Option<u32> {
    bulkhead_control::Client::connect(run_dir).ok()?.call(bulkhead_control::Hello {}).ok().map(|h| h.pid)
}

/// What the load threads share.
struct Load {
    stop: AtomicBool,
    requests: AtomicU64,
    errors: AtomicU64,
    /// Completion times (ns, monotonic) of each thread.
    times: Vec<Mutex<Vec<u64>>>,
}

/// Writes a block of its own and reads it back, again and again, until told to stop.
fn load_thread(file: std::fs::File, index: usize, load: Arc<Load>) {
    const BLOCK: usize = 4096;
    let layout = std::alloc::Layout::from_size_align(2 * BLOCK, BLOCK).expect("layout");
    // SAFETY: a non-zero size with a valid alignment; freed below with the same layout.
    let mem = unsafe { std::alloc::alloc_zeroed(layout) };
    if mem.is_null() {
        load.errors.fetch_add(1, Ordering::Relaxed);
        return;
    }
    // SAFETY: `mem` holds 2 * BLOCK bytes, split into two disjoint halves.
    let (out, back) =
        unsafe { (std::slice::from_raw_parts_mut(mem, BLOCK), std::slice::from_raw_parts_mut(mem.add(BLOCK), BLOCK)) };
    let blocks = 1024u64;
    let mut rng = bulkhead_rng::Rng::new(index as u64);
    while !load.stop.load(Ordering::Acquire) {
        let x = rng.next_u64();
        let offset = (index as u64 * blocks + x % blocks) * BLOCK as u64;
        out.iter_mut().enumerate().for_each(|(i, b)| *b = (x >> (i % 8 * 8)) as u8 ^ i as u8);
        let wrote = file.write_all_at(out, offset);
        let now = bulkhead_sys::monotonic_ns();
        load.times[index].lock().unwrap_or_else(|e| e.into_inner()).push(now);
        let read = wrote.and_then(|()| file.read_exact_at(back, offset));
        let now = bulkhead_sys::monotonic_ns();
        load.times[index].lock().unwrap_or_else(|e| e.into_inner()).push(now);
        load.requests.fetch_add(2, Ordering::Relaxed);
        if read.is_err() || out != back {
            load.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    // SAFETY: allocated above with `layout`.
    unsafe { std::alloc::dealloc(mem, layout) };
}

/// The longest time without a completion between `from` and `to` (ns), over every thread.
fn longest_gap(load: &Load, from: u64, to: u64) -> u64 {
    let mut all: Vec<u64> = Vec::new();
    for t in &load.times {
        all.extend(t.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|&&t| t >= from && t <= to));
    }
    all.sort_unstable();
    let mut last = from;
    let mut longest = 0;
    for t in all.into_iter().chain([to]) {
        longest = longest.max(t.saturating_sub(last));
        last = t;
    }
    longest
}

fn summary(what: &str, mut pauses: Vec<u64>) -> Kind {
    pauses.sort_unstable();
    let at = |p: f64| pauses.get(((pauses.len().max(1) - 1) as f64 * p).round() as usize).map_or(0.0, |&ns| ns as f64 / 1e6);
    Kind { what: what.into(), rounds: pauses.len(), pause_p50_ms: at(0.5), pause_p99_ms: at(0.99), pause_max_ms: at(1.0) }
}

/// Runs the benchmark with `exe` (a `bulkhead` that takes `serve`; needs root for FUSE).
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if !(1..=10_000).contains(&opts.rounds) || !(1..=16).contains(&opts.threads) {
        return Err(BenchError::Options(format!(
            "{} rounds, {} threads: rounds are 1..=10000, threads 1..=16",
            opts.rounds, opts.threads
        )));
    }
    let keeper = start(exe)?;
    let run_dir = keeper.run_dir();
    let file_path = run_dir.join("fuse/d");
    let load = Arc::new(Load {
        stop: AtomicBool::new(false),
        requests: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        times: (0..opts.threads).map(|_| Mutex::new(Vec::with_capacity(1 << 20))).collect(),
    });
    let mut threads = Vec::new();
    for i in 0..opts.threads {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&file_path)
            .map_err(|e| BenchError::io(&file_path, e))?;
        let l = load.clone();
        threads.push(std::thread::spawn(move || load_thread(f, i, l)));
    }
    let ended = |load: &Arc<Load>, threads: Vec<std::thread::JoinHandle<()>>| {
        load.stop.store(true, Ordering::Release);
        for t in threads {
            let _ = t.join();
        }
    };
    let serve_kind = if opts.upgrade { "upgrade" } else { "serve kill" };
    let (mut driver, mut serve) = (Vec::new(), Vec::new());
    let result = (|| -> Result<(), BenchError> {
        for round in 0..opts.rounds * 2 {
            std::thread::sleep(Duration::from_millis(300));
            let old = hello(&run_dir).ok_or_else(|| format!("serve does not answer:\n{}", keeper.log_tail()))?;
            let from = bulkhead_sys::monotonic_ns();
            if round % 2 == 0 {
                let status = crate::serve_status(&run_dir.join("control.sock")).ok_or("no status")?;
                let pid = status.devices.first().map(|d| d.driver_pid).ok_or("no device")?;
                let restarts = status.devices[0].restarts;
                bulkhead_sys::signal(pid, libc::SIGKILL).map_err(|e| format!("kill driver {pid}: {e}"))?;
                let deadline = Instant::now() + Duration::from_secs(30);
                while crate::serve_status(&run_dir.join("control.sock")).is_none_or(|s| {
                    s.devices[0].restarts == restarts || s.devices[0].state != bulkhead_control::DeviceState::Running
                }) {
                    if Instant::now() > deadline {
                        return Err(format!("the driver was not replaced:\n{}", keeper.log_tail()).into());
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            } else {
                if opts.upgrade {
                    let mut c = bulkhead_control::Client::connect(&run_dir).map_err(|e| e.to_string())?;
                    c.call(bulkhead_control::Upgrade {}).map_err(|e| format!("upgrade: {e}"))?;
                } else {
                    let pid = keeper.serve_pid().ok_or("the keeper runs no serve")?;
                    bulkhead_sys::signal(pid, libc::SIGKILL).map_err(|e| format!("kill serve {pid}: {e}"))?;
                }
                let deadline = Instant::now() + Duration::from_secs(30);
                while hello(&run_dir).is_none_or(|p| p == old) {
                    if Instant::now() > deadline {
                        return Err(format!("no new serve answered:\n{}", keeper.log_tail()).into());
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            // Whatever the load was waiting on has completed well within this.
            std::thread::sleep(Duration::from_millis(200));
            let to = bulkhead_sys::monotonic_ns();
            let gap = longest_gap(&load, from, to);
            if round % 2 == 0 { &mut driver } else { &mut serve }.push(gap);
            if round % 20 == 19 {
                progress(&format!("{} of {} rounds", round + 1, opts.rounds * 2));
            }
        }
        Ok(())
    })();
    ended(&load, threads);
    result?;
    Ok(Report {
        kinds: vec![summary("driver kill", driver), summary(serve_kind, serve)],
        requests: load.requests.load(Ordering::Relaxed),
        errors: load.errors.load(Ordering::Relaxed),
        threads: opts.threads,
    })
}

/// The report as a table.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["round", "rounds", "pause p50 ms", "p99 ms", "max ms"]);
    for k in &r.kinds {
        t.row(vec![
            k.what.clone(),
            k.rounds.to_string(),
            format!("{:.1}", k.pause_p50_ms),
            format!("{:.1}", k.pause_p99_ms),
            format!("{:.1}", k.pause_max_ms),
        ]);
    }
    format!("{}{} threads, {} requests, {} errors\n", t.render(), r.threads, r.requests, r.errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_gap_counts_from_the_start_and_to_the_end_over_every_thread() {
        let load = Load {
            stop: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            times: vec![Mutex::new(vec![5, 10, 40, 41]), Mutex::new(vec![12, 30, 90])],
        };
        // From 0: 5, 10, 12, 30, 40, 41, then 90 (out of the window), to 60.
        assert_eq!(longest_gap(&load, 0, 60), 19);
        // Nothing completes in the window: the whole of it.
        assert_eq!(longest_gap(&load, 50, 80), 30);
    }

    #[test]
    fn pauses_are_summarised_by_their_percentiles() {
        let k = summary("x", (1..=100).map(|ms| ms * 1_000_000).collect());
        assert_eq!((k.rounds, k.pause_p50_ms, k.pause_max_ms), (100, 51.0, 100.0));
        assert_eq!(k.pause_p99_ms, 99.0);
    }

    #[test]
    fn out_of_range_options_are_refused() {
        let e = run(Path::new("/nonexistent"), &Options { rounds: 0, upgrade: false, threads: 2 }, |_| {});
        assert!(matches!(e, Err(BenchError::Options(_))));
    }
}
