//! A discrete-event simulator: a workload's requests arrive, a scheduler orders them, and the
//! model serves them one access at a time, as a drive without a queue of its own does.
//!
//! The workload may depend on what completes (a process that reads a page, thinks, and reads
//! the next): the simulator tells it of every completion and takes the requests it makes.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use bulkhead_rng::Rng;
use serde::Serialize;

use crate::sched::{self, batch_access, Next, Policy, Queued, Tuning};
use crate::{Access, Drive, Model};

/// A request the workload makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Arrival {
    /// When it arrives, ns.
    pub at_ns: u64,
    /// What it reads or writes.
    pub access: Access,
    /// Who makes it.
    pub stream: u32,
}

/// What a workload makes in answer to an event: requests, and times at which one of its
/// streams wants to be woken (a process that has thought long enough).
#[derive(Debug, Default)]
pub struct Make {
    /// Requests, numbered in the order they are made, from 0 for the run.
    pub arrivals: Vec<Arrival>,
    /// `(when, stream)`: call [`Workload::woken`] then.
    pub wakes: Vec<(u64, u32)>,
}

/// Where requests come from.
pub trait Workload {
    /// The requests known at the start.
    fn start(&mut self, out: &mut Make);
    /// Request `id` of `stream` completed at `now_ns`: what this makes follows.
    fn completed(&mut self, id: u64, stream: u32, now_ns: u64, out: &mut Make);
    /// A wake-up `stream` asked for is due at `now_ns`.
    fn woken(&mut self, _stream: u32, _now_ns: u64, _out: &mut Make) {}
}

/// A fixed list of requests, whatever completes.
#[derive(Debug, Clone)]
pub struct Trace(pub Vec<Arrival>);

impl Workload for Trace {
    fn start(&mut self, out: &mut Make) {
        out.arrivals.extend_from_slice(&self.0);
    }
    fn completed(&mut self, _: u64, _: u32, _: u64, _: &mut Make) {}
}

/// A random open-loop workload: requests arriving as a Poisson process at uniform random
/// positions, each of `sectors`, a fraction of them writes, from `streams` streams in turn.
#[derive(Debug, Clone)]
pub struct Uniform {
    /// Requests.
    pub requests: u64,
    /// Mean time between arrivals, ns.
    pub interval_ns: u64,
    /// Sectors of the device they fall in.
    pub device_sectors: u64,
    /// Sectors of each.
    pub sectors: u64,
    /// Fraction that are writes, 0 to 1.
    pub write_fraction: f64,
    /// Streams.
    pub streams: u32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Workload for Uniform {
    fn start(&mut self, out: &mut Make) {
        let mut rng = Rng::new(self.seed);
        let mut at = 0u64;
        let span = self.device_sectors.saturating_sub(self.sectors).max(1);
        for i in 0..self.requests {
            // Exponential gaps: a Poisson process.
            at += (-(1.0 - rng.unit()).ln() * self.interval_ns as f64) as u64;
            let write = rng.unit() < self.write_fraction;
            let start = rng.below(span);
            out.arrivals.push(Arrival {
                at_ns: at,
                access: Access { start, sectors: self.sectors, write },
                stream: (i % self.streams.max(1) as u64) as u32,
            });
        }
    }
    fn completed(&mut self, _: u64, _: u32, _: u64, _: &mut Make) {}
}

/// One request's story.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Record {
    /// Its number, in arrival order.
    pub id: u64,
    /// What it read or wrote.
    pub start: u64,
    /// Sectors.
    pub sectors: u64,
    /// A write.
    pub write: bool,
    /// Its stream.
    pub stream: u32,
    /// Arrived, ns.
    pub arrival_ns: u64,
    /// Sent to the drive, ns.
    pub dispatch_ns: u64,
    /// Completed, ns.
    pub done_ns: u64,
    /// Served from the drive's cache.
    pub hit: bool,
}

impl Record {
    /// From dispatch to completion.
    pub fn service_ns(&self) -> u64 {
        self.done_ns - self.dispatch_ns
    }
    /// From arrival to dispatch.
    pub fn wait_ns(&self) -> u64 {
        self.dispatch_ns - self.arrival_ns
    }
    /// From arrival to completion.
    pub fn response_ns(&self) -> u64 {
        self.done_ns - self.arrival_ns
    }
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The scheduler.
    pub policy: Policy,
    /// Every request, in the order the drive served them.
    pub served: Vec<Record>,
}

