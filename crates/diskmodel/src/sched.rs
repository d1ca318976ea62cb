//! Disk schedulers: given the requests queued for the drive and the model's view of it
//! (where the head is, what the cache holds), which to send next.
//!
//! - `fcfs`: arrival order.
//! - `satf`: shortest access time first, as the model predicts it (greedy).
//! - `opt`: the first request of the order that minimises the queue's total response time
//!   ([algorithm T](crate::opt)), recomputed at every dispatch.
//! - `deadline`: Linux's deadline elevator: requests in sector order, one way, in batches;
//!   reads preferred; a request past its expiry starts the next batch.
//! - `cats`: cache-aware table scheduling, as Jones' performance modeling paper gives it: a
//!   predicted cache hit at once; reads before writes, in algorithm T's order; writes held until
//!   the oldest has waited a minimum delay (or a maximum, whatever reads are queued) and then
//!   served as a burst in circular-scan order; up to 5 ms of anticipation after a read, against
//!   deceptive idleness, for a stream whose reads have come soon and close to each other.
//!
//! Every scheduler coalesces: after the request it picks, it takes the queued requests of the
//! same direction that continue it, so that one access serves them all.
//!
//! No scheduler starves a request. `fcfs` serves in arrival order. `satf` and `opt` serve the
//! oldest request first once it has waited `expire` (500 ms by default), so a request waits
//! at most `expire` plus the service of the requests older than it. `deadline` serves a read
//! past `read_expire` (500 ms) or a write past `write_expire` (5 s) at the start of the next
//! batch, and serves writes after at most `writes_starved` read batches. `cats` serves a read
//! past `read_expire` first, and starts a write burst when the oldest write has waited
//! `max_write_delay` (100 ms), whatever reads are queued; a burst serves the writes queued
//! when it began and no others, so it ends.

use serde::{Deserialize, Serialize};

use crate::opt::{Optimiser, MAX_QUEUE};

use crate::{Access, Model};

/// A request waiting for the drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queued {
    /// The caller's name for it (a tag, a request number).
    pub id: u64,
    /// What it reads or writes.
    pub access: Access,
    /// When it arrived, ns.
    pub arrival_ns: u64,
    /// Who sent it (a queue, a process): anticipation waits for the stream whose read just
    /// completed.
    pub stream: u32,
}

/// What a scheduler decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Send the requests it put in the batch, in order, as one access.
    Dispatch,
    /// Nothing now, though requests are queued: ask again at this time (or when one
    /// arrives, or one completes).
    Wait(u64),
    /// Nothing is queued.
    Empty,
}

/// A scheduling policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// First come, first served.
    Fcfs,
    /// Shortest access time first.
    Satf,
    /// Algorithm T's optimal order, recomputed at every dispatch.
    Opt,
    /// Linux's deadline elevator.
    Deadline,
    /// Cache-aware table scheduling.
    Cats,
}

impl Policy {
    /// Every policy.
    pub const ALL: [Policy; 5] = [Policy::Fcfs, Policy::Satf, Policy::Opt, Policy::Deadline, Policy::Cats];

    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Satf => "satf",
            Policy::Opt => "opt",
            Policy::Deadline => "deadline",
            Policy::Cats => "cats",
        }
    }

    /// The policy of a name.
    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// The knobs of the schedulers, each used by those the field names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tuning {
    /// `satf`, `opt`: a request that has waited this long is served before any other but
    /// older ones.
    pub expire_ns: u64,
    /// `deadline`, `cats`: the same for reads.
    pub read_expire_ns: u64,
    /// `deadline`: the same for writes.
    pub write_expire_ns: u64,
    /// `deadline`: requests of one batch.
    pub fifo_batch: u32,
    /// `deadline`: read batches at most while writes wait.
    pub writes_starved: u32,
    /// `cats`: writes wait at least this long, to gather a burst (unless nothing else is
    /// queued and no read is anticipated).
    pub min_write_delay_ns: u64,
    /// `cats`: the oldest write waits at most this long before a burst starts.
    pub max_write_delay_ns: u64,
    /// `cats`: after a read, how long to wait for the next read of its stream.
    pub anticipate_ns: u64,
    /// `cats`: a read within this many sectors of the head is taken without anticipation.
    pub near_sectors: u64,
    /// Every scheduler: sectors of one coalesced access at most.
    pub max_coalesce_sectors: u64,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            expire_ns: 500_000_000,
            read_expire_ns: 500_000_000,
            write_expire_ns: 5_000_000_000,
            fifo_batch: 16,
            writes_starved: 2,
            min_write_delay_ns: 10_000_000,
            max_write_delay_ns: 100_000_000,
            anticipate_ns: 5_000_000,
            near_sectors: 2048,
            max_coalesce_sectors: 2048,
        }
    }
}

