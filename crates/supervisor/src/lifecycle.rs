//! A device's lifecycle as a state machine: events in, dispositions out. The watcher tells it
//! what it saw (a domain exited, broke its channel, stopped answering), and it says what to do
//! about it — restart these domains, after this delay, or fail the device — by its rules: which
//! domain an event concerns in each tap mode, the watchdog, crash-loop back-off, the restart
//! limit within its window, reconnecting with back-off. It owns no process, lock or thread,
//! and reads the time from the clock it is given, so every rule is tested here without
//! starting anything.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::state::{Clock, DeviceState, RestartPolicy, Role, Shape, GUARD_EXIT, LOST_EXIT};

/// What the watcher sees of a device at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Observation {
    /// Requests answered so far (any status).
    pub answered: u64,
    /// Requests submitted and not answered.
    pub pending: usize,
    /// The domain's heartbeat counter (it beats while layers hold requests).
    pub heartbeat: u64,
    /// Requests the domain says its layers hold.
    pub held: u64,
    /// The domain's loop beat (it beats while its loop turns).
    pub beat: u64,
    /// The loop beat of the driver domain below a tap domain, if there is one.
    pub below_beat: u64,
    /// Applications attached to the device, whose requests `pending` does not count.
    pub attached: usize,
}

/// Something that happened to a device's domains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    /// A domain exited: with this exit code (`None`: ended by a signal), `status` as the log
    /// says it.
    Exited { role: Role, pid: u32, code: Option<i32>, status: String },
    /// A domain released its memory: it is exiting, and can touch nothing any more, but may
    /// not finish until its successor answers what the kernel finishes for it.
    Exiting { role: Role, pid: u32 },
    /// The domain the frontend reaches broke the channel protocol.
    BrokeChannel { pid: u32 },
    /// A `vdev` device's model domain exited (`why` says how).
    ModelExited { why: String },
    /// Replacing one domain of an `interpose` device alone did not work (`why` says how).
    ReplaceFailed { why: String },
    /// The operator changed the device (`why` says how): a restart, another tap mode, a
    /// filter added or removed (`filters_only`), a snapshot.
    Changed { why: String, filters_only: bool },
}

/// Which domains a restart replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Which {
    /// Every domain of the device: the next generation.
    All,
    /// The tap domain of an `interpose` device alone, the driver domain below running on.
    Tap,
    /// The driver domain below an `interpose` device's tap domain alone.
    Below,
}

/// What to do about an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Replace `which` after `delay` (zero: at once); `why` goes to the log.
    Restart { which: Which, delay: Duration, why: String },
    /// Stop trying: the device is failed, for this reason.
    Fail { reason: String },
}

/// What a launch of the next generation came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Launch {
    /// It runs; the device had been reconnecting this long, if it had.
    Up { was_down: Option<Duration> },
    /// The remote server could not be reached: try again after this delay; the device is
    /// `reconnecting`.
    Retry { after: Duration },
    /// Stop trying: the device is failed, for this reason.
    Fail { reason: String },
}

/// A device's state and restart history.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    device: String,
    policy: RestartPolicy,
    clock: Arc<dyn Clock>,
    /// The layout of the running generation.
    shape: Shape,
    state: DeviceState,
    failure: Option<String>,
    restarts: u64,
    /// When each recent restart happened (within the policy's window).
    history: VecDeque<Instant>,
    /// Generations in a row that died within a second of starting, having answered nothing.
    quick_deaths: u32,
    started_at: Instant,
    answered_at_start: u64,
    /// While reconnecting: since when, the next attempt, the current delay.
    down_since: Option<Instant>,
    /// The episode in `down_since` is a remote that did not answer a domain started for it
    /// (not a launch that could not reach it): it lasts through launches, until a generation
    /// reaches the remote or runs for the reconnect time.
    remote_down: bool,
    /// With a remote backend, until the domain holding it has reached the remote: the loop
    /// beat that domain was launched at. Its loop turns only once the backend has started.
    opening: Option<u64>,
    retry_at: Option<Instant>,
    retry_delay: Duration,
    /// The watchdog's last sight of progress: requests answered, when, the heartbeat.
    progress: (u64, Instant, u64),
    /// The loop beat last seen, and since when (or since applications are attached).
    beat: (u64, Instant),
}

/// How long a device with requests pending must have answered nothing before the watcher
/// looks whether its domains are exiting (a look reads /proc for each of their threads).
pub(crate) const EXIT_CHECK_AFTER: Duration = Duration::from_millis(5);

/// How long a domain may take to reach its remote after it starts before the device reads
/// `reconnecting`: a cluster that answers opens an image in tens of milliseconds.
pub(crate) const OPENING_GRACE: Duration = Duration::from_secs(1);

impl Lifecycle {
    /// A device whose first generation, laid out as `shape`, starts now.
    pub fn new(device: &str, policy: RestartPolicy, shape: Shape, clock: Arc<dyn Clock>) -> Self {
        let now = clock.now();
        Lifecycle {
            device: device.to_string(),
            policy,
            clock,
            shape,
            state: DeviceState::Running,
            failure: None,
            restarts: 0,
            history: VecDeque::new(),
            quick_deaths: 0,
            started_at: now,
            answered_at_start: 0,
            down_since: None,
            remote_down: false,
            // A new device's pages are new: their loop beat is 0.
            opening: policy.reconnect.map(|_| 0),
            retry_at: None,
            retry_delay: Duration::ZERO,
            progress: (0, now, 0),
            beat: (0, now),
        }
    }

