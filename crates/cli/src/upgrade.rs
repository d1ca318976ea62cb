//! An upgrade asked for through the control socket: the call sets a flag and wakes `serve`'s
//! main loop with SIGUSR2, which then hands over to the binary now on disk.

use std::sync::atomic::{AtomicBool, Ordering};

/// Asked for by the `upgrade` call; SIGUSR2 wakes the main loop to see it.
static UPGRADE: AtomicBool = AtomicBool::new(false);

/// Starts the hand-over to a new `serve`: the main loop does it.
pub fn request() {
    UPGRADE.store(true, Ordering::Release);
    let _ = bulkhead_sys::signal(std::process::id(), signal_hook::consts::SIGUSR2);
}

/// Whether an upgrade was asked for.
pub fn requested() -> bool {
    UPGRADE.load(Ordering::Acquire)
}
