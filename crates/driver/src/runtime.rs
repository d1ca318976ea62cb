//! The service loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrayvec::ArrayVec;
use bulkhead_block::{Backend, Io, Request};
use bulkhead_channel::{BackQueue, Popped};
use bulkhead_doorbell::{now_ns, BudgetPolicy, NotifyMode, Poller, SpinBudget};
use bulkhead_ring::{HeaderOffsets, Op, ResponseSlot, Status, ValidRequest};

use crate::hostile::{Garbage, Hostility, TRIGGER_AFTER};
use crate::DriverError;

/// Requests taken from one queue per turn.
const BATCH: usize = 32;

/// Counters of a running domain.
#[derive(Debug, Clone, Copy, Default)]
pub struct DomainStats {
    /// Requests answered.
    pub completed: u64,
    /// Requests refused as malformed.
    pub invalid: u64,
    /// Times the loop slept.
    pub sleeps: u64,
}

/// A driver domain's queues and chain.
pub struct Domain {
    queues: Vec<BackQueue>,
    chain: Box<dyn Backend>,
    mode: NotifyMode,
    budget: SpinBudget,
    poller: Poller,
    stop: Arc<AtomicBool>,
    stats: DomainStats,
    /// Test-only misbehaviour, and whether it has started.
    hostile: Option<Hostility>,
    turned: bool,
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain").field("queues", &self.queues.len()).field("mode", &self.mode).finish()
    }
}

enum Taken {
    Valid(ValidRequest),
    Invalid { id: u64, generation: u32 },
}

impl Domain {
    /// A domain serving `queues` through `chain`; `stop` ends [`run`](Self::run).
    pub fn new(
        mut queues: Vec<BackQueue>,
        chain: Box<dyn Backend>,
        mode: NotifyMode,
        budget: BudgetPolicy,
        stop: Arc<AtomicBool>,
    ) -> Result<Self, DriverError> {
        let poller = Poller::new().map_err(|e| DriverError::Setup(e.to_string()))?;
        for (i, q) in queues.iter_mut().enumerate() {
            q.set_peer_polls(mode == NotifyMode::Poll);
            poller.add(q.kick_fd(), i as u64).map_err(|e| DriverError::Setup(e.to_string()))?;
        }
        Ok(Domain {
            queues,
            chain,
            mode,
            budget: SpinBudget::new(budget),
            poller,
            stop,
            stats: DomainStats::default(),
            hostile: None,
            turned: false,
        })
    }

    /// Makes this domain misbehave once it has answered [`TRIGGER_AFTER`] requests (tests only).
    pub fn set_hostility(&mut self, h: Hostility) {
        self.hostile = Some(h);
    }

    /// The hostile behaviour in force now, announcing it the first time.
    fn hostile_now(&mut self) -> Option<Hostility> {
        let h = self.hostile?;
        if h != Hostility::OutOfOrder && self.stats.completed < TRIGGER_AFTER {
            return None;
        }
        if !self.turned {
            self.turned = true;
            eprintln!("bulkhead driver: hostile test mode {}: misbehaving from now on", h.as_str());
            if h == Hostility::LogFlood {
                crate::hostile::flood_log();
            }
        }
        Some(h)
    }

    /// Queue `i`'s driver end (for test modes).
    pub fn queue(&self, i: usize) -> Option<&BackQueue> {
        self.queues.get(i)
    }

    /// Counters.
    pub fn stats(&self) -> DomainStats {
        self.stats
    }

