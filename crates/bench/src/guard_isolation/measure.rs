//! The measurement itself: a domain per fault, forked from this process (see the parent
//! module).

use std::cell::RefCell;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_backends::{Engine, FileBackend, RamBackend};
use bulkhead_block::{Backend, Chain, Layer};
use bulkhead_channel::{pair, BackQueue, BudgetPolicy, FrontQueue, FrontRequest, NotifyMode, QueueConfig};
use bulkhead_driver::guarded::{self, FilterParts, FilterSite};
use bulkhead_driver::Domain;
use bulkhead_filters::{FilterFds, FilterSpec, GuardMode, GuardSpec};
use bulkhead_guard::heap::{self, Reservation};
use bulkhead_guard::VIOLATION_EXIT;
use bulkhead_shmem::memfd;
use bulkhead_testkit::faults::{Faulty, Injector, FAULT_FLIP, FAULT_RECORD, PROBE_EXIT};
use bulkhead_testkit::inject::{InjectSpec, InjectTarget};

use super::child::{describe, Child, End};
use super::{Count, Options, Population, Report, Row, WorkingSet, EVERY};
use crate::guard_filters::{Gate, Setting};
use crate::BenchError;

/// Device size for the filters over `ram`.
const RAM_BYTES: u64 = 64 << 20;

impl Count {
    fn add(&mut self, o: Outcome) {
        match o {
            Outcome::Isolated => self.isolated += 1,
            Outcome::Landed => self.landed += 1,
            Outcome::Undecided => self.undecided += 1,
        }
    }
}

/// A filter to measure and what it runs over.
struct Bed {
    name: &'static str,
    spec: FilterSpec,
    below: Below,
    size: u64,
}

