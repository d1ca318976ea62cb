//! Algorithm T: the order of serving a queue of requests that minimises their total
//! response time, in `O(n²)`.
//!
//! The cost model is the seek model's: moving the head `d` sectors costs `a·d` and every
//! access costs a fixed `b` besides (half a rotation and the transfer). With a fixed cost the
//! same for every request, the sum of completion times is `Σ (n−k+1)·travel_k + b·n(n+1)/2`:
//! the fixed part does not depend on the order, so the best order is the best order for
//! travel alone. And for travel alone, an order that passes over a queued request without
//! serving it is never better than serving it on the way (that delays no one and finishes it
//! sooner). So some best order serves, at every moment, exactly the requests in an interval
//! of the sorted positions, and the head stands at one end of that interval: a dynamic
//! programme over `(first, last, end)` — `n²` intervals, two ends, two ways to grow each —
//! finds it (the minimum-latency problem on a line).
//!
//! The order is exact when every request costs the same `b`, which is the case for a queue of
//! requests of one size; the schedulers pass the mean of the queue when sizes differ. The
//! tests prove it against every order of random queues of up to eight requests.

/// Requests the optimiser considers at most; beyond this a caller passes the oldest.
pub const MAX_QUEUE: usize = 256;

/// The optimiser, with its tables kept between calls so that it allocates only while its
/// queues grow.
#[derive(Debug, Default, Clone)]
pub struct Optimiser {
    /// Indexes of the positions, sorted by position.
    sorted: Vec<usize>,
    /// Cost to go from each interval, head at its low (0) or high (1) end.
    table: Vec<[u128; 2]>,
}

/// The best order's total cost (the sum over requests of their completion times, in the
/// units of `a·d + b`) and the order (indexes into the positions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Sum of completion times.
    pub total: u128,
    /// Indexes into the positions, first served first.
    pub order: Vec<usize>,
}

impl Optimiser {
    /// An optimiser with empty tables.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fills the table for `positions` seen from nothing served; returns the sorted
    /// positions' count.
    fn solve(&mut self, positions: &[u64], a: u128, b: u128) -> usize {
        let n = positions.len();
        self.sorted.clear();
        self.sorted.extend(0..n);
        self.sorted.sort_by_key(|&i| (positions[i], i));
        self.table.clear();
        self.table.resize(n * n, [0, 0]);
        let p = |k: usize| positions[self.sorted[k]];
        // Longest intervals first: the whole queue served costs nothing more.
        for len in (1..n).rev() {
            let rem = (n - len) as u128;
            for i in 0..=(n - len) {
                let j = i + len - 1;
                for end in 0..2 {
                    let at = if end == 0 { p(i) } else { p(j) };
                    let mut best = u128::MAX;
                    if i > 0 {
                        let step = a * at.abs_diff(p(i - 1)) as u128 + b;
                        best = best.min(step * rem + self.table[(i - 1) * n + j][0]);
                    }
                    if j + 1 < n {
                        let step = a * at.abs_diff(p(j + 1)) as u128 + b;
                        best = best.min(step * rem + self.table[i * n + j + 1][1]);
                    }
                    self.table[i * n + j][end] = best;
                }
            }
        }
        n
    }

    /// The first request of a best order for `positions` with the head at `head` (`None` for
    /// an empty queue). At most [`MAX_QUEUE`] positions.
    pub fn first(&mut self, head: u64, positions: &[u64], a: u128, b: u128) -> Option<usize> {
        assert!(positions.len() <= MAX_QUEUE, "{} positions for the optimiser", positions.len());
        let n = self.solve(positions, a, b);
        (0..n)
            .map(|k| ((a * head.abs_diff(positions[self.sorted[k]]) as u128 + b) * n as u128 + self.table[k * n + k][0], k))
            .min()
            .map(|(_, k)| self.sorted[k])
    }

