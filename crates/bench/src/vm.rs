//! `bulkhead-bench vm`: bulkhead's vhost-user-blk export against qemu-storage-daemon's, with
//! the same workloads on the same backing, each system brought up in turn.
//!
//! - **host**: a frontend of the project's own (`bulkhead_vhost_export::frontend`: memfd
//!   "guest" memory, a virtqueue written directly, completions polled) drives each server,
//!   which measures the servers and not an emulator;
//! - **guest**: a real Linux guest under QEMU (TCG) runs `guest-io bench` against each;
//! - **restart**: the pause a guest sees while a driver domain is killed, and while `serve`
//!   (or qemu-storage-daemon) is killed with SIGKILL and started again, with the guest's
//!   errors under that loop.
//!
//! Rounds alternate the two systems (the first goes second in the next round); figures are
//! medians of the rounds. CPU is the user and system time of the server's processes over each
//! point: `serve` and its domains, or qemu-storage-daemon, per GiB moved and per 100,000
//! requests. Backings: a file on tmpfs (`/dev/shm`), then `ram`. qemu-storage-daemon has no
//! store of its own in memory (its `null-co` keeps nothing), so against bulkhead's `ram` it
//! serves a tmpfs file again.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_guest::{Disk, Kit, Outcome, Vm, VmOptions};
use bulkhead_vhost_export::frontend::{Frontend, FrontendOptions};
use serde::Serialize;

use crate::{cpu_seconds, median, BenchError, CpuPer100k, Table};

/// The device's size: small enough to write whole before each run.
const DEVICE_BYTES: u64 = 256 << 20;

/// Which parts to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// The host-side frontend.
    Host,
    /// Real guests.
    Guest,
    /// Restarts under a guest.
    Restart,
    /// Live migrations of a guest between two servers on one shared file.
    Migrate,
}

impl Part {
    /// Parses `host`, `guest` or `restart`.
    pub fn parse(s: &str) -> Result<Part, String> {
        match s {
            "host" => Ok(Part::Host),
            "guest" => Ok(Part::Guest),
            "restart" => Ok(Part::Restart),
            "migrate" => Ok(Part::Migrate),
            o => Err(format!("unknown part `{o}` (host, guest, restart, migrate)")),
        }
    }
}

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Alternated rounds.
    pub rounds: usize,
    /// Seconds per point with the host frontend.
    pub seconds: f64,
    /// Seconds per point in a guest.
    pub guest_seconds: u64,
    /// Kills of each kind in the restart part.
    pub kills: usize,
    /// The parts.
    pub parts: Vec<Part>,
    /// qemu-storage-daemon.
    pub qsd: PathBuf,
    /// How the host frontend waits for completions.
    pub frontend: FrontendWait,
    /// bulkhead's device notification (`adaptive`, `irq`, `poll`).
    pub notify: String,
}

/// How the host-side frontend waits for its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FrontendWait {
    /// As a guest's driver: it sleeps until the device calls (its vCPU halts).
    Call,
    /// It spins on the used ring and never asks for a call.
    Poll,
}

impl FrontendWait {
    /// Parses `call` or `poll`.
    pub fn parse(s: &str) -> Result<FrontendWait, String> {
        match s {
            "call" => Ok(FrontendWait::Call),
            "poll" => Ok(FrontendWait::Poll),
            o => Err(format!("unknown frontend wait `{o}` (call, poll)")),
        }
    }
}

impl Options {
    /// Checks the options.
    pub fn check(&self) -> Result<(), BenchError> {
        if self.rounds == 0 || self.kills == 0 || self.parts.is_empty() || self.seconds <= 0.0 || self.guest_seconds == 0 {
            return Err(BenchError::Options("rounds, kills, seconds and parts must be at least 1".into()));
        }
        Ok(())
    }
}

/// The two systems.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum System {
    /// `bulkhead serve`.
    Bulkhead,
    /// qemu-storage-daemon.
    Qsd,
}

/// The backings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Backing {
    /// A file on tmpfs.
    Tmpfs,
    /// Memory.
    Ram,
}

/// A workload point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Workload {
    /// Its name.
    pub name: &'static str,
    /// `randread`, `randwrite`, `read` or `write`.
    pub mode: &'static str,
    /// Bytes per request.
    pub bs: u32,
    /// Requests in flight.
    pub qd: u16,
}

/// The points measured.
pub const WORKLOADS: [Workload; 6] = [
    Workload { name: "4k randread qd1", mode: "randread", bs: 4096, qd: 1 },
    Workload { name: "4k randread qd16", mode: "randread", bs: 4096, qd: 16 },
    Workload { name: "4k randwrite qd1", mode: "randwrite", bs: 4096, qd: 1 },
    Workload { name: "4k randwrite qd16", mode: "randwrite", bs: 4096, qd: 16 },
    Workload { name: "1m read qd4", mode: "read", bs: 1 << 20, qd: 4 },
    Workload { name: "1m write qd4", mode: "write", bs: 1 << 20, qd: 4 },
];

/// One system at one point, over the rounds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// Requests per second, each round.
    pub iops: Vec<f64>,
    /// MiB/s, each round.
    pub mib_s: Vec<f64>,
    /// CPU seconds per GiB, each round.
    pub cpu_per_gib: Vec<f64>,
    /// CPU seconds per 100,000 requests, each round, by process: `server` is `serve` and its
    /// domain together (or qsd), `load` the guest's QEMU or the bench's host frontend.
    pub cpu_per_100k: CpuPer100k,
    /// Sleeps per request of `serve` (or qsd), each round: its threads' voluntary context
    /// switches.
    pub serve_sleeps_per_request: Vec<f64>,
    /// The same of the domain (bulkhead only).
    pub domain_sleeps_per_request: Vec<f64>,
}