/// A disk scheduler.
pub trait Scheduler: Send + std::fmt::Debug {
    /// Its policy.
    fn policy(&self) -> Policy;
    /// A request arrives.
    fn add(&mut self, q: Queued);
    /// The drive can take an access at `now_ns`: pick it into `batch` (cleared first) from
    /// what is queued, with the model as the drive is now.
    fn next(&mut self, now_ns: u64, model: &Model, batch: &mut Vec<Queued>) -> Next;
    /// An access it dispatched has completed at `now_ns`.
    fn completed(&mut self, _first: &Queued, _now_ns: u64) {}
    /// Requests queued.
    fn len(&self) -> usize;
    /// Whether nothing is queued.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A scheduler of `policy`.
pub fn build(policy: Policy, tuning: Tuning) -> Box<dyn Scheduler> {
    match policy {
        Policy::Fcfs => Box::new(Fcfs { q: Queue::default(), tuning }),
        Policy::Satf => Box::new(Satf { q: Queue::default(), tuning }),
        Policy::Opt => Box::new(Opt { q: Queue::default(), tuning, pick: Picker::default() }),
        Policy::Deadline => Box::new(Deadline::new(tuning)),
        Policy::Cats => Box::new(Cats::new(tuning)),
    }
}

/// Queued requests in arrival order.
#[derive(Debug, Default, Clone)]
struct Queue {
    q: Vec<Queued>,
}

impl Queue {
    fn push(&mut self, r: Queued) {
        self.q.push(r);
    }

    fn len(&self) -> usize {
        self.q.len()
    }

    /// The index of the oldest request matching `f`.
    fn oldest(&self, f: impl Fn(&Queued) -> bool) -> Option<usize> {
        self.q.iter().position(f)
    }

    /// Takes request `i` into `batch`, then every queued request of its direction that
    /// continues the access, up to `max_sectors` in all.
    fn take_coalesced(&mut self, i: usize, max_sectors: u64, batch: &mut Vec<Queued>) {
        batch.clear();
        let first = self.q.remove(i);
        let (write, mut end, mut sectors) = (first.access.write, first.access.end(), first.access.sectors);
        batch.push(first);
        while let Some(k) = self
            .q
            .iter()
            .position(|r| r.access.write == write && r.access.start == end && sectors + r.access.sectors <= max_sectors)
        {
            let r = self.q.remove(k);
            end = r.access.end();
            sectors += r.access.sectors;
            batch.push(r);
        }
    }

