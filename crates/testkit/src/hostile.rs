//! A hostile driver domain, for tests.
//!
//! The frontend must survive a driver that turns hostile: it may not crash, hang or corrupt
//! other requests, and must fail or hold the affected requests until the supervisor has
//! replaced the domain. [`serve`] is the domain side of the ring protocol written from its
//! parts (the ring, the arenas, the doorbells, a ramdisk), so it can break every rule the
//! shipped runtime keeps: it serves honestly for [`TRIGGER_AFTER`] requests, then misbehaves as
//! its [`Hostility`] says. The test driver (`bulkhead-test-driver`) runs it when
//! `BULKHEAD_TEST_FAULT=hostile:<name>` is set.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use bulkhead_backends::{ChannelBackend, RamBackend};
use bulkhead_block::{Backend, Io, SliceList, Status};
use bulkhead_channel::{ArenaWindows, ForwardQueueFds, FrontQueue, QueueConfig};
use bulkhead_doorbell::{now_ns, EventFd, Poller};
use bulkhead_ring::{
    status_code, validate_request, ArenaSizes, BackRing, HeaderOffsets, ResponseSlot, RingLayout, ValidRequest, ARENA_WRITE,
};
use bulkhead_shmem::{Mapping, Protection};
use bulkhead_spec::{BackendSpec, DomainSpec, QueueSpec};

/// Requests a hostile domain answers honestly before it turns.
pub const TRIGGER_AFTER: u64 = 64;

/// One way of misbehaving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostility {
    /// Publish a response producer index far beyond anything outstanding.
    CorruptIndex,
    /// Publish a response slot full of random bytes instead of a real response.
    CorruptSlot,
    /// Answer with an id the frontend never issued.
    UnknownId,
    /// Answer one request twice.
    DuplicateId,
    /// Answer with the previous channel generation.
    StaleGeneration,
    /// Answer every batch in reverse order (allowed by the protocol: nothing may break).
    OutOfOrder,
    /// Report more bytes than the request asked for.
    WrongLength,
    /// Answer with a status value the protocol does not define.
    BadStatus,
    /// Ring the frontend's doorbell in a tight loop while serving correctly but slowly (2 ms
    /// per batch), so the frontend has to wait through the storm.
    DoorbellStorm,
    /// Take no more requests, and stay alive.
    StopAnswering,
    /// Exit after executing a batch, before answering it.
    ExitMidRequest,
    /// Print a 1 MiB line and 100,000 more at once on standard error — terminal escapes,
    /// lines posing as serve's own, bytes that are not UTF-8 — then serve correctly.
    LogFlood,
}

impl Hostility {
    /// Every behaviour, in the order the tests run them.
    pub const ALL: [Hostility; 12] = [
        Hostility::CorruptIndex,
        Hostility::CorruptSlot,
        Hostility::UnknownId,
        Hostility::DuplicateId,
        Hostility::StaleGeneration,
        Hostility::OutOfOrder,
        Hostility::WrongLength,
        Hostility::BadStatus,
        Hostility::DoorbellStorm,
        Hostility::StopAnswering,
        Hostility::ExitMidRequest,
        Hostility::LogFlood,
    ];

    /// Its name in `BULKHEAD_TEST_FAULT=hostile:<name>`.
    pub fn as_str(self) -> &'static str {
        match self {
            Hostility::CorruptIndex => "corrupt-index",
            Hostility::CorruptSlot => "corrupt-slot",
            Hostility::UnknownId => "unknown-id",
            Hostility::DuplicateId => "duplicate-id",
            Hostility::StaleGeneration => "stale-generation",
            Hostility::OutOfOrder => "out-of-order",
            Hostility::WrongLength => "wrong-length",
            Hostility::BadStatus => "bad-status",
            Hostility::DoorbellStorm => "doorbell-storm",
            Hostility::StopAnswering => "stop-answering",
            Hostility::ExitMidRequest => "exit-mid-request",
            Hostility::LogFlood => "log-flood",
        }
    }

    /// Parses a name of [`as_str`](Self::as_str).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|h| h.as_str() == s)
    }

    /// Whether the behaviour breaks the protocol (the frontend must declare the channel broken).
    pub fn violates_protocol(self) -> bool {
        !matches!(
            self,
            Hostility::OutOfOrder
                | Hostility::DoorbellStorm
                | Hostility::StopAnswering
                | Hostility::ExitMidRequest
                | Hostility::LogFlood
        )
    }
}

