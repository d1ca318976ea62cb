//! The spin-then-sleep decision of a loop that serves several sources (an export's requests
//! and a device's answers), and learns from each idle stretch how long the next spin may be.

use crate::{BudgetPolicy, CrowdWatch, SpinBudget};

/// One serving loop's idle stretches: when one began, whether it slept, and the budget and
/// crowd check that decide between spinning and sleeping.
#[derive(Debug)]
pub struct IdleSpin {
    budget: SpinBudget,
    crowd: CrowdWatch,
    /// When the current idle stretch began (`None`: the loop is working).
    since: Option<u64>,
    /// The current stretch has slept.
    slept: bool,
}

impl IdleSpin {
    /// A loop at work, spinning by `policy` when idle.
    pub fn new(policy: BudgetPolicy) -> Self {
        IdleSpin { budget: SpinBudget::new(policy), crowd: CrowdWatch::default(), since: None, slept: false }
    }

    /// The loop found work at `now`: an idle stretch ends, and its length (less the wake-up,
    /// if it slept) tunes the budget.
    pub fn worked(&mut self, now: u64) {
        if let Some(t0) = self.since.take() {
            if self.slept {
                self.budget.record_after_sleep(now - t0);
            } else {
                self.budget.record(now - t0);
            }
        }
        self.slept = false;
    }

    /// How long the current idle stretch has lasted at `now` (0 while the loop is working).
    pub fn idle_ns(&self, now: u64) -> u64 {
        self.since.map_or(0, |t0| now.saturating_sub(t0))
    }

    /// The loop found nothing at `now`: whether to spin on (`true`) or sleep (`false`, and the
    /// stretch counts as slept until work comes). It spins within the budget, while
    /// `may_spin`, and while threads are not waiting for a CPU.
    pub fn spin(&mut self, now: u64, may_spin: bool) -> bool {
        let t0 = *self.since.get_or_insert(now);
        if !self.slept && may_spin && now - t0 < self.budget.budget_ns() && !self.crowd.should_sleep(t0, now) {
            return true;
        }
        self.slept = true;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_within_the_budget_then_sleeps_until_work_comes() {
        let mut w = IdleSpin::new(BudgetPolicy::Fixed(10_000));
        assert!(w.spin(1_000, true), "idle from 1 µs: spin");
        assert!(w.spin(5_000, true));
        assert!(!w.spin(5_000, false), "a caller that may not spin sleeps");
        assert!(!w.spin(6_000, true), "once slept, the stretch sleeps until work comes");
        w.worked(7_000);
        assert!(w.spin(8_000, true), "a new stretch spins again");
        assert_eq!(w.idle_ns(18_001), 10_001, "the stretch began at 8 µs");
        assert!(!w.spin(18_001, true), "past the 10 µs budget: sleep");
        w.worked(19_000);
        assert_eq!(w.idle_ns(20_000), 0, "working: not idle");
    }
}
