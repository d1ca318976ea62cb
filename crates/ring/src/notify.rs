//! Index publication and the sleep/wake handshake, written over [`IndexCell`] so the same code
//! runs on shared memory and under the loom model checker.
//!
//! The scheme is Xen's event index combined with the RUNNING/SLEEPING flag of Shirole's
//! "Performance Improvement of the Driver Domain":
//!
//! * a producer stores its new index with release ordering, issues a full fence, then reads the
//!   consumer's event index; it rings the doorbell only if the event index lies in
//!   `(old, new]` — i.e. the consumer asked to be woken for an entry just published;
//! * a consumer that wants to sleep publishes SLEEPING and `event = cons + 1`, issues a full
//!   fence, then re-reads the producer index; if anything arrived it stays awake, otherwise it
//!   blocks on its doorbell.
//!
//! The two fences order "publish index, read event" against "publish event, read index", so at
//! least one side sees the other's store: either the producer rings or the consumer sees the
//! work. No wake-up is lost, and a spinning consumer (which leaves its event index behind) is
//! never rung.

use std::sync::atomic::{fence, AtomicU32, Ordering};

/// The operations the protocol needs from a shared 32-bit index.
pub trait IndexCell {
    /// Load with acquire ordering.
    fn load_acquire(&self) -> u32;
    /// Load with relaxed ordering.
    fn load_relaxed(&self) -> u32;
    /// Store with release ordering.
    fn store_release(&self, v: u32);
    /// Store with relaxed ordering.
    fn store_relaxed(&self, v: u32);
    /// A sequentially consistent fence of the matching memory model.
    fn fence_seqcst();
}

impl IndexCell for AtomicU32 {
    fn load_acquire(&self) -> u32 {
        self.load(Ordering::Acquire)
    }
    fn load_relaxed(&self) -> u32 {
        self.load(Ordering::Relaxed)
    }
    fn store_release(&self, v: u32) {
        self.store(v, Ordering::Release)
    }
    fn store_relaxed(&self, v: u32) {
        self.store(v, Ordering::Relaxed)
    }
    fn fence_seqcst() {
        fence(Ordering::SeqCst)
    }
}

/// A side's published run state (informational for status and tests; the doorbell decision uses
/// the event index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum PeerState {
    /// Spinning or working: needs no doorbell.
    Running = 0,
    /// Blocked on its doorbell.
    Sleeping = 1,
}

/// Publishes producer index `new` (previously `old`) and says whether the consumer must be rung.
pub fn publish<C: IndexCell>(prod: &C, event: &C, old: u32, new: u32) -> bool {
    prod.store_release(new);
    C::fence_seqcst();
    let ev = event.load_relaxed();
    new.wrapping_sub(ev) < new.wrapping_sub(old)
}

/// Announces that the consumer (at `cons`) is about to sleep. Returns `true` if work is already
/// pending, in which case the caller must not sleep (and should call [`wake`]).
pub fn prepare_sleep<C: IndexCell>(prod: &C, event: &C, state: &C, cons: u32) -> bool {
    state.store_relaxed(PeerState::Sleeping as u32);
    event.store_relaxed(cons.wrapping_add(1));
    C::fence_seqcst();
    prod.load_acquire() != cons
}