/// Both systems at one point.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// The backing.
    pub backing: Backing,
    /// The point.
    pub workload: Workload,
    /// bulkhead.
    pub bulkhead: Figures,
    /// qemu-storage-daemon.
    pub qsd: Figures,
}

/// Guest-visible pauses of one kind of kill, ms.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Pauses {
    /// Kills made.
    pub kills: usize,
    /// Median pause.
    pub p50_ms: f64,
    /// 99th percentile pause.
    pub p99_ms: f64,
    /// Median request time outside pauses.
    pub median_request_ms: f64,
    /// Error lines in the guest (I/O errors, "not a head", checker failures).
    pub guest_errors: usize,
    /// The first of them.
    pub first_error: Option<String>,
    /// The guest stopped making progress and was killed.
    pub hung: bool,
}

/// Results.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Rounds.
    pub rounds: usize,
    /// How the host frontend waited.
    pub frontend: Option<FrontendWait>,
    /// bulkhead's device notification.
    pub notify: String,
    /// The host frontend's points.
    pub host: Vec<Comparison>,
    /// The guests' points.
    pub guest: Vec<Comparison>,
    /// A driver domain killed under a guest.
    pub driver_kill: Option<Pauses>,
    /// `serve` killed and started again under a guest.
    pub serve_kill: Option<Pauses>,
    /// qemu-storage-daemon killed and started again under a guest.
    pub qsd_kill: Option<Pauses>,
    /// A guest moved between two `serve`s, the disk handed over.
    pub migrate: Option<Moves>,
    /// The same between two qemu-storage-daemons.
    pub qsd_migrate: Option<Moves>,
    /// Runs that failed or stopped early, and why; their figures are left out.
    pub failures: Vec<String>,
}

/// Live migrations of a guest under load: QEMU's downtime of each, and the longest pauses
/// the guest's timed writer saw, ms.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Moves {
    /// Migrations completed.
    pub migrations: usize,
    /// QEMU's reported downtime, median and longest.
    pub downtime_p50_ms: f64,
    /// The longest downtime.
    pub downtime_max_ms: f64,
    /// Each migration's downtime.
    pub downtimes_ms: Vec<f64>,
    /// From the migration seen completed to the destination resumed (the hand-over, and
    /// the resume), each migration; the guest's clock stands still meanwhile, as in the
    /// downtime, so its own timings do not show it.
    pub handover_ms: Vec<f64>,
    /// The guest's outage in wall-clock time, each migration: the downtime and the hand-over.
    pub outage_p50_ms: f64,
    /// The longest outage.
    pub outage_max_ms: f64,
    /// The guest's longest requests, one per migration: median, longest.
    pub pauses: Pauses,
    /// The longest pause.
    pub pause_max_ms: f64,
}

/// A server under test.
struct Server {
    system: System,
    backing: Backing,
    /// The image it serves, when another server's (a migration's destination).
    image: Option<PathBuf>,
    /// It starts with its device inactive (bulkhead; a migration's destination).
    inactive: bool,
    child: Option<Child>,
    dir: PathBuf,
    socket: PathBuf,
    exe: PathBuf,
    qsd: PathBuf,
    notify: String,
}

impl Server {
    fn start(system: System, backing: Backing, exe: &Path, opts: &Options, tag: &str) -> Result<Server, BenchError> {
        Server::start_on(system, backing, exe, opts, tag, None)
    }

