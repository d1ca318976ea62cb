//! `vpt`: the virtual performance throttle. It makes the device below behave, in time, like
//! a modelled disk: each request's completion is held until `k·X` after the modelled drive
//! could start it, `X` being the seek model's time for it ([`bulkhead_diskmodel`]).
//!
//! The modelled drive serves one request at a time, in the order requests reach this filter
//! (a scheduler above decides that order): a request starts when it arrives or when the one
//! before it ends, whichever is later. The request itself goes below at once; its completion
//! waits until its target time. If it completes below after its target, it is late, and goes
//! up at once.
//!
//! `k` scales model time to real time, and tunes itself as the throttle of Jones' performance
//! modeling paper does: over each window of requests, more than 1% late raises it (the device below
//! cannot keep up with the model), fewer than 0.1% late lowers it (the run takes longer than it
//! needs). `lock_k` keeps it fixed for measurement runs. `k` lives in the state page, so a
//! restarted domain carries on with the `k` it had learnt.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use bulkhead_block::{After, BlockError, Layer, ReadBelow, Request, SharedSlice, Tag, TagSpace, Verdict};
use bulkhead_block::{Outcome, SetupError};
use bulkhead_diskmodel::{Access, Model};
use serde::{Deserialize, Serialize};

use crate::state::StatePage;

/// State page slots.
const K_MICRO: usize = 1;
const REQUESTS: usize = 2;
const LATE: usize = 3;
const WINDOW_LATE_PPM: usize = 4;
const HITS: usize = 5;
const HELD: usize = 6;
const MODEL_NS: usize = 7;
const SECTORS: usize = 8;

/// Completions per window over which `k` is tuned.
const WINDOW: u64 = 1000;
/// The bounds of `k`.
const K_MIN: f64 = 0.001;
const K_MAX: f64 = 10_000.0;

/// The modelled drive, but for its size, which is the device's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriveSpec {
    /// One revolution, ns.
    pub rotation_ns: u64,
    /// Full-stroke seek, ns.
    pub full_seek_ns: u64,
    /// Media rate, bytes/s.
    pub transfer_bps: u64,
    /// The drive's read cache, if modelled.
    pub cache: Option<bulkhead_diskmodel::CacheGeometry>,
}

impl DriveSpec {
    /// The drive over a device of `bytes`.
    pub fn drive(&self, bytes: u64) -> bulkhead_diskmodel::Drive {
        bulkhead_diskmodel::Drive {
            sectors: (bytes / 512).max(1),
            rotation_ns: self.rotation_ns,
            full_seek_ns: self.full_seek_ns,
            transfer_bps: self.transfer_bps,
            cache: self.cache,
        }
    }

    /// A model of the drive over a device of `bytes`, the head at sector 0 and the cache
    /// empty; why not, if the parameters are unusable.
    pub fn model(&self, bytes: u64) -> Result<Model, bulkhead_diskmodel::InvalidDrive> {
        let drive = self.drive(bytes);
        drive.validate()?;
        Ok(Model::new(drive))
    }

    /// The drive of Jones' performance modeling paper.
    pub fn seed() -> Self {
        let d = bulkhead_diskmodel::Drive::seed(1);
        DriveSpec { rotation_ns: d.rotation_ns, full_seek_ns: d.full_seek_ns, transfer_bps: d.transfer_bps, cache: d.cache }
    }
}

/// What a request is to the model: an access, or nothing it times (a flush, a discard).
pub(crate) fn access_of(req: &Request<'_>) -> Option<Access> {
    let sectors = |len: u64| len.div_ceil(512);
    match req {
        Request::Read { offset, into: bufs } => {
            Some(Access { start: offset / 512, sectors: sectors(bufs.total_len()), write: false })
        }
        Request::Write { offset, from: bufs, .. } => {
            Some(Access { start: offset / 512, sectors: sectors(bufs.total_len()), write: true })
        }
        Request::WriteZeroes { offset, len } => Some(Access { start: offset / 512, sectors: sectors(*len), write: true }),
        Request::Flush | Request::Discard { .. } => None,
    }
}

/// The `vpt` filter.
#[derive(Debug)]
pub struct Vpt {
    spec: DriveSpec,
    model: Option<Model>,
    k: f64,
    lock_k: bool,
    /// When the modelled drive is free again, ns.
    free_at: u64,
    /// Each tag's target completion time (0: not timed).
    target: Vec<u64>,
    /// Results held until their target.
    result: Vec<Option<Result<u64, BlockError>>>,
    due: BinaryHeap<Reverse<(u64, u32)>>,
    window: (u64, u64),
    page: StatePage,
}

