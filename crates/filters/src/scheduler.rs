//! `scheduler`: a disk scheduler as a filter. It holds the reads and writes that come down,
//! keeps at most `depth` accesses in flight below, and sends the next in the order its policy
//! chooses (`fcfs`, `satf`, `opt`, `deadline` or `cats`; see [`bulkhead_diskmodel::sched`]),
//! predicting access times with the same model the `vpt` filter delays completions by.
//!
//! Requests that continue each other are sent together as one access (coalesced). Flushes and
//! discards pass at once: a flush covers only writes already completed, and a discard moves
//! no data the model times.
//!
//! Every request it holds came through the channel's checks like any other; it sends each
//! below unchanged, exactly once, and fails none. A tag it was not attached with is refused.

use bulkhead_block::{After, BlockError, Layer, ReadBelow, Request, SharedSlice, Tag, TagSpace, Verdict};
use bulkhead_block::{Outcome, SetupError};
use bulkhead_diskmodel::sched::{self, batch_access, Next, Policy, Queued, Scheduler as Sched, Tuning};
use bulkhead_diskmodel::Model;

use crate::state::StatePage;
use crate::vpt::{access_of, DriveSpec};

/// State page slots.
const QUEUED: usize = 1;
const DISPATCHED: usize = 2;
const COALESCED: usize = 3;
const WAITED_US: usize = 4;
const MAX_WAIT_US: usize = 5;

/// The `scheduler` filter.
#[derive(Debug)]
pub struct Scheduler {
    spec: DriveSpec,
    model: Option<Model>,
    sched: Box<dyn Sched>,
    depth: u32,
    tags: TagSpace,
    /// Accesses in flight below.
    in_flight: u32,
    /// For each tag in flight below: the first request of its access (whose completion
    /// counts down the access), and for that first, the requests still to complete.
    leader: Vec<u32>,
    remaining: Vec<u32>,
    first: Vec<Option<Queued>>,
    batch: Vec<Queued>,
    page: StatePage,
}

impl Scheduler {
    /// A scheduler of `policy` sending at most `depth` accesses below at once, predicting
    /// with a model of `spec`.
    pub fn new(policy: Policy, depth: u32, spec: DriveSpec, tuning: Tuning, page: StatePage) -> Self {
        page.set(QUEUED, 0);
        Scheduler {
            spec,
            model: None,
            sched: sched::build(policy, tuning),
            depth: depth.max(1),
            tags: TagSpace { queues: 0, per_queue: 0 },
            in_flight: 0,
            leader: Vec::new(),
            remaining: Vec::new(),
            first: Vec::new(),
            batch: Vec::new(),
            page,
        }
    }
}

/// The figures of a scheduler's state page: queued now, accesses dispatched, requests
/// coalesced into another's access, total wait (µs), longest wait (µs).
pub fn read(page: &StatePage) -> (u64, u64, u64, u64, u64) {
    (page.get(QUEUED), page.get(DISPATCHED), page.get(COALESCED), page.get(WAITED_US), page.get(MAX_WAIT_US))
}

