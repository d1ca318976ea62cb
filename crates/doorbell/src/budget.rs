//! The spin budget of adaptive mode.
//!
//! Spinning before sleeping is the ski-rental problem: a gap spent spinning costs CPU time, a
//! sleep costs a wake-up — here ~20–25 µs of added latency on the sleeping side plus a doorbell
//! system call on the other, and on an exported device each request pays it again. The `auto`
//! policy weighs a wake-up as `wake_ns` (40 µs by default: its 25 µs of latency weighed one for
//! one against CPU, which on a busy host is not idle, plus the ~15 µs of CPU that a sleep and
//! its wake-up cost) and picks, up to a ceiling `max_ns` (200 µs), the threshold
//! that would have been cheapest on the gaps it has seen:
//!
//! * every gap (time from going idle to the next work) is recorded in a log2 histogram;
//! * every 64 samples, for each candidate threshold T (each bucket boundary up to the ceiling,
//!   and the floor `min_ns`), the cost over the histogram is Σ gap for gaps ≤ T (spun through;
//!   each bucket keeps the sum of its gaps) plus Σ (T + W) for longer gaps (spun in vain, then a
//!   wake-up); the cheapest T wins, the smaller on a tie;
//! * the histogram then decays by half, so the budget follows a changing workload within a few
//!   hundred requests.
//!
//! Back-to-back load (gaps far below W) keeps a budget that covers the gaps and never sleeps;
//! sparse load (gaps far above the ceiling) drops to the floor and stops burning CPU between
//! requests. A gap that ended after a sleep is longer than the real one by the sleeper's own
//! wake-up, which would feed back — sleeping makes the gaps look long, which makes sleeping
//! look right — so such gaps are recorded less [`WAKE_LATENCY_NS`] ([`SpinBudget::record_after_sleep`]).
//! Behind FUSE and a loop device the gaps between one thread's requests are 30–60 µs here,
//! the kernel's own round trip: the old ceiling of 50 µs with that feedback kept adaptive at
//! irq speed (docs/BENCHMARKS.md). A guest under QEMU's TCG asks every ~100 µs: spinning
//! through those gaps cost three times the CPU of a server that sleeps, for a quarter of the
//! latency, so `wake_ns` sits between the two (docs/ring-protocol.md, "Adaptive budget").
const BUCKETS: usize = 40;
const RETUNE_EVERY: u32 = 64;
/// One side's wake-up latency from a doorbell on this kind of machine (shared/BENCH.md).
pub const WAKE_LATENCY_NS: u64 = 25_000;

/// Whether the budget is fixed or tunes itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetPolicy {
    /// Always spin this long.
    Fixed(u64),
    /// Tune between `min_ns` and `max_ns` from observed gaps.
    Auto {
        /// Lower bound.
        min_ns: u64,
        /// Upper bound of the budget.
        max_ns: u64,
        /// What a wake-up is taken to cost, in spinning time.
        wake_ns: u64,
    },
}

impl BudgetPolicy {
    /// The default auto policy for this class of machine: 2 µs to 200 µs, a wake-up weighed as
    /// 40 µs of spinning.
    pub const DEFAULT_AUTO: BudgetPolicy = BudgetPolicy::Auto { min_ns: 2_000, max_ns: 200_000, wake_ns: 40_000 };
}

/// A spin budget, fixed or self-tuning.
#[derive(Debug, Clone)]
pub struct SpinBudget {
    policy: BudgetPolicy,
    current: u64,
    hist: [u32; BUCKETS],
    /// Sum of the gaps in each bucket, ns: the bucket's cost when spun through is what its gaps
    /// were, not a bucket-wide guess (a log2 bucket spans a factor of two).
    sums: [u64; BUCKETS],
    samples: u32,
    /// Sum of the gaps of this epoch (`RETUNE_EVERY` samples), each less the wake-up it
    /// included if this side slept: a probe that spins has none to shed.
    sum: u64,
    /// Epochs since the last probe.
    epochs: u32,
    /// Epochs between probes now: [`PROBE_EVERY`], doubled after each probe that changed
    /// nothing, up to [`PROBE_EVERY_MAX`].
    probe_every: u32,
    /// This epoch spins to the ceiling to see what gaps look like when nobody sleeps.
    probing: bool,
    /// Mean gap of the last ordinary epoch, ns.
    normal_mean: u64,
    /// Epochs left to hold the ceiling after a probe showed that spinning shortens the gaps.
    held: u32,
}

