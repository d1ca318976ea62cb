//! Whether a spinner waits for a thread that needs its own CPU, learned from its yields.
//!
//! A spinner waiting for a process on the same CPU waits in vain: the other runs only once
//! this one yields. `sched_yield` comes straight back (about 0.5 µs on the machine in
//! docs/BENCHMARKS.md) when nothing else is runnable on the CPU, and only after another
//! thread has run (about 1.7 µs a switch there) when something is. [`Handoff`] times each
//! yield. When what the spinner waits for arrives just after a yield that handed the CPU
//! over, the next wait yields before it spins; when it arrives while spinning, or after a
//! yield that came straight back, the next wait spins first as before. So a spinner with a
//! CPU to itself never changes, and one that shares a CPU with the thread it waits for
//! gives it the CPU at once instead of after its spin.

use crate::now_ns;

/// A yield taking at least this long ran another thread in between (a yield that comes
/// straight back costs about a third of it here).
const SWITCHED_NS: u64 = 1_200;

/// What one spinner has learned of where the thread it waits for runs.
#[derive(Debug, Default, Clone)]
pub struct Handoff {
    /// The last wait ended just after a yield that ran another thread.
    yield_first: bool,
    /// The current wait's last yield ran another thread.
    switched: bool,
    /// The current wait has yielded.
    yielded: bool,
}

impl Handoff {
    /// Whether the wait beginning now should yield before it spins.
    pub fn yield_first(&self) -> bool {
        self.yield_first
    }

    /// Yields the CPU, timing the yield.
    pub fn yield_now(&mut self) {
        let t0 = now_ns();
        std::thread::yield_now();
        self.note_yield(now_ns().saturating_sub(t0));
    }

    /// A yield of `ns` happened in the current wait.
    fn note_yield(&mut self, ns: u64) {
        self.yielded = true;
        self.switched = ns >= SWITCHED_NS;
    }

    /// The current wait found what it waited for: learn from how.
    pub fn arrived(&mut self) {
        self.yield_first = self.yielded && self.switched;
        self.yielded = false;
        self.switched = false;
    }

    /// The current wait ended without its answer (it sleeps, times out or gives up): the
    /// next one starts from what was learned before it.
    pub fn abandoned(&mut self) {
        self.yielded = false;
        self.switched = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_just_after_a_yield_that_ran_another_thread_makes_the_next_wait_yield_first() {
        let mut h = Handoff::default();
        assert!(!h.yield_first(), "a new spinner spins first");
        h.note_yield(3_000);
        h.arrived();
        assert!(h.yield_first());
        // The answer came while spinning: the other side has a CPU of its own.
        h.arrived();
        assert!(!h.yield_first());
    }

    #[test]
    fn a_yield_that_comes_straight_back_teaches_nothing_shared() {
        let mut h = Handoff::default();
        h.note_yield(3_000);
        h.arrived();
        assert!(h.yield_first());
        // Nothing else ran: the answer came from another CPU meanwhile.
        h.note_yield(400);
        h.arrived();
        assert!(!h.yield_first());
    }

    #[test]
    fn only_the_last_yield_before_the_answer_counts() {
        let mut h = Handoff::default();
        h.note_yield(3_000);
        h.note_yield(400);
        h.arrived();
        assert!(!h.yield_first(), "the switching yield was not the one the answer followed");
        h.note_yield(400);
        h.note_yield(3_000);
        h.arrived();
        assert!(h.yield_first());
    }

    #[test]
    fn an_abandoned_wait_keeps_what_was_learned() {
        let mut h = Handoff::default();
        h.note_yield(3_000);
        h.arrived();
        h.note_yield(400);
        h.abandoned();
        assert!(h.yield_first(), "a sleep says nothing of where the other side runs");
        h.arrived();
        assert!(!h.yield_first(), "the next wait starts afresh");
    }

    #[test]
    fn yield_now_counts_as_the_waits_last_yield() {
        let mut h = Handoff::default();
        h.note_yield(3_000);
        h.yield_now();
        assert!(h.yielded);
        h.arrived();
        assert!(!h.yielded && !h.switched, "each wait starts afresh");
    }
}
