//! Doorbells and polling policy.
//!
//! - [`EventFd`]: a doorbell each way between frontend and driver domain.
//! - [`Poller`]: blocks on several doorbells at once (the driver serves all queues from one loop).
//! - [`NotifyMode`]: `irq` (always sleep, always ring: the base design of Shirole's driver
//!   domain thesis), `poll` (spin forever), `adaptive` (spin up to a budget, then sleep: the
//!   thesis' improved design).
//! - [`SpinBudget`]: a fixed budget, or one that tunes itself from observed gaps (see
//!   `docs/ring-protocol.md`, "Adaptive budget").
//! - [`Crowd`]: whether runnable threads outnumber the CPUs, so an adaptive waiter stops
//!   spinning when its CPU is wanted.
//! - [`Handoff`]: whether a spinner's yields hand its CPU to the thread it waits for, so it
//!   yields before spinning.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod budget;
mod crowd;
mod handoff;
mod idle;

pub use budget::{BudgetPolicy, SpinBudget};
pub use bulkhead_sys::eventfd::{EventFd, Poller};
pub use crowd::{Crowd, CrowdWatch};
pub use handoff::Handoff;
pub use idle::IdleSpin;

use std::str::FromStr;

/// How a side waits for the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyMode {
    /// Sleep on the doorbell at once; the peer always rings.
    Irq,
    /// Spin without ever sleeping.
    Poll,
    /// Spin up to the budget, then publish SLEEPING and block.
    Adaptive,
}

impl NotifyMode {
    /// Name as written in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            NotifyMode::Irq => "irq",
            NotifyMode::Poll => "poll",
            NotifyMode::Adaptive => "adaptive",
        }
    }
}

impl FromStr for NotifyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "irq" => Ok(NotifyMode::Irq),
            "poll" => Ok(NotifyMode::Poll),
            "adaptive" => Ok(NotifyMode::Adaptive),
            _ => Err(format!("unknown notification mode `{s}` (expected irq, poll or adaptive)")),
        }
    }
}

impl std::fmt::Display for NotifyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Monotonic nanoseconds (CLOCK_MONOTONIC through the vDSO: ~20 ns).
pub fn now_ns() -> u64 {
    bulkhead_sys::monotonic_ns()
}
