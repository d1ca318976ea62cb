//! The spin-then-sleep decision of a loop that serves several sources (an export's requests
//! and a device's answers), and learns from each idle stretch how long the next spin may be.

use crate::{BudgetPolicy, CrowdWatch, SpinBudget};

/// One serving loop's idle stretches: when one began, whether it slept, and the budgets and
/// crowd check that decide between spinning and sleeping.
///
/// A stretch with requests at the device waits for an answer the driver domain owes; one
/// without waits for the loop's client to ask again. A wait for the client learns from the
/// client's gaps alone: a TCG guest asks every ~100 µs, and a budget that also learnt from
/// answers microseconds away spun each of those gaps for an answer's length before sleeping.
/// A wait for answers learns from every gap of the loop: answers 40–50 µs apart (a 1 MiB
/// read in a pipeline) would alone price a sleep as cheaper, while the client's short gaps
/// between them show the loop is busy and a wake-up on the answer path costs throughput.
#[derive(Debug)]
pub struct IdleSpin {
    /// Budget of waits for answers, from every stretch.
    budget: SpinBudget,
    /// Budget of waits for the client's next request, from those waits alone.
    requests: SpinBudget,
    /// The current stretch waits for answers.
    for_answers: bool,
    /// The run-queue check that cuts a spin short (`None`: the budget alone decides).
    crowd: Option<CrowdWatch>,
    /// When the current idle stretch began (`None`: the loop is working).
    since: Option<u64>,
    /// The current stretch has slept.
    slept: bool,
}

impl IdleSpin {
    /// A loop at work, spinning by `policy` when idle, and not while threads wait for a CPU.
    pub fn new(policy: BudgetPolicy) -> Self {
        IdleSpin {
            budget: SpinBudget::new(policy),
            requests: SpinBudget::new(policy),
            for_answers: false,
            crowd: Some(CrowdWatch::default()),
            since: None,
            slept: false,
        }
    }

    /// The same loop with no run-queue check: the budget and the caller's `may_spin` alone
    /// decide. For a caller that already limits its spin to where an answer is due within a
    /// request's time, where the threads the count finds are mostly other clients' and a sleep
    /// costs a wake-up on every answer (the NBD leader, docs/ring-protocol.md).
    pub fn without_crowd_check(mut self) -> Self {
        self.crowd = None;
        self
    }

    /// The same loop with `crowd` as its run-queue check.
    pub fn with_crowd_check(mut self, crowd: CrowdWatch) -> Self {
        self.crowd = Some(crowd);
        self
    }