/// A probe runs every this many epochs while the budget is below its ceiling, at first.
const PROBE_EVERY: u32 = 8;
/// The longest interval probes that change nothing back off to.
const PROBE_EVERY_MAX: u32 = 64;
/// Epochs the ceiling is held after a successful probe.
const HOLD_EPOCHS: u32 = 16;

impl SpinBudget {
    /// A budget following `policy`. An auto budget starts at its ceiling.
    pub fn new(policy: BudgetPolicy) -> Self {
        let current = match policy {
            BudgetPolicy::Fixed(ns) => ns,
            BudgetPolicy::Auto { max_ns, .. } => max_ns,
        };
        SpinBudget {
            policy,
            current,
            hist: [0; BUCKETS],
            sums: [0; BUCKETS],
            samples: 0,
            sum: 0,
            epochs: 0,
            probe_every: PROBE_EVERY,
            probing: false,
            normal_mean: 0,
            held: 0,
        }
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
        self.sample(gap_ns);
    }

    /// Records a gap that ended only after this side slept: less the wake-up it includes.
    #[inline]
    pub fn record_after_sleep(&mut self, gap_ns: u64) {
        self.sample(gap_ns.saturating_sub(WAKE_LATENCY_NS));
    }

    /// Whether recorded gaps change the budget (the `Auto` policy); callers that would read the
    /// clock only to record a gap can skip it otherwise.
    pub fn tunes(&self) -> bool {
        matches!(self.policy, BudgetPolicy::Auto { .. })
    }

    /// Whether the budget is probing at its ceiling now.
    pub fn probing(&self) -> bool {
        self.probing
    }

    #[inline]
    fn sample(&mut self, gap_ns: u64) {
        let BudgetPolicy::Auto { min_ns, max_ns, wake_ns } = self.policy else {
            return;
        };
        let b = (64 - gap_ns.max(1).leading_zeros() as usize).min(BUCKETS - 1);
        self.hist[b] += 1;
        self.sums[b] = self.sums[b].saturating_add(gap_ns);
        self.samples += 1;
        self.sum = self.sum.saturating_add(gap_ns);
        if self.samples >= RETUNE_EVERY {
            self.end_epoch(min_ns, max_ns, wake_ns);
        }
    }

    /// The gap histogram is measured under the budget in force, and on a small machine the
    /// gaps themselves depend on it: when this side sleeps its CPU halts, and every wake-up in
    /// the peer's own chain (FUSE, the loop device, the application) gets slower too, so the
    /// gaps grow by far more than this side's wake-up and sleeping looks right. Every
    /// [`PROBE_EVERY`] epochs one epoch spins to the ceiling instead; if its mean gap is under
    /// 70% of the last ordinary epoch's (both without this side's own wake-ups, which spinning
    /// saves whatever the peer does), spinning is what makes the work arrive sooner, and the
    /// ceiling is held for [`HOLD_EPOCHS`] epochs while the histogram fills with the gaps seen
    /// while spinning. A probe that changes nothing doubles the interval to the next, up to
    /// [`PROBE_EVERY_MAX`] epochs: on a load that comes ~100 µs apart a probe spins through a
    /// whole epoch of gaps, and one in nine cost more CPU than the sleeps saved.
    fn end_epoch(&mut self, min_ns: u64, max_ns: u64, wake_ns: u64) {
        let mean = self.sum / self.samples.max(1) as u64;
        self.sum = 0;
        if self.probing {
            self.probing = false;
            if mean * 10 < self.normal_mean * 7 {
                self.held = HOLD_EPOCHS;
                self.hist = [0; BUCKETS];
                self.sums = [0; BUCKETS];
                self.probe_every = PROBE_EVERY;
            } else {
                self.probe_every = (self.probe_every * 2).min(PROBE_EVERY_MAX);
            }
        } else {
            self.normal_mean = mean;
        }
        self.retune(min_ns, max_ns, wake_ns);
        if self.held > 0 {
            self.held -= 1;
            self.current = max_ns;
            return;
        }
        self.epochs += 1;
        if self.current < max_ns && self.epochs >= self.probe_every {
            self.epochs = 0;
            self.probing = true;
            self.current = max_ns;
        }
    }

