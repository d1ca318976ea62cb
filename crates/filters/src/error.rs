//! `error`: injects failures by operation, range, probability and count, like qemu's blkdebug
//! or nbdkit's `error` filter. A request it picks is answered with the configured errno and
//! never reaches the layers below; every other request passes unchanged.
//!
//! The counts live in the filter's state page, so `count = 1` means one failure for the life
//! of the device, not one per domain generation; the random generator's state lives there too,
//! so a restart does not replay the same choices.

use bulkhead_block::{After, BlockError, Layer, Op, Outcome, Request, SharedSlice, Tag, Verdict};

use crate::state::StatePage;

/// State page slots: requests that matched the rule, failures injected, generator state.
const MATCHED: usize = 1;
const INJECTED: usize = 2;
const RNG: usize = 3;

/// The errnos a failure can carry across the channel.
pub const ERRNOS: [(&str, i32); 5] = [
    ("EIO", libc_errno::EIO),
    ("ENOSPC", libc_errno::ENOSPC),
    ("EROFS", libc_errno::EROFS),
    ("EINVAL", libc_errno::EINVAL),
    ("EOPNOTSUPP", libc_errno::EOPNOTSUPP),
];

mod libc_errno {
    pub const EIO: i32 = 5;
    pub const ENOSPC: i32 = 28;
    pub const EROFS: i32 = 30;
    pub const EINVAL: i32 = 22;
    pub const EOPNOTSUPP: i32 = 95;
}

/// Which requests fail, and how.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorRule {
    /// Operations it applies to, a bit per [`Op::index`].
    pub ops: u8,
    /// Start of the device range it applies to (requests overlapping it match; a flush, which
    /// has no range, matches whatever the range).
    pub offset: u64,
    /// Length of that range.
    pub len: u64,
    /// Chance that a matching request fails, in millionths (1,000,000: always).
    pub probability_ppm: u32,
    /// Matching requests let through before the first failure.
    pub after: u64,
    /// Failures to inject at most (`None`: no limit).
    pub count: Option<u64>,
    /// The errno the failure carries (one of [`ERRNOS`]).
    pub errno: i32,
    /// Seed of the random choice.
    pub seed: u64,
}

/// The `error` filter.
#[derive(Debug)]
pub struct ErrorFilter {
    rule: ErrorRule,
    page: StatePage,
}

/// Requests matched and failures injected, as read back from an error filter's state page.
pub fn read(page: &StatePage) -> (u64, u64) {
    (page.get(MATCHED), page.get(INJECTED))
}

impl ErrorFilter {
    /// A filter applying `rule`, counting into `page`.
    pub fn new(rule: ErrorRule, page: StatePage) -> Self {
        if page.get(RNG) == 0 {
            page.set(RNG, rule.seed | 1);
        }
        ErrorFilter { rule, page }
    }

    fn random_ppm(&mut self) -> u32 {
        // Where the generator stands lives in the state page, so a restarted domain goes on
        // drawing where the last one stopped.
        let mut rng = bulkhead_rng::Rng::new(self.page.get(RNG));
        let ppm = rng.below(1_000_000) as u32;
        self.page.set(RNG, rng.state());
        ppm
    }

    fn decide(&mut self, op: Op, req: &Request<'_>) -> Verdict {
        let r = self.rule;
        if r.ops & (1 << op.index()) == 0 {
            return Verdict::Forward;
        }
        if op != Op::Flush {
            let (offset, len) = req.range();
            let end = offset.saturating_add(len.max(1));
            if end <= r.offset || offset >= r.offset.saturating_add(r.len) {
                return Verdict::Forward;
            }
        }
        let matched = self.page.get(MATCHED);
        self.page.add(MATCHED, 1);
        if matched < r.after || r.count.is_some_and(|c| self.page.get(INJECTED) >= c) {
            return Verdict::Forward;
        }
        if r.probability_ppm < 1_000_000 && self.random_ppm() >= r.probability_ppm {
            return Verdict::Forward;
        }
        self.page.add(INJECTED, 1);
        let offset = req.range().0;
        Verdict::Complete(Err(BlockError::Os { op: op.as_str(), offset, errno: r.errno }))
    }
}

