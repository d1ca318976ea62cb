//! What the supervisor's threads share: the devices, the watcher's mailbox, the workers, and
//! whether `serve` is stopping. Jobs are handed to the workers from here.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use crate::device::DeviceRuntime;
use crate::lifecycle::Disposition;
use crate::mailbox::{Mailbox, Reply};
use crate::state::Clock;
use crate::workers::Workers;

/// The supervisor's shared state.
#[derive(Debug)]
pub(crate) struct Hub {
    pub devices: Vec<Arc<DeviceRuntime>>,
    pub mailbox: Arc<Mailbox>,
    pub workers: Workers,
    /// `serve` is stopping: no new generation starts.
    pub stopping: AtomicBool,
    pub clock: Arc<dyn Clock>,
}

impl Hub {
    /// Carries out `disposition` on device `device`, which the caller has claimed, on a worker
    /// (see [`crate::jobs::run`]).
    pub fn dispatch(self: &Arc<Self>, device: usize, disposition: Disposition, detected: Instant, reply: Option<Reply>) {
        let hub = self.clone();
        self.workers.submit(move || {
            let rt = &hub.devices[device];
            crate::jobs::run(rt, disposition, detected, reply, &hub.stopping);
        });
    }

    /// Tries a `reconnecting` device's launch again on a worker; the caller has claimed it.
    pub fn retry(self: &Arc<Self>, device: usize) {
        let hub = self.clone();
        self.workers.submit(move || crate::jobs::retry(&hub.devices[device], &hub.stopping));
    }
}
