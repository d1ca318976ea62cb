//! `stats`: per-operation counts, bytes, errors and a latency histogram, in `status`.
//!
//! The filter passes every request on unchanged and times it from its submission to its
//! completion below. Latencies fall into [`BUCKETS`] power-of-two buckets of microseconds:
//! bucket 0 holds everything under 2 µs, bucket `i` latencies in `[2^i, 2^(i+1))` µs, the last
//! everything longer.

use bulkhead_block::{After, Layer, Op, Outcome, Request, SharedSlice, Tag, TagSpace, Verdict};

use crate::state::StatePage;

/// Latency histogram buckets per operation.
pub const BUCKETS: usize = 32;

/// Counters per operation in the state page: requests, errors, bytes, summed latency (ns),
/// then the histogram.
const PER_OP: usize = 4 + BUCKETS;

/// Slot of counter `field` of operation `op` in the state page.
fn slot(op: Op, field: usize) -> usize {
    1 + op.index() * PER_OP + field
}

/// One operation's figures, as read back from a state page.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OpStats {
    /// Operation name.
    pub op: String,
    /// Requests completed.
    pub requests: u64,
    /// Of which failed.
    pub errors: u64,
    /// Bytes of the successful ones.
    pub bytes: u64,
    /// Mean latency, µs.
    pub mean_us: f64,
    /// Latency percentiles from the histogram (upper bucket bounds), µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
    /// Histogram: count per bucket (see the module docs), trailing empty buckets left out.
    pub histogram: Vec<u64>,
}

/// Reads the figures of every operation with at least one request. The page is the domain's to
/// write, so any value may be there: the arithmetic saturates rather than overflows.
pub fn read(page: &StatePage) -> Vec<OpStats> {
    Op::ALL
        .into_iter()
        .filter_map(|op| {
            let requests = page.get(slot(op, 0));
            if requests == 0 {
                return None;
            }
            let mut histogram: Vec<u64> = (0..BUCKETS).map(|b| page.get(slot(op, 4 + b))).collect();
            while histogram.last() == Some(&0) {
                histogram.pop();
            }
            let total = histogram.iter().fold(0u64, |a, &n| a.saturating_add(n));
            let pct = |p: f64| {
                let want = ((total as f64) * p).ceil() as u64;
                let mut seen = 0u64;
                for (b, n) in histogram.iter().enumerate() {
                    seen = seen.saturating_add(*n);
                    if seen >= want.max(1) {
                        return 2u64 << b;
                    }
                }
                0
            };
            Some(OpStats {
                op: op.as_str().to_string(),
                requests,
                errors: page.get(slot(op, 1)),
                bytes: page.get(slot(op, 2)),
                mean_us: page.get(slot(op, 3)) as f64 / requests as f64 / 1e3,
                p50_us: pct(0.5),
                p99_us: pct(0.99),
                histogram,
            })
        })
        .collect()
}

/// The bucket of a latency in ns.
fn bucket(ns: u64) -> usize {
    let us = ns / 1000;
    if us < 2 {
        0
    } else {
        (63 - us.leading_zeros() as usize).min(BUCKETS - 1)
    }
}

/// The `stats` filter.
#[derive(Debug)]
pub struct Stats {
    page: StatePage,
    /// Submission time per tag.
    started: Vec<u64>,
}

impl Stats {
    /// A filter counting into `page`.
    pub fn new(page: StatePage) -> Self {
        Stats { page, started: Vec::new() }
    }
}

impl Layer for Stats {
    fn name(&self) -> &'static str {
        "stats"
    }
    fn attach(&mut self, tags: TagSpace) {
        self.started = vec![0; tags.capacity()];
    }
    fn submit(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, now_ns: u64) -> Verdict {
        match req.op() {
            Op::Read | Op::Write | Op::Flush | Op::Discard | Op::WriteZeroes => {
                self.started[tag.index()] = now_ns;
                Verdict::Forward
            }
        }
    }
    fn complete(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, result: &mut Outcome, now_ns: u64) -> After {
        let op = req.op();
        let ns = now_ns.saturating_sub(self.started[tag.index()]);
        self.page.add(slot(op, 0), 1);
        match result {
            Ok(_) => self.page.add(slot(op, 2), crate::bytes_of(req)),
            Err(_) => self.page.add(slot(op, 1), 1),
        }
        self.page.add(slot(op, 3), ns);
        self.page.add(slot(op, 4 + bucket(ns)), 1);
        After::Up
    }
    fn poll(&mut self, _: u64, _: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_page;
    use bulkhead_block::BlockError;

    #[test]
    fn a_page_full_of_the_largest_values_reads_without_overflow() {
        let (_fd, page) = test_page();
        for i in 0..crate::state::SLOTS {
            page.set(i, u64::MAX);
        }
        let ops = read(&page);
        assert_eq!(ops.len(), 5);
        assert_eq!(ops[0].histogram.len(), BUCKETS);
    }

    #[test]
    fn latency_buckets_are_powers_of_two_microseconds() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1_999), 0);
        assert_eq!(bucket(2_000), 1);
        assert_eq!(bucket(3_999), 1);
        assert_eq!(bucket(4_000), 2);
        assert_eq!(bucket(1_000_000_000), 19);
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn every_operation_is_counted_with_bytes_errors_and_latency() {
        let (fd, page) = test_page();
        let mut s = Stats::new(page);
        s.attach(TagSpace { queues: 1, per_queue: 4 });
        let reqs = [
            Request::Flush,
            Request::Discard { offset: 0, len: 8192 },
            Request::WriteZeroes { offset: 4096, len: 4096 },
            Request::Discard { offset: 0, len: 512 },
        ];
        for (i, r) in reqs.iter().enumerate() {
            let t = Tag::new(i as u32);
            assert_eq!(s.submit(t, r, SharedSlice::empty(), 1_000), Verdict::Forward);
        }
        for (i, r) in reqs.iter().enumerate() {
            let mut res = if i == 3 { Err(BlockError::NotSupported("discard")) } else { Ok(0) };
            s.complete(Tag::new(i as u32), r, SharedSlice::empty(), &mut res, 1_000 + 5_000 * (i as u64 + 1));
        }
        let back = read(&StatePage::map(std::os::fd::AsRawFd::as_raw_fd(&fd), false).unwrap());
        let names: Vec<_> = back.iter().map(|o| o.op.as_str()).collect();
        assert_eq!(names, ["flush", "discard", "write_zeroes"]);
        let discard = &back[1];
        assert_eq!((discard.requests, discard.errors, discard.bytes), (2, 1, 8192));
        assert_eq!(discard.mean_us, 15.0);
        assert_eq!(back[0].histogram, vec![0, 0, 1]);
        assert_eq!(back[0].p99_us, 8);
    }
}
