//! A queue held by one user: several requests in flight, completions reaped when it asks, and
//! its unanswered requests carried over every restart of the domain.

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use bulkhead_channel::{FillError, FrontQueue, FrontRequest, SharedSlice, SubmitError};
use bulkhead_doorbell::NotifyMode;

use crate::turn::{Place, Turnstile};
use crate::{Device, IoError, QueueState, Staged};

/// How long one wait slice lasts before the handle re-checks the generation and the device.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// A holder's turn, in rings' worth of requests submitted, after which it lets the queue go
/// if others wait for it (see [`QueueHandle::turn_over`]). Long enough that the ring's fill
/// and drain at each handover cost little; short enough that a user in line behind many
/// waits milliseconds, not seconds.
const TURN_RINGS: usize = 2;

/// What [`QueueHandle::arm`] says about sleeping on a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Armed {
    /// Nothing in flight: no answer will come.
    Idle,
    /// An answer is there: poll instead of sleeping.
    Now,
    /// The device is `poll`: its driver never rings, so no sleep can end with an answer.
    /// Look again, letting a thread runnable on this CPU go first (`sched_yield`): the
    /// driver's work, or the application's, may be waiting for this CPU.
    Spin,
    /// The queue is between generations or its device failed: sleep briefly, then poll and
    /// expire.
    Later,
    /// Sleep until this descriptor is readable (or another source wakes the caller).
    Fd(std::os::fd::RawFd),
}

/// One queue of a [`Device`], held by one user until dropped (SPDK's I/O channel): requests go
/// in with [`submit`](Self::submit) under a token of the caller's, and come back with that
/// token from [`poll`](Self::poll) or [`wait`](Self::wait), in any order. A restart of the
/// domain is invisible but for the pause: requests without an answer move to the next
/// generation with their data. Dropping the handle waits for the requests still in flight.
#[derive(Debug)]
pub struct QueueHandle<'a> {
    dev: &'a Device,
    idx: usize,
    st: MutexGuard<'a, QueueState>,
    /// Requests submitted since the queue became this user's.
    submitted: usize,
    /// Handed on when the handle goes, after `st` is unlocked.
    _turn: Turn<'a>,
}

/// The right to use one queue: passed to the next in line when dropped.
#[derive(Debug)]
struct Turn<'a>(&'a Turnstile, usize);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.leave(self.1);
    }
}

impl<'a> QueueHandle<'a> {
    /// Queue `idx` of `dev`, whose turn the caller has.
    pub(crate) fn new(dev: &'a Device, idx: usize) -> Self {
        let turn = Turn(dev.turnstile(), idx);
        let mut h = QueueHandle { dev, idx, st: dev.queue_state(idx), submitted: 0, _turn: turn };
        h.refresh();
        h
    }