    /// Its state.
    pub fn state(&self) -> DeviceState {
        self.state
    }

    /// The layout of the running generation.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Whether the running generation waits for its remote, as `obs` shows it now: the domain
    /// holding the backend has not reached it, and was started for a remote that did not
    /// answer the ones before it, or has been trying for [`OPENING_GRACE`].
    pub fn awaiting_remote(&self, obs: &Observation) -> bool {
        self.state == DeviceState::Running
            && self.still_opening(obs)
            && (self.remote_down || self.clock.now().saturating_duration_since(self.started_at) >= OPENING_GRACE)
    }

    /// Whether the domain holding a remote backend has neither started its loop nor answered
    /// since its launch.
    fn still_opening(&self, obs: &Observation) -> bool {
        let beat = if self.shape == Shape::Interpose { obs.below_beat } else { obs.beat };
        self.opening == Some(beat) && obs.answered == self.answered_at_start
    }

    /// Why it failed or is reconnecting.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Restarts decided (the one under way included): generations after the first, and
    /// domains replaced alone.
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// The device stopped at shutdown.
    pub fn stopped(&mut self) {
        self.state = DeviceState::Stopped;
    }

    /// When the next reconnect attempt is due, while reconnecting.
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at.filter(|_| self.state == DeviceState::Reconnecting)
    }

    /// Restarts the watchdog's clock (after a launch or a restart).
    pub fn progress_seen(&mut self, obs: Observation) {
        let now = self.clock.now();
        self.progress = (obs.answered, now, obs.heartbeat);
        self.beat = (obs.beat, now);
    }

    /// Whether the watcher should look whether the domains are exiting: requests are pending
    /// and none has been answered for [`EXIT_CHECK_AFTER`]. A domain that is exiting has
    /// released its memory before its pidfd says so, and may never finish on its own if what
    /// the kernel finishes for it goes through this very device.
    pub fn worth_looking_for_exit(&self, obs: &Observation) -> bool {
        self.state == DeviceState::Running
            && obs.pending > 0
            && self.clock.now().saturating_duration_since(self.progress.1) >= EXIT_CHECK_AFTER
    }

    /// The watchdog, at one look at the device whose top domain is `pid`: a restart if the
    /// domain is wedged — requests pending and none answered for the policy's time, while its
    /// layers hold nothing or its loop has stopped beating; or, with applications attached
    /// (whose requests the supervisor cannot count), a loop that has stopped beating for the
    /// policy's time.
    ///
    /// The beats are the domain's word, so a domain can only ever keep itself from being
    /// restarted by them, which it could as well by answering; no application can touch them.
    pub fn tick(&mut self, obs: Observation, pid: u32) -> Option<Disposition> {
        if self.state != DeviceState::Running {
            return None;
        }
        let now = self.clock.now();
        if self.opening.is_some() && !self.still_opening(&obs) {
            self.opening = None;
        }
        if self.remote_down {
            let settled = self.policy.reconnect.is_some_and(|t| now.saturating_duration_since(self.started_at) >= t);
            if self.opening.is_none() || settled {
                // The remote answers this generation: the episode is over.
                self.remote_down = false;
                self.down_since = None;
                self.retry_delay = Duration::ZERO;
            }
        }
        if obs.attached == 0 || obs.beat != self.beat.0 {
            self.beat = (obs.beat, now);
        }
        let still = now.saturating_duration_since(self.beat.1);
        let wedged = if still >= self.policy.watchdog {
            format!("showed no sign of life for {} ms with {} application(s) attached", still.as_millis(), obs.attached)
        } else {
            let (seen, since, heartbeat) = self.progress;
            let holding = obs.heartbeat != heartbeat && obs.held > 0;
            if obs.pending == 0 || obs.answered != seen || holding {
                self.progress = (obs.answered, now, obs.heartbeat);
                return None;
            }
            let quiet = now.saturating_duration_since(since);
            if quiet < self.policy.watchdog {
                return None;
            }
            format!("answered nothing for {} ms with {} requests pending", quiet.as_millis(), obs.pending)
        };
        // A tap domain waiting on a wedged domain below is silent too: replaced alone first, the
        // one below must let go of its queues in time, or both are replaced.
        let why = format!("{} domain (pid {pid}) {wedged}", self.shape.top_role());
        Some(self.count(why, self.top_alone(), now, obs.answered))
    }

    /// What to do about `event`; `answered` is the device's count of answered requests now.
    /// Counts the restart against the limit (an operator's change first clears the history and
    /// revives a failed device).
    pub fn on_event(&mut self, event: Event, answered: u64) -> Disposition {
        let now = self.clock.now();
        let unanswered = self.remote_lost(&event) && answered == self.answered_at_start;
        let (why, which) = match event {
            Event::Changed { why, filters_only } => {
                self.reset();
                // A filter inserted or removed in a tap domain of its own changes that domain
                // alone: the driver domain below runs on.
                let which = if filters_only { self.top_alone() } else { Which::All };
                (why, which)
            }
            other => self.classify(other),
        };
        if unanswered {
            return self.reconnect(why, which, now);
        }
        self.count(why, which, now, answered)
    }

    /// Whether `event` is the exit of the domain that holds a remote backend, having lost
    /// the remote (it says so with [`LOST_EXIT`]).
    fn remote_lost(&self, event: &Event) -> bool {
        let holder = match self.shape {
            Shape::Interpose => Role::Below,
            Shape::Passthrough | Shape::Intercept => Role::Top,
        };
        self.policy.reconnect.is_some()
            && matches!(event, Event::Exited { role, code: Some(c), .. } if *role == holder && *c == i32::from(LOST_EXIT))
    }

    /// A domain started for a remote that never answered it (a cluster whose monitor answers
    /// but whose OSD does not): not a fault of the domain, so not counted against the restart
    /// limit. The device is `reconnecting`, and `which` is replaced after a back-off, for the
    /// policy's reconnect time; then it fails.
    fn reconnect(&mut self, why: String, which: Which, now: Instant) -> Disposition {
        let timeout = self.policy.reconnect.unwrap_or_default();
        self.remote_down = true;
        match self.next_attempt(now, timeout, format!("{why}; reconnecting")) {
            Ok(delay) => {
                self.restarts += 1;
                Disposition::Restart { which, delay, why }
            }
            Err(down) => Disposition::Fail { reason: self.give_up(&format!("{why}; the remote has not answered"), down) },
        }
    }

    /// The next attempt of the reconnect episode under way (or of one starting `now`): its
    /// delay, doubling from 0.1 s to 2 s, the device `reconnecting` with `failure`; or, once
    /// the episode has lasted `timeout`, how long it lasted, the episode over.
    fn next_attempt(&mut self, now: Instant, timeout: Duration, failure: String) -> Result<Duration, Duration> {
        let down = now.saturating_duration_since(*self.down_since.get_or_insert(now));
        if down >= timeout {
            self.down_since = None;
            self.remote_down = false;
            self.retry_at = None;
            return Err(down);
        }
        self.retry_delay = (self.retry_delay * 2).clamp(Duration::from_millis(100), Duration::from_secs(2));
        self.retry_at = Some(now + self.retry_delay);
        self.state = DeviceState::Reconnecting;
        self.failure = Some(failure);
        Ok(self.retry_delay)
    }

    /// What an event says, for the log, and which domains it concerns.
    fn classify(&self, event: Event) -> (String, Which) {
        let top = self.shape.top_role();
        match event {
            Event::Exited { role: Role::Top, pid, code: Some(c), .. } if c == i32::from(LOST_EXIT) => {
                // The domain below broke the channel or vanished: both go.
                let what = match (self.shape, self.policy.reconnect) {
                    (Shape::Interpose, _) => "the driver domain below it",
                    (_, Some(_)) => "its remote server",
                    (_, None) => "its backend (it said why above)",
                };
                (format!("{top} domain (pid {pid}) lost {what}"), Which::All)
            }
            Event::Exited { role: Role::Top, pid, code: Some(c), .. } if c == i32::from(GUARD_EXIT) => {
                // Write capture stopped a filter's write before it landed; the domain said which
                // above. Its state is intact; it restarts like any other.
                (format!("{top} domain (pid {pid}) stopped a guarded filter's write (reported above)"), self.top_alone())
            }
            Event::Exited { role: Role::Top, pid, status, .. } => {
                (format!("{top} domain (pid {pid}) exited: {status}"), self.top_alone())
            }
            Event::Exited { role: Role::Below, pid, status, .. } => {
                (format!("driver domain (pid {pid}) below the tap domain exited: {status}"), self.below_alone())
            }
            Event::Exiting { role: Role::Top, pid } => {
                (format!("{top} domain (pid {pid}) is exiting (its memory released)"), self.top_alone())
            }
            Event::Exiting { role: Role::Below, pid } => {
                (format!("driver domain (pid {pid}) below the tap domain is exiting (its memory released)"), self.below_alone())
            }
            Event::BrokeChannel { pid } => (format!("{top} domain (pid {pid}) broke the channel protocol"), self.top_alone()),
            // The driver's card is gone: the device restarts, and its next launch starts a new
            // model over the same storage before the new driver.
            Event::ModelExited { why } | Event::ReplaceFailed { why } | Event::Changed { why, .. } => (why, Which::All),
        }
    }

    /// What replaces the domain the frontend reaches: the tap domain alone over a driver
    /// domain of its own, otherwise the whole generation.
    fn top_alone(&self) -> Which {
        match self.shape {
            Shape::Interpose => Which::Tap,
            Shape::Passthrough | Shape::Intercept => Which::All,
        }
    }

    /// What replaces the driver domain below a tap domain: itself alone.
    fn below_alone(&self) -> Which {
        match self.shape {
            Shape::Interpose => Which::Below,
            Shape::Passthrough | Shape::Intercept => Which::All,
        }
    }

    /// A restart of `which` for `why` at `now`: at once or after a back-off, or the device
    /// fails once the restart limit is reached within its window.
    fn count(&mut self, why: String, which: Which, now: Instant, answered: u64) -> Disposition {
        while self.history.front().is_some_and(|t| now.saturating_duration_since(*t) > self.policy.window) {
            self.history.pop_front();
        }
        if self.history.len() as u32 >= self.policy.limit {
            let reason = format!(
                "{why}; {} restarts within {} ms: device failed (`bulkhead device restart {}` tries again)",
                self.history.len(),
                self.policy.window.as_millis(),
                self.device
            );
            self.fail(&reason);
            return Disposition::Fail { reason };
        }
        // A domain that dies within a second of starting without answering anything is
        // crash-looping: back off. One that served requests restarts at once.
        if now.saturating_duration_since(self.started_at) < Duration::from_secs(1) && answered == self.answered_at_start {
            self.quick_deaths += 1;
        } else {
            self.quick_deaths = 0;
        }
        self.history.push_back(now);
        self.restarts += 1;
        let delay = match self.quick_deaths {
            0 => Duration::ZERO,
            n => Duration::from_millis(10u64 << (n - 1).min(7)).min(Duration::from_secs(1)),
        };
        Disposition::Restart { which, delay, why }
    }

    /// Forgets the restart history (a restart or change asked for by the operator, which also
    /// revives a failed device).
    fn reset(&mut self) {
        self.history.clear();
        self.quick_deaths = 0;
        self.down_since = None;
        self.remote_down = false;
        self.retry_at = None;
        self.state = DeviceState::Running;
        self.failure = None;
    }

    /// The next generation, laid out as `shape`, runs from now (or one domain of it was
    /// replaced alone); `before` is what the watcher saw of the device just before the launch,
    /// and `holder_new` whether the domain holding the backend is one of those launched.
    pub fn on_launched(&mut self, shape: Shape, before: &Observation, holder_new: bool) -> Launch {
        let now = self.clock.now();
        let answered = before.answered;
        // A remote that did not answer the last domain has yet to answer this one (`tick`).
        let was_down = if self.remote_down { None } else { self.down_since.take().map(|t| now.saturating_duration_since(t)) };
        self.shape = shape;
        self.retry_at = None;
        if holder_new && self.policy.reconnect.is_some() {
            self.opening = Some(if shape == Shape::Interpose { before.below_beat } else { before.beat });
        }
        if !self.remote_down {
            self.retry_delay = Duration::ZERO;
        }
        self.state = DeviceState::Running;
        self.failure = None;
        self.started_at = now;
        self.answered_at_start = answered;
        Launch::Up { was_down }
    }

    /// A launch after `why` failed with `error`; `unreachable`: the failure is a remote server
    /// that could not be reached, which is tried again for the policy's reconnect time, the
    /// device `reconnecting` meanwhile. Any other failure fails the device.
    pub fn on_launch_failed(&mut self, why: &str, error: &str, unreachable: bool) -> Launch {
        let now = self.clock.now();
        let timeout = match (unreachable, self.policy.reconnect) {
            (true, Some(t)) => t,
            _ => {
                let reason = format!("{why}; restart failed: {error}");
                self.fail(&reason);
                return Launch::Fail { reason };
            }
        };
        if let Ok(after) = self.next_attempt(now, timeout, format!("{why}; reconnecting: {error}")) {
            return Launch::Retry { after };
        }
        Launch::Fail { reason: self.give_up(&format!("{error}; no connection"), timeout) }
    }

    /// Fails the device after a reconnect episode: `what` lasted `down`. Returns why.
    fn give_up(&mut self, what: &str, down: Duration) -> String {
        let reason =
            format!("{what} for {} ms: device failed (`bulkhead device restart {}` tries again)", down.as_millis(), self.device);
        self.fail(&reason);
        reason
    }

    fn fail(&mut self, reason: &str) {
        self.state = DeviceState::Failed;
        self.failure = Some(reason.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A clock the test moves.
    #[derive(Debug)]
    struct Manual(Mutex<Instant>);

    impl Clock for Manual {
        fn now(&self) -> Instant {
            *self.0.lock().unwrap()
        }
    }

    impl Manual {
        fn new() -> Arc<Manual> {
            Arc::new(Manual(Mutex::new(Instant::now())))
        }
        fn advance(&self, ms: u64) {
            *self.0.lock().unwrap() += Duration::from_millis(ms);
        }
    }

    fn policy() -> RestartPolicy {
        RestartPolicy { watchdog: Duration::from_millis(1000), limit: 3, window: Duration::from_secs(60), reconnect: None }
    }

    fn life(shape: Shape) -> (Lifecycle, Arc<Manual>) {
        let clock = Manual::new();
        (Lifecycle::new("d", policy(), shape, clock.clone()), clock)
    }

    fn obs(answered: u64, pending: usize) -> Observation {
        Observation { answered, pending, ..Default::default() }
    }

    fn exited(role: Role, code: Option<i32>) -> Event {
        Event::Exited { role, pid: 42, code, status: format!("exit status: {}", code.unwrap_or(-1)) }
    }

    /// The domains a disposition restarts (panics on a failure).
    fn which(d: Disposition) -> Which {
        match d {
            Disposition::Restart { which, .. } => which,
            Disposition::Fail { reason } => panic!("failed: {reason}"),
        }
    }

    #[test]
    fn passthrough_restarts_the_whole_generation_whatever_happened() {
        for event in [
            exited(Role::Top, Some(1)),
            exited(Role::Top, None),
            exited(Role::Top, Some(GUARD_EXIT.into())),
            exited(Role::Top, Some(LOST_EXIT.into())),
            Event::Exiting { role: Role::Top, pid: 42 },
            Event::BrokeChannel { pid: 42 },
            Event::ModelExited { why: "device model (pid 9) exited".into() },
            Event::Changed { why: "restart requested".into(), filters_only: false },
            Event::Changed { why: "filter delay inserted at position 0".into(), filters_only: true },
        ] {
            let (mut l, clock) = life(Shape::Passthrough);
            clock.advance(5000);
            assert_eq!(which(l.on_event(event.clone(), 1)), Which::All, "{event:?}");
        }
    }

    #[test]
    fn intercept_has_one_domain_and_restarts_it_whole() {
        for event in [exited(Role::Top, Some(1)), Event::BrokeChannel { pid: 42 }, Event::Exiting { role: Role::Top, pid: 42 }] {
            let (mut l, _) = life(Shape::Intercept);
            let Disposition::Restart { which, why, .. } = l.on_event(event, 0) else { panic!() };
            assert_eq!(which, Which::All);
            assert!(why.starts_with("tap domain (pid 42)"), "{why}");
        }
    }

    #[test]
    fn interpose_replaces_the_domain_at_fault_alone() {
        let cases = [
            (exited(Role::Top, Some(1)), Which::Tap, "tap domain (pid 42) exited"),
            (exited(Role::Top, Some(GUARD_EXIT.into())), Which::Tap, "stopped a guarded filter's write"),
            (Event::BrokeChannel { pid: 42 }, Which::Tap, "broke the channel protocol"),
            (Event::Exiting { role: Role::Top, pid: 42 }, Which::Tap, "is exiting"),
            (exited(Role::Below, None), Which::Below, "driver domain (pid 42) below the tap domain exited"),
            (Event::Exiting { role: Role::Below, pid: 42 }, Which::Below, "below the tap domain is exiting"),
            // The tap domain lost the one below: both go.
            (exited(Role::Top, Some(LOST_EXIT.into())), Which::All, "lost the driver domain below it"),
            (Event::ReplaceFailed { why: "the driver domain below did not follow".into() }, Which::All, "did not follow"),
            (Event::Changed { why: "filter removed".into(), filters_only: true }, Which::Tap, "filter removed"),
            (Event::Changed { why: "tap mode interpose → passthrough".into(), filters_only: false }, Which::All, "tap mode"),
        ];
        for (event, want, says) in cases {
            let (mut l, _) = life(Shape::Interpose);
            let Disposition::Restart { which, why, .. } = l.on_event(event.clone(), 0) else { panic!("{event:?}") };
            assert_eq!(which, want, "{event:?}");
            assert!(why.contains(says), "{event:?}: {why}");
        }
    }

    #[test]
    fn a_lost_backend_is_named_by_what_the_device_depends_on() {
        let (mut l, _) = life(Shape::Passthrough);
        let Disposition::Restart { why, .. } = l.on_event(exited(Role::Top, Some(LOST_EXIT.into())), 0) else { panic!() };
        assert!(why.ends_with("lost its backend (it said why above)"), "{why}");
        let clock = Manual::new();
        let remote = RestartPolicy { reconnect: Some(Duration::from_secs(5)), ..policy() };
        let mut l = Lifecycle::new("far", remote, Shape::Passthrough, clock);
        let Disposition::Restart { why, .. } = l.on_event(exited(Role::Top, Some(LOST_EXIT.into())), 0) else { panic!() };
        assert!(why.ends_with("lost its remote server"), "{why}");
    }

    #[test]
    fn watchdog_fires_only_with_requests_pending_and_no_progress_for_its_time() {
        let (mut l, clock) = life(Shape::Passthrough);
        clock.advance(5000);
        assert_eq!(l.tick(obs(0, 0), 7), None, "nothing pending");
        clock.advance(500);
        assert_eq!(l.tick(obs(0, 2), 7), None);
        clock.advance(500);
        assert_eq!(l.tick(obs(3, 2), 7), None, "answers are progress");
        clock.advance(999);
        assert_eq!(l.tick(obs(3, 2), 7), None);
        clock.advance(1);
        let Some(Disposition::Restart { which: Which::All, why, .. }) = l.tick(obs(3, 2), 7) else { panic!("wedged") };
        assert_eq!(why, "driver domain (pid 7) answered nothing for 1000 ms with 2 requests pending");
    }

    #[test]
    fn a_wedged_tap_domain_over_a_domain_of_its_own_is_replaced_alone() {
        let (mut l, clock) = life(Shape::Interpose);
        assert_eq!(l.tick(obs(0, 1), 7), None);
        clock.advance(1000);
        let Some(Disposition::Restart { which, why, .. }) = l.tick(obs(0, 1), 7) else { panic!("wedged") };
        assert_eq!(which, Which::Tap);
        assert!(why.starts_with("tap domain (pid 7) answered nothing"), "{why}");
    }

    #[test]
    fn exiting_domains_are_looked_for_only_once_answers_have_stopped_for_a_moment() {
        let (mut l, clock) = life(Shape::Passthrough);
        assert!(!l.worth_looking_for_exit(&obs(0, 1)));
        clock.advance(5);
        assert!(l.worth_looking_for_exit(&obs(0, 1)));
        assert!(!l.worth_looking_for_exit(&obs(0, 0)), "nothing pending: nothing for the kernel to finish");
        l.progress_seen(obs(1, 1));
        assert!(!l.worth_looking_for_exit(&obs(1, 1)), "answered just now");
    }

    #[test]
    fn a_heartbeat_keeps_the_watchdog_off_only_while_layers_hold_requests() {
        let (mut l, clock) = life(Shape::Passthrough);
        let beat = |hb, held| Observation { pending: 1, heartbeat: hb, held, ..Default::default() };
        assert_eq!(l.tick(beat(0, 1), 1), None);
        for i in 1..10 {
            clock.advance(600);
            assert_eq!(l.tick(beat(i, 1), 1), None, "beating while holding");
        }
        // A beat with nothing held says nothing: the loop turns, but nothing will be answered.
        assert_eq!(l.tick(beat(10, 0), 1), None);
        clock.advance(1100);
        assert!(l.tick(beat(11, 0), 1).is_some());
        // A stopped heartbeat with requests held is a wedge too.
        let (mut l, clock) = life(Shape::Passthrough);
        assert_eq!(l.tick(beat(5, 1), 1), None);
        clock.advance(1000);
        assert!(l.tick(beat(5, 1), 1).is_some());
    }

    #[test]
    fn with_applications_attached_a_loop_that_stops_beating_is_a_wedge_even_with_nothing_pending() {
        let (mut l, clock) = life(Shape::Passthrough);
        let o = |beat, attached| Observation { beat, attached, ..Default::default() };
        // Nobody attached: a silent loop (an idle domain asleep) is no concern.
        assert_eq!(l.tick(o(0, 0), 1), None);
        clock.advance(5000);
        assert_eq!(l.tick(o(0, 0), 1), None);
        // Attached: the clock starts when the application came, and beats reset it.
        clock.advance(100);
        assert_eq!(l.tick(o(0, 1), 1), None);
        for i in 1..10 {
            clock.advance(400);
            assert_eq!(l.tick(o(i, 1), 1), None, "beating");
        }
        // The last beat was seen 0 ms ago; 999 ms on, still alive.
        clock.advance(999);
        assert_eq!(l.tick(o(9, 1), 1), None);
        clock.advance(1);
        let Some(Disposition::Restart { why, .. }) = l.tick(o(9, 1), 1) else { panic!("no beat for the watchdog's time") };
        assert!(why.contains("showed no sign of life for 1000 ms with 1 application(s) attached"), "{why}");
        // A new generation starts the clock again.
        clock.advance(350);
        l.on_launched(Shape::Passthrough, &obs(0, 0), true);
        l.progress_seen(o(0, 1));
        clock.advance(950);
        assert_eq!(l.tick(o(0, 1), 1), None);
        clock.advance(50);
        assert!(l.tick(o(0, 1), 1).is_some());
        // The application leaving ends the watch.
        assert_eq!(l.tick(o(0, 0), 1), None);
        clock.advance(9000);
        assert_eq!(l.tick(o(0, 0), 1), None);
    }

    #[test]
    fn crash_loops_back_off_doubling_to_a_second_and_serving_resets_the_back_off() {
        let clock = Manual::new();
        let mut l = Lifecycle::new("d", RestartPolicy { limit: 100, ..policy() }, Shape::Passthrough, clock.clone());
        let mut delays = Vec::new();
        for _ in 0..10 {
            clock.advance(100);
            match l.on_event(exited(Role::Top, Some(1)), 0) {
                Disposition::Restart { delay, .. } => delays.push(delay.as_millis()),
                other => panic!("{other:?}"),
            }
            clock.advance(5);
            l.on_launched(Shape::Passthrough, &obs(0, 0), true);
        }
        assert_eq!(delays, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        // A generation that answered something restarts at once.
        clock.advance(100);
        let d = l.on_event(exited(Role::Top, Some(1)), 5);
        assert!(matches!(d, Disposition::Restart { delay: Duration::ZERO, .. }), "{d:?}");
        // So does one that lived longer than a second.
        l.on_launched(Shape::Passthrough, &obs(5, 0), true);
        clock.advance(2000);
        let d = l.on_event(exited(Role::Top, Some(1)), 5);
        assert!(matches!(d, Disposition::Restart { delay: Duration::ZERO, .. }), "{d:?}");
        assert_eq!(l.restarts(), 12, "every restart decided counts");
    }

    #[test]
    fn the_restart_limit_within_its_window_fails_the_device_until_the_operator_changes_it() {
        for shape in [Shape::Passthrough, Shape::Interpose, Shape::Intercept] {
            let clock = Manual::new();
            let mut l = Lifecycle::new("disk9", policy(), shape, clock.clone());
            clock.advance(10_000);
            for _ in 0..3 {
                assert!(matches!(l.on_event(exited(Role::Top, Some(1)), 1), Disposition::Restart { .. }));
                l.on_launched(shape, &obs(1, 0), true);
                clock.advance(2000);
            }
            let Disposition::Fail { reason } = l.on_event(exited(Role::Top, Some(1)), 1) else { panic!("should fail") };
            assert!(
                reason.contains("3 restarts within 60000 ms") && reason.contains("`bulkhead device restart disk9`"),
                "{reason}"
            );
            assert_eq!(l.state(), DeviceState::Failed);
            assert_eq!(l.failure(), Some(reason.as_str()));
            // A failed device does not watch.
            clock.advance(5000);
            assert_eq!(l.tick(obs(0, 3), 1), None);
            // An operator's change clears the history and revives the device.
            let d = l.on_event(Event::Changed { why: "restart requested".into(), filters_only: false }, 1);
            assert!(matches!(d, Disposition::Restart { which: Which::All, .. }), "{d:?}");
            assert_eq!(l.state(), DeviceState::Running);
        }
        // Past the window the old restarts no longer count.
        let (mut l, clock) = life(Shape::Passthrough);
        clock.advance(10_000);
        for _ in 0..3 {
            assert!(matches!(l.on_event(exited(Role::Below, Some(1)), 1), Disposition::Restart { .. }));
            clock.advance(2000);
        }
        clock.advance(60_000);
        assert!(matches!(l.on_event(exited(Role::Top, Some(1)), 1), Disposition::Restart { .. }));
    }

    #[test]
    fn one_domain_replaced_alone_counts_against_the_limit_too() {
        let (mut l, clock) = life(Shape::Interpose);
        clock.advance(10_000);
        for e in [exited(Role::Top, Some(1)), exited(Role::Below, Some(1)), Event::BrokeChannel { pid: 42 }] {
            assert!(matches!(l.on_event(e, 1), Disposition::Restart { .. }));
            l.on_launched(Shape::Interpose, &obs(1, 0), true);
            clock.advance(2000);
        }
        assert!(matches!(l.on_event(exited(Role::Below, Some(1)), 1), Disposition::Fail { .. }));
    }

    #[test]
    fn an_unreachable_server_is_retried_with_back_off_until_the_reconnect_timeout() {
        let clock = Manual::new();
        let remote = RestartPolicy { reconnect: Some(Duration::from_secs(5)), ..policy() };
        let mut l = Lifecycle::new("far", remote, Shape::Passthrough, clock.clone());
        let mut delays = Vec::new();
        loop {
            match l.on_launch_failed("lost its server", "connection refused", true) {
                Launch::Retry { after } => {
                    assert_eq!(l.state(), DeviceState::Reconnecting);
                    assert_eq!(l.retry_at(), Some(clock.now() + after));
                    delays.push(after.as_millis());
                    clock.advance(after.as_millis() as u64);
                }
                Launch::Fail { reason } => {
                    assert!(reason.contains("no connection for 5000 ms"), "{reason}");
                    break;
                }
                Launch::Up { .. } => unreachable!(),
            }
        }
        assert_eq!(delays, [100, 200, 400, 800, 1600, 2000]);
        assert_eq!(l.state(), DeviceState::Failed);
        assert_eq!(l.retry_at(), None);
        // Reconnecting then succeeding says how long it was down.
        let clock = Manual::new();
        let mut l = Lifecycle::new("far", remote, Shape::Passthrough, clock.clone());
        assert!(matches!(l.on_launch_failed("lost", "refused", true), Launch::Retry { .. }));
        clock.advance(300);
        assert_eq!(
            l.on_launched(Shape::Passthrough, &obs(0, 0), true),
            Launch::Up { was_down: Some(Duration::from_millis(300)) }
        );
        assert_eq!(l.state(), DeviceState::Running);
        // Any other launch failure fails the device at once, and a local backend's always.
        assert!(matches!(l.on_launch_failed("exited", "exec failed", false), Launch::Fail { .. }));
        let (mut local, _) = life(Shape::Passthrough);
        assert!(matches!(local.on_launch_failed("exited", "refused", true), Launch::Fail { .. }));
    }

    #[test]
    fn domains_a_remote_never_answers_are_retried_with_back_off_not_counted_until_the_reconnect_timeout() {
        // The holder of the backend: the only domain, or the one below a tap domain.
        for (shape, holder, which) in [(Shape::Passthrough, Role::Top, Which::All), (Shape::Interpose, Role::Below, Which::Below)]
        {
            let clock = Manual::new();
            let remote = RestartPolicy { reconnect: Some(Duration::from_secs(5)), ..policy() };
            let mut l = Lifecycle::new("far", remote, shape, clock.clone());
            let mut delays = Vec::new();
            // Each domain lives 1 s (the op timeout), answers nothing and exits "lost": more
            // restarts than the limit of 3, and the device reconnects rather than failing.
            let reason = loop {
                clock.advance(1000);
                match l.on_event(exited(holder, Some(LOST_EXIT.into())), 0) {
                    Disposition::Restart { which: w, delay, .. } => {
                        assert_eq!(w, which);
                        assert_eq!(l.state(), DeviceState::Reconnecting);
                        assert!(l.failure().is_some_and(|f| f.contains("reconnecting")), "{:?}", l.failure());
                        delays.push(delay.as_millis());
                        clock.advance(delay.as_millis() as u64);
                        assert_eq!(
                            l.on_launched(shape, &obs(0, 0), true),
                            Launch::Up { was_down: None },
                            "the remote has not answered yet"
                        );
                        assert!(l.awaiting_remote(&obs(0, 0)));
                    }
                    Disposition::Fail { reason } => break reason,
                }
            };
            assert_eq!(delays, [100, 200, 400, 800], "{shape:?}");
            assert!(
                reason.contains("the remote has not answered for 5500 ms") && reason.contains("bulkhead device restart far"),
                "{reason}"
            );
            assert_eq!(l.state(), DeviceState::Failed);

            // Once a generation answers, the episode is over: a later loss starts afresh.
            let clock = Manual::new();
            let mut l = Lifecycle::new("far", remote, shape, clock.clone());
            clock.advance(2000);
            assert!(matches!(l.on_event(exited(holder, Some(LOST_EXIT.into())), 0), Disposition::Restart { .. }));
            clock.advance(100);
            l.on_launched(shape, &obs(0, 0), true);
            assert!(l.awaiting_remote(&obs(0, 0)));
            assert!(!l.awaiting_remote(&obs(5, 0)), "status reads the answer before the watcher");
            assert_eq!(l.tick(obs(5, 0), 7), None);
            assert!(!l.awaiting_remote(&obs(5, 0)));
            // So is one whose loop turns (it has reached the remote), idle as it may be.
            clock.advance(1000);
            assert!(matches!(l.on_event(exited(holder, Some(LOST_EXIT.into())), 0), Disposition::Restart { .. }));
            let turning = |b: u64| match holder {
                Role::Below => Observation { below_beat: b, beat: 9, ..Default::default() },
                Role::Top => Observation { beat: b, below_beat: 9, ..Default::default() },
            };
            l.on_launched(shape, &turning(4), true);
            assert_eq!(l.tick(turning(4), 7), None);
            assert!(l.awaiting_remote(&turning(4)), "the beat at launch is the reference");
            assert_eq!(l.tick(turning(5), 7), None);
            assert!(!l.awaiting_remote(&turning(5)));
            l.on_launched(shape, &obs(0, 0), true);
            clock.advance(1000);
            clock.advance(10_000);
            let Disposition::Restart { delay, .. } = l.on_event(exited(holder, Some(LOST_EXIT.into())), 5) else { panic!() };
            assert_eq!(delay, Duration::ZERO, "a domain that served is restarted at once, and counted");
            // So is one idle for the reconnect time.
            l.on_launched(shape, &obs(5, 0), true);
            clock.advance(1000);
            assert!(matches!(l.on_event(exited(holder, Some(LOST_EXIT.into())), 5), Disposition::Restart { .. }));
            clock.advance(100);
            l.on_launched(shape, &obs(5, 0), true);
            clock.advance(5000);
            assert_eq!(l.tick(obs(5, 0), 7), None);
            clock.advance(2000);
            assert!(matches!(l.on_event(exited(holder, Some(LOST_EXIT.into())), 5), Disposition::Restart { .. }));
            assert_eq!(l.state(), DeviceState::Reconnecting, "a fresh episode, not a failure");
        }
        // A local backend's lost domain is counted as any exit.
        let (mut local, clock) = life(Shape::Passthrough);
        clock.advance(2000);
        assert!(!local.awaiting_remote(&obs(0, 0)), "a local backend has no remote to wait for");
        let Disposition::Restart { delay, .. } = local.on_event(exited(Role::Top, Some(LOST_EXIT.into())), 0) else { panic!() };
        assert!(delay < Duration::from_millis(100) && local.state() == DeviceState::Running);
    }

    #[test]
    fn a_domain_that_has_not_reached_its_remote_a_second_after_its_start_is_waiting_for_it() {
        for (shape, holder) in [(Shape::Passthrough, Role::Top), (Shape::Interpose, Role::Below)] {
            let beats = |b: u64| match holder {
                Role::Below => Observation { below_beat: b, beat: 100 + b, ..Default::default() },
                Role::Top => Observation { beat: b, below_beat: 100 + b, ..Default::default() },
            };
            let clock = Manual::new();
            let remote = RestartPolicy { reconnect: Some(Duration::from_secs(5)), ..policy() };
            let mut l = Lifecycle::new("far", remote, shape, clock.clone());
            // The first generation: a new page, its beat 0.
            clock.advance(999);
            assert!(!l.awaiting_remote(&beats(0)), "an open takes a moment");
            clock.advance(1);
            assert!(l.awaiting_remote(&beats(0)), "{shape:?}");
            assert!(!l.awaiting_remote(&beats(1)), "its loop turns: it has reached the remote");
            assert_eq!(l.tick(beats(1), 7), None);
            assert!(!l.awaiting_remote(&beats(1)));
            // Killed (counted, as any crash), the new domain opening while the remote is
            // silent: the device waits for the remote, not counted again meanwhile.
            let Disposition::Restart { .. } = l.on_event(exited(holder, None), 0) else { panic!() };
            l.on_launched(shape, &beats(3), true);
            assert_eq!(l.restarts(), 1);
            clock.advance(500);
            assert!(!l.awaiting_remote(&beats(3)));
            clock.advance(700);
            assert!(l.awaiting_remote(&beats(3)));
            assert_eq!(l.tick(beats(3), 7), None);
            assert!(l.awaiting_remote(&beats(3)));
            assert!(!l.awaiting_remote(&Observation { answered: 1, ..beats(3) }), "it answered");
            // Replacing the tap domain alone leaves the holder below as it was.
            if shape == Shape::Interpose {
                l.on_launched(shape, &beats(3), false);
                clock.advance(2000);
                assert!(l.awaiting_remote(&beats(3)));
                assert_eq!(l.tick(beats(4), 7), None);
                l.on_launched(shape, &beats(4), false);
                clock.advance(2000);
                assert!(!l.awaiting_remote(&beats(4)), "the holder below had reached the remote");
            }
        }
    }
}
