//! A device's lifecycle as a state machine: what the watcher observes and what its launches
//! come to go in, decisions come out, and the time is passed in. It owns no process, lock or
//! clock, so every rule — the watchdog, crash-loop back-off, the restart limit, reconnecting
//! with back-off — is tested here without starting anything.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::domain::RestartPolicy;
use crate::supervisor::DeviceState;

/// What the watcher sees of a device at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Applications attached to the device, whose requests `pending` does not count.
    pub attached: usize,
}

/// What to do about a failed generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Start the next generation after this delay (zero: at once).
    Restart { delay: Duration },
    /// Stop trying: the device is failed, for this reason.
    Fail { reason: String },
}

/// What to do about a launch that did not succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Try again after this delay; the device is `reconnecting`.
    After(Duration),
    /// Stop trying: the device is failed, for this reason.
    Fail { reason: String },
}

/// A device's state and restart history.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    device: String,
    policy: RestartPolicy,
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
    retry_at: Option<Instant>,
    retry_delay: Duration,
    /// The watchdog's last sight of progress.
    progress: (u64, Instant, u64),
    /// The loop beat last seen, and since when (or since applications are attached).
    beat: (u64, Instant),
}

impl Lifecycle {
    /// A device whose first generation started at `now`.
    pub fn new(device: &str, policy: RestartPolicy, now: Instant) -> Self {
        Lifecycle {
            device: device.to_string(),
            policy,
            state: DeviceState::Running,
            failure: None,
            restarts: 0,
            history: VecDeque::new(),
            quick_deaths: 0,
            started_at: now,
            answered_at_start: 0,
            down_since: None,
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

    /// Why it failed or is reconnecting.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Generations started after the first.
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// The device stopped at shutdown.
    pub fn stopped(&mut self) {
        self.state = DeviceState::Stopped;
    }

    /// Forgets the restart history (a restart or change asked for by the operator, which also
    /// revives a failed device).
    pub fn reset(&mut self) {
        self.history.clear();
        self.quick_deaths = 0;
        self.down_since = None;
        self.retry_at = None;
        self.state = DeviceState::Running;
    }

    /// Whether a reconnect attempt is due.
    pub fn retry_due(&self, now: Instant) -> bool {
        self.state == DeviceState::Reconnecting && self.retry_at.is_some_and(|t| t <= now)
    }

    /// Restarts the watchdog's clock (after a launch or a restart).
    pub fn progress_seen(&mut self, now: Instant, obs: Observation) {
        self.progress = (obs.answered, now, obs.heartbeat);
        self.beat = (obs.beat, now);
    }

    /// How long the watchdog has seen no progress, as of its last look.
    pub fn quiet_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.progress.1)
    }

    /// The watchdog: why the running domain is wedged, if it is — requests pending and none
    /// answered for the policy's time, while its layers hold nothing or its loop has stopped
    /// beating; or, with applications attached (whose requests the supervisor cannot count),
    /// a loop that has stopped beating for the policy's time.
    ///
    /// The beats are the domain's word, so a domain can only ever keep itself from being
    /// restarted by them, which it could as well by answering; no application can touch them.
    pub fn watch(&mut self, now: Instant, obs: Observation) -> Option<String> {
        if obs.attached == 0 || obs.beat != self.beat.0 {
            self.beat = (obs.beat, now);
        }
        let still = now.duration_since(self.beat.1);
        if still >= self.policy.watchdog {
            return Some(format!(
                "showed no sign of life for {} ms with {} application(s) attached",
                still.as_millis(),
                obs.attached
            ));
        }
        let (answered, since, heartbeat) = self.progress;
        let holding = obs.heartbeat != heartbeat && obs.held > 0;
        if obs.pending == 0 || obs.answered != answered || holding {
            self.progress = (obs.answered, now, obs.heartbeat);
            return None;
        }
        let quiet = now.duration_since(since);
        (quiet >= self.policy.watchdog)
            .then(|| format!("answered nothing for {} ms with {} requests pending", quiet.as_millis(), obs.pending))
    }

    /// A generation failed (`why`) at `detected`: restart it now or later, or give up once the
    /// restart limit is reached within its window. `answered` is the device's count now.
    pub fn on_failure(&mut self, why: &str, detected: Instant, answered: u64) -> Decision {
        while self.history.front().is_some_and(|t| detected.duration_since(*t) > self.policy.window) {
            self.history.pop_front();
        }
        if self.history.len() as u32 >= self.policy.limit {
            let reason = format!(
                "{why}; {} restarts within {} ms: device failed (`bulkhead restart {}` tries again)",
                self.history.len(),
                self.policy.window.as_millis(),
                self.device
            );
            self.fail(&reason);
            return Decision::Fail { reason };
        }
        // A domain that dies within a second of starting without answering anything is
        // crash-looping: back off. One that served requests restarts at once.
        if detected.duration_since(self.started_at) < Duration::from_secs(1) && answered == self.answered_at_start {
            self.quick_deaths += 1;
        } else {
            self.quick_deaths = 0;
        }
        self.history.push_back(detected);
        let delay = match self.quick_deaths {
            0 => Duration::ZERO,
            n => Duration::from_millis(10u64 << (n - 1).min(7)).min(Duration::from_secs(1)),
        };
        Decision::Restart { delay }
    }