    /// The device the queue belongs to.
    pub fn device(&self) -> &'a Device {
        self.dev
    }

    /// Which of the device's queues this is.
    pub fn index(&self) -> usize {
        self.idx
    }

    /// Requests it holds in flight at most.
    pub fn capacity(&self) -> usize {
        self.st.q.capacity()
    }

    /// Whether this user has had its turn and others wait for the queue: it should submit
    /// nothing more, reap what it has in flight, and drop the handle, then ask again (at the
    /// back of the line). Users who keep a queue while they have requests in flight would
    /// otherwise keep it for as long as their clients keep them busy, and starve the rest.
    pub fn turn_over(&self) -> bool {
        self.submitted >= TURN_RINGS * self.capacity() && self.dev.turnstile().others_waiting()
    }

    /// Requests submitted and not yet answered.
    pub fn in_flight(&self) -> usize {
        let carried = self.st.carry.as_ref().map_or(0, |c| c.in_flight());
        if carried > 0 {
            carried
        } else {
            self.st.q.in_flight()
        }
    }

    /// Brings the queue to the device's newest generation, moving every request without an
    /// answer onto it. If the new generation is broken before they all move, they stay with
    /// the old queue and move to the next one.
    fn refresh(&mut self) {
        if self.st.q.generation() == self.dev.generation() {
            return;
        }
        let Some(staged) = self.dev.take_staged(self.idx) else { return };
        self.st.catch_up(self.dev, staged);
    }

    /// Whether the current generation cannot take requests: broken, being replaced, or
    /// still owing the requests of an older one.
    fn stalled(&self) -> bool {
        self.st.q.broken().is_some() || self.st.carry.is_some() || self.dev.in_outage()
    }

    /// Submits `req` under `token`. Blocks only while the domain is being replaced. `QueueFull`
    /// when the queue holds as many requests as it can: reap some first.
    pub fn submit(&mut self, req: FrontRequest<'_>, token: u64) -> Result<(), IoError> {
        match req {
            FrontRequest::Read { offset, into: len }
            | FrontRequest::Discard { offset, len }
            | FrontRequest::WriteZeroes { offset, len } => self.dev.check_range(offset, len)?,
            FrontRequest::Write { offset, from: data, .. } => self.dev.check_range(offset, data.len() as u64)?,
            FrontRequest::Flush => {}
        }
        self.place(|q| q.submit(req, token))
    }

    /// Submits under `token` a write of `len` bytes at `offset` whose data `fill` copies into
    /// the channel window it is given (exactly `len` bytes), for data the caller cannot lend as
    /// a slice, such as a guest's memory or a file. `fill` runs once, when there is room for
    /// the request; if it fails, nothing is submitted and the error is `Invalid`. As
    /// [`submit`](Self::submit) otherwise.
    pub fn submit_write_with(
        &mut self,
        offset: u64,
        len: u64,
        fua: bool,
        token: u64,
        fill: &mut dyn FnMut(SharedSlice<'_>) -> Result<(), FillError>,
    ) -> Result<(), IoError> {
        self.dev.check_range(offset, len)?;
        self.place(|q| {
            q.push_write_with(offset, len, fua, token, fill)?;
            q.publish();
            Ok(())
        })
    }

    /// Places a request with `put`, waiting out a generation being replaced.
    fn place(&mut self, mut put: impl FnMut(&mut FrontQueue) -> Result<(), SubmitError>) -> Result<(), IoError> {
        let started = Instant::now();
        loop {
            if self.dev.is_failed() {
                return Err(self.dev.unavailable());
            }
            self.refresh();
            if self.stalled() {
                // Wait for the next generation rather than pile requests into a queue nobody
                // serves (a remote server may take a while to reconnect).
                self.dev.wait_for_generation(self.st.q.generation(), WAIT_SLICE);
                self.check_timeout(started)?;
                continue;
            }
            match put(&mut self.st.q) {
                Ok(()) => {
                    self.submitted += 1;
                    self.dev.started();
                    return Ok(());
                }
                Err(SubmitError::Full) if self.st.q.in_flight() > 0 => return Err(IoError::QueueFull),
                Err(SubmitError::Full) => {
                    // Nothing of ours is in flight, yet the ring is full: the driver stopped
                    // answering requests it was given.
                    let e = bulkhead_channel::ChannelError::Protocol("queue full with no request outstanding".into());
                    self.dev.report_broken(&e);
                    self.dev.wait_for_generation(self.st.q.generation(), WAIT_SLICE);
                    self.check_timeout(started)?;
                }
                Err(SubmitError::TooLarge(_)) => return Err(IoError::Invalid("request larger than the queue's arena")),
                Err(SubmitError::Fill(e)) => return Err(IoError::Unreadable(e.0)),
                Err(SubmitError::Broken(e)) => self.dev.report_broken(&e),
            }
        }
    }

    fn check_timeout(&self, started: Instant) -> Result<(), IoError> {
        match self.dev.timeout() {
            Some(t) if started.elapsed() >= t => Err(IoError::Unavailable(format!("no response within {} ms", t.as_millis()))),
            _ => Ok(()),
        }
    }

    /// Delivers every answer that has arrived, without waiting: `f(token, result, data)`, with
    /// a successful read's data (copy it out inside `f`: the space is reused). Returns how
    /// many.
    pub fn poll(&mut self, mut f: impl FnMut(u64, Result<u64, IoError>, Option<SharedSlice<'_>>)) -> usize {
        self.refresh();
        if self.st.carry.is_some() {
            return 0;
        }
        let dev = self.dev;
        let counters = dev.queue_counters(self.idx);
        let mut n = 0;
        let reaped = self.st.q.reap(|c| {
            n += 1;
            dev.finished(Some(c.result.is_ok()));
            counters.record(c.op, c.len, c.latency_ns, c.result.is_ok());
            f(c.user, c.result.map_err(IoError::Device), c.data);
        });
        if let Err(e) = reaped {
            dev.report_broken(&e);
        }
        n
    }

    /// Gives up every request in flight with `err`.
    fn give_up(&mut self, err: &IoError, f: &mut impl FnMut(u64, Result<u64, IoError>, Option<SharedSlice<'_>>)) -> usize {
        let dev = self.dev;
        let mut n = 0;
        let st = &mut *self.st;
        let mut each = |token| {
            n += 1;
            dev.finished(Some(false));
            f(token, Err(err.clone()), None);
        };
        match st.carry.take() {
            Some(mut c) => {
                c.abandon(&mut each);
                // The current queue holds at most copies of some of them.
                st.q.abandon(|_| {});
            }
            None => st.q.abandon(&mut each),
        }
        n
    }

    /// For a caller that sleeps on this queue and on sources of its own (an export's request
    /// ring) in one `poll(2)`: arms the queue and says what to sleep on. After the sleep call
    /// [`disarm`](Self::disarm), then [`poll`](Self::poll) and [`expire`](Self::expire).
    pub fn arm(&mut self) -> Armed {
        self.refresh();
        if self.in_flight() == 0 {
            return Armed::Idle;
        }
        if self.dev.is_failed() || self.stalled() || self.dev.generation() != self.st.q.generation() || self.st.q.damped() {
            // Answers come from the next generation (or never), or the doorbell storms: look
            // again soon.
            return Armed::Later;
        }
        if self.st.q.arm() {
            Armed::Fd(self.st.q.irq_fd())
        } else if self.st.q.mode() == NotifyMode::Poll && !self.st.q.has_answer() {
            Armed::Spin
        } else {
            Armed::Now
        }
    }

    /// Adds the time the queue spent spinning and sleeping since it was last counted to the
    /// device's counters.
    fn count_waits(&mut self) {
        let st = self.st.q.stats();
        let (spin, sleep) = (st.spin_ns - self.st.spin_counted, st.sleep_ns - self.st.sleep_counted);
        let counters = self.dev.queue_counters(self.idx);
        if spin > 0 {
            counters.spin_ns.fetch_add(spin, std::sync::atomic::Ordering::Relaxed);
        }
        if sleep > 0 {
            counters.sleep_ns.fetch_add(sleep, std::sync::atomic::Ordering::Relaxed);
        }
        self.st.spin_counted = st.spin_ns;
        self.st.sleep_counted = st.sleep_ns;
    }

    /// Ends a sleep begun with [`arm`](Self::arm).
    pub fn disarm(&mut self) {
        let storms = self.st.q.stats().storms;
        self.st.q.disarm();
        self.count_waits();
        if self.st.q.stats().storms != storms {
            self.dev.log_storm();
        }
    }

    /// Gives up every request in flight with `Unavailable` if the device failed, or (with a
    /// timeout) if nothing was answered since `last_answer`; returns how many. For callers
    /// that wait with [`arm`](Self::arm) instead of [`wait`](Self::wait).
    pub fn expire(
        &mut self,
        last_answer: Instant,
        mut f: impl FnMut(u64, Result<u64, IoError>, Option<SharedSlice<'_>>),
    ) -> usize {
        if self.in_flight() == 0 {
            return 0;
        }
        if self.dev.is_failed() {
            let e = self.dev.unavailable();
            return self.give_up(&e, &mut f);
        }
        match self.check_timeout(last_answer) {
            Err(e) => self.give_up(&e, &mut f),
            Ok(()) => 0,
        }
    }

    /// Waits for at least one answer and delivers every one that has arrived, as
    /// [`poll`](Self::poll); returns how many (0 at once if nothing is in flight). Across a
    /// restart it waits for the next generation. If the device fails, or (with a timeout) no
    /// answer comes for that long, every request in flight is answered with `Unavailable`.
    pub fn wait(&mut self, mut f: impl FnMut(u64, Result<u64, IoError>, Option<SharedSlice<'_>>)) -> usize {
        let started = Instant::now();
        loop {
            if self.in_flight() == 0 {
                return 0;
            }
            if self.dev.is_failed() {
                let e = self.dev.unavailable();
                return self.give_up(&e, &mut f);
            }
            let n = self.poll(&mut f);
            if n > 0 {
                return n;
            }
            if let Err(e) = self.check_timeout(started) {
                return self.give_up(&e, &mut f);
            }
            let gen = self.st.q.generation();
            if self.stalled() {
                // This generation is finished or being replaced: wait for the next one.
                self.dev.wait_for_generation(gen, WAIT_SLICE);
                continue;
            }
            if self.dev.generation() != gen {
                continue;
            }
            let storms = self.st.q.stats().storms;
            let waited = self.st.q.wait_or(WAIT_SLICE.as_millis() as i32, self.dev.outage_flag());
            self.count_waits();
            if let Err(e) = waited {
                self.dev.report_broken(&e);
            } else if self.st.q.stats().storms != storms {
                self.dev.log_storm();
            }
        }
    }
}

impl Drop for QueueHandle<'_> {
    fn drop(&mut self) {
        // The next user of this queue must not get answers meant for this one.
        while self.in_flight() > 0 {
            self.wait(|_, _, _| {});
        }
    }
}

/// A place in line for one queue of a [`Device`] ([`Device::line_up`]), for a user that
/// polls other work meanwhile. Dropping it gives the place up (or passes the queue on, if its
/// turn had come).
#[derive(Debug)]
pub struct QueueLine<'a> {
    dev: &'a Device,
    place: Option<Arc<Place>>,
}

impl<'a> QueueLine<'a> {
    pub(crate) fn new(dev: &'a Device, place: Arc<Place>) -> Self {
        QueueLine { dev, place: Some(place) }
    }

    /// The queue, once its turn has come to this place (then the place is spent: later calls
    /// give `None`); `None` while others are ahead.
    pub fn try_take(&mut self) -> Option<QueueHandle<'a>> {
        let idx = self.place.as_ref()?.granted()?;
        self.place = None;
        Some(QueueHandle::new(self.dev, idx))
    }
}

impl Drop for QueueLine<'_> {
    fn drop(&mut self) {
        if let Some(place) = self.place.take() {
            self.dev.turnstile().leave_line(&place);
        }
    }
}