/// Means and spread of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// Requests.
    pub requests: u64,
    /// Mean service time, ms.
    pub mean_service_ms: f64,
    /// Mean wait, ms.
    pub mean_wait_ms: f64,
    /// Mean response time, ms.
    pub mean_response_ms: f64,
    /// Response time percentiles, ms.
    pub p50_response_ms: f64,
    /// 90th.
    pub p90_response_ms: f64,
    /// 99th.
    pub p99_response_ms: f64,
    /// Sectors moved per ms, from the first arrival to the last completion.
    pub sectors_per_ms: f64,
    /// Requests served from the cache.
    pub hits: u64,
}

impl Outcome {
    /// Its means and spread.
    pub fn summary(&self) -> Summary {
        let n = self.served.len().max(1) as f64;
        let ms = |ns: u64| ns as f64 / 1e6;
        let mean = |f: fn(&Record) -> u64| self.served.iter().map(|r| ms(f(r))).sum::<f64>() / n;
        let mut resp: Vec<u64> = self.served.iter().map(Record::response_ns).collect();
        resp.sort_unstable();
        let pct = |p: f64| resp.get(((resp.len() as f64 * p).ceil() as usize).saturating_sub(1)).map_or(0.0, |&v| ms(v));
        let first = self.served.iter().map(|r| r.arrival_ns).min().unwrap_or(0);
        let last = self.served.iter().map(|r| r.done_ns).max().unwrap_or(0);
        let sectors: u64 = self.served.iter().map(|r| r.sectors).sum();
        Summary {
            requests: self.served.len() as u64,
            mean_service_ms: mean(Record::service_ns),
            mean_wait_ms: mean(Record::wait_ns),
            mean_response_ms: mean(Record::response_ns),
            p50_response_ms: pct(0.5),
            p90_response_ms: pct(0.9),
            p99_response_ms: pct(0.99),
            sectors_per_ms: if last > first { sectors as f64 / ms(last - first) } else { 0.0 },
            hits: self.served.iter().filter(|r| r.hit).count() as u64,
        }
    }
}

