//! `bulkhead-bench channel`: the device channel between this process and an exec'd driver
//! domain, in each notification mode.
//!
//! Phases per mode: round trips without data (a flush, which the `ram` backend completes at
//! once), with a 4 KiB read and with a 4 KiB write; IOPS of 4 KiB reads at queue depth 1 and
//! 32; CPU time of each side during the IOPS phases; then an idle phase of one second, after
//! the spin budget has run out, with the CPU each side used. By default the frontend thread
//! and the driver domain are pinned to CPUs 0 and 1 (as SPDK pins its reactors), so two
//! spinning sides never share a core.

use crate::BenchError;
use bulkhead_sandbox::spawn::DomainChild;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use bulkhead_channel::{BudgetPolicy, FrontQueue, FrontRequest, NotifyMode, QueueConfig, QueueSetup};
use bulkhead_doorbell::now_ns;
use bulkhead_shmem::memfd;
use bulkhead_spec::{BackendSpec, DomainSpec, QueueSpec};
use serde::Serialize;

use crate::Table;

const DEVICE_SIZE: u64 = 64 << 20;
const BLOCK: u64 = 4096;

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Modes to measure.
    pub modes: Vec<NotifyMode>,
    /// Seconds per IOPS phase.
    pub seconds: f64,
    /// Round trips sampled per latency phase (polled modes; irq uses a tenth).
    pub samples: usize,
    /// Pin the frontend thread and the driver domain to different CPUs.
    pub pin: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            modes: vec![NotifyMode::Irq, NotifyMode::Poll, NotifyMode::Adaptive],
            seconds: 2.0,
            samples: 200_000,
            pin: true,
        }
    }
}

/// Latency percentiles in nanoseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Latency {
    /// Median.
    pub p50_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// Samples.
    pub samples: usize,
}

/// One IOPS phase.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Iops {
    /// Queue depth.
    pub depth: usize,
    /// Requests per second.
    pub iops: f64,
    /// CPU of the frontend thread, percent of one core.
    pub frontend_cpu_pct: f64,
    /// CPU of the driver domain, percent of one core.
    pub driver_cpu_pct: f64,
    /// Times the frontend slept on its doorbell.
    pub frontend_sleeps: u64,
    /// Frontend spin budget at the end of the phase, ns.
    pub frontend_budget_ns: u64,
}

/// The idle phase.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Idle {
    /// Length of the phase.
    pub seconds: f64,
    /// Frontend CPU, percent of one core.
    pub frontend_cpu_pct: f64,
    /// Driver CPU, percent of one core.
    pub driver_cpu_pct: f64,
}

/// Results of one mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    /// Mode.
    pub mode: String,
    /// Round trip without data.
    pub rtt_nodata: Latency,
    /// Round trip of a 4 KiB read.
    pub rtt_read_4k: Latency,
    /// Round trip of a 4 KiB write.
    pub rtt_write_4k: Latency,
    /// 4 KiB reads at depth 1.
    pub qd1: Iops,
    /// 4 KiB reads at depth 32.
    pub qd32: Iops,
    /// Idle phase.
    pub idle: Idle,
    /// The frontend's spin budget at the end, ns.
    pub frontend_budget_ns: u64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// One entry per mode.
    pub modes: Vec<ModeReport>,
}

/// CPU time of a process's threads, ns (from /proc/PID/task/*/schedstat).
fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
        .sum()
}

