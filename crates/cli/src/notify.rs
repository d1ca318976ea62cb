//! systemd's notify protocol for `serve` (`Type=notify`): READY=1 once every device is
//! exported, STATUS= lines, STOPPING=1, and WATCHDOG=1 while the supervisor answers, when
//! `WATCHDOG_USEC` asks for it. Without `NOTIFY_SOCKET` every call does nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bulkhead_control::DeviceState;
use bulkhead_supervisor::Supervisor;
use sd_notify::NotifyState;

/// Sends `states`; a service manager that cannot be reached is said once in the log.
fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        log::warn!("cannot notify the service manager: {e}");
    }
}

/// Every device is exported and the control socket answers.
pub fn ready(sup: &Supervisor) {
    send(&[NotifyState::Ready, NotifyState::Status(&summary(sup))]);
}

/// `serve` is applying its edited configuration (SIGHUP): READY=1 follows when it is done.
pub fn reloading() {
    let mut states = vec![NotifyState::Reloading, NotifyState::Status("reloading the configuration")];
    if let Ok(now) = NotifyState::monotonic_usec_now() {
        states.push(now);
    }
    send(&states);
}

/// `serve` is stopping.
pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("stopping: draining, flushing, ending domains")]);
}

/// The one-line status systemctl shows.
fn summary(sup: &Supervisor) -> String {
    let report = sup.status();
    let n = report.devices.len();
    let running = report.devices.iter().filter(|d| d.state == DeviceState::Running).count();
    let restarts: u64 = report.devices.iter().map(|d| d.restarts).sum();
    let mut s = format!("serving {running} of {n} device{}", if n == 1 { "" } else { "s" });
    if restarts > 0 {
        s.push_str(&format!("; {restarts} domain restart{}", if restarts == 1 { "" } else { "s" }));
    }
    let failed: Vec<&str> = report.devices.iter().filter(|d| d.state == DeviceState::Failed).map(|d| d.name.as_str()).collect();
    if !failed.is_empty() {
        s.push_str(&format!("; failed: {}", failed.join(", ")));
    }
    s
}

/// Pets systemd's watchdog at half its interval, for as long as the supervisor answers a
/// status (which takes each device's lock in turn: a supervisor that has locked up stops the
/// pets, and systemd restarts `serve`). The status line is refreshed at the same time.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts petting if `WATCHDOG_USEC` asks for it (`None` otherwise).
    pub fn start(sup: Arc<Supervisor>) -> Option<Watchdog> {
        let interval = sd_notify::watchdog_enabled()?;
        let every = (interval / 2).max(Duration::from_millis(10));
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    let line = summary(&sup);
                    send(&[NotifyState::Watchdog, NotifyState::Status(&line)]);
                    std::thread::park_timeout(every);
                }
            })
            .map_err(|e| log::warn!("cannot start the watchdog thread: {e}"))
            .ok()?;
        Some(Watchdog { stop, thread: Some(thread) })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}
