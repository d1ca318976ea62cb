//! `delay`: holds each request for a fixed time per operation before passing it on, like
//! nbdkit's `delay` filter, without stopping the domain: other requests, on this queue and
//! others, go on meanwhile.

use std::collections::VecDeque;

use bulkhead_block::{After, Layer, Op, Outcome, Request, SharedSlice, Tag, TagSpace, Verdict};

use crate::state::StatePage;

/// State page slots: requests delayed, requests held now.
const DELAYED: usize = 1;
const HELD: usize = 2;

/// The `delay` filter.
#[derive(Debug)]
pub struct Delay {
    /// Delay per operation ([`Op::index`]), ns.
    delay_ns: [u64; 5],
    /// Held requests per operation with their release time; each queue is in time order, as
    /// every request of one operation waits equally long.
    held: [VecDeque<(u64, Tag)>; 5],
    page: StatePage,
}

impl Delay {
    /// A filter delaying each operation by `delay_us[op.index()]` microseconds.
    pub fn new(delay_us: [u64; 5], page: StatePage) -> Self {
        page.set(HELD, 0);
        Delay { delay_ns: delay_us.map(|us| us.saturating_mul(1000)), held: Default::default(), page }
    }

    fn hold(&mut self, tag: Tag, op: Op, now_ns: u64) -> Verdict {
        let d = self.delay_ns[op.index()];
        if d == 0 {
            return Verdict::Forward;
        }
        self.held[op.index()].push_back((now_ns + d, tag));
        self.page.add(DELAYED, 1);
        self.page.add(HELD, 1);
        Verdict::Hold
    }
}

/// Requests delayed so far, and held now, as read back from a delay filter's state page.
pub fn read(page: &StatePage) -> (u64, u64) {
    (page.get(DELAYED), page.get(HELD))
}

impl Layer for Delay {
    fn name(&self) -> &'static str {
        "delay"
    }
    fn attach(&mut self, tags: TagSpace) {
        for q in &mut self.held {
            q.reserve(tags.capacity());
        }
    }
    fn submit(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, now_ns: u64) -> Verdict {
        match req {
            Request::Read { .. } => self.hold(tag, Op::Read, now_ns),
            Request::Write { .. } => self.hold(tag, Op::Write, now_ns),
            Request::Flush => self.hold(tag, Op::Flush, now_ns),
            Request::Discard { .. } => self.hold(tag, Op::Discard, now_ns),
            Request::WriteZeroes { .. } => self.hold(tag, Op::WriteZeroes, now_ns),
        }
    }
    fn complete(&mut self, _: Tag, _: &Request<'_>, _: SharedSlice<'_>, _: &mut Outcome, _: u64) -> After {
        After::Up
    }
    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        let mut next: Option<u64> = None;
        for q in &mut self.held {
            while let Some(&(at, tag)) = q.front() {
                if at > now_ns {
                    next = Some(next.map_or(at, |n| n.min(at)));
                    break;
                }
                q.pop_front();
                self.page.set(HELD, self.page.get(HELD).saturating_sub(1));
                release(tag, Verdict::Forward);
            }
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_page;

    #[test]
    fn each_operation_waits_its_own_delay_and_others_pass_at_once() {
        let (_fd, page) = test_page();
        // read 100 µs, write 0, flush 50 µs, discard 0, write-zeroes 10 µs.
        let mut d = Delay::new([100, 0, 50, 0, 10], page);
        d.attach(TagSpace { queues: 1, per_queue: 8 });
        assert_eq!(d.submit(Tag::new(0), &Request::Flush, SharedSlice::empty(), 0), Verdict::Hold);
        assert_eq!(d.submit(Tag::new(1), &Request::Discard { offset: 0, len: 4096 }, SharedSlice::empty(), 0), Verdict::Forward);
        assert_eq!(
            d.submit(Tag::new(2), &Request::WriteZeroes { offset: 0, len: 4096 }, SharedSlice::empty(), 5_000),
            Verdict::Hold
        );
        assert_eq!(d.submit(Tag::new(3), &Request::Flush, SharedSlice::empty(), 20_000), Verdict::Hold);
        let mut out = Vec::new();
        assert_eq!(d.poll(14_999, &mut |t, v| out.push((t, v))), Some(15_000));
        assert!(out.is_empty());
        assert_eq!(d.poll(50_000, &mut |t, v| out.push((t, v))), Some(70_000));
        assert_eq!(out, vec![(Tag::new(0), Verdict::Forward), (Tag::new(2), Verdict::Forward)]);
        assert_eq!(read(&d.page), (3, 1));
        out.clear();
        assert_eq!(d.poll(70_000, &mut |t, v| out.push((t, v))), None);
        assert_eq!(out, vec![(Tag::new(3), Verdict::Forward)]);
        assert_eq!(read(&d.page), (3, 0));
    }
}
