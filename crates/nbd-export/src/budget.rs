//! The payload budget: bytes of requests' data and replies held in memory, shared by every
//! connection, so no number of clients can grow the export's memory beyond a bound.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use bulkhead_nbd::proto::MAX_PAYLOAD;

use crate::lock;

/// Payload bytes held in memory by all connections together: one request of the largest size,
/// or many smaller ones, however many clients push at once (see [`memory_bound`](crate::memory_bound)).
pub(crate) const PAYLOAD_BUDGET: u64 = MAX_PAYLOAD as u64;
/// Payload bytes one connection takes ahead, beyond the request it waits for: a client that
/// sends and never reads its answers holds this much (and one request more) of the budget,
/// and the other connections keep the rest.
pub(crate) const CONNECTION_SHARE: u64 = PAYLOAD_BUDGET / 4;

/// A byte budget shared by every connection.
#[derive(Debug)]
pub(crate) struct Budget {
    state: Mutex<BudgetState>,
    cv: Condvar,
}

#[derive(Debug)]
struct BudgetState {
    free: u64,
    /// Threads waiting in [`Budget::take`]: a grant given back wakes them only if there are
    /// any, so the common return costs no system call.
    waiting: usize,
}

impl Budget {
    pub(crate) fn new(bytes: u64) -> Self {
        Budget { state: Mutex::new(BudgetState { free: bytes, waiting: 0 }), cv: Condvar::new() }
    }

    /// Waits until `n` bytes are free and takes them for connection `conn` (which counts what
    /// it holds); they return when the grant drops.
    pub(crate) fn take(self: &Arc<Self>, n: u64, conn: &Arc<AtomicU64>) -> Held {
        let mut st = lock(&self.state);
        while st.free < n {
            st.waiting += 1;
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            st.waiting -= 1;
        }
        st.free -= n;
        Held::new(self, n, conn)
    }

    /// Takes `n` bytes for `conn` if they are free now and `conn` would hold no more than
    /// `share` with them.
    pub(crate) fn try_take(self: &Arc<Self>, n: u64, conn: &Arc<AtomicU64>, share: u64) -> Option<Held> {
        if conn.load(Ordering::Acquire) + n > share {
            return None;
        }
        let mut st = lock(&self.state);
        if st.free < n {
            return None;
        }
        st.free -= n;
        Some(Held::new(self, n, conn))
    }
}

/// Bytes taken from the [`Budget`]; given back on drop, wherever the payload ends up.
pub(crate) struct Held {
    budget: Arc<Budget>,
    n: u64,
    /// What the connection that took them holds.
    conn: Arc<AtomicU64>,
}

impl Held {
    fn new(budget: &Arc<Budget>, n: u64, conn: &Arc<AtomicU64>) -> Held {
        conn.fetch_add(n, Ordering::AcqRel);
        Held { budget: budget.clone(), n, conn: conn.clone() }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.conn.fetch_sub(self.n, Ordering::AcqRel);
        let waiting = {
            let mut st = lock(&self.budget.state);
            st.free += self.n;
            st.waiting
        };
        if waiting > 0 {
            self.budget.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn payload_budget_waits_and_returns_on_drop() {
        let b = Arc::new(Budget::new(100));
        let conn = Arc::new(AtomicU64::new(0));
        let first = b.take(80, &conn);
        assert!(b.try_take(10, &conn, 85).is_none(), "beyond the connection's share");
        let (b2, c2, t0) = (b.clone(), conn.clone(), std::time::Instant::now());
        let waiter = std::thread::spawn(move || {
            let _second = b2.take(50, &c2);
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(first);
        assert!(waiter.join().unwrap() >= Duration::from_millis(50), "took bytes that were not free");
        assert_eq!(lock(&b.state).free, 100, "every grant came back");
        assert_eq!(conn.load(Ordering::Acquire), 0, "and the connection holds none");
    }
}