    /// Serves one batch from queue `qi`; returns how many requests it answered.
    fn serve_queue(&mut self, qi: usize) -> Result<usize, DriverError> {
        let mut taken: ArrayVec<Taken, BATCH> = ArrayVec::new();
        {
            let q = &mut self.queues[qi];
            while !taken.is_full() {
                match q.pop().map_err(|source| DriverError::Channel { queue: qi, source })? {
                    None => break,
                    Some(Popped::Valid(r)) => taken.push(Taken::Valid(r)),
                    Some(Popped::Invalid { id, generation, error }) => {
                        if self.stats.invalid.is_power_of_two() {
                            eprintln!(
                                "bulkhead driver: queue {qi}: refused request {id:#x}: {error} ({} so far)",
                                self.stats.invalid + 1
                            );
                        }
                        self.stats.invalid += 1;
                        taken.push(Taken::Invalid { id, generation });
                    }
                }
            }
        }
        if taken.is_empty() {
            return Ok(0);
        }
        let mut results: ArrayVec<ResponseSlot, BATCH> = ArrayVec::new();
        {
            let q = &self.queues[qi];
            let mut ios: ArrayVec<Io<'_>, BATCH> = ArrayVec::new();
            for t in &taken {
                if let Taken::Valid(r) = t {
                    let bufs = q.buffers(r);
                    let req = match r.op {
                        Op::Read => Request::Read { offset: r.offset, bufs },
                        Op::Write => Request::Write { offset: r.offset, bufs, fua: r.fua },
                        Op::Flush => Request::Flush,
                        Op::Discard => Request::Discard { offset: r.offset, len: r.len },
                        Op::WriteZeroes => Request::WriteZeroes { offset: r.offset, len: r.len },
                    };
                    ios.push(Io::new(req));
                }
            }
            self.chain.execute(&mut ios);
            if let Some(why) = self.chain.lost() {
                // Answer nothing: the next generation gets every request of this batch again.
                return Err(DriverError::BackendLost(why.to_string()));
            }
            let mut it = ios.iter();
            for t in &taken {
                let (id, generation, status, len) = match t {
                    Taken::Valid(r) => {
                        let io = it.next().expect("one io per valid request");
                        match &io.result {
                            Ok(n) => (r.id, r.generation, Status::Ok, *n),
                            Err(e) => {
                                eprintln!("bulkhead driver: request {:#x}: {e}", r.id);
                                (r.id, r.generation, e.status(), 0)
                            }
                        }
                    }
                    Taken::Invalid { id, generation } => (*id, *generation, Status::Invalid, 0),
                };
                results.push(ResponseSlot { id, generation, status: status as u32, len, reserved: 0 });
            }
        }
        let n = results.len();
        if let Some(h) = self.hostile_now() {
            self.misbehave(h, qi, &mut results);
            if h == Hostility::DoorbellStorm {
                // Answer slowly, ringing all the while: the frontend waits, and every wake-up
                // it gets is empty.
                let until = now_ns() + 2_000_000;
                while now_ns() < until {
                    for q in &self.queues {
                        q.ring_peer();
                    }
                }
            }
        }
        let q = &mut self.queues[qi];
        for rsp in results {
            q.complete_raw(rsp);
        }
        q.publish();
        if self.hostile_now() == Some(Hostility::CorruptIndex) {
            let nslots =
                self.queues[qi].ring_mapping().atomic_u32(HeaderOffsets::NSLOTS).map(|a| a.load(Ordering::Relaxed)).unwrap_or(64);
            if let Ok(prod) = self.queues[qi].ring_mapping().atomic_u32(HeaderOffsets::RSP_PROD) {
                prod.fetch_add(nslots.wrapping_mul(3), Ordering::Release);
            }
            self.queues[qi].ring_peer();
        }
        self.stats.completed += n as u64;
        Ok(n)
    }

    /// Rewrites a batch of responses the way `h` misbehaves (tests only).
    fn misbehave(&mut self, h: Hostility, qi: usize, results: &mut ArrayVec<ResponseSlot, BATCH>) {
        let first = results[0];
        match h {
            Hostility::UnknownId => results[0].id ^= 0x5a5a << 40,
            Hostility::DuplicateId => {
                if results.is_full() {
                    results.pop();
                }
                results.push(first);
            }
            Hostility::StaleGeneration => results[0].generation = first.generation.wrapping_sub(1),
            Hostility::OutOfOrder => results.reverse(),
            Hostility::WrongLength => results[0].len = first.len + 4096,
            Hostility::BadStatus => results[0].status = 0xbad,
            Hostility::CorruptSlot => {
                let mut g = Garbage::new(first.id ^ now_ns());
                results[0] = ResponseSlot {
                    id: g.next(),
                    generation: g.next() as u32,
                    status: g.next() as u32,
                    len: g.next(),
                    reserved: g.next(),
                };
            }
            Hostility::ExitMidRequest => {
                eprintln!("bulkhead driver: hostile test mode: exiting with {} requests of queue {qi} unanswered", results.len());
                std::process::exit(3);
            }
            Hostility::CorruptIndex | Hostility::DoorbellStorm | Hostility::StopAnswering | Hostility::LogFlood => {}
        }
    }

    /// One round over every queue.
    pub fn poll_once(&mut self) -> Result<usize, DriverError> {
        let mut n = 0;
        for qi in 0..self.queues.len() {
            n += self.serve_queue(qi)?;
        }
        Ok(n)
    }

    fn any_pending(&self) -> bool {
        self.queues.iter().any(|q| q.pending())
    }

    /// Serves until the stop flag is set, spinning and sleeping per the notification mode.
    pub fn run(&mut self) -> Result<(), DriverError> {
        self.chain.start().map_err(DriverError::BackendLost)?;
        let mut idle_since: Option<u64> = None;
        let mut spins = 0u32;
        let mut slept = false;
        let tunes = self.mode == NotifyMode::Adaptive && self.budget.tunes();
        while !self.stop.load(Ordering::Relaxed) {
            match self.hostile_now() {
                Some(Hostility::StopAnswering) => return self.play_dead(),
                Some(Hostility::DoorbellStorm) => {
                    for q in &self.queues {
                        q.ring_peer();
                    }
                }
                _ => {}
            }
            if self.poll_once()? > 0 {
                if let Some(t) = idle_since.take() {
                    if tunes {
                        if std::mem::take(&mut slept) {
                            self.budget.record_after_sleep(now_ns() - t);
                        } else {
                            self.budget.record(now_ns() - t);
                        }
                    }
                }
                spins = 0;
                continue;
            }
            let storming = self.turned && self.hostile == Some(Hostility::DoorbellStorm);
            let sleep = match self.mode {
                _ if storming => false,
                NotifyMode::Poll => false,
                NotifyMode::Irq => true,
                NotifyMode::Adaptive => {
                    // Only this mode times the idle gap: poll and irq read no clock per request.
                    let since = *idle_since.get_or_insert_with(now_ns);
                    spins = spins.wrapping_add(1);
                    spins.is_multiple_of(32) && now_ns() - since >= self.budget.budget_ns()
                }
            };
            if !sleep {
                for _ in 0..8 {
                    if self.any_pending() {
                        break;
                    }
                    std::hint::spin_loop();
                }
                continue;
            }
            self.sleep()?;
            slept = true;
        }
        Ok(())
    }