    /// The oldest request if it has waited `expire` by `now`.
    fn expired(&self, now: u64, expire: u64, f: impl Fn(&Queued) -> bool) -> Option<usize> {
        self.oldest(f).filter(|&i| now.saturating_sub(self.q[i].arrival_ns) >= expire)
    }
}

/// The access a batch makes: from its first request's start over all its sectors.
pub fn batch_access(batch: &[Queued]) -> Access {
    let first = batch[0].access;
    Access { start: first.start, sectors: batch.iter().map(|r| r.access.sectors).sum(), write: first.write }
}

#[derive(Debug)]
struct Fcfs {
    q: Queue,
    tuning: Tuning,
}

impl Scheduler for Fcfs {
    fn policy(&self) -> Policy {
        Policy::Fcfs
    }
    fn add(&mut self, q: Queued) {
        self.q.push(q);
    }
    fn next(&mut self, _: u64, _: &Model, batch: &mut Vec<Queued>) -> Next {
        if self.q.len() == 0 {
            return Next::Empty;
        }
        // Arrival order: only what directly follows the oldest in the queue continues it.
        batch.clear();
        let first = self.q.q.remove(0);
        let (mut end, mut sectors) = (first.access.end(), first.access.sectors);
        batch.push(first);
        while let Some(r) = self.q.q.first() {
            if r.access.write != first.access.write
                || r.access.start != end
                || sectors + r.access.sectors > self.tuning.max_coalesce_sectors
            {
                break;
            }
            let r = self.q.q.remove(0);
            end = r.access.end();
            sectors += r.access.sectors;
            batch.push(r);
        }
        Next::Dispatch
    }
    fn len(&self) -> usize {
        self.q.len()
    }
}

#[derive(Debug)]
struct Satf {
    q: Queue,
    tuning: Tuning,
}

impl Scheduler for Satf {
    fn policy(&self) -> Policy {
        Policy::Satf
    }
    fn add(&mut self, q: Queued) {
        self.q.push(q);
    }
    fn next(&mut self, now: u64, model: &Model, batch: &mut Vec<Queued>) -> Next {
        if self.q.len() == 0 {
            return Next::Empty;
        }
        let i = self.q.expired(now, self.tuning.expire_ns, |_| true).unwrap_or_else(|| {
            let best = self.q.q.iter().enumerate().min_by_key(|(i, r)| (model.predict(&r.access).ns, *i));
            best.map(|(i, _)| i).expect("queue is not empty")
        });
        self.q.take_coalesced(i, self.tuning.max_coalesce_sectors, batch);
        Next::Dispatch
    }
    fn len(&self) -> usize {
        self.q.len()
    }
}

/// Algorithm T with its inputs' buffers, kept between dispatches.
#[derive(Debug, Default)]
struct Picker {
    opt: Optimiser,
    positions: Vec<u64>,
    index: Vec<usize>,
}

/// Algorithm T's first pick among the queued requests matching `f` (the oldest
/// [`MAX_QUEUE`] of them), with the model's costs: `a = S`, `b = (R/2 + mean transfer)·D`,
/// so that `a·d + b` is the seek model scaled by `D` exactly.
fn optimal_first(opt: &mut Picker, q: &Queue, model: &Model, f: impl Fn(&Queued) -> bool) -> Option<usize> {
    let Picker { opt, positions, index } = opt;
    positions.clear();
    index.clear();
    let mut sectors = 0u64;
    for (i, r) in q.q.iter().enumerate().filter(|(_, r)| f(r)).take(MAX_QUEUE) {
        positions.push(r.access.start);
        index.push(i);
        sectors += r.access.sectors;
    }
    if positions.is_empty() {
        return None;
    }
    let d = model.drive();
    let mean = sectors / positions.len() as u64;
    let a = d.full_seek_ns as u128;
    let b = d.fixed_ns(mean) as u128 * d.sectors as u128;
    opt.first(model.head(), positions, a, b).map(|k| index[k])
}

#[derive(Debug)]
struct Opt {
    q: Queue,
    tuning: Tuning,
    pick: Picker,
}

impl Scheduler for Opt {
    fn policy(&self) -> Policy {
        Policy::Opt
    }
    fn add(&mut self, q: Queued) {
        self.q.push(q);
    }
    fn next(&mut self, now: u64, model: &Model, batch: &mut Vec<Queued>) -> Next {
        if self.q.len() == 0 {
            return Next::Empty;
        }
        let i = match self.q.expired(now, self.tuning.expire_ns, |_| true) {
            Some(i) => i,
            None => optimal_first(&mut self.pick, &self.q, model, |_| true).expect("queue is not empty"),
        };
        self.q.take_coalesced(i, self.tuning.max_coalesce_sectors, batch);
        Next::Dispatch
    }
    fn len(&self) -> usize {
        self.q.len()
    }
}

#[derive(Debug)]
struct Deadline {
    q: Queue,
    tuning: Tuning,
    /// Direction of the batch going on (true: writes), and requests it has served.
    batch_dir: Option<bool>,
    batched: u32,
    /// Where the last access ended: the batch goes on from there, upwards.
    next_sector: u64,
    /// Read batches started while writes waited.
    starved: u32,
}

impl Deadline {
    fn new(tuning: Tuning) -> Self {
        Deadline { q: Queue::default(), tuning, batch_dir: None, batched: 0, next_sector: 0, starved: 0 }
    }

