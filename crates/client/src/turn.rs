//! Turns at a device's queues. A queue has one user at a time (its requests' tokens and answers
//! are that user's), so users who want a queue when all are held line up, one line for the
//! device, and each queue let go passes to the first in line: a user who lets a queue go and
//! asks again goes to the back, never ahead of those already waiting. A holder asks
//! [`Turnstile::others_waiting`] to know when to let go (see
//! [`QueueHandle::turn_over`](crate::QueueHandle::turn_over)).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::Duration;

use crate::lock;

/// Who holds each of a device's queues, and who waits for one, in order.
#[derive(Debug)]
pub(crate) struct Turnstile {
    line: Mutex<Line>,
    /// Places in `line.waiting`: read without the lock on every submission.
    waiting: AtomicUsize,
}

#[derive(Debug)]
struct Line {
    held: Vec<bool>,
    waiting: VecDeque<Arc<Place>>,
}

/// One user's place in the line.
#[derive(Debug)]
pub(crate) struct Place {
    /// The queue handed to this user, plus one (0 while it waits).
    granted: AtomicUsize,
    /// Woken when granted.
    thread: Thread,
}

impl Place {
    /// The queue handed to this place, if one has been.
    pub(crate) fn granted(&self) -> Option<usize> {
        self.granted.load(Ordering::Acquire).checked_sub(1)
    }
}

impl Line {
    /// The first free queue from `from` on.
    fn free_from(&self, from: usize) -> Option<usize> {
        let n = self.held.len();
        (0..n).map(|i| (from + i) % n).find(|&i| !self.held[i])
    }
}

impl Turnstile {
    /// Turns at `queues` queues, all free.
    pub(crate) fn new(queues: usize) -> Self {
        Turnstile { line: Mutex::new(Line { held: vec![false; queues], waiting: VecDeque::new() }), waiting: AtomicUsize::new(0) }
    }

    /// Takes the first free queue from `from` on, if any is (then nobody waits either).
    pub(crate) fn try_enter(&self, from: usize) -> Option<usize> {
        let mut l = lock(&self.line);
        let idx = l.free_from(from)?;
        l.held[idx] = true;
        Some(idx)
    }

    /// A place in line, granted at once if a queue is free (`prefer` first).
    pub(crate) fn line_up(&self, prefer: usize) -> Arc<Place> {
        let mut l = lock(&self.line);
        let free = l.free_from(prefer);
        let place = Arc::new(Place { granted: AtomicUsize::new(free.map_or(0, |i| i + 1)), thread: std::thread::current() });
        match free {
            Some(idx) => l.held[idx] = true,
            None => {
                l.waiting.push_back(place.clone());
                self.waiting.store(l.waiting.len(), Ordering::Release);
            }
        }
        place
    }

    /// Takes a queue (`prefer` if it is free), waiting in line for one; returns which.
    pub(crate) fn enter(&self, prefer: usize) -> usize {
        let place = self.line_up(prefer);
        loop {
            if let Some(idx) = place.granted() {
                return idx;
            }
            // Unparked by the holder that hands over; a spurious wake-up looks again. The
            // slice only bounds a wake-up lost to a park token consumed elsewhere.
            std::thread::park_timeout(Duration::from_millis(50));
        }
    }

    /// Gives up `place`: it leaves the line, or, if a queue was handed to it meanwhile,
    /// passes that queue on.
    pub(crate) fn leave_line(&self, place: &Arc<Place>) {
        let mut l = lock(&self.line);
        if let Some(i) = l.waiting.iter().position(|p| Arc::ptr_eq(p, place)) {
            l.waiting.remove(i);
            self.waiting.store(l.waiting.len(), Ordering::Release);
            return;
        }
        drop(l);
        if let Some(idx) = place.granted() {
            self.leave(idx);
        }
    }

    /// Lets queue `idx` go: to the first in line, or free.
    pub(crate) fn leave(&self, idx: usize) {
        let mut l = lock(&self.line);
        debug_assert!(l.held[idx], "leaving a queue nobody holds");
        match l.waiting.pop_front() {
            Some(next) => {
                self.waiting.store(l.waiting.len(), Ordering::Release);
                drop(l);
                next.granted.store(idx + 1, Ordering::Release);
                next.thread.unpark();
            }
            None => l.held[idx] = false,
        }
    }

    /// Whether anyone waits for a queue.
    pub(crate) fn others_waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn a_free_queue_is_taken_at_once_the_preferred_one_first() {
        let t = Turnstile::new(2);
        assert_eq!(t.try_enter(1), Some(1));
        assert_eq!(t.try_enter(1), Some(0), "the next free one when the preferred is held");
        assert_eq!(t.try_enter(0), None);
        assert!(!t.others_waiting());
        t.leave(1);
        assert_eq!(t.try_enter(0), Some(1));
    }

    #[test]
    fn queues_pass_in_the_order_users_asked_and_a_returning_holder_goes_last() {
        let t = Arc::new(Turnstile::new(1));
        assert_eq!(t.enter(0), 0);
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut users = Vec::new();
        for who in 1..=3u32 {
            let (user, order) = (t.clone(), order.clone());
            users.push(std::thread::spawn(move || {
                let idx = user.enter(0);
                lock(&order).push(who);
                user.leave(idx);
            }));
            // Each is in line before the next asks.
            while t.waiting.load(Ordering::Acquire) < who as usize {
                std::thread::yield_now();
            }
        }
        assert!(t.others_waiting());
        // The holder lets go and asks again at once: it must not get ahead of the three.
        t.leave(0);
        let idx = t.enter(0);
        lock(&order).push(0);
        t.leave(idx);
        for u in users {
            u.join().unwrap();
        }
        assert_eq!(*lock(&order), [1, 2, 3, 0]);
        assert_eq!(t.try_enter(0), Some(0), "free once everyone has had a turn");
    }

    #[test]
    fn a_place_given_up_leaves_the_line_or_passes_the_queue_on() {
        let t = Turnstile::new(1);
        assert_eq!(t.try_enter(0), Some(0));
        let a = t.line_up(0);
        let b = t.line_up(0);
        assert!(a.granted().is_none() && b.granted().is_none());
        t.leave_line(&a);
        t.leave(0);
        assert_eq!(b.granted(), Some(0), "the queue skips a user who left the line");
        // Granted but given up: the queue is free again.
        t.leave_line(&b);
        assert_eq!(t.try_enter(0), Some(0));
    }

    #[test]
    fn a_user_in_line_takes_whichever_queue_is_let_go_first() {
        let t = Turnstile::new(2);
        assert_eq!(t.try_enter(0), Some(0));
        assert_eq!(t.try_enter(1), Some(1));
        let p = t.line_up(0);
        t.leave(1);
        assert_eq!(p.granted(), Some(1));
    }

    #[test]
    fn many_users_never_hold_one_queue_together() {
        let t = Arc::new(Turnstile::new(2));
        let inside: Arc<[AtomicU32; 2]> = Arc::new([AtomicU32::new(0), AtomicU32::new(0)]);
        let users: Vec<_> = (0..8)
            .map(|u| {
                let (t, inside) = (t.clone(), inside.clone());
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        let idx = t.enter(u);
                        assert_eq!(inside[idx].fetch_add(1, Ordering::SeqCst), 0, "two holders at once");
                        inside[idx].fetch_sub(1, Ordering::SeqCst);
                        t.leave(idx);
                    }
                })
            })
            .collect();
        for u in users {
            u.join().unwrap();
        }
        assert_eq!(t.try_enter(0), Some(0));
        assert_eq!(t.try_enter(0), Some(1));
    }
}
