//! The spin budget of adaptive mode.
//!
//! Spinning before sleeping is the ski-rental problem: each gap spent spinning costs CPU, each
//! sleep costs a wake-up (here ~25–45 µs of latency). Spinning for as long as a wake-up costs is
//! 2-competitive whatever the gaps are, so that is the ceiling (`max_ns`). Below it, the `auto`
//! policy learns from the gaps it observes:
//!
//! * every gap (time from going idle to the next work) is recorded in a log2 histogram;
//! * every 64 samples the budget is recomputed: if fewer than half the gaps were shorter than
//!   the ceiling, spinning rarely pays and the budget drops to `min_ns`; otherwise it becomes
//!   1.5× the 90th percentile of the short gaps (so most short gaps are caught by the spin),
//!   clamped to `[min_ns, max_ns]`;
//! * the histogram then decays by half, so the budget follows a changing workload within a few
//!   hundred requests.
//!
//! A gap that ended after a sleep includes the wake-up latency; that biases it upwards, which
//! only makes the policy spin a little longer, never starve.

const BUCKETS: usize = 40;
const RETUNE_EVERY: u32 = 64;

/// Whether the budget is fixed or tunes itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetPolicy {
    /// Always spin this long.
    Fixed(u64),
    /// Tune between `min_ns` and `max_ns` from observed gaps.
    Auto {
        /// Lower bound.
        min_ns: u64,
        /// Upper bound (the cost of a wake-up).
        max_ns: u64,
    },
}

impl BudgetPolicy {
    /// The default auto policy for this class of machine: 2 µs to 50 µs.
    pub const DEFAULT_AUTO: BudgetPolicy = BudgetPolicy::Auto { min_ns: 2_000, max_ns: 50_000 };
}

/// A spin budget, fixed or self-tuning.
#[derive(Debug, Clone)]
pub struct SpinBudget {
    policy: BudgetPolicy,
    current: u64,
    hist: [u32; BUCKETS],
    samples: u32,
}

impl SpinBudget {
    /// A budget following `policy`. An auto budget starts at its ceiling.
    pub fn new(policy: BudgetPolicy) -> Self {
        let current = match policy {
            BudgetPolicy::Fixed(ns) => ns,
            BudgetPolicy::Auto { max_ns, .. } => max_ns,
        };
        SpinBudget { policy, current, hist: [0; BUCKETS], samples: 0 }
    }

    /// Nanoseconds to spin before sleeping.
    #[inline]
    pub fn budget_ns(&self) -> u64 {
        self.current
    }

    /// The policy.
    pub fn policy(&self) -> BudgetPolicy {
        self.policy
    }

    /// Records one observed gap.
    #[inline]
    pub fn record(&mut self, gap_ns: u64) {
        let BudgetPolicy::Auto { min_ns, max_ns } = self.policy else { return };
        let b = (64 - gap_ns.max(1).leading_zeros() as usize).min(BUCKETS - 1);
        self.hist[b] += 1;
        self.samples += 1;
        if self.samples >= RETUNE_EVERY {
            self.retune(min_ns, max_ns);
        }
    }

    fn retune(&mut self, min_ns: u64, max_ns: u64) {
        self.samples = 0;
        // Bucket b holds gaps in [2^(b-1), 2^b).
        let max_bucket = (64 - max_ns.max(1).leading_zeros() as usize).min(BUCKETS - 1);
        let total: u64 = self.hist.iter().map(|&c| c as u64).sum();
        let short: u64 = self.hist[..=max_bucket].iter().map(|&c| c as u64).sum();
        self.current = if total == 0 || short * 2 < total {
            min_ns
        } else {
            let want = short * 9 / 10;
            let mut acc = 0;
            let mut p90 = max_ns;
            for (b, &c) in self.hist[..=max_bucket].iter().enumerate() {
                acc += c as u64;
                if acc >= want.max(1) {
                    p90 = 1u64 << b;
                    break;
                }
            }
            (p90 + p90 / 2).clamp(min_ns, max_ns)
        };
        for c in &mut self.hist {
            *c /= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUTO: BudgetPolicy = BudgetPolicy::Auto { min_ns: 1_000, max_ns: 50_000 };

    #[test]
    fn fixed_budget_never_moves() {
        let mut b = SpinBudget::new(BudgetPolicy::Fixed(7_000));
        for _ in 0..1000 {
            b.record(1_000_000);
        }
        assert_eq!(b.budget_ns(), 7_000);
    }

    #[test]
    fn short_gaps_shrink_budget_to_cover_them() {
        let mut b = SpinBudget::new(AUTO);
        for _ in 0..256 {
            b.record(3_000);
        }
        // p90 bucket upper bound 4096, times 1.5.
        assert_eq!(b.budget_ns(), 6_144);
    }

    #[test]
    fn long_gaps_drop_budget_to_minimum() {
        let mut b = SpinBudget::new(AUTO);
        for _ in 0..256 {
            b.record(10_000_000);
        }
        assert_eq!(b.budget_ns(), 1_000);
    }

    #[test]
    fn budget_follows_a_changing_workload() {
        let mut b = SpinBudget::new(AUTO);
        for _ in 0..512 {
            b.record(10_000_000);
        }
        assert_eq!(b.budget_ns(), 1_000);
        for _ in 0..512 {
            b.record(20_000);
        }
        assert!(b.budget_ns() >= 20_000 && b.budget_ns() <= 50_000, "budget {}", b.budget_ns());
    }
}
