//! `bulkhead-bench powercut`: what `serve` acknowledged as durable is on the file after `serve`
//! and every domain are killed at a random moment, again and again.
//!
//! Each round starts `serve` on one `file` device (raw, or a qcow2 image) exported over FUSE,
//! reads back every block the workload ever wrote and checks it against what was acknowledged,
//! then runs the workload and kills `serve` and its domains with SIGKILL at a random moment.
//! The workload's threads write 4 KiB blocks with `O_DIRECT`, each block stamped with its write
//! (and filled from the stamp, so a torn block shows); one thread's file is opened `O_DSYNC`
//! (every write is FUA), the others call `fdatasync` every few writes. A block is durable from
//! the moment a FUA write of it is acknowledged, or a flush that started after its write was
//! acknowledged completes. After the kill, each block must read as its durable write or a write
//! issued after it; anything else (an older write, zeroes, a torn block) is a loss. A qcow2
//! image must also pass `qemu-img check` after each kill (leaked clusters, which a crash leaves,
//! are counted, not failed).

use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::BenchError;
use bulkhead_rng::Rng;

/// Bytes of each block written and checked.
const BLOCK: usize = 4096;
/// Blocks the workload writes among (the first 8 MiB of the device).
const BLOCKS: u64 = 2048;
/// Bytes of the device.
const DEVICE_BYTES: u64 = 64 << 20;
/// Writes between a thread's flushes.
const FLUSH_EVERY: u64 = 8;

/// The image's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// A raw file.
    Raw,
    /// A qcow2 image.
    Qcow2,
}

impl Format {
    /// Parses `raw` or `qcow2`.
    pub fn parse(s: &str) -> Result<Format, String> {
        match s {
            "raw" => Ok(Format::Raw),
            "qcow2" => Ok(Format::Qcow2),
            _ => Err(format!("`{s}`: the format is raw or qcow2")),
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        }
    }
}

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Kills, for each format.
    pub rounds: usize,
    /// The formats, each run in turn.
    pub formats: Vec<Format>,
    /// Writer threads (one of them writes FUA).
    pub threads: usize,
    /// Seed of the kills' moments and the blocks written.
    pub seed: u64,
}

/// What one format's rounds found.
#[derive(Debug, Clone, Serialize)]
pub struct FormatReport {
    /// The format.
    pub format: Format,
    /// Kills made.
    pub kills: usize,
    /// Writes acknowledged.
    pub writes: u64,
    /// Of them FUA.
    pub fua_writes: u64,
    /// Flushes completed.
    pub flushes: u64,
    /// Block checks made after kills (every block written so far, each time).
    pub blocks_checked: u64,
    /// Blocks that did not hold their durable write or a later one.
    pub lost: u64,
    /// Blocks whose bytes were no whole write (torn).
    pub torn: u64,
    /// `qemu-img check` runs that found corruption (qcow2).
    pub check_errors: u64,
    /// Clusters leaked, summed over the checks (qcow2; a crash may leave some).
    pub leaked_clusters: u64,
    /// What the first losses were, for the report.
    pub first_losses: Vec<String>,
    /// Median time from `serve` started to the device served, ms.
    pub start_p50_ms: f64,
}

impl FormatReport {
    /// Nothing counted yet.
    fn new(format: Format) -> FormatReport {
        FormatReport {
            format,
            kills: 0,
            writes: 0,
            fua_writes: 0,
            flushes: 0,
            blocks_checked: 0,
            lost: 0,
            torn: 0,
            check_errors: 0,
            leaked_clusters: 0,
            first_losses: Vec::new(),
            start_p50_ms: 0.0,
        }
    }
}

/// Results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Seed.
    pub seed: u64,
    /// Each format's.
    pub formats: Vec<FormatReport>,
}

impl Report {
    /// Whether anything acknowledged was lost, or an image was damaged.
    pub fn lost_anything(&self) -> bool {
        self.formats.iter().any(|f| f.lost > 0 || f.torn > 0 || f.check_errors > 0)
    }
}

/// The bytes of write `stamp` of `block`: the stamp, the block, then bytes drawn from both.
fn content(block: u64, stamp: u64) -> Vec<u8> {
    let mut out = vec![0u8; BLOCK];
    if stamp == 0 {
        return out;
    }
    out[..8].copy_from_slice(&stamp.to_le_bytes());
    out[8..16].copy_from_slice(&block.to_le_bytes());
    Rng::new(stamp.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ block).fill(&mut out[16..]);
    out
}