impl Layer for Scheduler {
    fn name(&self) -> &'static str {
        "scheduler"
    }
    fn open(&mut self, below: &mut dyn ReadBelow) -> Result<(), SetupError> {
        self.model = Some(self.spec.model(below.size()).map_err(SetupError::of)?);
        Ok(())
    }
    fn attach(&mut self, tags: TagSpace) {
        self.tags = tags;
        self.leader = vec![0; tags.capacity()];
        self.remaining = vec![0; tags.capacity()];
        self.first = vec![None; tags.capacity()];
        self.batch.reserve(tags.capacity());
    }
    fn submit(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, now_ns: u64) -> Verdict {
        if tag.index() >= self.leader.len() {
            return Verdict::Complete(Err(BlockError::Invalid("scheduler: a tag beyond those attached")));
        }
        self.leader[tag.index()] = u32::MAX;
        let Some(access) = access_of(req) else { return Verdict::Forward };
        let stream = self.tags.queue_of(tag);
        self.sched.add(Queued { id: tag.index() as u64, access, arrival_ns: now_ns, stream });
        self.page.add(QUEUED, 1);
        Verdict::Hold
    }
    fn complete(&mut self, tag: Tag, _: &Request<'_>, _: SharedSlice<'_>, _: &mut Outcome, now_ns: u64) -> After {
        let Some(&leader) = self.leader.get(tag.index()) else { return After::Up };
        if leader == u32::MAX {
            return After::Up;
        }
        let l = leader as usize;
        self.remaining[l] -= 1;
        if self.remaining[l] == 0 {
            self.in_flight -= 1;
            if let Some(first) = self.first[l].take() {
                self.sched.completed(&first, now_ns);
            }
        }
        After::Up
    }
    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        let model = self.model.as_mut()?;
        while self.in_flight < self.depth {
            match self.sched.next(now_ns, model, &mut self.batch) {
                Next::Dispatch => {
                    model.serve(&batch_access(&self.batch));
                    let lead = self.batch[0].id as usize;
                    self.first[lead] = Some(self.batch[0]);
                    self.remaining[lead] = self.batch.len() as u32;
                    self.in_flight += 1;
                    self.page.add(DISPATCHED, 1);
                    self.page.add(COALESCED, self.batch.len() as u64 - 1);
                    for r in &self.batch {
                        self.leader[r.id as usize] = lead as u32;
                        let waited = now_ns.saturating_sub(r.arrival_ns) / 1000;
                        self.page.add(WAITED_US, waited);
                        if waited > self.page.get(MAX_WAIT_US) {
                            self.page.set(MAX_WAIT_US, waited);
                        }
                        self.page.set(QUEUED, self.page.get(QUEUED).saturating_sub(1));
                        release(Tag::new(r.id as u32), Verdict::Forward);
                    }
                }
                Next::Wait(at) => return Some(at),
                Next::Empty => return None,
            }
        }
        // Only a completion moves it on; the chain polls after each while it holds requests.
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{test_page, SizeBelow as Size};
    use bulkhead_shmem::SliceList;

    fn read_at(offset: u64) -> Request<'static> {
        Request::Read { offset, into: SliceList::new() }
    }

    #[test]
    fn it_sends_one_access_at_a_time_in_its_policys_order_and_the_next_when_one_completes() {
        let (_fd, page) = test_page();
        let mut s = Scheduler::new(Policy::Satf, 1, DriveSpec { cache: None, ..DriveSpec::seed() }, Tuning::default(), page);
        s.open(&mut Size(1 << 30)).unwrap();
        s.attach(TagSpace { queues: 2, per_queue: 4 });
        // Head at 0: the nearest first.
        for (t, off) in [(0u32, 900 << 20), (1, 10 << 20), (5, 400 << 20)] {
            assert_eq!(s.submit(Tag::new(t), &read_at(off), SharedSlice::empty(), 0), Verdict::Hold);
        }
        assert_eq!(s.submit(Tag::new(2), &Request::Flush, SharedSlice::empty(), 0), Verdict::Forward);
        let mut out = Vec::new();
        let mut order = Vec::new();
        for _ in 0..3 {
            assert_eq!(s.poll(1, &mut |t, v| out.push((t, v))), None);
            assert_eq!(out.len(), 1, "one access in flight at a time");
            let (t, v) = out.pop().unwrap();
            assert_eq!(v, Verdict::Forward);
            order.push(t.index());
            assert_eq!(s.poll(2, &mut |t, v| out.push((t, v))), None);
            assert!(out.is_empty(), "nothing more until it completes");
            assert_eq!(s.complete(t, &read_at(0), SharedSlice::empty(), &mut Ok(0), 3), After::Up);
        }
        assert_eq!(order, [1, 5, 0]);
        assert_eq!(s.complete(Tag::new(2), &Request::Flush, SharedSlice::empty(), &mut Ok(0), 3), After::Up);
        let (queued, dispatched, coalesced, ..) = read(&s.page);
        assert_eq!((queued, dispatched, coalesced), (0, 3, 0));
    }

    #[test]
    fn requests_that_continue_each_other_go_below_together_and_count_as_one_access() {
        let (_fd, page) = test_page();
        let mut s = Scheduler::new(Policy::Satf, 1, DriveSpec::seed(), Tuning::default(), page);
        s.open(&mut Size(1 << 30)).unwrap();
        s.attach(TagSpace { queues: 1, per_queue: 8 });
        let zeroes = |offset: u64| Request::WriteZeroes { offset, len: 4096 };
        s.submit(Tag::new(3), &zeroes(8192), SharedSlice::empty(), 0);
        s.submit(Tag::new(4), &zeroes(4096), SharedSlice::empty(), 0);
        s.submit(Tag::new(6), &zeroes(1 << 29), SharedSlice::empty(), 0);
        let mut out = Vec::new();
        s.poll(1, &mut |t, _| out.push(t.index()));
        assert_eq!(out, [4, 3]);
        // The access completes when both have; only then does the next go.
        s.complete(Tag::new(4), &zeroes(4096), SharedSlice::empty(), &mut Ok(0), 2);
        s.poll(3, &mut |t, _| out.push(t.index()));
        assert_eq!(out, [4, 3]);
        s.complete(Tag::new(3), &zeroes(8192), SharedSlice::empty(), &mut Ok(0), 4);
        s.poll(5, &mut |t, _| out.push(t.index()));
        assert_eq!(out, [4, 3, 6]);
        let (queued, dispatched, coalesced, ..) = read(&s.page);
        assert_eq!((queued, dispatched, coalesced), (0, 2, 1));
    }
}