impl Vpt {
    /// A throttle modelling `spec`, starting at `k` (or the `k` a domain before it learnt,
    /// unless `lock_k`).
    pub fn new(spec: DriveSpec, k: f64, lock_k: bool, page: StatePage) -> Self {
        let learnt = page.get(K_MICRO) as f64 / 1e6;
        let k = if !lock_k && learnt > 0.0 { learnt } else { k }.clamp(K_MIN, K_MAX);
        page.set(K_MICRO, (k * 1e6) as u64);
        page.set(HELD, 0);
        Vpt {
            spec,
            model: None,
            k,
            lock_k,
            free_at: 0,
            target: Vec::new(),
            result: Vec::new(),
            due: BinaryHeap::new(),
            window: (0, 0),
            page,
        }
    }

    /// The current scale.
    pub fn k(&self) -> f64 {
        self.k
    }

    fn count(&mut self, late: bool) {
        self.page.add(REQUESTS, 1);
        self.window.0 += 1;
        if late {
            self.page.add(LATE, 1);
            self.window.1 += 1;
        }
        if self.window.0 < WINDOW {
            return;
        }
        let fraction = self.window.1 as f64 / self.window.0 as f64;
        self.page.set(WINDOW_LATE_PPM, (fraction * 1e6) as u64);
        self.window = (0, 0);
        if self.lock_k {
            return;
        }
        if fraction > 0.01 {
            self.k = (self.k * 1.25).min(K_MAX);
        } else if fraction < 0.001 {
            self.k = (self.k * 0.95).max(K_MIN);
        }
        self.page.set(K_MICRO, (self.k * 1e6) as u64);
    }
}

/// The figures of a vpt's state page.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    /// Scale of model time to real time now.
    pub k: f64,
    /// Requests timed.
    pub requests: u64,
    /// Of those, completed below after their target.
    pub late: u64,
    /// The late fraction of the last full window.
    pub late_fraction: f64,
    /// Predicted cache hits.
    pub cache_hits: u64,
    /// Completions held now.
    pub held: u64,
    /// The modelled drive's busy time over every timed access, model ns (before `k`).
    pub model_ns: u64,
    /// Sectors of every timed access.
    pub sectors: u64,
}

/// Reads the figures of a vpt's state page.
pub fn read(page: &StatePage) -> Figures {
    Figures {
        k: page.get(K_MICRO) as f64 / 1e6,
        requests: page.get(REQUESTS),
        late: page.get(LATE),
        late_fraction: page.get(WINDOW_LATE_PPM) as f64 / 1e6,
        cache_hits: page.get(HITS),
        held: page.get(HELD),
        model_ns: page.get(MODEL_NS),
        sectors: page.get(SECTORS),
    }
}