/// Writes the [`Hostility::LogFlood`] output to standard error.
fn flood_log() {
    use std::io::Write;
    let mut out = Vec::with_capacity(2 << 20);
    out.extend(std::iter::repeat_n(b'L', 1 << 20));
    out.push(b'\n');
    for i in 0..100_000u32 {
        match i % 4 {
            0 => out.extend_from_slice(format!("flood line {i}\n").as_bytes()),
            1 => out.extend_from_slice(b"\x1b[2J\x1b[31mforged: screen cleared\r\n"),
            2 => out.extend_from_slice(b"bulkhead: device other: forged: restarted, all is well\n"),
            _ => out.extend_from_slice(b"\xff\xfe not utf-8\x07\n"),
        }
        if out.len() >= 1 << 20 {
            let _ = std::io::stderr().write_all(&out);
            out.clear();
        }
    }
    let _ = std::io::stderr().write_all(&out);
}

/// One queue, from its parts.
#[derive(Debug)]
struct RawQueue {
    ring: BackRing,
    warena: Mapping,
    rarena: Mapping,
    kick: EventFd,
    irq: EventFd,
    arenas: ArenaSizes,
}

/// Takes an inherited descriptor named in the spec.
///
/// # Safety
/// `fd` must be inherited for this domain and claimed once.
unsafe fn claim(fd: i32) -> Result<OwnedFd, crate::KitError> {
    // SAFETY: the caller's guarantee.
    unsafe { bulkhead_sys::claim_inherited(fd) }.map_err(|e| crate::KitError(e.to_string()))
}

impl RawQueue {
    /// # Safety
    /// The descriptors in `q` are this domain's and claimed once.
    unsafe fn from_spec(q: &QueueSpec) -> Result<Self, crate::KitError> {
        let e = |e: &dyn std::fmt::Display| e.to_string();
        // SAFETY: forwarded.
        let [ring, warena, rarena, kick, irq] = q.fds.map(|fd| unsafe { claim(fd) });
        let layout = RingLayout::new(q.nslots).map_err(|x| e(&x))?;
        let map = Mapping::new(ring?.as_raw_fd(), layout.file_size(), Protection::ReadWrite).map_err(|x| e(&x))?;
        let len = q.arena_bytes as usize;
        Ok(RawQueue {
            ring: BackRing::attach(map, layout).map_err(|x| e(&x))?,
            warena: Mapping::new(warena?.as_raw_fd(), len, Protection::ReadOnly).map_err(|x| e(&x))?,
            rarena: Mapping::new(rarena?.as_raw_fd(), len, Protection::ReadWrite).map_err(|x| e(&x))?,
            kick: EventFd::from_owned(kick?).map_err(|x| e(&x))?,
            irq: EventFd::from_owned(irq?).map_err(|x| e(&x))?,
            arenas: ArenaSizes { write: q.arena_bytes, read: q.arena_bytes },
        })
    }

    fn buffers(&self, v: &ValidRequest) -> SliceList<'_> {
        let mut list = SliceList::new();
        for s in v.segments() {
            let arena = if s.arena == ARENA_WRITE { &self.warena } else { &self.rarena };
            list.push(arena.slice(s.offset as usize, s.len as usize).expect("validated against the arena"));
        }
        list
    }
}