    /// The queued request of direction `write` that comes next in sector order from
    /// `next_sector`, upwards.
    fn next_in_order(&self, write: bool) -> Option<usize> {
        self.q
            .q
            .iter()
            .enumerate()
            .filter(|(_, r)| r.access.write == write && r.access.start >= self.next_sector)
            .min_by_key(|(i, r)| (r.access.start, *i))
            .map(|(i, _)| i)
    }
}

impl Scheduler for Deadline {
    fn policy(&self) -> Policy {
        Policy::Deadline
    }
    fn add(&mut self, q: Queued) {
        self.q.push(q);
    }
    fn next(&mut self, now: u64, _: &Model, batch: &mut Vec<Queued>) -> Next {
        if self.q.len() == 0 {
            return Next::Empty;
        }
        // The batch goes on while it can.
        if let Some(write) = self.batch_dir {
            if self.batched < self.tuning.fifo_batch {
                if let Some(i) = self.next_in_order(write) {
                    self.batched += 1;
                    self.q.take_coalesced(i, self.tuning.max_coalesce_sectors, batch);
                    self.next_sector = batch_access(batch).end();
                    return Next::Dispatch;
                }
            }
        }
        let reads = self.q.oldest(|r| !r.access.write).is_some();
        let writes = self.q.oldest(|r| r.access.write).is_some();
        let write = if reads && (!writes || self.starved < self.tuning.writes_starved) {
            if writes {
                self.starved += 1;
            }
            false
        } else {
            self.starved = 0;
            true
        };
        let expire = if write { self.tuning.write_expire_ns } else { self.tuning.read_expire_ns };
        let i = self
            .q
            .expired(now, expire, |r| r.access.write == write)
            .or_else(|| self.next_in_order(write))
            .or_else(|| self.q.oldest(|r| r.access.write == write))
            .expect("a request of the chosen direction is queued");
        self.batch_dir = Some(write);
        self.batched = 1;
        self.q.take_coalesced(i, self.tuning.max_coalesce_sectors, batch);
        self.next_sector = batch_access(batch).end();
        Next::Dispatch
    }
    fn len(&self) -> usize {
        self.q.len()
    }
}

#[derive(Debug)]
struct Cats {
    q: Queue,
    tuning: Tuning,
    pick: Picker,
    /// The writes of the burst going on, by id.
    burst: Vec<u64>,
    /// The stream of the last completed read and when it completed.
    last_read: Option<(u32, u64)>,
    /// What each stream's reads have been like, to tell whether waiting for one pays.
    streams: Vec<StreamHabits>,
}

/// A stream's habits, as anticipation judges them: how long after its read completes it sends
/// the next, and how far from the last that one lies (exponentially weighted means).
#[derive(Debug, Clone, Copy)]
struct StreamHabits {
    stream: u32,
    last_done: u64,
    last_end: u64,
    think_ns: f64,
    distance: f64,
    samples: u32,
}

impl StreamHabits {
    /// Whether its next read is likely soon enough and close enough to wait for: Linux's
    /// anticipatory scheduler asked the same of each process.
    fn worth_waiting(&self, t: &Tuning) -> bool {
        self.samples >= 2 && self.think_ns < t.anticipate_ns as f64 && self.distance <= t.near_sectors as f64
    }
}

impl Cats {
    fn new(tuning: Tuning) -> Self {
        Cats { q: Queue::default(), tuning, pick: Picker::default(), burst: Vec::new(), last_read: None, streams: Vec::new() }
    }

    /// The next write of the burst in circular-scan order: the lowest at or above the head,
    /// else the lowest.
    fn burst_next(&self, head: u64) -> Option<usize> {
        let member = |r: &Queued| r.access.write && self.burst.contains(&r.id);
        let key = |(i, r): &(usize, &Queued)| (r.access.start < head, r.access.start, *i);
        self.q.q.iter().enumerate().filter(|(_, r)| member(r)).min_by_key(key).map(|(i, _)| i)
    }

    fn start_burst(&mut self) {
        self.burst.clear();
        self.burst.extend(self.q.q.iter().filter(|r| r.access.write).map(|r| r.id));
    }