    /// A whole best order and its cost.
    pub fn plan(&mut self, head: u64, positions: &[u64], a: u128, b: u128) -> Plan {
        assert!(positions.len() <= MAX_QUEUE, "{} positions for the optimiser", positions.len());
        let n = self.solve(positions, a, b);
        if n == 0 {
            return Plan { total: 0, order: Vec::new() };
        }
        let p = |k: usize| positions[self.sorted[k]];
        let (total, k) = (0..n)
            .map(|k| ((a * head.abs_diff(p(k)) as u128 + b) * n as u128 + self.table[k * n + k][0], k))
            .min()
            .expect("n > 0");
        let mut order = vec![self.sorted[k]];
        let (mut i, mut j, mut end) = (k, k, 0usize);
        while order.len() < n {
            let rem = (n - (j - i + 1)) as u128;
            let at = if end == 0 { p(i) } else { p(j) };
            let here = self.table[i * n + j][end];
            let left = (i > 0).then(|| (a * at.abs_diff(p(i - 1)) as u128 + b) * rem + self.table[(i - 1) * n + j][0]);
            if left == Some(here) {
                i -= 1;
                end = 0;
                order.push(self.sorted[i]);
            } else {
                j += 1;
                end = 1;
                order.push(self.sorted[j]);
            }
        }
        Plan { total, order }
    }
}

/// The sum of completion times of serving `positions` in `order` from `head`, each access
/// costing `a·d + b`: what [`Optimiser::plan`] minimises.
pub fn total(head: u64, positions: &[u64], order: &[usize], a: u128, b: u128) -> u128 {
    let (mut at, mut t, mut sum) = (head, 0u128, 0u128);
    for &k in order {
        t += a * at.abs_diff(positions[k]) as u128 + b;
        at = positions[k];
        sum += t;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every order of `0..n`, by Heap's algorithm.
    fn permutations(n: usize) -> Vec<Vec<usize>> {
        fn go(k: usize, a: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
            if k <= 1 {
                out.push(a.clone());
                return;
            }
            for i in 0..k {
                go(k - 1, a, out);
                let j = if k.is_multiple_of(2) { i } else { 0 };
                a.swap(j, k - 1);
            }
        }
        let mut out = Vec::new();
        go(n, &mut (0..n).collect(), &mut out);
        out
    }

    #[test]
    fn the_seed_example_is_served_60_41_10_95() {
        let positions = [95, 10, 60, 41];
        let plan = Optimiser::new().plan(50, &positions, 1, 0);
        let served: Vec<u64> = plan.order.iter().map(|&k| positions[k]).collect();
        assert_eq!(served, [60, 41, 10, 95]);
        // Completion times 10, 29, 60, 145: mean response 61.
        assert_eq!(plan.total, 244);
    }

    #[test]
    fn algorithm_t_matches_brute_force_over_every_order_of_random_queues_up_to_eight() {
        let mut rng = bulkhead_rng::Rng::new(0x9e37_79b9_7f4a_7c15);
        let perms: Vec<Vec<Vec<usize>>> = (0..=8).map(permutations).collect();
        let mut opt = Optimiser::new();
        for round in 0..600 {
            let n = 1 + (round % 8);
            // Narrow ranges make ties and equal positions common; wide ones do not.
            let span = [10, 1000, 1 << 30][round % 3];
            let positions: Vec<u64> = (0..n).map(|_| rng.below(span)).collect();
            let head = rng.below(span);
            let (a, b) = ([1u128, 7, 7_500_000][round % 3], [0u128, 3, 2_045_511_000][(round / 3) % 3]);
            let plan = opt.plan(head, &positions, a, b);
            let brute = perms[n].iter().map(|o| total(head, &positions, o, a, b)).min().unwrap();
            assert_eq!(plan.total, brute, "queue {positions:?} head {head} a {a} b {b}");
            // The order given achieves the cost given, and is an order of them all.
            assert_eq!(total(head, &positions, &plan.order, a, b), plan.total);
            let mut seen = plan.order.clone();
            seen.sort();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
            assert_eq!(opt.first(head, &positions, a, b), plan.order.first().copied());
        }
    }

    #[test]
    fn an_empty_queue_has_no_first() {
        assert_eq!(Optimiser::new().first(5, &[], 1, 1), None);
        assert_eq!(Optimiser::new().plan(5, &[], 1, 1), Plan { total: 0, order: vec![] });
    }
}