/// Runs `workload` through a `policy` scheduler on `drive`, the head starting at `head`,
/// until nothing more arrives (and no wake-up is due) or `limit` requests have arrived.
pub fn run(drive: &Drive, head: u64, policy: Policy, tuning: Tuning, workload: &mut dyn Workload, limit: u64) -> Outcome {
    let mut model = Model::new(*drive);
    model.set_head(head);
    let mut sched = sched::build(policy, tuning);
    let mut pending: BinaryHeap<Reverse<(u64, u64, Arrival)>> = BinaryHeap::new();
    let mut wakes: BinaryHeap<Reverse<(u64, u64, u32)>> = BinaryHeap::new();
    let mut made = Make::default();
    let (mut seq, mut wake_seq) = (0u64, 0u64);
    let push = |made: &mut Make, pending: &mut BinaryHeap<_>, wakes: &mut BinaryHeap<_>, seq: &mut u64, wake_seq: &mut u64| {
        for a in made.arrivals.drain(..) {
            if *seq < limit {
                pending.push(Reverse((a.at_ns, *seq, a)));
                *seq += 1;
            }
        }
        for (at, stream) in made.wakes.drain(..) {
            wakes.push(Reverse((at, *wake_seq, stream)));
            *wake_seq += 1;
        }
    };
    workload.start(&mut made);
    push(&mut made, &mut pending, &mut wakes, &mut seq, &mut wake_seq);
    let mut records: Vec<Option<Record>> = Vec::new();
    let mut served = Vec::new();
    let mut busy: Option<(u64, Vec<Queued>, bool)> = None;
    let mut batch = Vec::new();
    let mut wake: Option<u64> = None;
    let mut now = 0u64;
    loop {
        while let Some(Reverse((at, _, stream))) = wakes.peek().copied() {
            if at > now {
                break;
            }
            wakes.pop();
            workload.woken(stream, now, &mut made);
            push(&mut made, &mut pending, &mut wakes, &mut seq, &mut wake_seq);
        }
        while let Some(Reverse((at, id, a))) = pending.peek().copied() {
            if at > now {
                break;
            }
            pending.pop();
            if records.len() <= id as usize {
                records.resize(id as usize + 1, None);
            }
            records[id as usize] = Some(Record {
                id,
                start: a.access.start,
                sectors: a.access.sectors,
                write: a.access.write,
                stream: a.stream,
                arrival_ns: at,
                dispatch_ns: 0,
                done_ns: 0,
                hit: false,
            });
            sched.add(Queued { id, access: a.access, arrival_ns: at, stream: a.stream });
            wake = None;
        }
        if let Some((done, _, _)) = &busy {
            if *done <= now {
                let (done, members, hit) = busy.take().expect("checked");
                for m in &members {
                    let r = records[m.id as usize].as_mut().expect("dispatched requests have records");
                    r.done_ns = done;
                    r.hit = hit;
                    served.push(*r);
                    workload.completed(m.id, m.stream, done, &mut made);
                }
                sched.completed(&members[0], done);
                push(&mut made, &mut pending, &mut wakes, &mut seq, &mut wake_seq);
                wake = None;
                continue;
            }
        }
        if busy.is_none() && wake.is_none_or(|w| w <= now) {
            wake = None;
            match sched.next(now, &model, &mut batch) {
                Next::Dispatch => {
                    let s = model.serve(&batch_access(&batch));
                    for m in &batch {
                        records[m.id as usize].as_mut().expect("queued requests have records").dispatch_ns = now;
                    }
                    busy = Some((now + s.ns, std::mem::take(&mut batch), s.hit));
                    continue;
                }
                Next::Wait(until) => wake = Some(until.max(now + 1)),
                Next::Empty => {}
            }
        }
        let next = [
            pending.peek().map(|Reverse((at, _, _))| *at),
            wakes.peek().map(|Reverse((at, _, _))| *at),
            busy.as_ref().map(|b| b.0),
            wake,
        ]
        .into_iter()
        .flatten()
        .min();
        match next {
            Some(t) => now = now.max(t),
            None => break,
        }
    }
    Outcome { policy, served }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> Trace {
        Trace(
            [95, 10, 60, 41]
                .into_iter()
                .map(|p| Arrival { at_ns: 0, access: Access { start: p, sectors: 0, write: false }, stream: 0 })
                .collect(),
        )
    }

    fn rows(o: &Outcome) -> Vec<(u64, f64, f64, f64)> {
        let ms = |ns: u64| ns as f64 / 1e6;
        o.served.iter().map(|r| (r.start, ms(r.service_ns()), ms(r.wait_ns()), ms(r.response_ns()))).collect()
    }

    #[test]
    fn the_seed_example_tables_come_out_as_the_seed_prints_them() {
        let drive = Drive::travel_only(100);
        let fcfs = run(&drive, 50, Policy::Fcfs, Tuning::default(), &mut example(), u64::MAX);
        assert_eq!(
            rows(&fcfs),
            [(95, 45.0, 0.0, 45.0), (10, 85.0, 45.0, 130.0), (60, 50.0, 130.0, 180.0), (41, 19.0, 180.0, 199.0)]
        );
        let s = fcfs.summary();
        assert_eq!((s.mean_service_ms, s.mean_wait_ms, s.mean_response_ms), (49.75, 88.75, 138.5));
        let satf = run(&drive, 50, Policy::Satf, Tuning::default(), &mut example(), u64::MAX);
        assert_eq!(rows(&satf), [(41, 9.0, 0.0, 9.0), (60, 19.0, 9.0, 28.0), (95, 35.0, 28.0, 63.0), (10, 85.0, 63.0, 148.0)]);
        let s = satf.summary();
        assert_eq!((s.mean_service_ms, s.mean_wait_ms, s.mean_response_ms), (37.0, 25.0, 62.0));
        let opt = run(&drive, 50, Policy::Opt, Tuning::default(), &mut example(), u64::MAX);
        assert_eq!(rows(&opt), [(60, 10.0, 0.0, 10.0), (41, 19.0, 10.0, 29.0), (10, 31.0, 29.0, 60.0), (95, 85.0, 60.0, 145.0)]);
        let s = opt.summary();
        assert_eq!((s.mean_service_ms, s.mean_wait_ms, s.mean_response_ms), (36.25, 24.75, 61.0));
    }
}