enum Below {
    Ram,
    Luks { file: PathBuf, key: Vec<u8> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Isolated,
    Landed,
    Undecided,
}

/// What one child showed.
struct Result1 {
    outcome: Outcome,
    disagreed: bool,
    /// Its runtime's heap was in huge pages as it exited.
    huge: bool,
}

fn beds(scratch: &Path, notes: &mut Vec<String>) -> Vec<Bed> {
    let mut v = vec![Bed { name: "trace", spec: FilterSpec::Trace { device_number: 0 }, below: Below::Ram, size: RAM_BYTES }];
    match crypt_bed(scratch) {
        Ok(b) => v.push(b),
        Err(e) => notes.push(format!("crypt left out: {e}")),
    }
    v.push(Bed { name: "cow", spec: FilterSpec::Cow { cluster_bits: 16, op: None }, below: Below::Ram, size: RAM_BYTES });
    v
}

/// A LUKS2 volume opened as the supervisor opens one: the filter's layout and master key.
fn crypt_bed(scratch: &Path) -> Result<Bed, BenchError> {
    let (file, keyfile) = crate::guard_filters::make_luks(scratch, "bench-guard-isolation", RAM_BYTES)?;
    let f = std::fs::File::open(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    let mut read = |off: u64, buf: &mut [u8]| f.read_exact_at(buf, off);
    let v = bulkhead_crypt::Volume::read(&mut read).map_err(|e| e.to_string())?;
    let data_size = v.data_size(len).map_err(|e| e.to_string())?;
    let pass = std::fs::read(&keyfile).map_err(|e| e.to_string())?;
    let key = v.unlock(&pass, &mut read).map_err(|e| e.to_string())?.bytes().to_vec();
    let _ = std::fs::remove_file(&keyfile);
    let spec = FilterSpec::Crypt { payload_offset: v.payload_offset, data_size, sector_size: v.sector_size };
    Ok(Bed { name: "crypt", spec, below: Below::Luks { file, key }, size: data_size })
}

fn state_page(name: &str) -> Result<OwnedFd, BenchError> {
    memfd::create(name, bulkhead_filters::state::STATE_BYTES as u64).map_err(|e| BenchError::Run(format!("state page: {e}")))
}

/// A memory file holding `bytes`.
fn memfd_with(name: &str, bytes: &[u8]) -> Result<OwnedFd, BenchError> {
    let fd = memfd::create(name, bytes.len() as u64).map_err(|e| format!("{name}: {e}"))?;
    let f = std::fs::File::from(fd);
    f.write_all_at(bytes, 0).map_err(|e| format!("{name}: {e}"))?;
    Ok(OwnedFd::from(f))
}

/// The descriptors of the measured filter and the `stats` filter after it.
fn filter_parts(bed: &Bed, guard: GuardSpec) -> Result<Vec<FilterParts>, BenchError> {
    let (output, secret) = match (&bed.spec, &bed.below) {
        (FilterSpec::Trace { .. }, _) => (Some(memfd::create("bench-trace", 0).map_err(|e| e.to_string())?), None),
        (FilterSpec::Cow { cluster_bits, .. }, _) => {
            let image = bulkhead_image::new_image(bed.size, *cluster_bits, None).map_err(|e| e.to_string())?;
            (Some(memfd_with("bench-overlay", &image)?), None)
        }
        (_, Below::Luks { key, .. }) => (None, Some(memfd_with("bench-key", key)?)),
        _ => (None, None),
    };
    let measured =
        FilterParts { spec: bed.spec.clone(), fds: FilterFds { state: state_page("bench-filter")?, output, secret }, guard };
    let stats = FilterParts {
        spec: FilterSpec::Stats {},
        fds: FilterFds { state: state_page("bench-stats")?, output: None, secret: None },
        guard: GuardSpec::default(),
    };
    Ok(vec![measured, stats])
}

/// What the child's domain runs over, opened before the fork.
enum BelowFd {
    Ram(OwnedFd),
    File(OwnedFd),
}

fn below_fd(bed: &Bed) -> Result<BelowFd, BenchError> {
    match &bed.below {
        Below::Ram => Ok(memfd::create("bench-ram", bed.size).map(BelowFd::Ram).map_err(|e| e.to_string())?),
        Below::Luks { file, .. } => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(file)
            .map(|f| BelowFd::File(OwnedFd::from(f)))
            .map_err(|e| BenchError::io(file, e)),
    }
}

/// What a child's measured filter does.
#[derive(Clone, Copy)]
enum Work {
    /// Makes this one fault.
    Fault(InjectSpec),
    /// Counts the write working set over this many calls ([`Injector::census`]).
    Census(u64),
}

/// The child: builds the domain in the heap spaces of `res`, private as a domain's are, with
/// `work` in the measured filter (the first), and serves until the fault or the count ends it.
fn child_run(res: Reservation, back: BackQueue, below: BelowFd, parts: Vec<FilterParts>, work: Work, probe: OwnedFd) -> String {
    let run = || -> Result<(), BenchError> {
        let guards: Vec<GuardSpec> = parts.iter().map(|p| p.guard).collect();
        guarded::prepare_heap(res, &guards)?;
        let backend: Box<dyn Backend> = match below {
            BelowFd::Ram(fd) => {
                let size = bulkhead_sys::storage_size(std::os::fd::AsFd::as_fd(&fd)).map_err(|e| e.to_string())?.0;
                Box::new(RamBackend::new(fd, size).map_err(|e| e.to_string())?)
            }
            BelowFd::File(fd) => Box::new(FileBackend::new(fd, None, false, Engine::Sync).map_err(|e| e.to_string())?),
        };
        let rings = [back.ring_region()];
        // The measured filter's faults report to the probe.
        let probe = RefCell::new(Some(probe));
        let wrap = |site: &FilterSite, layer: Box<dyn Layer>| -> Box<dyn Layer> {
            let Some(probe) = (site.index == 0).then(|| probe.borrow_mut().take()).flatten() else { return layer };
            let injector = match work {
                Work::Fault(inject) => Injector::new(site, inject, Some(probe)),
                Work::Census(calls) => Injector::census(site, calls, probe),
            };
            Box::new(Faulty::new(layer, injector))
        };
        let layers = guarded::build_filters_wrapping(parts, &rings, &wrap)?;
        let chain = Chain::new(layers, backend);
        let stop = Arc::new(AtomicBool::new(false));
        let mut dom =
            Domain::new(vec![back], chain, NotifyMode::Poll, BudgetPolicy::DEFAULT_AUTO, stop).map_err(|e| e.to_string())?;
        dom.run().map_err(|e| e.to_string())?;
        Err("the domain stopped before its fault".into())
    };
    match run() {
        Ok(()) => String::new(),
        Err(e) => e.to_string(),
    }
}

/// Whether this process runs one thread: forking a process with more would leave the child
/// with locks held by threads that do not exist in it.
fn single_threaded() -> bool {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["Threads:", "1"])
}

/// The socket a child's measured filter reports to ([`Injector::new`], [`Injector::census`]).
struct Probe {
    sock: UnixStream,
    /// What has come on it so far.
    record: Vec<u8>,
    /// Whether a whole record means a fault is due, which waits for this process to watch.
    fault: bool,
}

impl Probe {
    /// Takes in what has come, without waiting; whether a fault is due.
    fn due(&mut self) -> Result<bool, BenchError> {
        let mut buf = [0u8; FAULT_RECORD];
        while self.record.len() < FAULT_RECORD {
            match self.sock.read(&mut buf[..FAULT_RECORD - self.record.len()]) {
                Ok(0) => break,
                Ok(n) => self.record.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(BenchError::Run(format!("the probe: {e}"))),
            }
        }
        Ok(self.fault && self.record.len() == FAULT_RECORD)
    }
}

/// What ended [`drive`].
enum Driven {
    /// The child ended, with this wait status.
    Ended(i32),
    /// Its fault is due: the record is in, and the write waits.
    Due,
}

/// Whether driving is over.
fn over(child: &Child, probe: &mut Probe, started: Instant) -> Result<Option<Driven>, BenchError> {
    if probe.due()? {
        return Ok(Some(Driven::Due));
    }
    Ok(child.ended(started)?.map(Driven::Ended))
}

/// Drives `front` with 4 KiB random reads and writes until the child ends or its fault is
/// due.
fn drive(front: &mut FrontQueue, child: &Child, probe: &mut Probe, size: u64, seed: u64) -> Result<Driven, BenchError> {
    let data = vec![0x5Au8; 4096];
    let mut random = bulkhead_rng::Rng::new(seed);
    let started = Instant::now();
    loop {
        if let Some(d) = over(child, probe, started)? {
            return Ok(d);
        }
        let rng = random.next_u64();
        let offset = (rng >> 1) % (size / 4096) * 4096;
        let req = if rng & 1 == 0 {
            FrontRequest::Read { offset, into: 4096 }
        } else {
            FrontRequest::Write { offset, from: &data, fua: false }
        };
        if front.submit(req, 1).is_err() {
            // The child ended with the request slot taken, or the ring is broken: either way
            // the child's end is what is left to see.
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let mut done = false;
        while !done {
            if front.reap(|_| done = true).is_err() {
                break;
            }
            if done {
                break;
            }
            match front.wait(2) {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    if let Some(d) = over(child, probe, started)? {
                        return Ok(d);
                    }
                }
            }
        }
    }
}

/// The last lines the child wrote to its standard error.
fn tail(log: &OwnedFd) -> String {
    let Ok(dup) = log.try_clone() else { return String::new() };
    let f = std::fs::File::from(dup);
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let from = len.saturating_sub(600);
    let mut buf = vec![0u8; (len - from) as usize];
    let _ = f.read_exact_at(&mut buf, from);
    String::from_utf8_lossy(&buf).trim().replace('\n', " | ")
}

/// The fault target `name` stands for.
fn target(name: &str) -> InjectTarget {
    InjectTarget::ALL.iter().find(|(n, _)| *n == name).map(|(_, t)| *t).expect("a target of the test kit")
}

/// A child that has ended, and what it left.
struct Ran {
    /// Its wait status.
    status: i32,
    /// What its measured filter sent before the end.
    record: Vec<u8>,
    /// What its memory held as it exited, once its fault was due.
    end: Option<End>,
    /// Its standard error.
    log: OwnedFd,
}

/// Runs `work` in a domain of its own, in a child forked from this process, over `bed`
/// guarded by `guard`, until the child ends.
fn run_child(bed: &Bed, guard: GuardSpec, work: Work, seed: u64) -> Result<Ran, BenchError> {
    let parts = filter_parts(bed, guard)?;
    let below = below_fd(bed)?;
    // Made here, so that this process knows where the child's spaces lie.
    let res = Reservation::new(1 + parts.len()).map_err(|e| format!("heap: {e}"))?;
    let runtime = (res.start(heap::RUNTIME), heap::SPACE_BYTES);
    let cfg = QueueConfig { nslots: 32, arena_bytes: 1 << 20, mode: NotifyMode::Poll, ..Default::default() };
    let (mut front, back) = pair(&cfg, bed.size).map_err(|e| format!("channel: {e}"))?;
    let (ours, theirs) = UnixStream::pair().map_err(|e| format!("probe: {e}"))?;
    ours.set_nonblocking(true).map_err(|e| format!("probe: {e}"))?;
    let log = memfd::create("bench-guard-log", 0).map_err(|e| e.to_string())?;
    if !single_threaded() {
        return Err("bench guard --isolation forks a domain per fault, so it must run single-threaded".into());
    }
    // SAFETY: this process runs one thread (checked above), so the child starts with no lock
    // held and no other thread's state half-changed; it never returns into this function's
    // caller (it ends with `_exit`).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(BenchError::Run(format!("fork: {}", std::io::Error::last_os_error())));
    }
    if pid == 0 {
        // The child: its copy of the frontend stays untouched; its standard error goes to the
        // log; it dies with this process.
        std::mem::forget(front);
        drop(ours);
        // SAFETY: plain system calls on descriptors this process owns and on itself.
        unsafe {
            libc::dup2(log.as_raw_fd(), 2);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        }
        let e = child_run(res, back, below, parts, work, OwnedFd::from(theirs));
        eprintln!("{e}");
        // SAFETY: ends the child without running anything of the parent's (no destructors,
        // no exit handlers).
        unsafe { libc::_exit(70) };
    }
    // This process's copy of the spaces is never used.
    drop((res, parts, below, theirs));
    let child = Child::new(pid);
    let started = Instant::now();
    let mut probe = Probe { sock: ours, record: Vec::with_capacity(FAULT_RECORD), fault: matches!(work, Work::Fault(_)) };
    let with_log = |e: BenchError| BenchError::Run(format!("{e} ({})", tail(&log)));
    let (status, end) = match drive(&mut front, &child, &mut probe, bed.size, seed).map_err(with_log)? {
        Driven::Ended(status) => {
            // What it sent before it ended (a census's count) is all in by now.
            probe.due()?;
            (status, None)
        }
        Driven::Due => {
            let addr = u64::from_le_bytes(probe.record[..8].try_into().expect("8 bytes"));
            child.watch_end()?;
            probe.sock.write_all(&[1]).map_err(|e| format!("probe: {e}"))?;
            let (status, end) = child.end_reading(addr, runtime, started).map_err(with_log)?;
            (status, Some(end))
        }
    };
    drop((front, back));
    Ok(Ran { status, record: probe.record, end, log })
}