    /// As [`start`](Self::start); with `image`, on that file, its device inactive: the
    /// destination of a migration from the server that made it.
    fn start_on(
        system: System,
        backing: Backing,
        exe: &Path,
        opts: &Options,
        tag: &str,
        image: Option<PathBuf>,
    ) -> Result<Server, BenchError> {
        let dir = PathBuf::from("/dev/shm").join(format!("bulkhead-bench-vm-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
        if (backing == Backing::Tmpfs || system == System::Qsd) && image.is_none() {
            let img = dir.join("disk.img");
            let f = std::fs::File::create(&img).map_err(|e| BenchError::io(&img, e))?;
            f.set_len(DEVICE_BYTES).map_err(|e| BenchError::io(&img, e))?;
        }
        let socket = match system {
            System::Bulkhead => dir.join("run/vhost/vm.sock"),
            System::Qsd => dir.join("qsd.sock"),
        };
        let mut s = Server {
            system,
            backing,
            inactive: image.is_some(),
            image,
            child: None,
            dir,
            socket,
            exe: exe.to_path_buf(),
            qsd: opts.qsd.clone(),
            notify: opts.notify.clone(),
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> Result<(), BenchError> {
        let _ = std::fs::remove_file(&self.socket);
        let log = self.dir.join("server.log");
        let err = std::fs::OpenOptions::new().create(true).append(true).open(&log).map_err(|e| BenchError::io(&log, e))?;
        let img = self.image.clone().unwrap_or_else(|| self.dir.join("disk.img"));
        let mut cmd = match self.system {
            System::Bulkhead => {
                let backend = match self.backing {
                    Backing::Tmpfs => format!("type = \"file\"\npath = \"{}\"\n", img.display()),
                    Backing::Ram => "type = \"ram\"\n".to_string(),
                };
                let cfg = format!(
                    "[fuse]\nenabled = false\n[nbd]\nenabled = false\n[vhost_user]\nenabled = true\n\
                     [[device]]\nname = \"vm\"\nsize = \"{}\"\nnotify = \"{}\"\nrestart_limit = 100000\nactive = {}\n\
                     [device.backend]\n{backend}",
                    DEVICE_BYTES, self.notify, !self.inactive
                );
                let path = self.dir.join("vm.toml");
                std::fs::write(&path, cfg).map_err(|e| BenchError::io(&path, e))?;
                let _ = std::fs::remove_file(self.dir.join("run/control.sock"));
                let mut c = Command::new(&self.exe);
                c.arg("serve").arg("--config").arg(&path).arg("--run-dir").arg(self.dir.join("run"));
                c
            }
            System::Qsd => {
                let blockdev = match self.backing {
                    // Two daemons open a migration's file: neither locks it, as on shared storage
                    // where qemu-storage-daemon 7.2 has no hand-over (`blockdev-set-active` is
                    // 10.0's).
                    Backing::Tmpfs => {
                        format!("driver=file,node-name=disk,filename={},cache.direct=off,locking=off", img.display())
                    }
                    // qemu-storage-daemon keeps no data in memory of its own (`null-co` stores
                    // nothing): its nearest is a file on tmpfs, as for `Tmpfs`.
                    Backing::Ram => format!("driver=file,node-name=disk,filename={},cache.direct=off", img.display()),
                };
                let mut c = Command::new(&self.qsd);
                c.arg("--blockdev").arg(blockdev).arg("--export").arg(format!(
                    "type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path={},writable=on,num-queues=1",
                    self.socket.display()
                ));
                c
            }
        };
        let child =
            cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err).spawn().map_err(|e| BenchError::io(&self.exe, e))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.socket.exists() || (self.system == System::Bulkhead && !self.dir.join("run/control.sock").exists()) {
            if Instant::now() > deadline {
                return Err(BenchError::Run(format!("{:?} did not start: {}", self.system, self.log_tail())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        text.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn status(&self) -> Option<bulkhead_control::StatusReport> {
        crate::serve_status(&self.dir.join("run/control.sock"))
    }

    /// The processes whose CPU counts: the server, and for bulkhead its domains.
    fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.child.iter().map(Child::id).collect();
        if self.system == System::Bulkhead {
            pids.extend(self.status().map(|r| crate::domain_pids(&r)).unwrap_or_default());
        }
        pids
    }

    /// CPU seconds so far of the server (`pids[0]`) and of its domains (the rest), with the
    /// load generator's.
    fn cpu(&self, pids: &[u32], load: u32) -> Cpu {
        Cpu {
            serve: pids.first().map_or(0.0, |&p| cpu_seconds(p)),
            domain: pids.iter().skip(1).map(|&p| cpu_seconds(p)).sum(),
            load: cpu_seconds(load),
            serve_sleeps: pids.first().map_or(0.0, |&p| sleeps(p)),
            domain_sleeps: pids.iter().skip(1).map(|&p| sleeps(p)).sum(),
        }
    }

    /// SIGKILL, then the same server again.
    fn kill_and_restart(&mut self) -> Result<(), BenchError> {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.spawn()
    }

    fn driver_pid(&self) -> u32 {
        self.status().and_then(|r| r.devices.first().map(|d| d.driver_pid)).unwrap_or(0)
    }

    /// Waits until the driver domain is no longer `old` and the device serves.
    fn wait_replaced(&self, old: u32) -> Result<(), BenchError> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let d = self.status().and_then(|r| r.devices.into_iter().next());
            if d.is_some_and(|d| d.driver_pid != old && d.state == bulkhead_control::DeviceState::Running) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(BenchError::Run(format!("driver domain {old} was not replaced: {}", self.log_tail())));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            crate::stop_child(&mut c, Duration::from_secs(20));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A connection to `socket`, retried while the server still holds the last one.
fn connect(socket: &Path, slot_bytes: u64) -> Result<Frontend, BenchError> {
    let opts = FrontendOptions { queues: 1, queue_size: 128, slot_bytes, event_idx: true, inflight: false };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match Frontend::connect(socket, &opts) {
            Ok(f) => return Ok(f),
            Err(e) if Instant::now() > deadline => return Err(BenchError::Run(format!("connect {}: {e}", socket.display()))),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Drives `w` for `seconds` from the host frontend; returns (requests, seconds).
fn drive(fe: &mut Frontend, w: &Workload, seconds: f64, wait: FrontendWait) -> Result<(u64, f64), BenchError> {
    let (q, mem) = fe.queue(0);
    let sectors_per = u64::from(w.bs) / 512;
    let slots = DEVICE_BYTES / u64::from(w.bs);
    let mut rng = bulkhead_rng::Rng::new(0);
    let mut seq = 0u64;
    let mut next = || {
        if w.mode.starts_with("rand") {
            let x = rng.next_u64();
            (x % slots) * sectors_per
        } else {
            seq += 1;
            (seq % slots) * sectors_per
        }
    };
    let write = w.mode.ends_with("write");
    let mut submit = |q: &mut bulkhead_vhost_export::frontend::Queue| -> Result<(), BenchError> {
        let sector = next();
        let r = if write { q.write(mem, sector, w.bs, 0x6b) } else { q.read(mem, sector, w.bs) };
        r.map_err(|e| BenchError::Run(e.to_string()))?.ok_or_else(|| BenchError::Run("no free head".into()))?;
        Ok(())
    };
    for _ in 0..w.qd {
        submit(q)?;
    }
    q.publish(mem).map_err(|e| BenchError::Run(e.to_string()))?;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(seconds);
    let mut done = 0u64;
    let mut failed = None;
    let mut outstanding = u64::from(w.qd);
    while outstanding > 0 {
        let mut n = 0;
        q.reap(mem, |d| {
            n += 1;
            if d.status != 0 {
                failed = Some(d.status);
            }
        })
        .map_err(|e| BenchError::Run(e.to_string()))?;
        if let Some(s) = failed {
            return Err(BenchError::Run(format!("{}: a request failed with status {s}", w.name)));
        }
        done += n;
        outstanding -= n;
        if n > 0 && Instant::now() < deadline {
            for _ in 0..n {
                submit(q)?;
            }
            outstanding += n;
            q.publish(mem).map_err(|e| BenchError::Run(e.to_string()))?;
        } else if n == 0 {
            match wait {
                FrontendWait::Call => q.wait_used(mem, 100).map_err(|e| BenchError::Run(e.to_string()))?,
                FrontendWait::Poll => std::hint::spin_loop(),
            }
        }
    }
    Ok((done, t0.elapsed().as_secs_f64()))
}

/// CPU seconds by process: `serve` (or qsd), the domains, the load generator.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    serve: f64,
    domain: f64,
    load: f64,
    /// Sleeps (voluntary context switches, every thread) of `serve` or qsd.
    serve_sleeps: f64,
    /// Sleeps of the domains.
    domain_sleeps: f64,
}

impl std::ops::Sub for Cpu {
    type Output = Cpu;
    fn sub(self, o: Cpu) -> Cpu {
        Cpu {
            serve: self.serve - o.serve,
            domain: self.domain - o.domain,
            load: self.load - o.load,
            serve_sleeps: self.serve_sleeps - o.serve_sleeps,
            domain_sleeps: self.domain_sleeps - o.domain_sleeps,
        }
    }
}

/// Voluntary context switches of every thread of `pid`: how often it slept.
fn sleeps(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0.0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .filter_map(|st| {
            st.lines().find_map(|l| l.strip_prefix("voluntary_ctxt_switches:")).and_then(|v| v.trim().parse::<f64>().ok())
        })
        .sum()
}

fn record(f: &mut Figures, system: System, w: &Workload, requests: u64, secs: f64, cpu: Cpu) {
    let bytes = requests as f64 * f64::from(w.bs);
    let server = cpu.serve + cpu.domain;
    f.iops.push(requests as f64 / secs);
    f.mib_s.push(bytes / secs / 1048576.0);
    f.cpu_per_gib.push(server / (bytes / (1u64 << 30) as f64));
    let per = |c: f64| c / (requests as f64 / 100_000.0);
    let c = &mut f.cpu_per_100k;
    c.server.push(per(server));
    c.load.push(per(cpu.load));
    f.serve_sleeps_per_request.push(cpu.serve_sleeps / requests.max(1) as f64);
    if system == System::Bulkhead {
        c.serve.push(per(cpu.serve));
        c.domain.push(per(cpu.domain));
        f.domain_sleeps_per_request.push(cpu.domain_sleeps / requests.max(1) as f64);
    }
}

fn blank(backing: Backing) -> Vec<Comparison> {
    WORKLOADS
        .iter()
        .map(|w| Comparison { backing, workload: *w, bulkhead: Figures::default(), qsd: Figures::default() })
        .collect()
}

fn figures(c: &mut Comparison, s: System) -> &mut Figures {
    match s {
        System::Bulkhead => &mut c.bulkhead,
        System::Qsd => &mut c.qsd,
    }
}

/// The order of the systems in round `r`.
fn order(r: usize) -> [System; 2] {
    if r.is_multiple_of(2) {
        [System::Bulkhead, System::Qsd]
    } else {
        [System::Qsd, System::Bulkhead]
    }
}

/// One workload a server finished: how many requests in how long, and the CPU of the server,
/// its domains and the load generator meanwhile.
struct Point {
    workload: usize,
    requests: u64,
    seconds: f64,
    cpu: Cpu,
}

/// One server's points from the host frontend.
fn host_round(exe: &Path, opts: &Options, system: System, backing: Backing) -> Result<Vec<Point>, BenchError> {
    let server = Server::start(system, backing, exe, opts, "host")?;
    // Write the device whole first, so that reads find data.
    let mut fe = connect(&server.socket, 1 << 20)?;
    let fill = Workload { name: "fill", mode: "write", bs: 1 << 20, qd: 4 };
    drive(&mut fe, &fill, 0.5 + DEVICE_BYTES as f64 / (400.0 * 1048576.0), opts.frontend)?;
    drop(fe);
    let mut out = Vec::new();
    for (i, w) in WORKLOADS.iter().enumerate() {
        let mut fe = connect(&server.socket, u64::from(w.bs))?;
        let pids = server.pids();
        // The frontend is this process: it does nothing else meanwhile.
        let c0 = server.cpu(&pids, std::process::id());
        let (n, secs) = drive(&mut fe, w, opts.seconds, opts.frontend)?;
        out.push(Point { workload: i, requests: n, seconds: secs, cpu: server.cpu(&pids, std::process::id()) - c0 });
    }
    Ok(out)
}

fn host(exe: &Path, opts: &Options, failures: &mut Vec<String>, progress: &mut impl FnMut(&str)) -> Vec<Comparison> {
    let mut out = Vec::new();
    for backing in [Backing::Tmpfs, Backing::Ram] {
        let mut cmp = blank(backing);
        for r in 0..opts.rounds {
            for system in order(r) {
                progress(&format!("host, {backing:?}, round {}/{}: {system:?}", r + 1, opts.rounds));
                match host_round(exe, opts, system, backing) {
                    Ok(points) => {
                        for p in points {
                            let w = p.workload;
                            record(figures(&mut cmp[w], system), system, &WORKLOADS[w], p.requests, p.seconds, p.cpu);
                        }
                    }
                    Err(e) => failures.push(format!("host, {backing:?}, round {}, {system:?}: {e}", r + 1)),
                }
            }
        }
        out.extend(cmp);
    }
    out
}

fn guest_script(seconds: u64) -> String {
    let mut s = String::from("dd if=/dev/zero of=/dev/vda bs=1M oflag=direct 2>/dev/null || true\n");
    for w in WORKLOADS {
        s.push_str(&format!("echo 'POINT {}'\nguest-io bench /dev/vda {} {} {} {seconds}\n", w.name, w.mode, w.bs, w.qd));
    }
    s.push_str("echo 'POINT end'\n");
    s
}

/// One server's points in a guest, and why the guest stopped early if it did.
fn guest_round(
    exe: &Path,
    kit: &Kit,
    opts: &Options,
    system: System,
    backing: Backing,
    scratch: &Path,
) -> Result<(Vec<Point>, Option<String>), BenchError> {
    let server = Server::start(system, backing, exe, opts, "guest")?;
    let vm_opts = VmOptions {
        disks: vec![Disk { socket: server.socket.clone(), queues: 1 }],
        script: guest_script(opts.guest_seconds),
        memory_mib: 512,
        cpus: 1,
        scratch: scratch.to_path_buf(),
    };
    let vm = Vm::boot(kit, &vm_opts).map_err(|e| BenchError::Run(e.to_string()))?;
    // CPU at each point's start, from the console's markers.
    let pids = server.pids();
    let mut marks: Vec<(String, Cpu)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120 + 2 * opts.guest_seconds * WORKLOADS.len() as u64);
    let mut stopped = None;
    loop {
        let lines = vm.lines();
        let points: Vec<&String> = lines.iter().filter(|l| l.starts_with("POINT ")).collect();
        while marks.len() < points.len() {
            marks.push((points[marks.len()].clone(), server.cpu(&pids, vm.pid())));
        }
        if marks.last().is_some_and(|m| m.0 == "POINT end") || lines.iter().any(|l| l.starts_with("GUEST EXIT")) {
            break;
        }
        if Instant::now() > deadline {
            let at = marks.last().map_or("boot", |m| m.0.trim_start_matches("POINT "));
            stopped = Some(format!("the guest made no progress at `{at}`: {}", server.log_tail().replace('\n', " | ")));
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let result = vm.finish(Duration::from_secs(if stopped.is_some() { 1 } else { 60 }));
    if stopped.is_none() {
        if let Err(e) = result.check() {
            stopped = Some(e.0.lines().next().unwrap_or("the guest failed").to_string());
        }
    }
    let mut out = Vec::new();
    for (i, w) in WORKLOADS.iter().enumerate() {
        let prefix = format!("GUESTIO bench {} bs={} qd={} ", w.mode, w.bs, w.qd);
        let Some(line) = result.with_prefix(&prefix).next() else { continue };
        let field = |k: &str| -> f64 {
            line.split_whitespace().find_map(|f| f.strip_prefix(k)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        };
        let cpu = match (marks.get(i), marks.get(i + 1)) {
            (Some(a), Some(b)) => b.1 - a.1,
            _ => Cpu::default(),
        };
        out.push(Point { workload: i, requests: field("requests=") as u64, seconds: field("seconds="), cpu });
    }
    Ok((out, stopped))
}

fn guest(exe: &Path, kit: &Kit, opts: &Options, failures: &mut Vec<String>, progress: &mut impl FnMut(&str)) -> Vec<Comparison> {
    let mut out = Vec::new();
    let scratch = std::env::temp_dir().join(format!("bulkhead-bench-vm-initrd-{}", std::process::id()));
    for backing in [Backing::Tmpfs, Backing::Ram] {
        let mut cmp = blank(backing);
        for r in 0..opts.rounds {
            for system in order(r) {
                progress(&format!("guest, {backing:?}, round {}/{}: {system:?}", r + 1, opts.rounds));
                match guest_round(exe, kit, opts, system, backing, &scratch) {
                    Ok((points, stopped)) => {
                        for p in points {
                            let w = p.workload;
                            record(figures(&mut cmp[w], system), system, &WORKLOADS[w], p.requests, p.seconds, p.cpu);
                        }
                        if let Some(why) = stopped {
                            failures.push(format!("guest, {backing:?}, round {}, {system:?}: {why}", r + 1));
                        }
                    }
                    Err(e) => failures.push(format!("guest, {backing:?}, round {}, {system:?}: {e}", r + 1)),
                }
            }
        }
        out.extend(cmp);
    }
    let _ = std::fs::remove_file(&scratch);
    out
}

/// Pauses from a guest's `GUESTIO pauses` line: the `kills` longest requests.
fn pauses_of(out: &Outcome, kills: usize, hung: bool) -> Pauses {
    let errors = out.errors();
    let mut p = Pauses {
        kills,
        hung,
        guest_errors: errors.len(),
        first_error: errors.first().map(|e| e.to_string()),
        ..Default::default()
    };
    if let Some(line) = out.lines.iter().find(|l| l.starts_with("GUESTIO pauses")) {
        let field = |k: &str| line.split_whitespace().find_map(|f| f.strip_prefix(k)).unwrap_or("");
        p.median_request_ms = field("median_ms=").parse().unwrap_or(0.0);
        let mut longest: Vec<f64> = field("longest_ms=").split(',').filter_map(|v| v.parse().ok()).take(kills).collect();
        longest.sort_by(f64::total_cmp);
        p.p50_ms = median(&longest);
        p.p99_ms = longest.get(((longest.len() as f64 * 0.99).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0);
    }
    p
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kill {
    Driver,
    Server,
}

fn restart(
    exe: &Path,
    kit: &Kit,
    opts: &Options,
    system: System,
    kill: Kill,
    progress: &mut impl FnMut(&str),
) -> Result<Pauses, BenchError> {
    let mut server = Server::start(system, Backing::Tmpfs, exe, opts, "restart")?;
    let seconds = 10 + opts.kills as u64 * 3;
    // Twelve threads of verified load, and one writer timing each request.
    let script = format!(
        "guest-io stress /dev/vda {seconds} 12 > /tmp/stress 2>&1 &\ns=$!\n\
         guest-io pauses /dev/vda {seconds} {}\nwait $s || true\ncat /tmp/stress\n",
        opts.kills.max(64)
    );
    let scratch = std::env::temp_dir().join(format!("bulkhead-bench-vm-restart-{}", std::process::id()));
    let vm_opts =
        VmOptions { disks: vec![Disk { socket: server.socket.clone(), queues: 1 }], script, memory_mib: 512, cpus: 1, scratch };
    let vm = Vm::boot(kit, &vm_opts).map_err(|e| BenchError::Run(e.to_string()))?;
    if vm.wait_for("GUESTIO started pauses", Duration::from_secs(90)).is_none() {
        return Err(BenchError::Run(format!("the guest did not start: {}", vm.lines().join("\n"))));
    }
    std::thread::sleep(Duration::from_secs(2));
    let mut hung = false;
    for i in 0..opts.kills {
        progress(&format!("restart: {system:?}, kill {}/{}", i + 1, opts.kills));
        match kill {
            Kill::Driver => {
                let old = server.driver_pid();
                bulkhead_sys::signal(old, libc::SIGKILL).map_err(|e| BenchError::Run(format!("kill {old}: {e}")))?;
                server.wait_replaced(old)?;
            }
            Kill::Server => server.kill_and_restart()?,
        }
        // Let the guest come back and run a while before the next kill.
        let seen = vm.lines().len();
        std::thread::sleep(Duration::from_millis(1500));
        if vm.lines().iter().skip(seen).any(|l| l.contains("GUESTIO FAIL")) {
            break;
        }
    }
    let ended = vm.wait_for("GUEST EXIT", Duration::from_secs(seconds + 60));
    if ended.is_none() {
        hung = true;
    }
    let out = vm.finish(Duration::from_secs(5));
    Ok(pauses_of(&out, opts.kills, hung))
}

/// Moves a guest `opts.kills` times between two servers of `system` on one file, as libvirt
/// does it: the destination QEMU waits paused; once the source's migration completes, the
/// disk is handed over (bulkhead: `deactivate` at the source, `activate` at the
/// destination; qemu-storage-daemon 7.2 has no hand-over, and its unlocked file needs none on
/// one host), and the destination resumes. The guest runs a verified load and a timed writer
/// whose longest requests are the pauses the moves cause.
fn migrate(exe: &Path, kit: &Kit, opts: &Options, system: System, progress: &mut impl FnMut(&str)) -> Result<Moves, BenchError> {
    let a = Server::start(system, Backing::Tmpfs, exe, opts, "mig-a")?;
    let image = a.image.clone().unwrap_or_else(|| a.dir.join("disk.img"));
    let b = Server::start_on(system, Backing::Tmpfs, exe, opts, "mig-b", Some(image))?;
    let servers = [&a, &b];
    let seconds = 15 + opts.kills as u64 * 6;
    let script = format!(
        "guest-io stress /dev/vda {seconds} 12 > /tmp/stress 2>&1 &\ns=$!\n\
         guest-io pauses /dev/vda {seconds} {}\nwait $s || true\ncat /tmp/stress\n",
        opts.kills
    );
    let scratch = std::env::temp_dir().join(format!("bulkhead-bench-vm-migrate-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&scratch);
    let vm_opts = |on: &Server, n: usize| VmOptions {
        disks: vec![Disk { socket: on.socket.clone(), queues: 1 }],
        script: script.clone(),
        memory_mib: 256,
        cpus: 1,
        scratch: scratch.join(format!("initrd-{n}")),
    };
    let run = |e: bulkhead_guest::GuestError| BenchError::Run(e.to_string());
    let qmp_path = |n: usize| scratch.join(format!("qmp-{n}.sock"));
    let mut vm = Vm::boot_with(kit, &vm_opts(&a, 0), &bulkhead_guest::qmp_args(&qmp_path(0))).map_err(run)?;
    let mut qmp = bulkhead_guest::Qmp::connect(&qmp_path(0), Duration::from_secs(10)).map_err(run)?;
    if vm.wait_for("GUESTIO started pauses", Duration::from_secs(90)).is_none() {
        return Err(BenchError::Run(format!("the guest did not start: {}", vm.lines().join("\n"))));
    }
    std::thread::sleep(Duration::from_secs(2));
    let mut lines = Vec::new();
    let (mut downtimes, mut handovers) = (Vec::new(), Vec::new());
    for i in 0..opts.kills {
        progress(&format!("migrate: {system:?}, move {}/{}", i + 1, opts.kills));
        let (src, dst) = (servers[i % 2], servers[(i + 1) % 2]);
        let port = 46_000 + (std::process::id() % 500) as u16 * 2 + (i % 2) as u16;
        let mut more = bulkhead_guest::qmp_args(&qmp_path(i + 1));
        more.extend(["-incoming".into(), format!("tcp:127.0.0.1:{port}"), "-S".into()]);
        let next = Vm::boot_with(kit, &vm_opts(dst, i + 1), &more).map_err(run)?;
        let mut next_qmp = bulkhead_guest::Qmp::connect(&qmp_path(i + 1), Duration::from_secs(10)).map_err(run)?;
        qmp.execute("migrate", &format!(r#"{{"uri":"tcp:127.0.0.1:{port}"}}"#)).map_err(run)?;
        let (status, downtime) = qmp.migration_ended(Duration::from_secs(120)).map_err(run)?;
        let completed = Instant::now();
        if status != "completed" {
            return Err(BenchError::Run(format!("migration {} {status}", i + 1)));
        }
        if system == System::Bulkhead {
            let call = |dir: &Path, active: bool, expect| -> Result<bulkhead_control::Activity, BenchError> {
                let mut c = bulkhead_control::Client::connect(&dir.join("run")).map_err(|e| BenchError::Run(e.to_string()))?;
                let device = "vm".to_string();
                let r = if active {
                    c.call(bulkhead_control::Activate { device, expect })
                } else {
                    c.call(bulkhead_control::Deactivate { device })
                };
                r.map_err(|e| BenchError::Run(format!("{}: {e}", if active { "activate" } else { "deactivate" })))
            };
            let was = call(&src.dir, false, None)?;
            call(&dst.dir, true, Some(was.geometry))?;
        }
        next_qmp.execute("cont", "{}").map_err(run)?;
        handovers.push(completed.elapsed().as_secs_f64() * 1e3);
        downtimes.push(downtime);
        lines.extend(vm.lines());
        (vm, qmp) = (next, next_qmp);
        std::thread::sleep(Duration::from_millis(1500));
        if vm.lines().iter().any(|l| l.contains("GUESTIO FAIL")) {
            break;
        }
    }
    let hung = vm.wait_for("GUEST EXIT", Duration::from_secs(seconds + 60)).is_none();
    let out = vm.finish(Duration::from_secs(5));
    lines.extend(out.lines);
    let _ = std::fs::remove_dir_all(&scratch);
    let all = Outcome { lines, status: out.status };
    let pauses = pauses_of(&all, downtimes.len(), hung);
    let mut sorted = downtimes.clone();
    sorted.sort_by(f64::total_cmp);
    let longest = all.lines.iter().find_map(|l| {
        let f = l.strip_prefix("GUESTIO pauses")?.split_whitespace().find_map(|f| f.strip_prefix("longest_ms="))?;
        f.split(',').next()?.parse::<f64>().ok()
    });
    let mut outages: Vec<f64> = downtimes.iter().zip(&handovers).map(|(d, h)| d + h).collect();
    outages.sort_by(f64::total_cmp);
    Ok(Moves {
        migrations: downtimes.len(),
        outage_p50_ms: median(&outages),
        outage_max_ms: outages.last().copied().unwrap_or(0.0),
        handover_ms: handovers,
        downtime_p50_ms: median(&sorted),
        downtime_max_ms: sorted.last().copied().unwrap_or(0.0),
        downtimes_ms: downtimes,
        pause_max_ms: longest.unwrap_or(0.0),
        pauses,
    })
}

/// Runs the parts of `opts` with `exe` (a `bulkhead` that takes `serve`).
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    opts.check()?;
    let mut report =
        Report { rounds: opts.rounds, frontend: Some(opts.frontend), notify: opts.notify.clone(), ..Default::default() };
    let needs_kit = opts.parts.iter().any(|p| *p != Part::Host);
    let kit = if needs_kit {
        progress("building the guest kit");
        Some(Kit::ensure().map_err(|e| BenchError::Run(e.to_string()))?)
    } else {
        None
    };
    for part in &opts.parts {
        match part {
            Part::Host => report.host = host(exe, opts, &mut report.failures, &mut progress),
            Part::Guest => {
                report.guest = guest(exe, kit.as_ref().expect("built above"), opts, &mut report.failures, &mut progress)
            }
            Part::Restart => {
                let kit = kit.as_ref().expect("built above");
                let mut one = |system, kill, what: &str| match restart(exe, kit, opts, system, kill, &mut progress) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        report.failures.push(format!("restart, {what}: {e}"));
                        None
                    }
                };
                report.driver_kill = one(System::Bulkhead, Kill::Driver, "driver domain kills");
                report.serve_kill = one(System::Bulkhead, Kill::Server, "serve kills");
                report.qsd_kill = one(System::Qsd, Kill::Server, "qsd kills");
            }
            Part::Migrate => {
                let kit = kit.as_ref().expect("built above");
                let mut one = |system, what: &str| match migrate(exe, kit, opts, system, &mut progress) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        report.failures.push(format!("migrate, {what}: {e}"));
                        None
                    }
                };
                report.migrate = one(System::Bulkhead, "bulkhead");
                report.qsd_migrate = one(System::Qsd, "qsd");
            }
        }
    }
    Ok(report)
}

fn table(title: &str, rows: &[Comparison]) -> String {
    let mut t = Table::new(&[
        "backing",
        "point",
        "bulkhead IOPS",
        "qsd IOPS",
        "ratio",
        "bulkhead MiB/s",
        "qsd MiB/s",
        "CPU s/GiB b|q",
        "CPU s/100k b|q",
        "b serve|domain",
        "QEMU or frontend b|q",
        "sleeps/req b serve|domain|q",
        "bulkhead rounds",
        "qsd rounds",
    ]);
    for c in rows {
        let (b, q) = (&c.bulkhead, &c.qsd);
        let rounds = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(" ");
        t.row(vec![
            format!("{:?}", c.backing).to_lowercase(),
            c.workload.name.to_string(),
            format!("{:.0}", median(&b.iops)),
            format!("{:.0}", median(&q.iops)),
            format!("{:.2}", median(&b.iops) / median(&q.iops).max(1e-9)),
            format!("{:.1}", median(&b.mib_s)),
            format!("{:.1}", median(&q.mib_s)),
            format!("{:.2}|{:.2}", median(&b.cpu_per_gib), median(&q.cpu_per_gib)),
            format!("{:.2}|{:.2}", median(&b.cpu_per_100k.server), median(&q.cpu_per_100k.server)),
            format!("{:.2}|{:.2}", median(&b.cpu_per_100k.serve), median(&b.cpu_per_100k.domain)),
            format!("{:.2}|{:.2}", median(&b.cpu_per_100k.load), median(&q.cpu_per_100k.load)),
            format!(
                "{:.2}|{:.2}|{:.2}",
                median(&b.serve_sleeps_per_request),
                median(&b.domain_sleeps_per_request),
                median(&q.serve_sleeps_per_request)
            ),
            rounds(&b.iops),
            rounds(&q.iops),
        ]);
    }
    format!("{title}\n{}", t.render())
}

/// Renders a report.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    if !r.host.is_empty() {
        out.push_str(&table(
            &format!(
                "host frontend ({}; medians of {} alternated rounds; ratio = bulkhead / qsd IOPS)",
                match r.frontend {
                    Some(FrontendWait::Poll) => "polling the used ring",
                    _ => "sleeping until called, as a guest's driver",
                },
                r.rounds
            ),
            &r.host,
        ));
        let worst = r
            .host
            .iter()
            .filter(|c| c.workload.bs == 4096)
            .map(|c| median(&c.bulkhead.iops) / median(&c.qsd.iops).max(1e-9))
            .fold(f64::INFINITY, f64::min);
        out.push_str(&format!("goal: >= 1.5x qsd's IOPS at QD1 and QD16: lowest 4 KiB ratio {worst:.2}\n\n"));
    }
    if !r.guest.is_empty() {
        out.push_str(&table(
            &format!("guest (QEMU TCG, guest-io; bulkhead notify = {}; medians of {} alternated rounds)", r.notify, r.rounds),
            &r.guest,
        ));
        let behind = r.guest.iter().filter(|c| median(&c.bulkhead.iops) < median(&c.qsd.iops)).count();
        let costlier =
            r.guest.iter().filter(|c| median(&c.bulkhead.cpu_per_100k.server) > median(&c.qsd.cpu_per_100k.server)).count();
        out.push_str(&format!(
            "goal: bulkhead >= qsd at every point: {behind} of {n} points behind; CPU per request (serve and domain \
             against qsd) <= qsd's at every point: {costlier} of {n} above\n\n",
            n = r.guest.len()
        ));
    }
    let mut t = Table::new(&["kill", "kills", "pause p50 ms", "pause p99 ms", "request median ms", "guest errors", "guest hung"]);
    for (name, p) in
        [("driver domain", &r.driver_kill), ("serve (SIGKILL, restart)", &r.serve_kill), ("qsd (SIGKILL, restart)", &r.qsd_kill)]
    {
        if let Some(p) = p {
            t.row(vec![
                name.to_string(),
                p.kills.to_string(),
                format!("{:.1}", p.p50_ms),
                format!("{:.1}", p.p99_ms),
                format!("{:.2}", p.median_request_ms),
                p.guest_errors.to_string(),
                if p.hung { "yes" } else { "no" }.to_string(),
            ]);
        }
    }
    if r.driver_kill.is_some() {
        out.push_str(
            "restarts under a guest (12 threads of verified load and one timed writer; pauses are its longest requests)\n",
        );
        out.push_str(&t.render());
        for (name, p) in [("driver domain", &r.driver_kill), ("serve", &r.serve_kill), ("qsd", &r.qsd_kill)] {
            if let Some(e) = p.as_ref().and_then(|p| p.first_error.as_ref()) {
                out.push_str(&format!("first guest error under {name} kills: {e}\n"));
            }
        }
    }
    if r.migrate.is_some() || r.qsd_migrate.is_some() {
        let mut t = Table::new(&[
            "system",
            "moves",
            "downtime p50 ms",
            "downtime max ms",
            "outage p50 ms",
            "outage max ms",
            "guest pause p50 ms",
            "guest pause max ms",
            "guest errors",
            "guest hung",
        ]);
        for (name, m) in [("bulkhead (hand-over)", &r.migrate), ("qsd (shared file)", &r.qsd_migrate)] {
            if let Some(m) = m {
                t.row(vec![
                    name.to_string(),
                    m.migrations.to_string(),
                    format!("{:.0}", m.downtime_p50_ms),
                    format!("{:.0}", m.downtime_max_ms),
                    format!("{:.0}", m.outage_p50_ms),
                    format!("{:.0}", m.outage_max_ms),
                    format!("{:.1}", m.pauses.p50_ms),
                    format!("{:.1}", m.pause_max_ms),
                    m.pauses.guest_errors.to_string(),
                    if m.pauses.hung { "yes" } else { "no" }.to_string(),
                ]);
            }
        }
        out.push_str(
            "live migrations under a guest (12 threads of verified load and one timed writer): QEMU's downtime; the \
             outage, wall-clock from the guest stopped to resumed (the downtime and the hand-over); the guest's longest \
             requests, by its own clock, which stands still while it is stopped\n",
        );
        out.push_str(&t.render());
        if let Some(m) = &r.migrate {
            let over = m.downtimes_ms.iter().zip(&m.handover_ms).map(|(_, h)| *h).fold(0.0, f64::max);
            out.push_str(&format!(
                "goal: the guest's pause <= QEMU's downtime + 50 ms, 0 errors: the hand-over added at most {over:.0} ms \
                 to a downtime; the guest's longest request {:.1} ms; {} errors\n",
                m.pause_max_ms, m.pauses.guest_errors
            ));
        }
    }
    for f in &r.failures {
        out.push_str(&format!("failed: {f}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_pauses_come_from_what_the_guest_printed() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let out = Outcome {
            lines: vec!["GUESTIO pauses requests=900 median_ms=0.300 longest_ms=40.0,30.0,20.0,10.0,1.0".into()],
            status: Some(0),
        };
        let p = pauses_of(&out, 4, false);
        assert_eq!((p.p50_ms, p.p99_ms, p.median_request_ms, p.guest_errors), (25.0, 40.0, 0.3, 0));
        assert!(Part::parse("guest").is_ok() && Part::parse("migrate") == Ok(Part::Migrate) && Part::parse("vm").is_err());
        assert!(guest_script(3).contains("guest-io bench /dev/vda randread 4096 16 3"));
    }
}
