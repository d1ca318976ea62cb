//! `throttle`: limits bytes and operations per second, with bursts, as qemu's throttle groups
//! do.
//!
//! Each limit is a leaky bucket. A request may start while the bucket's level is at most its
//! size, and then adds its bytes (or one operation) to the level, which drains at the average
//! rate. Without a burst the bucket holds a tenth of a second at the average rate, so short
//! bursts are not penalised; with a burst rate `max` for `max_length` seconds it holds
//! `max × max_length`, and a second bucket draining at `max` keeps the burst itself at that rate.
//! With `iops_size`, a request larger than that counts as several operations.
//!
//! Reads and writes wait in separate first-in-first-out queues, so a write limit never holds up
//! reads. Discard and write-zeroes count as write operations of no bytes; a flush is never
//! held (it covers only writes already completed, and held writes are not).

use std::collections::VecDeque;

use bulkhead_block::{After, Layer, Outcome, Request, SharedSlice, Tag, TagSpace, Verdict};

use crate::state::StatePage;

/// State page slots: requests that had to wait, requests waiting now, total wait (ns).
const THROTTLED: usize = 1;
const WAITING: usize = 2;
const WAITED_NS: usize = 3;

/// One limit: an average rate and an optional burst.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// Units (bytes or operations) per second.
    pub avg: f64,
    /// Burst rate, units per second (0: no burst beyond a tenth of a second of `avg`).
    pub max: f64,
    /// How long a burst at `max` may last, seconds (at least 1).
    pub max_length: f64,
}

/// The limits of a throttle filter; each may be absent.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Bytes per second, reads and writes together.
    pub bps_total: Option<Limit>,
    /// Bytes per second read.
    pub bps_read: Option<Limit>,
    /// Bytes per second written.
    pub bps_write: Option<Limit>,
    /// Operations per second, together.
    pub iops_total: Option<Limit>,
    /// Read operations per second.
    pub iops_read: Option<Limit>,
    /// Write operations per second.
    pub iops_write: Option<Limit>,
    /// A request counts as `bytes / iops_size` operations when larger (0: always one).
    pub iops_size: u64,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    limit: Limit,
    level: f64,
    burst_level: f64,
}

impl Bucket {
    fn new(limit: Limit) -> Self {
        Bucket { limit, level: 0.0, burst_level: 0.0 }
    }

    fn leak(&mut self, secs: f64) {
        self.level = (self.level - self.limit.avg * secs).max(0.0);
        self.burst_level = (self.burst_level - self.limit.max * secs).max(0.0);
    }

    /// Seconds until a request may start.
    fn wait(&self) -> f64 {
        let l = self.limit;
        let (size, burst_size) = if l.max > 0.0 { (l.max * l.max_length, l.max / 10.0) } else { (l.avg / 10.0, 0.0) };
        let extra = self.level - size;
        if extra > 0.0 {
            return extra / l.avg;
        }
        if l.max > 0.0 && l.max_length > 1.0 {
            let extra = self.burst_level - burst_size;
            if extra > 0.0 {
                return extra / l.max;
            }
        }
        0.0
    }

    fn account(&mut self, units: f64) {
        self.level += units;
        if self.limit.max > 0.0 && self.limit.max_length > 1.0 {
            self.burst_level += units;
        }
    }
}

/// Bucket indexes.
const BPS_TOTAL: usize = 0;
const BPS_READ: usize = 1;
const BPS_WRITE: usize = 2;
const IOPS_TOTAL: usize = 3;
const IOPS_READ: usize = 4;
const IOPS_WRITE: usize = 5;

/// A request waiting: its tag and how much it counts.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    tag: Tag,
    bytes: u64,
    since: u64,
}

/// The `throttle` filter.
#[derive(Debug)]
pub struct Throttle {
    buckets: [Option<Bucket>; 6],
    iops_size: u64,
    /// Reads waiting, writes waiting.
    queues: [VecDeque<Waiting>; 2],
    leaked_at: Option<u64>,
    page: StatePage,
}

/// Requests throttled so far, waiting now, and their total wait in ms, as read back from a
/// throttle filter's state page.
pub fn read(page: &StatePage) -> (u64, u64, u64) {
    (page.get(THROTTLED), page.get(WAITING), page.get(WAITED_NS) / 1_000_000)
}