    fn dispatch(&mut self, i: usize, batch: &mut Vec<Queued>) -> Next {
        self.q.take_coalesced(i, self.tuning.max_coalesce_sectors, batch);
        Next::Dispatch
    }
}

impl Scheduler for Cats {
    fn policy(&self) -> Policy {
        Policy::Cats
    }
    fn add(&mut self, q: Queued) {
        if !q.access.write {
            if let Some(h) = self.streams.iter_mut().find(|h| h.stream == q.stream) {
                let think = q.arrival_ns.saturating_sub(h.last_done) as f64;
                let distance = q.access.start.abs_diff(h.last_end) as f64;
                if h.samples == 0 {
                    (h.think_ns, h.distance) = (think, distance);
                } else {
                    h.think_ns = 0.75 * h.think_ns + 0.25 * think;
                    h.distance = 0.75 * h.distance + 0.25 * distance;
                }
                h.samples = h.samples.saturating_add(1);
            }
        }
        self.q.push(q);
    }
    fn completed(&mut self, first: &Queued, now: u64) {
        if first.access.write {
            return;
        }
        self.last_read = Some((first.stream, now));
        let end = first.access.end();
        match self.streams.iter_mut().find(|h| h.stream == first.stream) {
            Some(h) => (h.last_done, h.last_end) = (now, end),
            None => self.streams.push(StreamHabits {
                stream: first.stream,
                last_done: now,
                last_end: end,
                think_ns: 0.0,
                distance: 0.0,
                samples: 0,
            }),
        }
    }
    fn next(&mut self, now: u64, model: &Model, batch: &mut Vec<Queued>) -> Next {
        if self.q.len() == 0 {
            self.burst.clear();
            return Next::Empty;
        }
        let t = self.tuning;
        // A predicted cache hit costs next to nothing and moves no head: at once.
        if let Some(i) = self.q.q.iter().position(|r| model.would_hit(&r.access)) {
            return self.dispatch(i, batch);
        }
        // A burst of writes goes on until the writes it began with are served.
        if !self.burst.is_empty() {
            match self.burst_next(model.head()) {
                Some(i) => {
                    let n = self.dispatch(i, batch);
                    self.burst.retain(|id| !batch.iter().any(|r| r.id == *id));
                    return n;
                }
                None => self.burst.clear(),
            }
        }
        let oldest_write = self.q.oldest(|r| r.access.write).map(|i| self.q.q[i].arrival_ns);
        let start_burst = |this: &mut Self, batch: &mut Vec<Queued>| {
            this.start_burst();
            let i = this.burst_next(model.head()).expect("a burst has writes");
            let n = this.dispatch(i, batch);
            this.burst.retain(|id| !batch.iter().any(|r| r.id == *id));
            n
        };
        if oldest_write.is_some_and(|at| now.saturating_sub(at) >= t.max_write_delay_ns) {
            return start_burst(self, batch);
        }
        if let Some(i) = self.q.expired(now, t.read_expire_ns, |r| !r.access.write) {
            return self.dispatch(i, batch);
        }
        let best = optimal_first(&mut self.pick, &self.q, model, |r| !r.access.write);
        // Anticipation: the stream whose read just completed may send the next one close by;
        // going far away (or to a write burst) first would waste the seek back.
        let anticipating = match self.last_read {
            Some((stream, done)) if now < done + t.anticipate_ns => {
                let queued = self.q.q.iter().any(|r| r.stream == stream && !r.access.write);
                let near = best.is_some_and(|i| self.q.q[i].access.start.abs_diff(model.head()) <= t.near_sectors);
                let worth = self.streams.iter().any(|h| h.stream == stream && h.worth_waiting(&t));
                (worth && !queued && !near).then_some(done + t.anticipate_ns)
            }
            _ => None,
        };
        if let Some(until) = anticipating {
            let until = oldest_write.map_or(until, |at| until.min(at + t.max_write_delay_ns));
            return Next::Wait(until);
        }
        if let Some(i) = best {
            return self.dispatch(i, batch);
        }
        let at = oldest_write.expect("the queue holds only writes");
        if now.saturating_sub(at) >= t.min_write_delay_ns {
            return start_burst(self, batch);
        }
        Next::Wait(at + t.min_write_delay_ns)
    }
    fn len(&self) -> usize {
        self.q.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{self, Arrival, Trace};
    use crate::Drive;

    fn drive() -> Drive {
        Drive { cache: None, ..Drive::seed(1_000_000) }
    }

    fn q(id: u64, start: u64, write: bool, at: u64, stream: u32) -> Queued {
        Queued { id, access: Access { start, sectors: 8, write }, arrival_ns: at, stream }
    }

    fn ids(batch: &[Queued]) -> Vec<u64> {
        batch.iter().map(|r| r.id).collect()
    }

    #[test]
    fn every_scheduler_coalesces_requests_that_continue_each_other() {
        for p in Policy::ALL {
            let mut s = build(p, Tuning { min_write_delay_ns: 0, ..Tuning::default() });
            s.add(q(1, 100, false, 0, 0));
            s.add(q(2, 108, false, 0, 0));
            s.add(q(3, 116, false, 0, 0));
            s.add(q(4, 124, true, 0, 0)); // a write does not join reads
            let model = Model::new(drive());
            let mut batch = Vec::new();
            assert_eq!(s.next(1, &model, &mut batch), Next::Dispatch, "{p:?}");
            assert_eq!(ids(&batch), [1, 2, 3], "{p:?}");
            assert_eq!(batch_access(&batch), Access { start: 100, sectors: 24, write: false });
            assert_eq!(s.len(), 1);
        }
    }

    #[test]
    fn deadline_serves_one_way_in_sector_order_and_prefers_reads() {
        let mut s = build(Policy::Deadline, Tuning::default());
        for (id, start) in [(1, 5000), (2, 100), (3, 9000), (4, 3000)] {
            s.add(q(id, start, false, 0, 0));
        }
        s.add(q(5, 50, true, 0, 0));
        let mut model = Model::new(drive());
        model.set_head(2000);
        let mut batch = Vec::new();
        let mut order = Vec::new();
        while s.next(1, &model, &mut batch) == Next::Dispatch {
            model.serve(&batch_access(&batch));
            order.extend(ids(&batch));
        }
        // The first batch starts at the oldest read (nothing served yet: sector 0 upwards),
        // then goes up; the write waits until reads have had their batches.
        assert_eq!(order, [2, 4, 1, 3, 5]);
    }

    #[test]
    fn cats_serves_a_predicted_cache_hit_first_and_reads_before_writes() {
        let mut s = build(Policy::Cats, Tuning::default());
        let mut model = Model::new(Drive::seed(1_000_000));
        model.serve(&Access { start: 500_000, sectors: 8, write: false }); // fills 500000..500072
        s.add(q(1, 10, true, 0, 0));
        s.add(q(2, 900_000, false, 0, 1));
        s.add(q(3, 500_016, false, 0, 2));
        let mut batch = Vec::new();
        assert_eq!(s.next(20_000_000, &model, &mut batch), Next::Dispatch);
        assert_eq!(ids(&batch), [3], "the predicted hit goes first, though farther than nothing");
        assert_eq!(s.next(20_000_000, &model, &mut batch), Next::Dispatch);
        assert_eq!(ids(&batch), [2], "then the read, though the write is older");
        assert_eq!(s.next(20_000_000, &model, &mut batch), Next::Dispatch);
        assert_eq!(ids(&batch), [1]);
    }

    #[test]
    fn cats_holds_writes_for_the_minimum_delay_then_serves_them_as_a_burst_in_circular_scan_order() {
        let t = Tuning::default();
        let mut s = build(Policy::Cats, t);
        let mut model = Model::new(drive());
        model.set_head(5000);
        for (id, start) in [(1, 8000), (2, 1000), (3, 6000), (4, 3000)] {
            s.add(q(id, start, true, 0, 0));
        }
        let mut batch = Vec::new();
        assert_eq!(s.next(1, &model, &mut batch), Next::Wait(t.min_write_delay_ns));
        let mut order = Vec::new();
        let now = t.min_write_delay_ns;
        while s.next(now, &model, &mut batch) == Next::Dispatch {
            model.serve(&batch_access(&batch));
            order.extend(ids(&batch));
            // A write that arrives during the burst waits for the next one.
            if order.len() == 1 {
                s.add(q(9, 7000, true, now, 0));
            }
        }
        assert_eq!(order, [3, 1, 2, 4], "upwards from the head, then round from the lowest");
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn cats_anticipates_the_next_read_of_the_stream_it_just_served() {
        let t = Tuning::default();
        let mut s = build(Policy::Cats, t);
        let mut model = Model::new(drive());
        let mut batch = Vec::new();
        // Stream 7 reads on and on, each read 1 ms after the last completed, close by.
        let mut now = 0;
        for (id, start) in [(10, 200), (11, 400), (12, 600), (1, 1000)] {
            s.add(q(id, start, false, now, 7));
            assert_eq!(s.next(now, &model, &mut batch), Next::Dispatch);
            assert_eq!(ids(&batch), [id]);
            model.serve(&batch_access(&batch));
            s.completed(&batch[0], now + 1_000_000);
            now += 2_000_000;
        }
        s.completed(&batch[0], 2_000_000);
        // A stream with no such habit is not waited for.
        s.add(q(20, 100, false, 2_000_000, 5));
        assert_eq!(s.next(2_000_000, &model, &mut batch), Next::Dispatch);
        s.completed(&batch[0], 2_000_000);
        s.add(q(21, 900_000, false, 2_000_000, 3));
        assert_eq!(s.next(2_000_000, &model, &mut batch), Next::Dispatch, "stream 5 is not anticipated");
        assert_eq!(ids(&batch), [21]);
        model.set_head(1008);
        s.completed(&Queued { stream: 7, ..batch[0] }, 2_000_000);
        // Another stream's read far away: wait for stream 7 rather than seek there at once.
        s.add(q(2, 900_000, false, 2_000_000, 3));
        assert_eq!(s.next(2_000_000, &model, &mut batch), Next::Wait(2_000_000 + t.anticipate_ns));
        // Stream 7 sends its next read close by: it goes first.
        s.add(q(3, 1100, false, 3_000_000, 7));
        assert_eq!(s.next(3_000_000, &model, &mut batch), Next::Dispatch);
        assert_eq!(ids(&batch), [3]);
        // After the window the far read goes.
        s.completed(&batch[0], 4_000_000);
        assert_eq!(s.next(4_000_000 + t.anticipate_ns, &model, &mut batch), Next::Dispatch);
        assert_eq!(ids(&batch), [2]);
    }

    /// A saturating stream of reads near the start of the device, and one request at its far
    /// end arriving early: a greedy scheduler without a bound would leave it until the stream
    /// stops.
    fn starvation_run(policy: Policy, tuning: Tuning, far_write: bool) -> (u64, u64, u64) {
        let mut arrivals: Vec<Arrival> = (0..1000u64)
            .map(|i| Arrival {
                at_ns: i * 1_500_000,
                access: Access { start: (i * 7919) % 2000 * 8, sectors: 8, write: false },
                stream: (i % 4) as u32,
            })
            .collect();
        arrivals.insert(
            10,
            Arrival { at_ns: 10_000_000, access: Access { start: 999_000, sectors: 8, write: far_write }, stream: 9 },
        );
        let out = sim::run(&drive(), 0, policy, tuning, &mut Trace(arrivals), u64::MAX);
        let far = out.served.iter().find(|r| r.stream == 9).expect("the far request is served");
        let older = out.served.iter().filter(|r| r.arrival_ns < far.arrival_ns).count() as u64;
        let max_service = out.served.iter().map(|r| r.service_ns()).max().unwrap();
        (far.wait_ns(), older, max_service)
    }

    #[test]
    fn no_scheduler_starves_a_far_request_under_a_saturating_stream_of_near_ones() {
        let t = Tuning::default();
        for p in Policy::ALL {
            for far_write in [false, true] {
                let (wait, older, max_service) = starvation_run(p, t, far_write);
                // The stated bounds: the expiry (for cats' writes the maximum write delay; for
                // deadline's writes the write expiry), then at most the older requests, one
                // access each, and the access under way.
                let expire = match (p, far_write) {
                    (Policy::Fcfs, _) => 0,
                    (Policy::Satf | Policy::Opt, _) => t.expire_ns,
                    (Policy::Deadline, false) | (Policy::Cats, false) => t.read_expire_ns,
                    (Policy::Deadline, true) => t.write_expire_ns,
                    (Policy::Cats, true) => t.max_write_delay_ns,
                };
                let bound = expire + (older + 2) * max_service;
                assert!(wait <= bound, "{p:?} write={far_write}: waited {wait} ns, bound {bound} ns");
            }
        }
        // Without the bound, greedy leaves it until the stream stops (1.5 s of arrivals and
        // their backlog).
        let unbounded = Tuning { expire_ns: u64::MAX, ..t };
        let (wait, _, _) = starvation_run(Policy::Satf, unbounded, false);
        assert!(wait > 1_500_000_000, "waited {wait} ns");
    }
}
