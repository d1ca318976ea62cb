//! Starting, watching and stopping every device's domain; the status report.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bulkhead_config::Config;
use serde::Serialize;

use crate::domain::{current_exe, DeviceRuntime};
use crate::proc_info::{self, Rss};

/// Supervisor errors.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// A device could not be started.
    #[error("device `{device}`: {message}")]
    Device {
        /// Device name.
        device: String,
        /// What failed.
        message: String,
    },
}

/// State of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    /// Its domain runs and serves.
    Running,
    /// Its domain is gone; I/O fails promptly.
    Failed,
    /// Stopped at shutdown.
    Stopped,
}

impl DeviceState {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceState::Running => "running",
            DeviceState::Failed => "failed",
            DeviceState::Stopped => "stopped",
        }
    }
}

/// Resident memory of one process.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessMemory {
    /// Process id.
    pub pid: u32,
    /// Resident memory.
    pub rss: Option<Rss>,
}

/// One device in the status report.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceStatus {
    /// Name.
    pub name: String,
    /// State.
    pub state: DeviceState,
    /// Driver-domain pid (0 if none).
    pub driver_pid: u32,
    /// Notification mode.
    pub mode: String,
    /// Backend description.
    pub backend: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Queues.
    pub queues: usize,
    /// Requests completed successfully.
    pub requests_completed: u64,
    /// Requests failed.
    pub requests_failed: u64,
    /// Domain restarts.
    pub restarts: u64,
    /// Last restart outage, ms.
    pub last_outage_ms: Option<f64>,
    /// 99th percentile restart outage, ms.
    pub p99_outage_ms: Option<f64>,
    /// Driver resident memory.
    pub driver_memory: Option<Rss>,
    /// Why the device failed.
    pub failure: Option<String>,
}

/// The whole status report.
#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    /// The `serve` process (supervisor and frontends).
    pub frontend: ProcessMemory,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Devices.
    pub devices: Vec<DeviceStatus>,
}

struct Inner {
    devices: Vec<DeviceRuntime>,
    shutting_down: AtomicBool,
}

/// The supervisor: owns every device's runtime and a watcher thread.
pub struct Supervisor {
    inner: Arc<Inner>,
    watcher: std::sync::Mutex<Option<JoinHandle<()>>>,
    started: Instant,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor").field("devices", &self.inner.devices.len()).finish()
    }
}

impl Supervisor {
    /// Starts a domain for each device of `config`, using `exe` (default: this executable).
    pub fn start(config: &Config, exe: Option<&Path>) -> Result<Self, SupervisorError> {
        let exe: PathBuf = exe.map(Path::to_path_buf).unwrap_or_else(current_exe);
        let mut devices = Vec::new();
        for d in &config.devices {
            match DeviceRuntime::start(d, &exe) {
                Ok(rt) => devices.push(rt),
                Err(e) => {
                    // Stop what was started before failing.
                    let partial = Supervisor {
                        inner: Arc::new(Inner { devices, shutting_down: AtomicBool::new(false) }),
                        watcher: std::sync::Mutex::new(None),
                        started: Instant::now(),
                    };
                    partial.shutdown();
                    return Err(e);
                }
            }
        }
        let inner = Arc::new(Inner { devices, shutting_down: AtomicBool::new(false) });
        let w = inner.clone();
        let watcher = std::thread::Builder::new().name("watcher".into()).spawn(move || watch(w)).expect("spawn watcher");
        Ok(Supervisor { inner, watcher: std::sync::Mutex::new(Some(watcher)), started: Instant::now() })
    }

    /// The devices, for the exports.
    pub fn devices(&self) -> Vec<Arc<bulkhead_client::Device>> {
        self.inner.devices.iter().map(|d| d.device.clone()).collect()
    }

    /// The current status.
    pub fn status(&self) -> StatusReport {
        let me = std::process::id();
        let devices = self
            .inner
            .devices
            .iter()
            .map(|rt| {
                let p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
                let running = p.state == DeviceState::Running;
                DeviceStatus {
                    name: rt.name.clone(),
                    state: p.state,
                    driver_pid: if running { p.pid } else { 0 },
                    mode: rt.mode.as_str().to_string(),
                    backend: rt.backend_desc.clone(),
                    size_bytes: rt.device.size(),
                    queues: rt.queues,
                    requests_completed: rt.device.counters.completed.load(Ordering::Relaxed),
                    requests_failed: rt.device.counters.failed.load(Ordering::Relaxed),
                    restarts: 0,
                    last_outage_ms: None,
                    p99_outage_ms: None,
                    driver_memory: if running { proc_info::rss(p.pid) } else { None },
                    failure: p.failure.clone(),
                }
            })
            .collect();
        StatusReport {
            frontend: ProcessMemory { pid: me, rss: proc_info::rss(me) },
            uptime_s: self.started.elapsed().as_secs_f64(),
            devices,
        }
    }

    /// Flushes every device, then ends every domain (SIGTERM, SIGKILL after 3 s). Idempotent.
    pub fn shutdown(&self) {
        if self.inner.shutting_down.swap(true, Ordering::AcqRel) {
            return;
        }
        for rt in &self.inner.devices {
            let running = rt.proc_.lock().unwrap_or_else(|e| e.into_inner()).state == DeviceState::Running;
            if running {
                if let Err(e) = rt.device.flush(0) {
                    eprintln!("bulkhead: device {}: final flush failed: {e}", rt.name);
                }
            }
            rt.device.fail("shutting down");
        }
        for rt in &self.inner.devices {
            let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(mut child) = p.child.take() {
                // SAFETY: signalling our own child by pid.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                let deadline = Instant::now() + Duration::from_secs(3);
                loop {
                    match child.try_wait() {
                        Ok(Some(_)) => break,
                        Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                        _ => {
                            eprintln!("bulkhead: device {}: driver did not stop; killing it", rt.name);
                            let _ = child.kill();
                            let _ = child.wait();
                            break;
                        }
                    }
                }
            }
            p.pidfd = None;
            p.state = DeviceState::Stopped;
        }
        let w = self.watcher.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = w {
            let _ = w.join();
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Waits on every domain's pidfd; a domain that exits while not shutting down fails its device.
fn watch(inner: Arc<Inner>) {
    while !inner.shutting_down.load(Ordering::Acquire) {
        let mut pfds = Vec::new();
        let mut idx = Vec::new();
        for (i, rt) in inner.devices.iter().enumerate() {
            let p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            if let (Some(fd), DeviceState::Running) = (&p.pidfd, p.state) {
                pfds.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                idx.push(i);
            }
        }
        // SAFETY: `pfds` is a valid array of pollfds for the call (possibly empty).
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 200) };
        if n <= 0 || inner.shutting_down.load(Ordering::Acquire) {
            continue;
        }
        for (pfd, &i) in pfds.iter().zip(&idx) {
            if pfd.revents == 0 {
                continue;
            }
            let rt = &inner.devices[i];
            let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            if inner.shutting_down.load(Ordering::Acquire) {
                break;
            }
            let status = p.child.as_mut().and_then(|c| c.wait().ok());
            let why = match status {
                Some(s) => format!("driver domain (pid {}) exited: {s}", p.pid),
                None => format!("driver domain (pid {}) exited", p.pid),
            };
            eprintln!("bulkhead: device {}: {why}; the device is failed", rt.name);
            rt.device.fail(&why);
            p.child = None;
            p.pidfd = None;
            p.state = DeviceState::Failed;
            p.failure = Some(why);
        }
    }
}