    fn retune(&mut self, min_ns: u64, max_ns: u64, wake_ns: u64) {
        self.samples = 0;
        let wake = wake_ns as f64;
        // Each bucket's gaps as one: how many, and their mean. Bucket b holds gaps in
        // [2^(b-1), 2^b), so a threshold at a power of two spins through whole buckets.
        let cost = |t: u64| -> f64 {
            self.hist
                .iter()
                .zip(&self.sums)
                .filter(|(&c, _)| c > 0)
                .map(|(&c, &sum)| {
                    let mean = sum as f64 / c as f64;
                    if mean <= t as f64 {
                        sum as f64
                    } else {
                        c as f64 * (t as f64 + wake)
                    }
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
        for (c, sum) in self.hist.iter_mut().zip(&mut self.sums) {
            *c /= 2;
            *sum /= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUTO: BudgetPolicy = BudgetPolicy::Auto { min_ns: 1_000, max_ns: 50_000, wake_ns: 50_000 };

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
        assert!(b.budget_ns() == 1_000 || b.probing(), "budget {}", b.budget_ns());
    }

    #[test]
    fn budget_follows_a_changing_workload() {
        let mut b = SpinBudget::new(AUTO);
        for _ in 0..512 {
            b.record(10_000_000);
        }
        assert!(b.budget_ns() == 1_000 || b.probing(), "budget {}", b.budget_ns());
        for _ in 0..512 {
            b.record(20_000);
        }
        assert!(b.budget_ns() >= 20_000 && b.budget_ns() <= 50_000, "budget {}", b.budget_ns());
    }

    #[test]
    fn a_probe_that_shortens_the_gaps_holds_the_ceiling() {
        // Gaps that are long whenever this side sleeps, and short when it spins through them.
        let mut b = SpinBudget::new(BudgetPolicy::DEFAULT_AUTO);
        let mut raised = false;
        for _ in 0..64 * 64 {
            if b.budget_ns() >= 65_536 {
                b.record(35_000);
            } else {
                b.record_after_sleep(160_000);
            }
            raised |= b.budget_ns() == 200_000 && !b.probing();
        }
        assert!(raised, "a probe found the short gaps and held the ceiling");
        assert!(b.budget_ns() >= 65_536, "spinning covers 35 µs gaps: {}", b.budget_ns());
    }

    #[test]
    fn requests_a_tcg_guest_apart_are_slept_through_and_probes_back_off() {
        // A guest under TCG asks every ~90 µs as a domain sees it (bench vm, 11k IOPS at QD1),
        // and ~65 µs while the domain spins, which saves the guest the domain's wake-up.
        let mut b = SpinBudget::new(BudgetPolicy::DEFAULT_AUTO);
        let mut spun_epochs = Vec::new();
        for epoch in 0..400 {
            let spinning = b.budget_ns() >= 65_536;
            for _ in 0..RETUNE_EVERY {
                if spinning {
                    b.record(65_000);
                } else {
                    b.record_after_sleep(90_000);
                }
            }
            if spinning {
                spun_epochs.push(epoch);
            }
        }
        // Only the first epoch (the budget starts at its ceiling) and the probes spin, and
        // the probes come further apart each time they change nothing.
        assert!(spun_epochs.len() <= 1 + 3 + 400 / PROBE_EVERY_MAX as usize, "spun in epochs {spun_epochs:?}");
        let late = spun_epochs.iter().filter(|&&e| e >= 200).count();
        assert!(late <= 200 / PROBE_EVERY_MAX as usize + 1, "spun in epochs {spun_epochs:?}");
        assert_eq!(b.budget_ns(), 2_000, "between probes the budget is at its floor");
    }

    #[test]
    fn gaps_of_a_file_system_over_a_loop_device_keep_their_spin() {
        // FUSE and a loop device on two CPUs: ~33 µs between one thread's requests while the
        // domain spins.
        let mut b = SpinBudget::new(BudgetPolicy::DEFAULT_AUTO);
        for i in 0..64 * 16 {
            b.record(28_000 + (i % 5) * 3_000);
        }
        assert!(b.budget_ns() >= 40_000, "budget {}", b.budget_ns());
    }

    #[test]
    fn a_probe_that_changes_nothing_leaves_a_sparse_load_asleep() {
        let mut b = SpinBudget::new(BudgetPolicy::DEFAULT_AUTO);
        for _ in 0..64 * 64 {
            b.record(if b.budget_ns() > 2_000 { 5_000_000 } else { 5_000_000 + 20_000 });
        }
        // Only the probes spin; between them the budget is at its floor.
        let mut spinning = 0;
        for _ in 0..64 * 16 {
            spinning += (b.budget_ns() > 2_000) as u32;
            b.record(5_000_000);
        }
        assert!(spinning <= 64 * 16 / PROBE_EVERY + 64, "spun {spinning} of {} gaps", 64 * 16);
    }
}