/// The hostile domain: serves the queues of `spec` over its ramdisk — or, as a tap domain, over
/// the channel to the domain below, passing requests on honestly — honestly for
/// [`TRIGGER_AFTER`] requests, then as `h` says to the frontend, until `stop` is set.
///
/// # Safety
/// Every descriptor the spec names must be inherited for this process and used by nothing else.
pub unsafe fn serve(spec: &DomainSpec, h: Hostility, stop: &AtomicBool) -> Result<(), crate::KitError> {
    let mut queues = Vec::new();
    for q in &spec.queues {
        // SAFETY: forwarded from this function's contract.
        queues.push(unsafe { RawQueue::from_spec(q) }?);
    }
    let mut ram: Box<dyn Backend> = match &spec.backend {
        BackendSpec::Ram { fd } => {
            // SAFETY: as above.
            let fd = unsafe { claim(*fd) }?;
            Box::new(RamBackend::new(fd, spec.size).map_err(|e| crate::KitError(e.to_string()))?)
        }
        BackendSpec::Channel { queues: lower, generation, control_fds: _ } => {
            let mut fronts = Vec::new();
            for (q, above) in lower.iter().zip(&spec.queues) {
                // SAFETY: as above.
                let [ring, kick, irq] = q.fds.map(|fd| unsafe { claim(fd) });
                let cfg = QueueConfig {
                    nslots: q.nslots,
                    arena_bytes: above.arena_bytes as usize,
                    mode: spec.notify_mode()?,
                    budget: spec.budget(),
                    generation: *generation,
                };
                // SAFETY: as above.
                let arenas = match q.arena_fds.map(|fds| fds.map(|fd| unsafe { claim(fd) })) {
                    Some([w, r]) => Some([w?, r?]),
                    None => None,
                };
                let fds = ForwardQueueFds { ring: ring?, kick: kick?, irq: irq?, arenas };
                fronts.push(FrontQueue::forwarding(fds, &cfg).map_err(|e| crate::KitError(e.to_string()))?);
            }
            let windows = queues
                .iter()
                .map(|q| ArenaWindows {
                    write: (q.warena.base_ptr() as usize, q.warena.len()),
                    read: (q.rarena.base_ptr() as usize, q.rarena.len()),
                })
                .collect();
            Box::new(ChannelBackend::new(fronts, windows, spec.size, std::sync::Arc::new(AtomicBool::new(false)), None))
        }
        _ => return Err(crate::KitError("the hostile test driver serves ram devices, or the channel below a tap domain".into())),
    };
    let poller = Poller::new().map_err(|e| crate::KitError(e.to_string()))?;
    for (i, q) in queues.iter().enumerate() {
        poller.add(q.kick.as_raw_fd(), i as u64).map_err(|e| crate::KitError(e.to_string()))?;
    }
    bulkhead_driver::confine_and_report(spec).map_err(|e| crate::KitError(e.to_string()))?;
    let mut completed = 0u64;
    let mut turned = false;
    let mut idle_since: Option<u64> = None;
    // A storm's rings, said on standard error every five seconds (`bulkhead-bench storm` reads
    // the rate from the log).
    let mut rings = 0u64;
    let mut storm_since = 0u64;
    let mut storm_said = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let active = h == Hostility::OutOfOrder || completed >= TRIGGER_AFTER;
        if active && !turned {
            turned = true;
            eprintln!("bulkhead driver: hostile test mode {}: misbehaving from now on", h.as_str());
            if h == Hostility::LogFlood {
                flood_log();
            }
        }
        if active && h == Hostility::StopAnswering {
            // Stay alive and take nothing more.
            poller.wait(500, |_| {}).map_err(|e| crate::KitError(e.to_string()))?;
            for q in &queues {
                q.ring.set_running();
                q.kick.drain();
            }
            continue;
        }
        if active && h == Hostility::DoorbellStorm {
            for q in &queues {
                q.irq.ring();
            }
            rings += queues.len() as u64;
            let now = now_ns();
            if storm_since == 0 {
                (storm_since, storm_said) = (now, now);
            } else if now - storm_said >= 5_000_000_000 {
                storm_said = now;
                eprintln!("doorbell storm: {rings} rings in {:.3} s", (now - storm_since) as f64 / 1e9);
            }
        }
        let mut served = 0;
        for (qi, q) in queues.iter_mut().enumerate() {
            let mut results: Vec<ResponseSlot> = Vec::new();
            while results.len() < 32 {
                let slot = match q.ring.pop_request() {
                    Ok(Some(s)) => s,
                    Ok(None) => break,
                    Err(e) => return Err(crate::KitError(format!("queue {qi}: {e}"))),
                };
                let (status, len) = match validate_request(&slot, q.arenas, spec.size, q.ring.generation()) {
                    Err(_) => (Status::Invalid, 0),
                    Ok(v) => {
                        let req = v.command(|| q.buffers(&v));
                        let mut io = [Io::new(req)];
                        ram.execute(&mut io);
                        match &io[0].result {
                            Ok(n) => (Status::Ok, *n),
                            Err(e) => (e.status(), 0),
                        }
                    }
                };
                results.push(ResponseSlot {
                    id: slot.id,
                    generation: slot.generation,
                    status: status_code(status),
                    len,
                    reserved: 0,
                });
            }
            if results.is_empty() {
                continue;
            }
            served += results.len();
            if active {
                misbehave(h, qi, &mut results);
                if h == Hostility::DoorbellStorm {
                    // Answer slowly, ringing all the while: the frontend waits, and every
                    // wake-up it gets is empty.
                    let until = now_ns() + 2_000_000;
                    while now_ns() < until {
                        q.irq.ring();
                        rings += 1;
                    }
                }
            }
            for r in &results {
                let _ = q.ring.push(r);
            }
            if q.ring.publish() {
                q.irq.ring();
            }
            if active && h == Hostility::CorruptIndex {
                let map = q.ring.mapping();
                let nslots = map.atomic_u32(HeaderOffsets::NSLOTS).map(|a| a.load(Ordering::Relaxed)).unwrap_or(64);
                if let Ok(prod) = map.atomic_u32(HeaderOffsets::RSP_PROD) {
                    prod.fetch_add(nslots.wrapping_mul(3), Ordering::Release);
                }
                q.irq.ring();
            }
            completed += results.len() as u64;
        }
        if served > 0 {
            idle_since = None;
            continue;
        }
        // Idle: spin for 50 µs (never while storming), then sleep on the doorbells.
        let since = *idle_since.get_or_insert_with(now_ns);
        if (active && h == Hostility::DoorbellStorm) || now_ns() - since < 50_000 {
            std::hint::spin_loop();
            continue;
        }
        let mut pending = false;
        for q in &queues {
            pending |= q.ring.prepare_sleep();
        }
        if !pending {
            poller.wait(100, |_| {}).map_err(|e| crate::KitError(e.to_string()))?;
        }
        for q in &queues {
            q.ring.set_running();
            q.kick.drain();
        }
        idle_since = None;
    }
    Ok(())
}