impl Layer for Vpt {
    fn name(&self) -> &'static str {
        "vpt"
    }
    fn open(&mut self, below: &mut dyn ReadBelow) -> Result<(), SetupError> {
        self.model = Some(self.spec.model(below.size()).map_err(SetupError::of)?);
        Ok(())
    }
    fn attach(&mut self, tags: TagSpace) {
        self.target = vec![0; tags.capacity()];
        self.result = vec![None; tags.capacity()];
        self.due.reserve(tags.capacity());
    }
    fn submit(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, now_ns: u64) -> Verdict {
        let (Some(model), Some(target)) = (self.model.as_mut(), self.target.get_mut(tag.index())) else {
            return Verdict::Complete(Err(BlockError::Invalid("vpt: a tag beyond those attached")));
        };
        *target = 0;
        if let Some(a) = access_of(req) {
            let s = model.serve(&a);
            if s.hit {
                self.page.add(HITS, 1);
            }
            self.page.add(MODEL_NS, s.ns);
            self.page.add(SECTORS, a.sectors);
            let start = now_ns.max(self.free_at);
            self.free_at = start + (s.ns as f64 * self.k) as u64;
            *target = self.free_at;
        }
        Verdict::Forward
    }
    fn complete(&mut self, tag: Tag, _: &Request<'_>, _: SharedSlice<'_>, result: &mut Outcome, now_ns: u64) -> After {
        let target = self.target.get(tag.index()).copied().unwrap_or(0);
        if target == 0 {
            return After::Up;
        }
        let late = now_ns > target;
        self.count(late);
        if late {
            return After::Up;
        }
        self.result[tag.index()] = Some(result.clone());
        self.due.push(Reverse((target, tag.index() as u32)));
        self.page.add(HELD, 1);
        After::Hold
    }
    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        while let Some(&Reverse((at, t))) = self.due.peek() {
            if at > now_ns {
                return Some(at);
            }
            self.due.pop();
            self.page.set(HELD, self.page.get(HELD).saturating_sub(1));
            let r = self.result[t as usize].take().unwrap_or(Err(BlockError::Invalid("vpt: a held request lost its result")));
            release(Tag::new(t), Verdict::Complete(r));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{test_page, SizeBelow as Size};
    use bulkhead_shmem::SliceList;

    fn vpt(k: f64, lock: bool) -> (std::os::fd::OwnedFd, Vpt) {
        let (fd, page) = test_page();
        let spec = DriveSpec { cache: None, ..DriveSpec::seed() };
        let mut v = Vpt::new(spec, k, lock, page);
        v.open(&mut Size(1 << 30)).unwrap();
        v.attach(TagSpace { queues: 1, per_queue: 8 });
        (fd, v)
    }

    fn read_at(offset: u64) -> Request<'static> {
        Request::Read { offset, into: SliceList::new() }
    }

    #[test]
    fn completions_wait_for_k_times_the_model_and_the_drive_serves_one_at_a_time() {
        let (_fd, mut v) = vpt(2.0, true);
        // Empty reads: half a rotation (2 ms) and the seek; none of them transfers.
        assert_eq!(v.submit(Tag::new(0), &read_at(0), SharedSlice::empty(), 1_000), Verdict::Forward);
        // Half the device away: + 3.75 ms of seek. It starts when the first ends.
        assert_eq!(v.submit(Tag::new(1), &read_at(1 << 29), SharedSlice::empty(), 1_000), Verdict::Forward);
        let first = 1_000 + 2 * 2_000_000;
        let second = first + 2 * (2_000_000 + 3_750_000);
        assert_eq!(v.target[..2], [first, second]);
        let mut r = Ok(0);
        assert_eq!(v.complete(Tag::new(1), &read_at(1 << 29), SharedSlice::empty(), &mut r, 2_000), After::Hold);
        assert_eq!(v.complete(Tag::new(0), &read_at(0), SharedSlice::empty(), &mut r, 2_000), After::Hold);
        let mut out = Vec::new();
        assert_eq!(v.poll(first - 1, &mut |t, x| out.push((t, x))), Some(first));
        assert!(out.is_empty());
        assert_eq!(v.poll(second, &mut |t, x| out.push((t, x))), None);
        assert_eq!(out, [(Tag::new(0), Verdict::Complete(Ok(0))), (Tag::new(1), Verdict::Complete(Ok(0)))]);
        // A flush is not timed.
        assert_eq!(v.submit(Tag::new(2), &Request::Flush, SharedSlice::empty(), 5), Verdict::Forward);
        assert_eq!(v.complete(Tag::new(2), &Request::Flush, SharedSlice::empty(), &mut r, 6), After::Up);
    }

    #[test]
    fn a_late_completion_goes_up_at_once_and_k_rises_when_more_than_one_percent_are_late() {
        let (_fd, mut v) = vpt(1.0, false);
        let mut r = Ok(0);
        for i in 0..WINDOW {
            let now = i * 100_000_000;
            v.submit(Tag::new(0), &read_at(0), SharedSlice::empty(), now);
            // Every 50th completes after its target: 2% late.
            let done = if i % 50 == 0 { now + 50_000_000 } else { now + 1 };
            let after = v.complete(Tag::new(0), &read_at(0), SharedSlice::empty(), &mut r, done);
            assert_eq!(after, if i % 50 == 0 { After::Up } else { After::Hold });
            v.poll(u64::MAX - 1, &mut |_, _| {});
        }
        assert_eq!(v.k(), 1.25);
        let f = read(&v.page);
        assert_eq!((f.k, f.requests, f.late, f.late_fraction), (1.25, WINDOW, 20, 0.02));
    }

    #[test]
    fn k_falls_when_nothing_is_late_unless_locked_and_a_new_domain_carries_on_with_it() {
        for lock in [false, true] {
            let (fd, mut v) = vpt(1.0, lock);
            let mut r = Ok(0);
            for i in 0..WINDOW {
                v.submit(Tag::new(0), &read_at(0), SharedSlice::empty(), i * 100_000_000);
                v.complete(Tag::new(0), &read_at(0), SharedSlice::empty(), &mut r, i * 100_000_000 + 1);
                v.poll(u64::MAX - 1, &mut |_, _| {});
            }
            assert_eq!(v.k(), if lock { 1.0 } else { 0.95 });
            use std::os::fd::AsRawFd;
            let again = Vpt::new(DriveSpec::seed(), 1.0, false, StatePage::map(fd.as_raw_fd(), true).unwrap());
            assert_eq!(again.k(), if lock { 1.0 } else { 0.95 });
        }
    }
}