    /// The next generation runs since `now`; returns how long the device had been reconnecting,
    /// if it was.
    pub fn on_launched(&mut self, now: Instant, answered: u64) -> Option<Duration> {
        let was_down = self.down_since.take().map(|t| now.duration_since(t));
        self.retry_at = None;
        self.retry_delay = Duration::ZERO;
        self.state = DeviceState::Running;
        self.failure = None;
        self.started_at = now;
        self.answered_at_start = answered;
        self.restarts += 1;
        was_down
    }

    /// A launch after `why` failed with `error`. `reconnect` is how long to keep trying when the
    /// failure is a remote server that could not be reached; otherwise the device fails.
    pub fn on_launch_failed(&mut self, why: &str, error: &str, reconnect: Option<Duration>, now: Instant) -> Retry {
        let Some(timeout) = reconnect else {
            let reason = format!("{why}; restart failed: {error}");
            self.fail(&reason);
            return Retry::Fail { reason };
        };
        let since = *self.down_since.get_or_insert(now);
        if now.duration_since(since) < timeout {
            self.retry_delay = (self.retry_delay * 2).clamp(Duration::from_millis(100), Duration::from_secs(2));
            self.retry_at = Some(now + self.retry_delay);
            self.state = DeviceState::Reconnecting;
            self.failure = Some(format!("{why}; reconnecting: {error}"));
            return Retry::After(self.retry_delay);
        }
        let reason = format!(
            "{error}; no connection for {} ms: device failed (`bulkhead restart {}` tries again)",
            timeout.as_millis(),
            self.device
        );
        self.down_since = None;
        self.retry_at = None;
        self.fail(&reason);
        Retry::Fail { reason }
    }