/// Rewrites a batch of responses the way `h` misbehaves.
fn misbehave(h: Hostility, qi: usize, results: &mut Vec<ResponseSlot>) {
    let first = results[0];
    match h {
        Hostility::UnknownId => results[0].id ^= 0x5a5a << 40,
        Hostility::DuplicateId => results.push(first),
        Hostility::StaleGeneration => results[0].generation = first.generation.wrapping_sub(1),
        Hostility::OutOfOrder => results.reverse(),
        Hostility::WrongLength => results[0].len = first.len + 4096,
        Hostility::BadStatus => results[0].status = 0xbad,
        Hostility::CorruptSlot => {
            let mut g = bulkhead_rng::Rng::new(first.id ^ now_ns());
            results[0] = ResponseSlot {
                id: g.next_u64(),
                generation: g.next_u64() as u32,
                status: g.next_u64() as u32,
                len: g.next_u64(),
                reserved: g.next_u64(),
            };
        }
        Hostility::ExitMidRequest => {
            eprintln!("bulkhead driver: hostile test mode: exiting with {} requests of queue {qi} unanswered", results.len());
            std::process::exit(3);
        }
        Hostility::CorruptIndex | Hostility::DoorbellStorm | Hostility::StopAnswering | Hostility::LogFlood => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for h in Hostility::ALL {
            assert_eq!(Hostility::parse(h.as_str()), Some(h));
        }
        assert_eq!(Hostility::parse("friendly"), None);
    }
}