impl Throttle {
    /// A filter enforcing `limits`, counting into `page`.
    pub fn new(limits: Limits, page: StatePage) -> Self {
        let b = |l: Option<Limit>| l.map(Bucket::new);
        page.set(WAITING, 0);
        Throttle {
            buckets: [
                b(limits.bps_total),
                b(limits.bps_read),
                b(limits.bps_write),
                b(limits.iops_total),
                b(limits.iops_read),
                b(limits.iops_write),
            ],
            iops_size: limits.iops_size,
            queues: Default::default(),
            leaked_at: None,
            page,
        }
    }

    fn leak(&mut self, now_ns: u64) {
        let secs = self.leaked_at.map_or(0.0, |t| now_ns.saturating_sub(t) as f64 / 1e9);
        self.leaked_at = Some(now_ns);
        for b in self.buckets.iter_mut().flatten() {
            b.leak(secs);
        }
    }

    /// The buckets a request in queue `q` (0 reads, 1 writes) fills.
    fn applicable(q: usize) -> [usize; 4] {
        if q == 0 {
            [BPS_TOTAL, BPS_READ, IOPS_TOTAL, IOPS_READ]
        } else {
            [BPS_TOTAL, BPS_WRITE, IOPS_TOTAL, IOPS_WRITE]
        }
    }

    fn wait_ns(&self, q: usize) -> u64 {
        let secs = Self::applicable(q).iter().filter_map(|&i| self.buckets[i].map(|b| b.wait())).fold(0.0, f64::max);
        (secs * 1e9).ceil() as u64
    }

    fn account(&mut self, q: usize, bytes: u64) {
        let ops = if self.iops_size > 0 && bytes > self.iops_size { bytes as f64 / self.iops_size as f64 } else { 1.0 };
        for (k, &i) in Self::applicable(q).iter().enumerate() {
            if let Some(b) = &mut self.buckets[i] {
                b.account(if k < 2 { bytes as f64 } else { ops });
            }
        }
    }

    fn admit(&mut self, tag: Tag, q: usize, bytes: u64, now_ns: u64) -> Verdict {
        self.leak(now_ns);
        if self.queues[q].is_empty() && self.wait_ns(q) == 0 {
            self.account(q, bytes);
            return Verdict::Forward;
        }
        self.queues[q].push_back(Waiting { tag, bytes, since: now_ns });
        self.page.add(THROTTLED, 1);
        self.page.add(WAITING, 1);
        Verdict::Hold
    }
}