    /// Stays alive and takes nothing more (the stop-answering test mode).
    fn play_dead(&mut self) -> Result<(), DriverError> {
        while !self.stop.load(Ordering::Relaxed) {
            self.poller.wait(500, |_| {}).map_err(|e| DriverError::Setup(e.to_string()))?;
            for q in &self.queues {
                q.set_running();
            }
        }
        Ok(())
    }

    fn sleep(&mut self) -> Result<(), DriverError> {
        let mut pending = false;
        for q in &self.queues {
            pending |= q.prepare_sleep();
        }
        if !pending {
            self.stats.sleeps += 1;
            // A bounded wait, so a stop request racing the sleep is seen within half a second.
            self.poller.wait(500, |_| {}).map_err(|e| DriverError::Setup(e.to_string()))?;
        }
        for q in &self.queues {
            q.set_running();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_backends::RamBackend;
    use bulkhead_block::Chain;
    use bulkhead_channel::{pair, FrontRequest, QueueConfig};
    use bulkhead_shmem::{memfd, Mapping, Protection};
    use bulkhead_testkit::XorLayer;
    use std::os::fd::AsRawFd;

    fn run_chain_test(mode: NotifyMode) {
        let size = 4 << 20;
        let cfg = QueueConfig { nslots: 16, arena_bytes: 1 << 20, mode, ..Default::default() };
        let (mut front, back) = pair(&cfg, size).unwrap();
        let ram_fd = memfd::create("ram", size).unwrap();
        let probe = Mapping::new(ram_fd.as_raw_fd(), size as usize, Protection::ReadOnly).unwrap();
        let ram = RamBackend::new(ram_fd, size).unwrap();
        let chain = Chain::new(vec![Box::new(XorLayer::new(0x5a, 1 << 20))], Box::new(ram));
        let stop = Arc::new(AtomicBool::new(false));
        let mut dom = Domain::new(vec![back], Box::new(chain), mode, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        let t = std::thread::spawn(move || {
            dom.run().unwrap();
            dom.stats()
        });

        let data: Vec<u8> = (0..65536u32).map(|i| (i * 31 % 256) as u8).collect();
        let r = front.execute(FrontRequest::Write { offset: 8192, data: &data, fua: false }, 5000, |_| {}).unwrap();
        assert_eq!(r, Ok(65536));
        assert_eq!(front.execute(FrontRequest::Flush, 5000, |_| {}).unwrap(), Ok(0));
        // The backend holds transformed bytes: the layer really sat in the path.
        let mut stored = vec![0u8; 65536];
        probe.slice(8192, 65536).unwrap().copy_to(&mut stored);
        assert!(stored.iter().zip(&data).all(|(s, d)| *s == d ^ 0x5a));
        let mut back_out = vec![0u8; 65536];
        let r = front.execute(FrontRequest::Read { offset: 8192, len: 65536 }, 5000, |w| w.copy_to(&mut back_out)).unwrap();
        assert_eq!(r, Ok(65536));
        assert_eq!(back_out, data);
        // An operation the layer refuses comes back as its status, not as silent success.
        let r = front.execute(FrontRequest::WriteZeroes { offset: 0, len: 4096 }, 5000, |_| {}).unwrap();
        assert_eq!(r, Err(Status::NotSupported));
        stop.store(true, Ordering::Relaxed);
        let stats = t.join().unwrap();
        assert_eq!(stats.completed, 4);
    }

    #[test]
    fn chain_with_test_layer_serves_in_poll_mode() {
        run_chain_test(NotifyMode::Poll);
    }

    #[test]
    fn chain_with_test_layer_serves_in_irq_mode() {
        run_chain_test(NotifyMode::Irq);
    }

    #[test]
    fn chain_with_test_layer_serves_in_adaptive_mode() {
        run_chain_test(NotifyMode::Adaptive);
    }

    #[test]
    fn request_past_device_end_is_answered_invalid() {
        let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Poll, ..Default::default() };
        let (mut front, back) = pair(&cfg, 1 << 16).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let null = bulkhead_backends::NullBackend::new(1 << 16);
        let mut dom =
            Domain::new(vec![back], Box::new(null), NotifyMode::Poll, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        let t = std::thread::spawn(move || dom.run());
        let r = front.execute(FrontRequest::Read { offset: 1 << 16, len: 4096 }, 5000, |_| {}).unwrap();
        assert_eq!(r, Err(Status::Invalid));
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap().unwrap();
    }
}