    fn fail(&mut self, reason: &str) {
        self.state = DeviceState::Failed;
        self.failure = Some(reason.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RestartPolicy {
        RestartPolicy { watchdog: Duration::from_millis(1000), limit: 3, window: Duration::from_secs(60) }
    }

    fn obs(answered: u64, pending: usize) -> Observation {
        Observation { answered, pending, heartbeat: 0, held: 0, beat: 0, attached: 0 }
    }

    #[test]
    fn watchdog_fires_only_with_requests_pending_and_no_progress_for_its_time() {
        let t0 = Instant::now();
        let mut l = Lifecycle::new("d", policy(), t0);
        let ms = |n| t0 + Duration::from_millis(n);
        assert_eq!(l.watch(ms(5000), obs(0, 0)), None, "nothing pending");
        assert_eq!(l.watch(ms(5500), obs(0, 2)), None);
        assert_eq!(l.watch(ms(6000), obs(3, 2)), None, "answers are progress");
        assert_eq!(l.watch(ms(6999), obs(3, 2)), None);
        let why = l.watch(ms(7000), obs(3, 2)).expect("wedged after 1000 ms");
        assert!(why.contains("answered nothing for 1000 ms with 2 requests pending"), "{why}");
        assert_eq!(l.quiet_for(ms(7500)), Duration::from_millis(1500), "quiet since the answers at 6000 ms");
    }

    #[test]
    fn a_heartbeat_keeps_the_watchdog_off_only_while_layers_hold_requests() {
        let t0 = Instant::now();
        let mut l = Lifecycle::new("d", policy(), t0);
        let at = |n| t0 + Duration::from_millis(n);
        let beat = |hb, held| Observation { answered: 0, pending: 1, heartbeat: hb, held, beat: 0, attached: 0 };
        assert_eq!(l.watch(at(0), beat(0, 1)), None);
        for i in 1..10 {
            assert_eq!(l.watch(at(i * 600), beat(i, 1)), None, "beating while holding");
        }
        // A beat with nothing held says nothing: the loop turns, but nothing will be answered.
        assert_eq!(l.watch(at(6000), beat(10, 0)), None);
        assert!(l.watch(at(7100), beat(11, 0)).is_some());
        // A stopped heartbeat with requests held is a wedge too.
        let mut l = Lifecycle::new("d", policy(), t0);
        assert_eq!(l.watch(at(0), beat(5, 1)), None);
        assert!(l.watch(at(1000), beat(5, 1)).is_some());
    }

    #[test]
    fn with_applications_attached_a_loop_that_stops_beating_is_a_wedge_even_with_nothing_pending() {
        let t0 = Instant::now();
        let mut l = Lifecycle::new("d", policy(), t0);
        let at = |n| t0 + Duration::from_millis(n);
        let o = |beat, attached| Observation { answered: 0, pending: 0, heartbeat: 0, held: 0, beat, attached };
        // Nobody attached: a silent loop (an idle domain asleep) is no concern.
        assert_eq!(l.watch(at(0), o(0, 0)), None);
        assert_eq!(l.watch(at(5000), o(0, 0)), None);
        // Attached: the clock starts when the application came, and beats reset it.
        assert_eq!(l.watch(at(5100), o(0, 1)), None);
        for i in 1..10 {
            assert_eq!(l.watch(at(5100 + i * 400), o(i, 1)), None, "beating");
        }
        // The last beat was seen at 8700 ms.
        assert_eq!(l.watch(at(9699), o(9, 1)), None);
        let why = l.watch(at(9700), o(9, 1)).expect("no beat for the watchdog's time");
        assert!(why.contains("showed no sign of life for 1000 ms with 1 application(s) attached"), "{why}");
        // A new generation starts the clock again.
        l.progress_seen(at(10_050), o(0, 1));
        assert_eq!(l.watch(at(11_000), o(0, 1)), None);
        assert!(l.watch(at(11_050), o(0, 1)).is_some());
        // The application leaving ends the watch.
        assert_eq!(l.watch(at(11_100), o(0, 0)), None);
        assert_eq!(l.watch(at(20_000), o(0, 0)), None);
    }

    #[test]
    fn crash_loops_back_off_doubling_to_a_second_and_serving_resets_the_back_off() {
        let t0 = Instant::now();
        let p = RestartPolicy { limit: 100, ..policy() };
        let mut l = Lifecycle::new("d", p, t0);
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..10 {
            now += Duration::from_millis(100);
            match l.on_failure("exited", now, 0) {
                Decision::Restart { delay } => delays.push(delay.as_millis()),
                other => panic!("{other:?}"),
            }
            now += Duration::from_millis(5);
            l.on_launched(now, 0);
        }
        assert_eq!(delays, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        // A generation that answered something restarts at once.
        now += Duration::from_millis(100);
        assert_eq!(l.on_failure("exited", now, 5), Decision::Restart { delay: Duration::ZERO });
        // So does one that lived longer than a second.
        l.on_launched(now, 5);
        assert_eq!(l.on_failure("exited", now + Duration::from_secs(2), 5), Decision::Restart { delay: Duration::ZERO });
        assert_eq!(l.restarts(), 11);
    }

    #[test]
    fn the_restart_limit_within_its_window_fails_the_device_until_a_reset() {
        let t0 = Instant::now();
        let mut l = Lifecycle::new("disk9", policy(), t0);
        let s = |n| t0 + Duration::from_secs(n);
        for i in 0..3 {
            assert!(matches!(l.on_failure("exited", s(10 + 2 * i), 1), Decision::Restart { .. }));
            l.on_launched(s(10 + 2 * i), 1);
        }
        let Decision::Fail { reason } = l.on_failure("exited", s(20), 1) else { panic!("should fail") };
        assert!(reason.contains("3 restarts within 60000 ms") && reason.contains("`bulkhead restart disk9`"), "{reason}");
        assert_eq!(l.state(), DeviceState::Failed);
        assert_eq!(l.failure(), Some(reason.as_str()));
        // Past the window the old restarts no longer count.
        let mut l2 = Lifecycle::new("d", policy(), t0);
        for i in 0..3 {
            assert!(matches!(l2.on_failure("exited", s(10 + 2 * i), 1), Decision::Restart { .. }));
        }
        assert!(matches!(l2.on_failure("exited", s(80), 1), Decision::Restart { .. }));
        // An operator's restart clears the history and revives the device.
        l.reset();
        assert_eq!(l.state(), DeviceState::Running);
        assert!(matches!(l.on_failure("exited", s(21), 1), Decision::Restart { .. }));
    }

    #[test]
    fn an_unreachable_server_is_retried_with_back_off_until_the_reconnect_timeout() {
        let t0 = Instant::now();
        let mut l = Lifecycle::new("far", policy(), t0);
        let timeout = Some(Duration::from_secs(5));
        let mut now = t0;
        let mut delays = Vec::new();
        loop {
            match l.on_launch_failed("lost its server", "connection refused", timeout, now) {
                Retry::After(d) => {
                    assert_eq!(l.state(), DeviceState::Reconnecting);
                    assert!(!l.retry_due(now) && l.retry_due(now + d));
                    delays.push(d.as_millis());
                    now += d;
                }
                Retry::Fail { reason } => {
                    assert!(reason.contains("no connection for 5000 ms"), "{reason}");
                    break;
                }
            }
        }
        assert_eq!(delays, [100, 200, 400, 800, 1600, 2000]);
        assert_eq!(l.state(), DeviceState::Failed);
        // Reconnecting then succeeding says how long it was down.
        let mut l = Lifecycle::new("far", policy(), t0);
        assert!(matches!(l.on_launch_failed("lost", "refused", timeout, t0), Retry::After(_)));
        assert_eq!(l.on_launched(t0 + Duration::from_millis(300), 0), Some(Duration::from_millis(300)));
        assert_eq!(l.state(), DeviceState::Running);
        // Any other launch failure fails the device at once.
        assert!(matches!(l.on_launch_failed("exited", "exec failed", None, t0), Retry::Fail { .. }));
    }
}