/// Pins `pid` (0: the calling thread) to `cpu`. Returns whether it worked.
pub(crate) fn pin(pid: u32, cpu: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(pid as libc::pid_t, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

fn percentiles(mut v: Vec<u64>) -> Latency {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
    Latency { p50_ns: at(0.50), p99_ns: at(0.99), samples: v.len() }
}

struct Peer {
    front: FrontQueue,
    child: DomainChild,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Execs `exe driver` as a one-queue domain over a `size`-byte ram backend, with the queue
/// described by `cfg`; returns the frontend end and the domain process.
pub fn spawn_ram_domain(exe: &Path, cfg: &QueueConfig, size: u64) -> Result<(FrontQueue, DomainChild), BenchError> {
    let (front, fds) = QueueSetup::create("peer", cfg).map_err(|e| e.to_string())?;
    let ram = memfd::create("peer-ram", size).map_err(|e| e.to_string())?;
    let owned: [&OwnedFd; 6] = [&fds.ring, &fds.write_arena, &fds.read_arena, &fds.kick, &fds.irq, &ram];
    let raw: Vec<RawFd> = owned.iter().map(|f| f.as_raw_fd()).collect();
    let spec = DomainSpec {
        device: "peer".into(),
        size,
        backend_size: size,
        mode: cfg.mode.as_str().into(),
        budget_ns: match cfg.budget {
            BudgetPolicy::Fixed(ns) => Some(ns),
            BudgetPolicy::Auto { .. } => None,
        },
        queues: vec![QueueSpec { nslots: cfg.nslots, arena_bytes: front.arena_bytes() as u64, fds: [3, 4, 5, 6, 7], view: None }],
        views: Vec::new(),
        backend: BackendSpec::Ram { fd: 8 },
        filters: Vec::new(),
        state_fd: None,
        heartbeat_ms: 100,
        above_control_fds: None,
        attach: None,
        inactive: false,
        sandbox: Default::default(),
        report_fd: None,
        standby_fd: None,
    };
    let json = serde_json::to_string(&spec).map_err(|e| e.to_string())?;
    let (child, _) =
        bulkhead_supervisor::spawn_domain(exe, &spec.device, &json, &raw, true).map_err(|e| format!("exec driver: {e}"))?;
    Ok((front, child))
}

fn start_peer(exe: &Path, mode: NotifyMode) -> Result<Peer, BenchError> {
    let cfg = QueueConfig { nslots: 64, arena_bytes: 8 << 20, mode, budget: BudgetPolicy::DEFAULT_AUTO, generation: 1 };
    let (front, child) = spawn_ram_domain(exe, &cfg, DEVICE_SIZE)?;
    Ok(Peer { front, child })
}

fn rtt(front: &mut FrontQueue, n: usize, mut make: impl FnMut(u64) -> FrontRequest<'static>) -> Result<Latency, BenchError> {
    let mut v = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let t = now_ns();
        let r = front.execute(make(i), 10_000, |_| {}).map_err(|e| e.to_string())?;
        v.push(now_ns() - t);
        r.map_err(|s| format!("request failed: {s:?}"))?;
    }
    Ok(percentiles(v))
}

fn iops(front: &mut FrontQueue, pid: u32, depth: usize, secs: f64) -> Result<Iops, BenchError> {
    let (c0, d0, t0) = (bulkhead_sys::thread_cpu_ns(), process_cpu_ns(pid), Instant::now());
    let sleeps0 = front.stats().sleeps;
    let nblocks = DEVICE_SIZE / BLOCK;
    let mut seq = 0u64;
    let mut done = 0u64;
    let mut inflight = 0usize;
    let end = t0 + Duration::from_secs_f64(secs);
    let mut check = 0u32;
    loop {
        while inflight < depth {
            let off = (seq.wrapping_mul(2_654_435_761) % nblocks) * BLOCK;
            front.push(FrontRequest::Read { offset: off, into: BLOCK }, seq).map_err(|e| e.to_string())?;
            seq += 1;
            inflight += 1;
        }
        front.publish();
        let mut bad = None;
        let n = front
            .reap(|c| {
                if c.result.is_err() {
                    bad = Some(c.result);
                }
            })
            .map_err(|e| e.to_string())?;
        if let Some(b) = bad {
            return Err(BenchError::Run(format!("read failed: {b:?}")));
        }
        inflight -= n;
        done += n as u64;
        if n == 0 && !front.wait(10_000).map_err(|e| e.to_string())? {
            return Err("driver stopped answering".into());
        }
        check += 1;
        if check.is_multiple_of(64) && Instant::now() >= end {
            break;
        }
    }
    while inflight > 0 {
        front.wait(10_000).map_err(|e| e.to_string())?;
        inflight -= front.reap(|_| {}).map_err(|e| e.to_string())?;
    }
    let el = t0.elapsed().as_secs_f64();
    let (c1, d1) = (bulkhead_sys::thread_cpu_ns(), process_cpu_ns(pid));
    Ok(Iops {
        depth,
        iops: done as f64 / el,
        frontend_cpu_pct: (c1 - c0) as f64 / (el * 1e7),
        driver_cpu_pct: (d1 - d0) as f64 / (el * 1e7),
        frontend_sleeps: front.stats().sleeps - sleeps0,
        frontend_budget_ns: front.budget_ns(),
    })
}

/// Runs the benchmark for each mode, execing `exe` as the driver domain.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    let mut modes = Vec::new();
    // Read once: available_parallelism honours the affinity mask, which pinning narrows.
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    for &mode in &opts.modes {
        progress(&format!("{mode}: starting driver domain"));
        let mut peer = start_peer(exe, mode)?;
        let pid = peer.child.id();
        if opts.pin && cpus >= 2 {
            pin(0, 0);
            pin(pid, 1);
        }
        let front = &mut peer.front;
        let n = if mode == NotifyMode::Irq { (opts.samples / 10).max(1000) } else { opts.samples };
        // Warm up: touch the device so reads hit allocated pages, and let budgets settle.
        let zero = vec![0x5au8; BLOCK as usize];
        for i in 0..(DEVICE_SIZE / BLOCK).min(4096) {
            let r = front.execute(FrontRequest::Write { offset: i * BLOCK, from: &zero, fua: false }, 10_000, |_| {});
            r.map_err(|e| e.to_string())?.map_err(|s| format!("{s:?}"))?;
        }
        progress(&format!("{mode}: round trips ({n} per kind)"));
        let rtt_nodata = rtt(front, n, |_| FrontRequest::Flush)?;
        let rtt_read_4k = rtt(front, n, |i| FrontRequest::Read { offset: (i % 4096) * BLOCK, into: BLOCK })?;
        static PAYLOAD: [u8; BLOCK as usize] = [0xa5; BLOCK as usize];
        let rtt_write_4k = rtt(front, n, |i| FrontRequest::Write { offset: (i % 4096) * BLOCK, from: &PAYLOAD, fua: false })?;
        progress(&format!("{mode}: IOPS at depth 1 and 32"));
        let qd1 = iops(front, pid, 1, opts.seconds)?;
        let qd32 = iops(front, pid, 32, opts.seconds)?;
        progress(&format!("{mode}: idle second"));
        // Let the spin budget run out first (it is at most 50 µs; wait well past it).
        std::thread::sleep(Duration::from_millis(100));
        let (c0, d0, t0) = (bulkhead_sys::thread_cpu_ns(), process_cpu_ns(pid), Instant::now());
        std::thread::sleep(Duration::from_secs(1));
        let el = t0.elapsed().as_secs_f64();
        let idle = Idle {
            seconds: el,
            frontend_cpu_pct: (bulkhead_sys::thread_cpu_ns() - c0) as f64 / (el * 1e7),
            driver_cpu_pct: (process_cpu_ns(pid) - d0) as f64 / (el * 1e7),
        };
        let frontend_budget_ns = front.budget_ns();
        modes.push(ModeReport {
            mode: mode.as_str().into(),
            rtt_nodata,
            rtt_read_4k,
            rtt_write_4k,
            qd1,
            qd32,
            idle,
            frontend_budget_ns,
        });
        drop(peer);
    }
    if opts.pin {
        // Give the calling thread its CPUs back.
        // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for c in 0..cpus {
                libc::CPU_SET(c, &mut set);
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    Ok(Report { modes })
}

fn us(ns: u64) -> String {
    if ns < 10_000 {
        format!("{:.2}", ns as f64 / 1000.0)
    } else {
        format!("{:.1}", ns as f64 / 1000.0)
    }
}

/// Renders the report as tables.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["mode", "no-data p50/p99 µs", "4K read p50/p99 µs", "4K write p50/p99 µs"]);
    for m in &r.modes {
        t.row(vec![
            m.mode.clone(),
            format!("{} / {}", us(m.rtt_nodata.p50_ns), us(m.rtt_nodata.p99_ns)),
            format!("{} / {}", us(m.rtt_read_4k.p50_ns), us(m.rtt_read_4k.p99_ns)),
            format!("{} / {}", us(m.rtt_write_4k.p50_ns), us(m.rtt_write_4k.p99_ns)),
        ]);
    }
    let mut u = Table::new(&["mode", "QD1 kIOPS", "CPU fe/drv %", "QD32 kIOPS", "CPU fe/drv %", "idle CPU fe/drv %"]);
    for m in &r.modes {
        u.row(vec![
            m.mode.clone(),
            format!("{:.0}", m.qd1.iops / 1000.0),
            format!("{:.0} / {:.0}", m.qd1.frontend_cpu_pct, m.qd1.driver_cpu_pct),
            format!("{:.0}", m.qd32.iops / 1000.0),
            format!("{:.0} / {:.0}", m.qd32.frontend_cpu_pct, m.qd32.driver_cpu_pct),
            format!("{:.2} / {:.2}", m.idle.frontend_cpu_pct, m.idle.driver_cpu_pct),
        ]);
    }
    let mut out = format!("Round trips (4 KiB = data copied into and out of the grant arena)\n{}\n", t.render());
    out.push_str(&format!("Throughput, 4 KiB reads from a ram backend\n{}", u.render()));
    if let (Some(p), Some(a)) = (r.modes.iter().find(|m| m.mode == "poll"), r.modes.iter().find(|m| m.mode == "adaptive")) {
        out.push_str(&format!("\nadaptive / poll IOPS at depth 1: {:.2}\n", a.qd1.iops / p.qd1.iops));
    }
    out
}