impl Layer for ErrorFilter {
    fn name(&self) -> &'static str {
        "error"
    }
    fn submit(&mut self, _: Tag, req: &Request<'_>, _: SharedSlice<'_>, _: u64) -> Verdict {
        match req {
            Request::Read { .. } => self.decide(Op::Read, req),
            Request::Write { .. } => self.decide(Op::Write, req),
            Request::Flush => self.decide(Op::Flush, req),
            Request::Discard { .. } => self.decide(Op::Discard, req),
            Request::WriteZeroes { .. } => self.decide(Op::WriteZeroes, req),
        }
    }
    fn complete(&mut self, _: Tag, _: &Request<'_>, _: SharedSlice<'_>, _: &mut Outcome, _: u64) -> After {
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
    use bulkhead_block::Status;

    fn rule() -> ErrorRule {
        ErrorRule { ops: 0b11111, offset: 0, len: u64::MAX, probability_ppm: 1_000_000, after: 0, count: None, errno: 5, seed: 1 }
    }

    fn fails(f: &mut ErrorFilter, req: &Request<'_>) -> Option<Status> {
        match f.submit(Tag::new(0), req, SharedSlice::empty(), 0) {
            Verdict::Forward => None,
            Verdict::Complete(Err(e)) => Some(e.status()),
            other => panic!("unexpected verdict {other:?}"),
        }
    }

    #[test]
    fn only_the_configured_operations_and_range_fail_with_the_configured_errno() {
        let (_fd, page) = test_page();
        let ops = 1 << Op::Discard.index() | 1 << Op::Flush.index();
        let mut f = ErrorFilter::new(ErrorRule { ops, offset: 8192, len: 4096, errno: 28, ..rule() }, page);
        assert_eq!(fails(&mut f, &Request::Discard { offset: 0, len: 8192 }), None, "ends where the range starts");
        assert_eq!(fails(&mut f, &Request::Discard { offset: 12288, len: 4096 }), None, "starts where it ends");
        assert_eq!(fails(&mut f, &Request::Discard { offset: 4096, len: 8192 }), Some(Status::NoSpace));
        assert_eq!(fails(&mut f, &Request::WriteZeroes { offset: 8192, len: 4096 }), None, "not a chosen op");
        assert_eq!(fails(&mut f, &Request::Flush), Some(Status::NoSpace), "a flush has no range");
        assert_eq!(read(&f.page), (2, 2));
    }

    #[test]
    fn after_and_count_bound_the_failures_across_a_restart() {
        let (fd, page) = test_page();
        let r = ErrorRule { after: 2, count: Some(3), ..rule() };
        let mut f = ErrorFilter::new(r, page);
        let got: Vec<_> = (0..4).map(|_| fails(&mut f, &Request::Flush).is_some()).collect();
        assert_eq!(got, [false, false, true, true]);
        // A new generation of the domain maps the same page: one failure is left.
        drop(f);
        let mut f = ErrorFilter::new(r, StatePage::map(std::os::fd::AsRawFd::as_raw_fd(&fd), true).unwrap());
        let got: Vec<_> = (0..4).map(|_| fails(&mut f, &Request::Flush).is_some()).collect();
        assert_eq!(got, [true, false, false, false]);
        assert_eq!(read(&f.page), (8, 3));
    }

    #[test]
    fn probability_fails_about_that_share() {
        let (_fd, page) = test_page();
        let mut f = ErrorFilter::new(ErrorRule { probability_ppm: 250_000, seed: 42, ..rule() }, page);
        let n = (0..10_000).filter(|_| fails(&mut f, &Request::Flush).is_some()).count();
        assert!((2_200..2_800).contains(&n), "{n} of 10000 failed at p=0.25");
    }
}
