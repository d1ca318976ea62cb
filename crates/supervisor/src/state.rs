//! What the supervisor's modules share, and nothing else: a device's state and restart
//! policy, the shape of its domains, the exit codes domains speak in, and the clock.

use std::time::{Duration, Instant};

/// Exit status of a domain whose backend lost its remote server (EX_TEMPFAIL): the supervisor
/// reconnects and starts the next generation.
pub const LOST_EXIT: u8 = 75;
/// Exit status of a domain whose write capture stopped a filter's write
/// (`bulkhead_guard::VIOLATION_EXIT`): restarted like a crash, with the reason in the log.
pub const GUARD_EXIT: u8 = 86;

pub use bulkhead_control::DeviceState;

/// Restart policy of a device.
#[derive(Debug, Clone, Copy)]
pub struct RestartPolicy {
    /// A domain with requests pending and no answer for this long is wedged.
    pub watchdog: Duration,
    /// Restarts allowed within `window` before the device turns failed.
    pub limit: u32,
    /// The window.
    pub window: Duration,
    /// How long to keep reconnecting to a lost remote server (`None`: the backend is local,
    /// and a launch that fails fails the device).
    pub reconnect: Option<Duration>,
}

/// How a generation's domains are laid out: which the device's tap mode makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One driver domain runs the filters and the backend.
    Passthrough,
    /// A tap domain runs the filters over a driver domain of its own: each may be replaced
    /// alone.
    Interpose,
    /// One tap domain runs the filters and ends in the soft device.
    Intercept,
}

impl Shape {
    /// The shape a tap mode makes.
    pub fn of(tap: bulkhead_config::Tap) -> Shape {
        match tap {
            bulkhead_config::Tap::Passthrough => Shape::Passthrough,
            bulkhead_config::Tap::Interpose => Shape::Interpose,
            bulkhead_config::Tap::Intercept => Shape::Intercept,
        }
    }

    /// What the domain the frontend reaches is called in messages.
    pub fn top_role(self) -> &'static str {
        match self {
            Shape::Passthrough => "driver",
            Shape::Interpose | Shape::Intercept => "tap",
        }
    }
}

/// Which of a device's domains something concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The domain the frontend reaches (the driver domain, or the tap domain).
    Top,
    /// The driver domain below an `interpose` device's tap domain.
    Below,
}

/// The time, as the supervisor's rules read it: the monotonic clock in `serve`, a clock the
/// test moves in the lifecycle's tests.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Now.
    fn now(&self) -> Instant;
}

/// The monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct Monotonic;

impl Clock for Monotonic {
    fn now(&self) -> Instant {
        Instant::now()
    }
}
