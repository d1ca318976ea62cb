//! The supervisor's line to a tap domain about the domain below it.
//!
//! When the driver domain below a tap domain dies, the supervisor replaces it alone: the tap
//! domain keeps running, with the requests it holds and its filters' state. The two agree on
//! the switch through one page of shared memory and a doorbell:
//!
//! 1. the supervisor reaps the old domain below, writes the next generation in the page
//!    ([`request_restart`](BelowControl::request_restart)) and rings the doorbell (and the
//!    doorbells the tap domain waits on for responses);
//! 2. the tap domain starts every queue below over as that generation
//!    ([`FrontQueue::restart`](crate::FrontQueue::restart)), reissues what had no answer, and
//!    writes the generation back ([`report_ready`](BelowControl::report_ready));
//! 3. the supervisor sees it ([`ready`](BelowControl::ready)) and starts the new domain below
//!    on the same queue files.
//!
//! A standby tap domain taking over from a dead one is let go with step 1 (the driver domain
//! below has let go of the queues) and answers with step 2 while the frontend starts the
//! channel above over; the supervisor then names that channel's generation
//! ([`allow_above`](BelowControl::allow_above)), and the standby attaches to it.
//!
//! The tap domain is untrusted: what it writes in the page only decides whether the supervisor
//! goes on to start the domain below, which validates the queues like any driver.

use crate::line::{line_ends, Line};
use crate::ChannelError;

/// Offset of the generation the supervisor asks for.
const WANTED: usize = 0;
/// Offset of the generation the tap domain has started over as.
const READY: usize = 8;
/// Offset of the generation the frontend has started the channel above over as, for a standby
/// tap domain taking over.
const ABOVE: usize = 16;

/// One end of the line (both ends have the same view).
#[derive(Debug)]
pub struct BelowControl {
    line: Line,
}

line_ends!(BelowControl, "below", "control of the domain below", "a tap domain");

impl BelowControl {
    /// Supervisor: asks the tap domain to start the channel below over as `generation` (the
    /// old domain below is gone), and wakes it.
    pub fn request_restart(&self, generation: u32) {
        self.line.put(WANTED, generation);
        self.line.ring();
    }

    /// Supervisor: lets a standby tap domain attach to the channel above, which the frontend
    /// has started over as `above`, and wakes it. Asked after
    /// [`request_restart`](Self::request_restart), with which a standby is let go: it starts
    /// the channel below over while the frontend starts the channel above over.
    pub fn allow_above(&self, above: u32) {
        self.line.put(ABOVE, above);
        self.line.ring();
    }

    /// Standby tap domain: the generation of the channel above it may attach to, once
    /// [allowed](Self::allow_above).
    pub fn above_allowed(&self) -> Option<u32> {
        self.line.changed(ABOVE, 0)
    }

    /// Supervisor: the generation the tap domain last reported having started over as.
    pub fn ready(&self) -> u64 {
        self.line.get(READY)
    }

    /// Tap domain: the generation asked for, if it is not `current`.
    pub fn wanted(&self, current: u32) -> Option<u32> {
        self.line.changed(WANTED, current)
    }

    /// Tap domain: reports the channel below started over as `generation`.
    pub fn report_ready(&self, generation: u32) {
        self.line.put(READY, generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_asked_for_is_seen_once_and_reported_back() {
        let sup = BelowControl::create("t").unwrap();
        let [page, wake] = sup.fds().unwrap();
        let tap = BelowControl::attach(page, wake).unwrap();
        assert_eq!(tap.wanted(1), None, "nothing asked yet");
        sup.request_restart(2);
        assert_eq!(tap.wanted(1), Some(2));
        assert_eq!(tap.wanted(2), None, "already there");
        assert_eq!(tap.line.drain(), 1, "the tap domain was woken");
        tap.report_ready(2);
        assert_eq!(sup.ready(), 2);
    }

    #[test]
    fn a_standby_tap_is_let_start_below_over_then_attach_above() {
        let sup = BelowControl::create("t").unwrap();
        let [page, wake] = sup.fds().unwrap();
        let standby = BelowControl::attach(page, wake).unwrap();
        assert_eq!(standby.above_allowed(), None, "nothing asked yet");
        sup.request_restart(9);
        assert_eq!((standby.above_allowed(), standby.wanted(8)), (None, Some(9)), "below first");
        sup.allow_above(4);
        assert_eq!(standby.above_allowed(), Some(4));
        assert_eq!(standby.line.drain(), 2, "woken each time");
    }
}