impl Layer for Throttle {
    fn name(&self) -> &'static str {
        "throttle"
    }
    fn attach(&mut self, tags: TagSpace) {
        for q in &mut self.queues {
            q.reserve(tags.capacity());
        }
    }
    fn submit(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, now_ns: u64) -> Verdict {
        match req {
            Request::Read { into: bufs, .. } => self.admit(tag, 0, bufs.total_len(), now_ns),
            Request::Write { from: bufs, .. } => self.admit(tag, 1, bufs.total_len(), now_ns),
            Request::Discard { .. } | Request::WriteZeroes { .. } => self.admit(tag, 1, 0, now_ns),
            Request::Flush => Verdict::Forward,
        }
    }
    fn complete(&mut self, _: Tag, _: &Request<'_>, _: SharedSlice<'_>, _: &mut Outcome, _: u64) -> After {
        After::Up
    }
    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        self.leak(now_ns);
        let mut next: Option<u64> = None;
        for q in 0..2 {
            while let Some(&w) = self.queues[q].front() {
                let wait = self.wait_ns(q);
                if wait > 0 {
                    let at = now_ns + wait;
                    next = Some(next.map_or(at, |n| n.min(at)));
                    break;
                }
                self.queues[q].pop_front();
                self.account(q, w.bytes);
                self.page.set(WAITING, self.page.get(WAITING).saturating_sub(1));
                self.page.add(WAITED_NS, now_ns.saturating_sub(w.since));
                release(w.tag, Verdict::Forward);
            }
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_page;

    const SEC: u64 = 1_000_000_000;

    fn limit(avg: f64) -> Option<Limit> {
        Some(Limit { avg, max: 0.0, max_length: 1.0 })
    }

    /// Runs `n` discards (one write op each) submitted at once and returns when each was let go.
    fn release_times(t: &mut Throttle, n: u32) -> Vec<u64> {
        let mut at = vec![None; n as usize];
        for i in 0..n {
            if t.submit(Tag::new(i), &Request::Discard { offset: 0, len: 4096 }, SharedSlice::empty(), 0) == Verdict::Forward {
                at[i as usize] = Some(0);
            }
        }
        let mut now = 0;
        while let Some(next) = t.poll(now, &mut |tag, v| {
            assert_eq!(v, Verdict::Forward);
            at[tag.index()] = Some(now);
        }) {
            assert!(next > now, "poll time must move forward");
            now = next;
        }
        at.into_iter().map(|x| x.expect("every request released")).collect()
    }

    #[test]
    fn iops_limit_spaces_requests_at_the_average_rate_after_a_tenth_second_burst() {
        let (_fd, page) = test_page();
        let mut t = Throttle::new(Limits { iops_write: limit(100.0), ..Limits::default() }, page);
        t.attach(TagSpace { queues: 1, per_queue: 64 });
        let times = release_times(&mut t, 40);
        // A bucket of 10 operations: 11 go at once (the level may reach the size), then one
        // every 10 ms.
        assert_eq!(times.iter().filter(|&&x| x == 0).count(), 11);
        let last = *times.last().unwrap() as f64 / SEC as f64;
        assert!((0.28..0.31).contains(&last), "40 ops at 100/s with a burst of 11 took {last} s");
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "first in, first out");
        assert_eq!(read(&t.page).0, 29);
    }

    #[test]
    fn burst_rate_lets_more_through_at_once_then_falls_to_the_average() {
        let (_fd, page) = test_page();
        let burst = Some(Limit { avg: 10.0, max: 100.0, max_length: 2.0 });
        let mut t = Throttle::new(Limits { iops_total: burst, ..Limits::default() }, page);
        t.attach(TagSpace { queues: 1, per_queue: 300 });
        let times = release_times(&mut t, 250);
        let by = |s: f64| times.iter().filter(|&&x| (x as f64) <= s * SEC as f64).count();
        // The burst runs at 100/s (bounded by its own bucket of 10) while the main bucket, of
        // max × max_length = 200, fills at 100 - 10 = 90 a second: full after about 2.1 s and
        // 221 requests. Then the rate falls to the average, 10/s.
        assert!((105..=115).contains(&by(1.0)), "{} by 1 s", by(1.0));
        assert!((215..=228).contains(&by(2.2)), "{} by 2.2 s", by(2.2));
        assert!((233..=245).contains(&by(4.0)), "{} by 4 s: should have slowed to 10/s", by(4.0));
    }

    #[test]
    fn a_write_limit_never_holds_up_reads_and_flush_passes() {
        let (_fd, page) = test_page();
        let mut t = Throttle::new(Limits { bps_write: limit(1.0), ..Limits::default() }, page);
        t.attach(TagSpace { queues: 1, per_queue: 8 });
        // Fill the write bucket, then queue a write behind it.
        assert_eq!(t.submit(Tag::new(0), &Request::WriteZeroes { offset: 0, len: 1 }, SharedSlice::empty(), 0), Verdict::Forward);
        t.account(1, 1000);
        assert_eq!(t.submit(Tag::new(1), &Request::Discard { offset: 0, len: 1 }, SharedSlice::empty(), 0), Verdict::Hold);
        assert_eq!(t.submit(Tag::new(2), &Request::Flush, SharedSlice::empty(), 0), Verdict::Forward);
        let fd = bulkhead_shmem::memfd::create("buf", 4096).unwrap();
        let map = bulkhead_shmem::Mapping::new(std::os::fd::AsRawFd::as_raw_fd(&fd), 4096, bulkhead_shmem::Protection::ReadWrite)
            .unwrap();
        let bufs = bulkhead_block::SliceList::one(map.slice(0, 4096).unwrap());
        assert_eq!(t.submit(Tag::new(3), &Request::Read { offset: 0, into: bufs }, SharedSlice::empty(), 0), Verdict::Forward);
        assert_eq!(
            t.submit(Tag::new(4), &Request::Write { offset: 0, from: bufs, fua: false }, SharedSlice::empty(), 0),
            Verdict::Hold
        );
        assert_eq!(read(&t.page), (2, 2, 0));
    }
}