/// One fault, in a child of its own.
fn one(bed: &Bed, setting: Setting, target: InjectTarget, seed: u64) -> Result<Result1, BenchError> {
    let inject = InjectSpec { target, every: EVERY, seed };
    let Ran { status, record: rec, end, log } = run_child(bed, setting.spec(), Work::Fault(inject), seed)?;
    let (Some(End { word: now, huge }), true) = (end, rec.len() == FAULT_RECORD) else {
        return Err(BenchError::Run(format!("the domain ended ({}) before its fault: {}", describe(status), tail(&log))));
    };
    let value = u64::from_le_bytes(rec[8..].try_into().expect("8 bytes"));
    let old = value ^ FAULT_FLIP;
    let outcome = if now == value {
        Outcome::Landed
    } else if now == old {
        Outcome::Isolated
    } else {
        Outcome::Undecided
    };
    let stopped = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == VIOLATION_EXIT;
    let ended = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == PROBE_EXIT;
    if !stopped && !ended {
        return Err(BenchError::Run(format!("the domain ended with {} after its fault: {}", describe(status), tail(&log))));
    }
    let disagreed = (outcome == Outcome::Landed && stopped) || (outcome == Outcome::Isolated && ended);
    Ok(Result1 { outcome, disagreed, huge })
}