    /// The loop found work at `now`: an idle stretch ends, and its length (less the wake-up,
    /// if it slept) tunes the budgets it belongs to.
    pub fn worked(&mut self, now: u64) {
        if let Some(t0) = self.since.take() {
            let (gap, slept) = (now - t0, self.slept);
            let record = |b: &mut SpinBudget| if slept { b.record_after_sleep(gap) } else { b.record(gap) };
            record(&mut self.budget);
            if !self.for_answers {
                record(&mut self.requests);
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
    /// `may_spin`, and (unless built [`without_crowd_check`](Self::without_crowd_check)) while
    /// threads are not waiting for a CPU.
    pub fn spin(&mut self, now: u64, may_spin: bool) -> bool {
        self.spin_while(now, false, |w, t0| {
            may_spin && now - t0 < w.requests.budget_ns() && !w.crowd.as_mut().is_some_and(|c| c.should_sleep(t0, now))
        })
    }

    /// As [`spin`](Self::spin), for a loop that has requests in flight at a device and
    /// yields its CPU between looks. Here a crowd makes it wait on, not sleep: what ends the
    /// wait is an answer the driver domain owes, not a request a crowded thread has yet to
    /// make, and the yields give the CPU to every thread runnable on it, so waiting takes
    /// little from the threads that want it. A sleep there lets the CPU halt with the
    /// answer microseconds away, and the answer then pays a doorbell and a wake-up. So it
    /// spins within the budget, and past it while threads are waiting for a CPU (unless built
    /// [`without_crowd_check`](Self::without_crowd_check)); on CPUs with room to spare the
    /// budget ends it as in [`spin`](Self::spin) (docs/ring-protocol.md, "Adaptive budget").
    pub fn spin_for_answers(&mut self, now: u64) -> bool {
        self.spin_while(now, true, |w, t0| {
            now - t0 < w.budget.budget_ns() || w.crowd.as_mut().is_some_and(|c| c.crowded_lately(t0, now))
        })
    }

    /// The stretch at `now` (begun at `now` if the loop was working, waiting for answers or
    /// not as `for_answers` says) spins on while it has not slept and `spin_on` says so, given
    /// when it began; once it stops, it counts as slept until work comes.
    fn spin_while(&mut self, now: u64, for_answers: bool, spin_on: impl FnOnce(&mut Self, u64) -> bool) -> bool {
        let t0 = match self.since {
            Some(t0) => t0,
            None => {
                self.for_answers = for_answers;
                *self.since.insert(now)
            }
        };
        if !self.slept && spin_on(self, t0) {
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

    /// Looks every 8 µs of a fake clock over a 1 ms budget; the last look that spun, µs.
    fn spun_until(mut w: IdleSpin) -> u64 {
        let mut last = 0;
        for t in (0..1_000).step_by(8) {
            if !w.spin(t * 1_000, true) {
                break;
            }
            last = t;
        }
        last
    }

    /// As [`spun_until`], waiting for answers.
    fn spun_for_answers_until(mut w: IdleSpin) -> u64 {
        let mut last = 0;
        for t in (0..1_000).step_by(8) {
            if !w.spin_for_answers(t * 1_000) {
                break;
            }
            last = t;
        }
        last
    }

    #[test]
    fn a_wait_for_answers_on_idle_cpus_ends_with_the_budget() {
        let mut w = IdleSpin::new(BudgetPolicy::Fixed(10_000)).without_crowd_check();
        assert!(w.spin_for_answers(1_000));
        assert!(w.spin_for_answers(10_999), "within the 10 µs budget from 1 µs");
        assert!(!w.spin_for_answers(11_000), "past it: sleep");
        assert!(!w.spin_for_answers(11_500), "and the stretch stays slept");
        w.worked(12_000);
        assert!(w.spin_for_answers(12_500), "a new stretch spins again");
    }

    /// A loop serving a TCG guest at QD1 on a fake clock, looking every µs: each request's
    /// answer comes 6 µs after it is sent, the guest's next request 90 µs after the answer
    /// (later by a wake-up where the loop slept).
    #[test]
    fn waits_for_answers_and_for_requests_keep_their_own_budgets() {
        let mut w = IdleSpin::new(BudgetPolicy::DEFAULT_AUTO).without_crowd_check();
        let mut t = 0u64;
        let mut slept_on_requests = 0;
        for i in 0..4_000 {
            // Sent; the answer is due.
            assert!(w.spin_for_answers(t) || i > 0, "a fresh budget spins for the first answer");
            let mut answered = t + 6_000;
            let mut look = t;
            while look < t + 6_000 {
                if !w.spin_for_answers(look) {
                    answered = t + 6_000 + crate::budget::WAKE_LATENCY_NS;
                    break;
                }
                look += 1_000;
            }
            w.worked(answered);
            // Answered; the guest asks again 90 µs later.
            let mut next = answered + 90_000;
            let mut look = answered;
            while look < answered + 90_000 {
                if !w.spin(look, true) {
                    next += crate::budget::WAKE_LATENCY_NS;
                    if i >= 3_000 && look - answered <= 2_000 {
                        slept_on_requests += 1;
                    }
                    break;
                }
                look += 1_000;
            }
            w.worked(next);
            t = next;
        }
        assert!(w.budget.budget_ns() > 6_000, "answers 6 µs away keep their spin: {} ns", w.budget.budget_ns());
        assert!(w.requests.budget_ns() < 6_000, "requests 90 µs apart are not spun through: {} ns", w.requests.budget_ns());
        // Probes spin to the ceiling now and then; the rest of the waits for the guest sleep
        // at once (within the 2 µs floor), not after an answer's worth of spin.
        assert!(slept_on_requests >= 900, "{slept_on_requests} of the last 1000 waits for the guest slept at once");
    }

    #[test]
    fn on_crowded_cpus_only_the_crowd_check_cuts_the_spin_short() {
        let crowd = crate::Crowd::get();
        if !crowd.available() {
            eprintln!("skipped: /proc/loadavg cannot be read here");
            return;
        }
        // More busy threads than CPUs: the run queues count a crowd at every look.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let busy: Vec<_> = (0..crowd.cpus() + 2)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !crowd.crowded() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let crowded = crowd.crowded();
        let checked = spun_until(IdleSpin::new(BudgetPolicy::Fixed(1_000_000)));
        let unchecked = spun_until(IdleSpin::new(BudgetPolicy::Fixed(1_000_000)).without_crowd_check());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        busy.into_iter().for_each(|t| t.join().unwrap());
        assert!(crowded, "{} busy threads on {} CPUs, and no crowd seen", crowd.cpus() + 2, crowd.cpus());
        assert!(checked < 100, "the crowd check let the spin run to {checked} µs of 1000");
        assert!(unchecked >= 992, "without the check the budget alone ends the spin, not at {unchecked} µs");
    }

    /// What a wait for answers does is decided by what each look sees, so the looks here are
    /// told, not read: the kernel's count can read below the truth for one look while the
    /// scheduler moves threads between run queues, and one such look ends the wait.
    #[test]
    fn a_wait_for_answers_on_crowded_cpus_outlasts_its_budget_until_a_look_finds_room() {
        use std::sync::atomic::{AtomicBool, Ordering};
        static CROWDED: AtomicBool = AtomicBool::new(true);
        let waiter = || {
            let crowd = CrowdWatch::with_source(|| CROWDED.load(Ordering::Relaxed));
            IdleSpin::new(BudgetPolicy::Fixed(10_000)).with_crowd_check(crowd)
        };
        assert!(spun_for_answers_until(waiter()) >= 992, "crowded at every look: the wait goes on past its 10 µs budget");
        // Crowded at the first looks, then room: the wait ends at the first look that finds it.
        let mut w = waiter();
        assert!(w.spin_for_answers(0));
        assert!(w.spin_for_answers(20_000), "past the budget, the CPUs crowded at the last look");
        CROWDED.store(false, Ordering::Relaxed);
        assert!(w.spin_for_answers(25_000), "between looks, the last look's crowd holds");
        assert!(!w.spin_for_answers(40_000), "a look that finds room ends the wait");
        assert!(!w.spin_for_answers(41_000), "and the stretch stays slept");
        // With room at every look, the budget ends it.
        assert!(spun_for_answers_until(waiter()) < 16, "the 10 µs budget ends a wait on CPUs with room");
    }
}
