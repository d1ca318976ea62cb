//! The spin budget of adaptive mode.
//!
//! Spinning before sleeping is the ski-rental problem: a gap spent spinning costs CPU time, a
//! sleep costs a wake-up (here ~25–45 µs of added latency and the peer's doorbell system call).
//! Spinning for as long as a wake-up costs is 2-competitive whatever the gaps are, so that is
//! the ceiling (`max_ns`, which stands for the wake-up cost W). Below it, the `auto` policy picks
//! the threshold that would have been cheapest on the gaps it has seen:
//!
//! * every gap (time from going idle to the next work) is recorded in a log2 histogram;
//! * every 64 samples, for each candidate threshold T (each bucket boundary up to the ceiling,
//!   and the floor `min_ns`), the cost over the histogram is Σ gap for gaps ≤ T (spun through)
//!   plus Σ (T + W) for longer gaps (spun in vain, then a wake-up); the cheapest T wins, the
//!   smaller on a tie;
//! * the histogram then decays by half, so the budget follows a changing workload within a few
//!   hundred requests.
//!
//! Back-to-back load (gaps far below W) therefore keeps the full budget and never sleeps; sparse
//! load (gaps far above W) drops to the floor and stops burning CPU between requests. A gap that
//! ended after a sleep includes the wake-up latency; that biases it upwards, which only makes
//! the policy spin a little longer, never starve.

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
        let BudgetPolicy::Auto { min_ns, max_ns } = self.policy else {
            return;
        };
        let b = (64 - gap_ns.max(1).leading_zeros() as usize).min(BUCKETS - 1);
        self.hist[b] += 1;
        self.samples += 1;
        if self.samples >= RETUNE_EVERY {
            self.retune(min_ns, max_ns);
        }
    }

    fn retune(&mut self, min_ns: u64, max_ns: u64) {
        self.samples = 0;
        let wake = max_ns as f64;
        // Bucket b holds gaps in [2^(b-1), 2^b); its representative gap is 0.75 * 2^b.
        let rep = |b: usize| 0.75 * (1u64 << b) as f64;
        let cost = |t: u64| -> f64 {
            self.hist
                .iter()
                .enumerate()
                .map(|(b, &c)| {
                    let g = rep(b);
                    c as f64 * if g <= t as f64 { g } else { t as f64 + wake }
                })
                .sum()
        };
        let mut best = (cost(min_ns), min_ns);
        let mut t = min_ns.next_power_of_two();
        while t < max_ns {
            let c = cost(t);
            if c < best.0 {
                best = (c, t);
            }
            t *= 2;
        }
        let c = cost(max_ns);
        if c < best.0 {
            best = (c, max_ns);
        }
        self.current = best.1;
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
    fn short_gaps_get_a_budget_that_covers_them() {
        let mut b = SpinBudget::new(AUTO);
        for _ in 0..256 {
            b.record(3_000);
        }
        // Gaps of ~3 µs: the cheapest threshold is the first one that covers them.
        assert_eq!(b.budget_ns(), 4_096);
    }

    #[test]
    fn back_to_back_load_with_a_tail_keeps_spinning_through_the_tail() {
        let mut b = SpinBudget::new(AUTO);
        for i in 0..640 {
            // 95% gaps of 300 ns, 5% of 20 µs: sleeping through the tail would cost a wake-up
            // each time, so the budget must cover the tail too.
            b.record(if i % 20 == 0 { 20_000 } else { 300 });
        }
        assert!(b.budget_ns() >= 20_000, "budget {}", b.budget_ns());
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
