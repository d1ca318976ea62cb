//! The supervisor's line to a driver domain about the tap domain above it.
//!
//! When the tap domain above a driver domain dies, the supervisor replaces it alone: the
//! driver domain keeps running, and with it the backend's connection and state. The channel
//! between the two keeps its files (the ring, and the arenas, which are those of the channel
//! above the tap domain); a new tap domain writes the ring's header afresh. The driver domain
//! must not touch the ring meanwhile, so the switch takes two steps, each a generation written
//! in a page of shared memory and a doorbell:
//!
//! 1. the supervisor reaps the old tap domain and asks the driver domain to let go of the
//!    channel for `generation` ([`request_detach`](AboveControl::request_detach));
//! 2. the driver domain finishes what it holds, answering none of it (the frontend sends it
//!    all again), stops reading the ring and says so
//!    ([`report_detached`](AboveControl::report_detached));
//! 3. the supervisor starts the frontend's queues over and the new tap domain, which writes
//!    the headers as `generation`, then tells the driver domain to take the channel again
//!    ([`request_attach`](AboveControl::request_attach));
//! 4. the driver domain attaches to every queue afresh, checking each header as at its start,
//!    and says so ([`report_attached`](AboveControl::report_attached)).
//!
//! The driver domain is untrusted: what it writes in the page only decides whether the
//! supervisor waits on or replaces it too.

use crate::line::{line_ends, Line};
use crate::ChannelError;

/// The generation the supervisor asks the driver domain to let go for.
const DETACH: usize = 0;
/// The generation the driver domain has let go for.
const DETACHED: usize = 8;
/// The generation the supervisor asks the driver domain to attach as.
const ATTACH: usize = 16;
/// The generation the driver domain has attached as.
const ATTACHED: usize = 24;

/// One end of the line (both ends have the same view).
#[derive(Debug)]
pub struct AboveControl {
    line: Line,
}

line_ends!(AboveControl, "above", "control of the domain above", "a driver domain");

impl AboveControl {
    /// Supervisor: asks the driver domain to let go of the channel above, which will start
    /// over as `generation`, and wakes it.
    pub fn request_detach(&self, generation: u32) {
        self.line.put(DETACH, generation);
        self.line.ring();
    }

    /// Supervisor: whether the driver domain has let go for `generation`.
    pub fn detached(&self, generation: u32) -> bool {
        self.line.get(DETACHED) == u64::from(generation)
    }

    /// Supervisor: tells the driver domain the channel above has started over as
    /// `generation` (its new frontend has written every header), and wakes it.
    pub fn request_attach(&self, generation: u32) {
        self.line.put(ATTACH, generation);
        self.line.ring();
    }

    /// Supervisor: whether the driver domain has attached as `generation`.
    pub fn attached(&self, generation: u32) -> bool {
        self.line.get(ATTACHED) == u64::from(generation)
    }

    /// Driver domain: the generation it is asked to let go for, if it is not `current`.
    pub fn detach_wanted(&self, current: u32) -> Option<u32> {
        self.line.changed(DETACH, current)
    }

    /// Driver domain: it has let go for `generation`.
    pub fn report_detached(&self, generation: u32) {
        self.line.put(DETACHED, generation);
    }

    /// Driver domain: whether it may attach as `generation` now.
    pub fn attach_allowed(&self, generation: u32) -> bool {
        self.line.get(ATTACH) == u64::from(generation)
    }

    /// Driver domain: it has attached as `generation`.
    pub fn report_attached(&self, generation: u32) {
        self.line.put(ATTACHED, generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_steps_are_asked_and_answered_in_turn() {
        let sup = AboveControl::create("t").unwrap();
        let [page, wake] = sup.fds().unwrap();
        let drv = AboveControl::attach(page, wake).unwrap();
        assert_eq!(drv.detach_wanted(1), None, "nothing asked yet");
        sup.request_detach(2);
        assert_eq!(drv.line.drain(), 1, "the driver domain was woken");
        assert_eq!(drv.detach_wanted(1), Some(2));
        assert!(!sup.detached(2));
        drv.report_detached(2);
        assert!(sup.detached(2));
        assert!(!drv.attach_allowed(2), "not before the supervisor says");
        sup.request_attach(2);
        assert!(drv.attach_allowed(2));
        drv.report_attached(2);
        assert!(sup.attached(2));
        assert_eq!(drv.detach_wanted(2), None, "done with");
    }
}