impl QueueState {
    /// Brings this queue to the generation `staged` leads to, moving its unanswered requests.
    pub(crate) fn catch_up(&mut self, dev: &Device, staged: Staged) {
        match staged {
            Staged::Queue(newer) => {
                let mut newer = *newer;
                newer.set_timed(true);
                let old = std::mem::replace(&mut self.q, newer);
                (self.spin_counted, self.sleep_counted) = (0, 0);
                // A carried queue holds the requests; the one just replaced has at most a
                // partial copy.
                let source = self.carry.take().unwrap_or(old);
                if source.in_flight() == 0 {
                    return;
                }
                if source.reissue_onto(&mut self.q).is_err() {
                    self.carry = Some(source);
                }
            }
            Staged::InPlace(generation) => {
                if let Some(carried) = self.carry.take() {
                    // The current queue holds at most partial copies of the carried requests:
                    // forget them, start over empty, and move the carried ones on.
                    self.q.abandon(|_| {});
                    let started = self.q.start_over(generation);
                    if started.is_err() || carried.reissue_onto(&mut self.q).is_err() {
                        self.carry = Some(carried);
                    }
                } else if let Err(e) = self.q.start_over(generation) {
                    // Left behind: the supervisor's wait for this queue runs out and it starts
                    // a new generation instead.
                    dev.report_broken(&e);
                    return;
                }
                dev.started_over();
            }
        }
    }
}
