//! `bulkhead-bench overload`: many NBD clients at a deep queue against one device, a FUSE user
//! beside them, and two clients that misbehave within the protocol's rules. No client may
//! starve, nothing the protocol allows may be refused, and `serve`'s memory must stay within the
//! export's bound.
//!
//! One `ram` device, exported over NBD (unix socket) and FUSE. `--clients` connections each
//! keep `--depth` requests in flight, 4 KiB reads and writes at random offsets, half each, for
//! `--seconds`; a FUSE user reads 4 KiB with O_DIRECT, one at a time, and records each latency.
//! Beside them, a slowloris negotiates one byte a second, and a client that never reads its
//! answers sends 64 KiB reads until the socket takes no more. `serve`'s private memory
//! (`RssAnon`) is sampled every 100 ms; its growth must stay within the export's bound
//! ([`bulkhead_nbd_export::memory_bound`]).
//!
//! Each client's completions are compared with the fair share (all completions over the
//! number of clients): the goal is at least half of it for every client. A request answered
//! with an error is a refusal (goal 0).

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_nbd::proto::{CMD_READ, CMD_WRITE, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC};
use serde::Serialize;

use crate::{quantile, Aligned, BenchError, BenchServe, Table};

/// Bytes of each request.
const BLOCK: usize = 4096;
/// Bytes of the device.
const DEVICE: u64 = 256 << 20;

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// NBD connections.
    pub clients: usize,
    /// Requests each keeps in flight.
    pub depth: usize,
    /// Seconds of load.
    pub seconds: u64,
}

/// Results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Connections.
    pub clients: usize,
    /// Requests each kept in flight.
    pub depth: usize,
    /// Seconds of load.
    pub seconds: u64,
    /// Requests the NBD clients completed.
    pub completed: u64,
    /// Requests answered with an error (goal 0).
    pub refused: u64,
    /// Connections that ended before the run did (goal 0).
    pub dropped: u64,
    /// The fewest completions of one client over the fair share (goal ≥ 0.5).
    pub min_share: f64,
    /// The most over the fair share.
    pub max_share: f64,
    /// The FUSE user's reads.
    pub fuse_reads: u64,
    /// Their median latency, µs.
    pub fuse_p50_us: f64,
    /// Their 99th percentile latency, µs.
    pub fuse_p99_us: f64,
    /// `serve`'s private memory (`RssAnon`) before the load, MiB. The rest of its resident set
    /// is the channel arenas it shares with its domains, fixed by the configuration.
    pub rss_before_mib: f64,
    /// How much the NBD export's private memory may grow for these connections, MiB
    /// ([`bulkhead_nbd_export::memory_bound`]): goal, peak ≤ before + this.
    pub growth_bound_mib: f64,
    /// Its peak under the load, MiB.
    pub rss_peak_mib: f64,
    /// Seconds the slowloris was kept before the server closed it (the negotiation deadline).
    pub slowloris_closed_after_s: f64,
    /// Requests the client that never reads got in before its socket filled.
    pub unread_requests: u64,
}

/// Threads of one NBD connection (the export's default).
const WORKERS: usize = 4;

/// The benchmark's `serve`.
fn start(exe: &Path, clients: usize) -> Result<Serve, BenchError> {
    let text = format!(
        "[nbd]\nenabled = true\nmax_connections = {}\nworkers = {WORKERS}\nhandshake_timeout_ms = 10000\n\n\
         [[device]]\nname = \"o\"\nsize = \"{}\"\n[device.backend]\ntype = \"ram\"\n",
        clients + 8,
        DEVICE
    );
    let s = BenchServe::start(exe, "overload", &text, &[], &[], |s| {
        s.run_dir().join("fuse/o").exists() && s.run_dir().join("nbd.sock").exists()
    })?;
    Ok(Serve(s))
}

/// The benchmark's `serve`, and what the load asks of it.
struct Serve(BenchServe);