/// What is known of one block.
#[derive(Debug, Clone, Default)]
struct Block {
    /// The write that is durable (0: the zeroes it started as).
    durable: u64,
    /// Writes issued after it, in order: any of them may have landed.
    since: Vec<u64>,
}

/// The workload's record of every block.
struct Model {
    blocks: Mutex<Vec<Block>>,
}

impl Model {
    fn issued(&self, block: u64, stamp: u64) {
        self.lock()[block as usize].since.push(stamp);
    }

    /// Write `stamp` of `block` is durable: the writes before it can no longer be read.
    fn durable(&self, block: u64, stamp: u64) {
        let mut blocks = self.lock();
        let b = &mut blocks[block as usize];
        if let Some(p) = b.since.iter().position(|&s| s == stamp) {
            b.durable = stamp;
            b.since.drain(..=p);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Block>> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Counters of a round's workload.
#[derive(Default)]
struct Counts {
    writes: AtomicU64,
    fua: AtomicU64,
    flushes: AtomicU64,
}

/// What a round's writers share.
struct Round {
    model: Arc<Model>,
    counts: Arc<Counts>,
    /// The next write's stamp.
    stamps: Arc<AtomicU64>,
    stop: AtomicBool,
    threads: u64,
}

/// Writer `k`: blocks `b` with `b % threads == k`, until `stop` or an error (the kill). Writer
/// 0's file is `O_DSYNC`: its writes are FUA.
fn writer(file: &std::fs::File, k: u64, seed: u64, round: &Round) {
    let (model, counts, threads, fua) = (&round.model, &round.counts, round.threads, k == 0);
    let mut rng = Rng::new(seed);
    let mut acked: Vec<(u64, u64)> = Vec::new();
    let mut buf = AlignedBlock::new();
    let mut n = 0u64;
    while !round.stop.load(Ordering::Relaxed) {
        let block = rng.below(BLOCKS / threads) * threads + k;
        let stamp = round.stamps.fetch_add(1, Ordering::Relaxed);
        model.issued(block, stamp);
        buf.bytes().copy_from_slice(&content(block, stamp));
        if file.write_all_at(buf.bytes(), block * BLOCK as u64).is_err() {
            return;
        }
        counts.writes.fetch_add(1, Ordering::Relaxed);
        if fua {
            counts.fua.fetch_add(1, Ordering::Relaxed);
            model.durable(block, stamp);
            continue;
        }
        acked.push((block, stamp));
        n += 1;
        if n.is_multiple_of(FLUSH_EVERY) {
            if file.sync_data().is_err() {
                return;
            }
            counts.flushes.fetch_add(1, Ordering::Relaxed);
            for (b, s) in acked.drain(..) {
                model.durable(b, s);
            }
        }
    }
}

/// One block's worth of memory aligned for `O_DIRECT`.
struct AlignedBlock {
    raw: Vec<u8>,
    at: usize,
}

impl AlignedBlock {
    fn new() -> AlignedBlock {
        let raw = vec![0u8; 2 * BLOCK];
        let at = raw.as_ptr().align_offset(BLOCK);
        AlignedBlock { raw, at }
    }

    fn bytes(&mut self) -> &mut [u8] {
        &mut self.raw[self.at..self.at + BLOCK]
    }
}

/// A `serve` of this benchmark, killed or stopped when dropped.
struct Serve {
    child: Option<Child>,
    run: PathBuf,
}

impl Serve {
    fn start(exe: &Path, dir: &Path, config: &Path) -> Result<(Serve, Duration), BenchError> {
        let log = dir.join("serve.log");
        let err = std::fs::OpenOptions::new().create(true).append(true).open(&log).map_err(|e| BenchError::io(&log, e))?;
        let run = dir.join("run");
        let t0 = Instant::now();
        let child = Command::new(exe)
            .arg("serve")
            .arg("--config")
            .arg(config)
            .arg("--run-dir")
            .arg(&run)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .map_err(|e| BenchError::io(exe, e))?;
        let serve = Serve { child: Some(child), run };
        let sock = serve.run.join("control.sock");
        let deadline = t0 + Duration::from_secs(30);
        loop {
            let up = crate::serve_status(&sock)
                .is_some_and(|r| r.devices.first().is_some_and(|d| d.state == bulkhead_control::DeviceState::Running));
            if up && serve.file().exists() {
                return Ok((serve, t0.elapsed()));
            }
            if Instant::now() > deadline {
                return Err(BenchError::Run(format!("serve did not start:\n{}", log_tail(&log))));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn file(&self) -> PathBuf {
        self.run.join("fuse").join("pc")
    }

    /// SIGKILL to `serve` and every domain at once; waits until `serve` is gone.
    fn kill_all(&mut self) {
        let domains = crate::serve_status(&self.run.join("control.sock")).map(|r| crate::domain_pids(&r)).unwrap_or_default();
        if let Some(mut c) = self.child.take() {
            let _ = bulkhead_sys::signal(c.id(), libc::SIGKILL);
            for p in &domains {
                let _ = bulkhead_sys::signal(*p, libc::SIGKILL);
            }
            let _ = c.wait();
        }
        // The domains die with serve too; wait until none is left writing.
        let deadline = Instant::now() + Duration::from_secs(10);
        while domains.iter().any(|&p| !ended(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            crate::stop_child(&mut c, Duration::from_secs(30));
        }
        // A killed serve's mount is dead; the next serve (or this) takes it away.
        let _ = bulkhead_sys::detach_mount(&self.run.join("fuse"));
    }
}

/// Whether process `pid` has finished exiting: gone, or a zombie with no thread left (a
/// zombie leader's other threads, io_uring's workers among them, may still be running). Who
/// reaps it, and when, is up to its new parent.
fn ended(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return true };
    let zombie = stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    zombie && threads <= 1
}

fn log_tail(log: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = std::fs::File::open(log) {
        let _ = f.read_to_string(&mut s);
    }
    s.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Reads every block through `file` and checks it against `model`; adds to the report and
/// takes what was read as durable from then on.
fn check(file: &Path, model: &Model, r: &mut FormatReport) -> Result<(), BenchError> {
    let f =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(file).map_err(|e| BenchError::io(file, e))?;
    let mut buf = AlignedBlock::new();
    let mut blocks = model.lock();
    for (i, b) in blocks.iter_mut().enumerate() {
        if b.durable == 0 && b.since.is_empty() {
            continue;
        }
        f.read_exact_at(buf.bytes(), i as u64 * BLOCK as u64).map_err(|e| BenchError::io(file, e))?;
        judge(i as u64, buf.bytes(), b, r);
    }
    Ok(())
}

/// Judges what block `i` holds (`got`) against what is known of it (`b`), counting a loss or a
/// torn block in `r`; what it holds is what later rounds start from.
fn judge(i: u64, got: &[u8], b: &mut Block, r: &mut FormatReport) {
    r.blocks_checked += 1;
    let stamp = u64::from_le_bytes(got[..8].try_into().expect("eight bytes"));
    let whole = content(i, stamp) == got;
    let allowed = stamp == b.durable || b.since.contains(&stamp);
    if !whole {
        r.torn += 1;
        if r.first_losses.len() < 5 {
            r.first_losses.push(format!("block {i}: torn (starts as write {stamp}); durable {}", b.durable));
        }
    } else if !allowed {
        r.lost += 1;
        if r.first_losses.len() < 5 {
            r.first_losses.push(format!(
                "block {i}: holds write {stamp}, but write {} was durable (later writes issued: {:?})",
                b.durable, b.since
            ));
        }
    }
    *b = Block { durable: if whole { stamp } else { b.durable }, since: Vec::new() };
}

/// `qemu-img check` of a qcow2 image: whether it found corruption, and the clusters leaked.
fn qemu_img_check(img: &Path) -> Result<(bool, u64), BenchError> {
    let out = Command::new("qemu-img")
        .args(["check", "--output=json", "-f", "qcow2"])
        .arg(img)
        .output()
        .map_err(|e| BenchError::io(Path::new("qemu-img"), e))?;
    // 0: clean; 3: leaked clusters only; 2: corruption; 1, 63: could not check.
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let leaks = v["leaks"].as_u64().unwrap_or(0);
    match out.status.code() {
        Some(0) | Some(3) => Ok((false, leaks)),
        Some(2) => Ok((true, leaks)),
        _ => Err(BenchError::Run(format!("qemu-img check {}: {}", img.display(), String::from_utf8_lossy(&out.stderr)))),
    }
}

/// Runs the rounds of one format in `dir`.
fn run_format(
    exe: &Path,
    dir: &Path,
    format: Format,
    opts: &Options,
    progress: &mut impl FnMut(&str),
) -> Result<FormatReport, BenchError> {
    let img = dir.join(format!("pc.{}", format.as_str()));
    match format {
        Format::Raw => {
            let f = std::fs::File::create(&img).map_err(|e| BenchError::io(&img, e))?;
            f.set_len(DEVICE_BYTES).map_err(|e| BenchError::io(&img, e))?;
        }
        Format::Qcow2 => {
            let out = Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2"])
                .arg(&img)
                .arg(DEVICE_BYTES.to_string())
                .output()
                .map_err(|e| BenchError::io(Path::new("qemu-img"), e))?;
            if !out.status.success() {
                return Err(BenchError::Run(format!("qemu-img create: {}", String::from_utf8_lossy(&out.stderr))));
            }
        }
    }
    let config = dir.join(format!("pc-{}.toml", format.as_str()));
    let format_key = if format == Format::Qcow2 { "format = \"qcow2\"\n" } else { "" };
    let text = format!(
        "[fuse]\nenabled = true\n[nbd]\nenabled = false\n\n[[device]]\nname = \"pc\"\nrestart_limit = 100000\n\
         [device.backend]\ntype = \"file\"\npath = \"{}\"\n{format_key}",
        img.display()
    );
    std::fs::write(&config, text).map_err(|e| BenchError::io(&config, e))?;
    let model = Arc::new(Model { blocks: Mutex::new(vec![Block::default(); BLOCKS as usize]) });
    let counts = Arc::new(Counts::default());
    let stamps = Arc::new(AtomicU64::new(1));
    let mut rng = Rng::new(opts.seed ^ format as u64 ^ 0x5eed);
    let mut r = FormatReport::new(format);
    let mut starts = Vec::new();
    for round in 0..=opts.rounds {
        let (mut serve, took) = Serve::start(exe, dir, &config)?;
        starts.push(took.as_secs_f64() * 1e3);
        check(&serve.file(), &model, &mut r)?;
        if round == opts.rounds {
            break;
        }
        let shared = Arc::new(Round {
            model: model.clone(),
            counts: counts.clone(),
            stamps: stamps.clone(),
            stop: AtomicBool::new(false),
            threads: opts.threads as u64,
        });
        let mut writers = Vec::new();
        for k in 0..opts.threads as u64 {
            let mut o = std::fs::OpenOptions::new();
            o.write(true).custom_flags(libc::O_DIRECT | if k == 0 { libc::O_DSYNC } else { 0 });
            let file = o.open(serve.file()).map_err(|e| BenchError::io(&serve.file(), e))?;
            let (shared, seed) = (shared.clone(), rng.next_u64());
            writers.push(std::thread::spawn(move || writer(&file, k, seed, &shared)));
        }
        std::thread::sleep(Duration::from_millis(20 + rng.below(280)));
        serve.kill_all();
        r.kills += 1;
        shared.stop.store(true, Ordering::Relaxed);
        for w in writers {
            let _ = w.join();
        }
        drop(serve);
        if format == Format::Qcow2 {
            let (corrupt, leaks) = qemu_img_check(&img)?;
            r.check_errors += u64::from(corrupt);
            r.leaked_clusters += leaks;
        }
        if (round + 1) % 10 == 0 {
            progress(&format!(
                "{}: {} kills, {} writes acknowledged, {} lost",
                format.as_str(),
                round + 1,
                counts.writes.load(Ordering::Relaxed),
                r.lost + r.torn
            ));
        }
    }
    r.writes = counts.writes.load(Ordering::Relaxed);
    r.fua_writes = counts.fua.load(Ordering::Relaxed);
    r.flushes = counts.flushes.load(Ordering::Relaxed);
    r.start_p50_ms = crate::median(&starts);
    Ok(r)
}

/// Runs every format's rounds with `exe` (a `bulkhead` that takes `serve`; needs root).
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if !(1..=100_000).contains(&opts.rounds) || !(2..=16).contains(&opts.threads) {
        return Err(BenchError::Options(format!(
            "{} rounds and {} threads: rounds are 1..=100000, threads 2..=16 (one writes FUA, the others flush)",
            opts.rounds, opts.threads
        )));
    }
    let dir = std::env::temp_dir().join(format!("bulkhead-bench-powercut-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
    let mut formats = Vec::new();
    let mut result = Ok(());
    for &f in &opts.formats {
        match run_format(exe, &dir, f, opts, &mut progress) {
            Ok(r) => formats.push(r),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let _ = bulkhead_sys::detach_mount(&dir.join("run").join("fuse"));
    let _ = std::fs::remove_dir_all(&dir);
    result.map(|()| Report { seed: opts.seed, formats })
}

/// The report as a table.
pub fn render(r: &Report) -> String {
    let mut t = crate::Table::new(&[
        "format",
        "kills",
        "writes acked",
        "FUA",
        "flushes",
        "blocks checked",
        "lost",
        "torn",
        "check errors",
        "leaked clusters",
        "start p50 ms",
    ]);
    for f in &r.formats {
        t.row(vec![
            f.format.as_str().to_string(),
            f.kills.to_string(),
            f.writes.to_string(),
            f.fua_writes.to_string(),
            f.flushes.to_string(),
            f.blocks_checked.to_string(),
            f.lost.to_string(),
            f.torn.to_string(),
            f.check_errors.to_string(),
            f.leaked_clusters.to_string(),
            format!("{:.0}", f.start_p50_ms),
        ]);
    }
    let mut out = format!("Power cuts: serve and every domain SIGKILLed at a random moment (seed {})\n", r.seed);
    out.push_str(&t.render());
    for f in &r.formats {
        for l in &f.first_losses {
            out.push_str(&format!("{}: {l}\n", f.format.as_str()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_durable_from_its_fua_or_flush_and_then_only_it_or_later_writes_may_be_read() {
        let m = Model { blocks: Mutex::new(vec![Block::default(); 4]) };
        m.issued(1, 10);
        m.issued(1, 11);
        m.durable(1, 10);
        m.issued(1, 12);
        let b = m.lock()[1].clone();
        assert_eq!((b.durable, b.since), (10, vec![11, 12]));
        // A flush's acknowledgement of a write that a later durable write superseded changes
        // nothing.
        m.durable(1, 12);
        m.durable(1, 11);
        let b = m.lock()[1].clone();
        assert_eq!((b.durable, b.since.len()), (12, 0));
    }

    #[test]
    fn an_older_write_zeroes_or_a_torn_block_after_a_cut_is_a_loss_and_the_durable_or_a_later_one_is_not() {
        let mut r = FormatReport::new(Format::Raw);
        let known = || Block { durable: 5, since: vec![7, 9] };
        for ok in [5, 7, 9] {
            judge(3, &content(3, ok), &mut known(), &mut r);
        }
        assert_eq!((r.lost, r.torn, r.blocks_checked), (0, 0, 3));
        // The write before the durable one, and the zeroes the block started as: lost.
        judge(3, &content(3, 4), &mut known(), &mut r);
        judge(3, &content(3, 0), &mut known(), &mut r);
        assert_eq!(r.lost, 2);
        // Half of write 7, half of write 9: torn.
        let mut torn = content(3, 7);
        torn[2048..].copy_from_slice(&content(3, 9)[2048..]);
        judge(3, &torn, &mut known(), &mut r);
        // Write 7 of another block is no write of this one.
        judge(3, &content(4, 7), &mut known(), &mut r);
        assert_eq!((r.lost, r.torn), (2, 2), "{:?}", r.first_losses);
        // What was read is where the next round starts.
        let mut b = known();
        judge(3, &content(3, 9), &mut b, &mut r);
        assert_eq!((b.durable, b.since.len()), (9, 0));
    }

    #[test]
    fn every_write_fills_its_block_from_its_stamp_so_a_torn_block_shows() {
        let (a, b) = (content(3, 7), content(3, 8));
        assert_eq!(u64::from_le_bytes(a[..8].try_into().unwrap()), 7);
        assert_ne!(a[16..], b[16..]);
        let mut torn = a.clone();
        torn[2048..].copy_from_slice(&b[2048..]);
        assert_ne!(content(3, 7), torn);
        assert!(content(0, 0).iter().all(|&x| x == 0));
    }
}