/// Announces that the consumer runs again.
pub fn wake<C: IndexCell>(state: &C) {
    state.store_relaxed(PeerState::Running as u32);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spinning_consumer_is_never_rung() {
        let (prod, event) = (AtomicU32::new(0), AtomicU32::new(0));
        // Consumer never prepared to sleep: event stays at 0, behind every publication.
        let mut old = 0;
        for new in 1..100u32 {
            assert!(!publish(&prod, &event, old, new));
            old = new;
        }
    }

    #[test]
    fn sleeping_consumer_is_rung_once_per_sleep() {
        let (prod, event, state) = (AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0));
        assert!(!prepare_sleep(&prod, &event, &state, 0));
        assert!(publish(&prod, &event, 0, 1), "first publication after sleep rings");
        assert!(!publish(&prod, &event, 1, 2), "second one in the same sleep does not");
    }

    #[test]
    fn batched_publication_rings_when_event_inside_batch() {
        let (prod, event, state) = (AtomicU32::new(10), AtomicU32::new(0), AtomicU32::new(0));
        assert!(!prepare_sleep(&prod, &event, &state, 10));
        assert!(publish(&prod, &event, 10, 42));
    }

    #[test]
    fn prepare_sleep_sees_pending_work() {
        let (prod, event, state) = (AtomicU32::new(5), AtomicU32::new(0), AtomicU32::new(0));
        assert!(prepare_sleep(&prod, &event, &state, 4));
    }

    #[test]
    fn indexes_wrap_around() {
        let start = u32::MAX - 1;
        let (prod, event, state) = (AtomicU32::new(start), AtomicU32::new(0), AtomicU32::new(0));
        assert!(!prepare_sleep(&prod, &event, &state, start));
        assert!(publish(&prod, &event, start, start.wrapping_add(3)), "wrapping batch still rings");
        assert!(!publish(&prod, &event, start.wrapping_add(3), start.wrapping_add(4)));
    }
}

/// Loom models of the handshake. Run with `cargo test -p bulkhead-ring --release loom`.
#[cfg(test)]
mod loom_models {
    use super::*;
    use loom::sync::atomic::{AtomicU32 as LAtomicU32, AtomicU64 as LAtomicU64};
    use loom::sync::{Arc, Notify};
    use loom::thread;
    use std::sync::atomic::Ordering as O;

    impl IndexCell for LAtomicU32 {
        fn load_acquire(&self) -> u32 {
            self.load(O::Acquire)
        }
        fn load_relaxed(&self) -> u32 {
            self.load(O::Relaxed)
        }
        fn store_release(&self, v: u32) {
            self.store(v, O::Release)
        }
        fn store_relaxed(&self, v: u32) {
            self.store(v, O::Relaxed)
        }
        fn fence_seqcst() {
            loom::sync::atomic::fence(O::SeqCst)
        }
    }

    struct Shared {
        prod: LAtomicU32,
        event: LAtomicU32,
        state: LAtomicU32,
        slots: [LAtomicU64; 2],
        doorbell: Notify,
    }

    /// A producer publishes two entries one at a time; a consumer that sleeps whenever the ring
    /// looks empty must receive both (loom reports a deadlock on a lost wake-up) and see each
    /// slot's payload exactly once (no stale or double completion).
    #[test]
    fn loom_no_lost_wakeup_no_double_completion() {
        loom::model(|| {
            let s = Arc::new(Shared {
                prod: LAtomicU32::new(0),
                event: LAtomicU32::new(0),
                state: LAtomicU32::new(0),
                slots: [LAtomicU64::new(0), LAtomicU64::new(0)],
                doorbell: Notify::new(),
            });
            let p = s.clone();
            let producer = thread::spawn(move || {
                for i in 0..2u32 {
                    p.slots[i as usize].store(100 + i as u64, O::Relaxed);
                    if publish(&p.prod, &p.event, i, i + 1) {
                        p.doorbell.notify();
                    }
                }
            });
            let mut cons = 0u32;
            let mut seen = [0u32; 2];
            while cons < 2 {
                let prod = s.prod.load_acquire();
                while cons != prod {
                    let v = s.slots[cons as usize].load(O::Relaxed);
                    assert_eq!(v, 100 + cons as u64, "stale slot read");
                    seen[cons as usize] += 1;
                    cons += 1;
                }
                if cons == 2 {
                    break;
                }
                if !prepare_sleep(&s.prod, &s.event, &s.state, cons) {
                    s.doorbell.wait();
                }
                wake(&s.state);
            }
            assert_eq!(seen, [1, 1]);
            producer.join().unwrap();
        });
    }
}