impl Serve {
    fn run(&self) -> PathBuf {
        self.0.run_dir()
    }

    fn log(&self) -> String {
        self.0.log()
    }

    /// Serve's private memory (`RssAnon`): what it allocates. The rest of its resident set is
    /// the channel arenas it shares with its domains, fixed by the configuration.
    fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    }

    /// A connection negotiated for the device.
    fn connect(&self) -> Result<UnixStream, BenchError> {
        let path = self.run().join("nbd.sock");
        let s = UnixStream::connect(&path).map_err(|e| BenchError::io(&path, e))?;
        bulkhead_nbd::client::handshake(s.as_fd(), "o", Duration::from_secs(30))
            .map_err(|e| BenchError::Run(format!("NBD negotiation: {e}")))?;
        Ok(s)
    }
}

/// A request's header.
fn header(kind: u16, handle: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[6..8].copy_from_slice(&kind.to_be_bytes());
    h[8..16].copy_from_slice(&handle.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&len.to_be_bytes());
    h
}

/// What one client counted.
#[derive(Default)]
struct Counts {
    completed: AtomicU64,
    refused: AtomicU64,
    dropped: AtomicBool,
}

/// One client: keeps `depth` requests in flight until `stop`, then waits for its answers.
fn client(sock: UnixStream, depth: u64, seed: u64, stop: Arc<AtomicBool>, counts: Arc<Counts>) {
    let Ok(mut rx) = sock.try_clone() else {
        counts.dropped.store(true, Ordering::Relaxed);
        return;
    };
    let sender = std::thread::current();
    let sent = Arc::new(AtomicU64::new(0));
    let reader = {
        let (counts, sent) = (counts.clone(), sent.clone());
        std::thread::spawn(move || {
            let mut hdr = [0u8; 16];
            let mut data = vec![0u8; BLOCK];
            let mut got = 0u64;
            loop {
                if rx.read_exact(&mut hdr).is_err() {
                    // The end of the run closes the socket after the last answer.
                    if got < sent.load(Ordering::Acquire) {
                        counts.dropped.store(true, Ordering::Relaxed);
                    }
                    break;
                }
                let handle = u64::from_be_bytes(hdr[8..16].try_into().expect("eight bytes"));
                let error = u32::from_be_bytes(hdr[4..8].try_into().expect("four bytes"));
                if u32::from_be_bytes(hdr[..4].try_into().expect("four bytes")) != SIMPLE_REPLY_MAGIC {
                    counts.dropped.store(true, Ordering::Relaxed);
                    break;
                }
                if error != 0 {
                    counts.refused.fetch_add(1, Ordering::Relaxed);
                } else if handle & 1 == 1 && rx.read_exact(&mut data).is_err() {
                    counts.dropped.store(true, Ordering::Relaxed);
                    break;
                }
                counts.completed.fetch_add(1, Ordering::Relaxed);
                got += 1;
                sender.unpark();
            }
        })
    };
    let mut tx = sock;
    let mut rng = bulkhead_rng::Rng::new(seed);
    let mut n = 0u64;
    let payload = vec![0x5au8; BLOCK];
    while !stop.load(Ordering::Relaxed) {
        if n - counts.completed.load(Ordering::Acquire) >= depth {
            std::thread::park_timeout(Duration::from_millis(10));
            continue;
        }
        let x = rng.next_u64();
        let offset = (x % (DEVICE / BLOCK as u64)) * BLOCK as u64;
        let read = n.is_multiple_of(2);
        let handle = n << 1 | u64::from(read);
        let h = header(if read { CMD_READ } else { CMD_WRITE }, handle, offset, BLOCK as u32);
        let ok = tx.write_all(&h).is_ok() && (read || tx.write_all(&payload).is_ok());
        if !ok {
            counts.dropped.store(true, Ordering::Relaxed);
            break;
        }
        n += 1;
        sent.store(n, Ordering::Release);
    }
    // Every answer, then a clean end.
    let deadline = Instant::now() + Duration::from_secs(30);
    while counts.completed.load(Ordering::Acquire) < n && Instant::now() < deadline && !counts.dropped.load(Ordering::Relaxed) {
        std::thread::park_timeout(Duration::from_millis(10));
    }
    let _ = tx.write_all(&header(bulkhead_nbd::proto::CMD_DISC, 0, 0, 0));
    let _ = tx.shutdown(std::net::Shutdown::Both);
    let _ = reader.join();
}