/// The write working set of `bed`'s domain: the distinct pages the runtime and the filters
/// write over the filter's first [`EVERY`] calls, the window a fault strikes in, counted by
/// SCDWC's cache at its largest (256 pages, more than any of them writes); and the pages of
/// guarded memory in use then.
fn working_set(bed: &Bed) -> Result<(u32, u32), BenchError> {
    let cache = bulkhead_guard::shadow::MAX_CACHE as u32;
    let guard = GuardSpec { mode: GuardMode::Scdwc { cache }, keys: false, pages: false };
    let Ran { status, record, log, .. } = run_child(bed, guard, Work::Census(EVERY), 1)?;
    let ended = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == PROBE_EXIT;
    match <[u8; 16]>::try_from(record.as_slice()) {
        Ok(b) if ended => {
            let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes")) as u32;
            Ok((word(0), word(8)))
        }
        _ => Err(BenchError::Run(format!("the domain ended ({}) before its count: {}", describe(status), tail(&log)))),
    }
}

/// Runs every population and setting.
pub fn run(opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    let mut notes = Vec::new();
    let beds = beds(&opts.scratch, &mut notes);
    let mut working_sets = Vec::new();
    for b in &beds {
        match working_set(b) {
            Ok((pages, guarded)) => working_sets.push(WorkingSet { filter: b.name.to_string(), pages, guarded }),
            Err(e) => notes.push(format!("{}: write working set not counted: {e}", b.name)),
        }
    }
    if !working_sets.is_empty() {
        let ws: Vec<String> = working_sets.iter().map(|w| format!("{} {} of {}", w.filter, w.pages, w.guarded)).collect();
        progress(&format!("write working set, pages of the guarded pages in use: {}", ws.join(", ")));
    }
    let mut rows = Vec::new();
    let settings: Vec<Setting> = opts.settings.iter().copied().filter(|s| s.mode != GuardMode::Off).collect();
    for &population in &opts.populations {
        let targets = population.targets();
        for (si, &setting) in settings.iter().enumerate() {
            let label = setting.label();
            progress(&format!("{label}: {} {} faults", opts.faults, population.as_str()));
            let mut all = Count::default();
            let mut by_target: Vec<(String, Count)> = targets.iter().map(|t| (t.to_string(), Count::default())).collect();
            let mut by_filter: Vec<(String, Count)> = beds.iter().map(|b| (b.name.to_string(), Count::default())).collect();
            let (mut disagreed, mut lost, mut huge) = (0, 0, 0);
            let started = Instant::now();
            for k in 0..opts.faults {
                let bi = k as usize % beds.len();
                let ti = (k as usize / beds.len()) % targets.len();
                // The targeted faults' seeds are as they always were; the seed-like ones differ.
                let pop = u64::from(population == Population::SeedLike) << 48;
                let seed = 1 + (pop | (si as u64) << 32 | k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                match one(&beds[bi], setting, target(targets[ti]), seed) {
                    Ok(r) => {
                        all.add(r.outcome);
                        by_target[ti].1.add(r.outcome);
                        by_filter[bi].1.add(r.outcome);
                        disagreed += u32::from(r.disagreed);
                        huge += u32::from(r.huge);
                    }
                    Err(e) => {
                        lost += 1;
                        if notes.len() < 20 {
                            notes.push(format!("{label}, {} → {}: {e}", beds[bi].name, targets[ti]));
                        }
                    }
                }
            }
            let ms_per_fault = started.elapsed().as_secs_f64() * 1000.0 / opts.faults.max(1) as f64;
            rows.push(Row {
                population,
                guard: setting.mode.as_str().into(),
                cache: setting.cache(),
                gate: setting.gate,
                all,
                by_target,
                by_filter,
                disagreed,
                lost,
                huge,
                ms_per_fault,
            });
        }
    }
    for b in &beds {
        if let Below::Luks { file, .. } = &b.below {
            let _ = std::fs::remove_file(file);
        }
    }
    // Each gate's C are judged against DWC with the same gate, or without one (the page gate
    // has no DWC of its own: DWC keeps nothing open to shut).
    let targeted = |g: Gate| rows.iter().filter(move |r| r.population == Population::Targeted && r.gate == g);
    let mut drops_at = Vec::new();
    for gate in [Gate::None, Gate::Keys, Gate::Pages] {
        if !targeted(gate).any(|r| r.cache.is_some()) {
            continue;
        }
        let dwc = targeted(gate).chain(targeted(Gate::None)).find(|r| r.cache.is_none()).map(|r| r.all.rate_pct());
        if let Some(dwc) = dwc {
            drops_at.push((gate, targeted(gate).filter(|r| r.all.rate_pct() < dwc).find_map(|r| r.cache)));
        }
    }
    Ok(Report {
        faults: opts.faults,
        every: EVERY,
        filters: beds.iter().map(|b| b.name.to_string()).collect(),
        working_sets,
        rows,
        drops_at,
        notes,
    })
}
