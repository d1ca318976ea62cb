//! A fixed pool of threads that run the supervisor's jobs: starting devices, replacing
//! domains, failing devices. Every domain is exec'd by one of them, and a domain dies with the
//! thread that started it (PR_SET_PDEATHSIG), so the pool lives as long as the supervisor and
//! its threads end only after the domains have.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Threads in the pool: enough that one device's slow restart (a drain, a domain slow to
/// report) does not hold up another's, few enough to be the same for any number of devices.
pub(crate) const WORKERS: usize = 4;

type Task = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Task>,
    running: usize,
    stop: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// Rung when a task is queued, or the pool stops.
    more: Condvar,
    /// Rung when a task finishes.
    finished: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The pool.
pub(crate) struct Workers {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = self.shared.lock();
        f.debug_struct("Workers").field("queued", &q.tasks.len()).field("running", &q.running).finish()
    }
}

impl Workers {
    /// Starts `n` threads.
    pub fn start(n: usize) -> std::io::Result<Workers> {
        let shared = Arc::new(Shared::default());
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let s = shared.clone();
            threads.push(std::thread::Builder::new().name(format!("worker-{i}")).spawn(move || work(&s))?);
        }
        Ok(Workers { shared, threads: Mutex::new(threads) })
    }

    /// Runs `task` on the first thread free.
    pub fn submit(&self, task: impl FnOnce() + Send + 'static) {
        self.shared.lock().tasks.push_back(Box::new(task));
        self.shared.more.notify_one();
    }

    /// Waits up to `timeout` until no task is queued or running; returns whether none is.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut q = self.shared.lock();
        while !q.tasks.is_empty() || q.running > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q = self.shared.finished.wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    /// Ends the threads once what is queued has run. The domains they started die with them:
    /// call this last.
    pub fn stop(&self) {
        self.shared.lock().stop = true;
        self.shared.more.notify_all();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

fn work(s: &Shared) {
    loop {
        let task = {
            let mut q = s.lock();
            loop {
                if let Some(t) = q.tasks.pop_front() {
                    q.running += 1;
                    break t;
                }
                if q.stop {
                    return;
                }
                q = s.more.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        task();
        s.lock().running -= 1;
        s.finished.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn tasks_run_on_the_pool_and_stop_waits_for_what_was_queued() {
        let w = Workers::start(2).unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..10 {
            let d = done.clone();
            w.submit(move || {
                std::thread::sleep(Duration::from_millis(2));
                d.fetch_add(1, Ordering::SeqCst);
            });
        }
        assert!(w.wait_idle(Duration::from_secs(5)));
        assert_eq!(done.load(Ordering::SeqCst), 10);
        let d = done.clone();
        w.submit(move || {
            d.fetch_add(1, Ordering::SeqCst);
        });
        w.stop();
        assert_eq!(done.load(Ordering::SeqCst), 11);
    }
}