/// Sends a negotiation one byte a second until the server closes; returns after how long.
fn slowloris(path: &Path, stop: Arc<AtomicBool>) -> f64 {
    let t0 = Instant::now();
    let Ok(mut s) = UnixStream::connect(path) else { return 0.0 };
    let _ = s.set_read_timeout(Some(Duration::from_millis(1000)));
    // The server's greeting first, then the client's flags, a byte at a time.
    let mut greeting = [0u8; 18];
    if s.read_exact(&mut greeting).is_err() {
        return t0.elapsed().as_secs_f64();
    }
    let bytes = [0u8, 0, 0, 3, 0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54, 0, 0, 0, 7, 0, 0, 0, 0];
    let mut i = 0;
    let mut probe = [0u8; 1];
    while !stop.load(Ordering::Relaxed) {
        if s.write_all(&bytes[i % bytes.len()..i % bytes.len() + 1]).is_err() {
            break;
        }
        i += 1;
        // The read's timeout paces the bytes; the end of the connection ends the wait.
        match s.read(&mut probe) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    t0.elapsed().as_secs_f64()
}

/// Sends 64 KiB reads and never reads an answer, until its socket takes no more or `stop`.
fn never_reads(s: UnixStream, stop: Arc<AtomicBool>) -> u64 {
    let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
    let mut tx = s;
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        if tx.write_all(&header(CMD_READ, n << 1 | 1, (n % 1024) * 65536, 65536)).is_err() {
            // Full: the server holds its answers; keep the connection, idle.
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        n += 1;
    }
    n
}

/// Runs the load with `exe` (a `bulkhead` that takes `serve`; needs root for FUSE).
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if !(1..=1024).contains(&opts.clients) || !(1..=512).contains(&opts.depth) || !(1..=3600).contains(&opts.seconds) {
        return Err(BenchError::Options(format!(
            "{} clients, depth {}, {} s: clients are 1..=1024, depth 1..=512, seconds 1..=3600",
            opts.clients, opts.depth, opts.seconds
        )));
    }
    let serve = start(exe, opts.clients)?;
    std::thread::sleep(Duration::from_millis(300));
    let rss_before_mib = serve.rss_mib();
    let stop = Arc::new(AtomicBool::new(false));
    let mut counts = Vec::new();
    let mut threads = Vec::new();
    for i in 0..opts.clients {
        let sock = serve.connect()?;
        let c = Arc::new(Counts::default());
        counts.push(c.clone());
        let (stop, depth) = (stop.clone(), opts.depth as u64);
        threads.push(std::thread::spawn(move || client(sock, depth, 0x9e37_79b9 ^ (i as u64 + 1) << 20, stop, c)));
    }
    let slow = {
        let (path, stop) = (serve.run().join("nbd.sock"), stop.clone());
        std::thread::spawn(move || slowloris(&path, stop))
    };
    let unread = {
        let (s, stop) = (serve.connect()?, stop.clone());
        std::thread::spawn(move || never_reads(s, stop))
    };
    let fuse = {
        let path = serve.run().join("fuse/o");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .map_err(|e| BenchError::io(&path, e))?;
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = Aligned::new(BLOCK);
            let mut lat = Vec::new();
            let mut rng = bulkhead_rng::Rng::new(0x1234_5678);
            while !stop.load(Ordering::Relaxed) {
                let x = rng.next_u64();
                let t = Instant::now();
                if f.read_exact_at(buf.buf(), (x % (DEVICE / BLOCK as u64)) * BLOCK as u64).is_ok() {
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            lat
        })
    };
    let t0 = Instant::now();
    let mut rss_peak_mib = rss_before_mib;
    let mut said = 0;
    while t0.elapsed() < Duration::from_secs(opts.seconds) {
        std::thread::sleep(Duration::from_millis(100));
        rss_peak_mib = rss_peak_mib.max(serve.rss_mib());
        let s = t0.elapsed().as_secs();
        if s >= said + 10 {
            said = s;
            let done: u64 = counts.iter().map(|c| c.completed.load(Ordering::Relaxed)).sum();
            progress(&format!("{s} s: {done} requests, serve {rss_peak_mib:.0} MiB at most"));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let mut lat = fuse.join().unwrap_or_default();
    let slowloris_closed_after_s = slow.join().unwrap_or(0.0);
    let unread_requests = unread.join().unwrap_or(0);
    rss_peak_mib = rss_peak_mib.max(serve.rss_mib());
    let done: Vec<u64> = counts.iter().map(|c| c.completed.load(Ordering::Relaxed)).collect();
    let completed: u64 = done.iter().sum();
    let fair = completed as f64 / opts.clients as f64;
    let share = |f: fn(f64, f64) -> f64, init: f64| done.iter().fold(init, |a, &d| f(a, d as f64 / fair.max(1e-9)));
    lat.sort_by(f64::total_cmp);
    if completed == 0 {
        return Err(BenchError::Run(format!("no request completed:\n{}", serve.log())));
    }
    Ok(Report {
        clients: opts.clients,
        depth: opts.depth,
        seconds: opts.seconds,
        completed,
        refused: counts.iter().map(|c| c.refused.load(Ordering::Relaxed)).sum(),
        dropped: counts.iter().filter(|c| c.dropped.load(Ordering::Relaxed)).count() as u64,
        min_share: share(f64::min, f64::MAX),
        max_share: share(f64::max, 0.0),
        fuse_reads: lat.len() as u64,
        fuse_p50_us: quantile(&lat, 0.5),
        fuse_p99_us: quantile(&lat, 0.99),
        rss_before_mib,
        // The clients, the slowloris and the client that never reads.
        growth_bound_mib: bulkhead_nbd_export::memory_bound(opts.clients + 2, WORKERS) as f64 / (1 << 20) as f64,
        rss_peak_mib,
        slowloris_closed_after_s,
        unread_requests,
    })
}

/// The report as a table.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["what", "figure"]);
    let rows = [
        ("NBD clients × depth", format!("{} × {}", r.clients, r.depth)),
        ("requests completed", format!("{} in {} s ({:.0}/s)", r.completed, r.seconds, r.completed as f64 / r.seconds as f64)),
        ("refused (goal 0)", r.refused.to_string()),
        ("connections dropped (goal 0)", r.dropped.to_string()),
        ("fewest of one client / fair share (goal ≥ 0.5)", format!("{:.2}", r.min_share)),
        ("most of one client / fair share", format!("{:.2}", r.max_share)),
        ("FUSE user: reads, p50, p99", format!("{}, {:.0} µs, {:.0} µs", r.fuse_reads, r.fuse_p50_us, r.fuse_p99_us)),
        (
            "serve's private memory: before, peak (goal ≤ before + bound)",
            format!("{:.0} MiB, {:.0} MiB (bound {:.0} MiB)", r.rss_before_mib, r.rss_peak_mib, r.growth_bound_mib),
        ),
        ("slowloris closed after", format!("{:.1} s", r.slowloris_closed_after_s)),
        ("requests sent by the client that never reads", r.unread_requests.to_string()),
    ];
    for (k, v) in rows {
        t.row(vec![k.to_string(), v]);
    }
    format!("Overload: NBD clients at a deep queue, a FUSE user, a slowloris and a client that never reads\n{}", t.render())
}
