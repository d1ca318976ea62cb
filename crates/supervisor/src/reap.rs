//! Ending a domain process that will not be used.

use std::time::Duration;

use bulkhead_sandbox::spawn::DomainChild;

/// How long a restart waits for a killed domain to finish exiting before it starts the next
/// generation anyway (the old one can no longer run code; it is reaped later).
pub(crate) const EXIT_WAIT: Duration = Duration::from_millis(500);

/// Ends a domain that will not be used: kills it and reaps it, on a thread of its own if it
/// does not finish exiting at once (a killed process can take a while; see [`EXIT_WAIT`]).
pub(crate) fn discard(mut child: DomainChild) {
    let _ = child.kill();
    if let Ok(None) = child.wait_timeout(EXIT_WAIT) {
        let _ = std::thread::Builder::new().name("reap-domain".into()).spawn(move || {
            let _ = child.wait();
        });
    }
}
