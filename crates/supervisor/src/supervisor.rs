//! Starting, watching and stopping every device's domain; the status report.

use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bulkhead_config::Config;
use serde::Serialize;

use crate::domain::{current_exe, DeviceRuntime, DomainProc, LaunchError};
use crate::lifecycle::{Decision, Observation, Retry};
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
    /// Its remote server is gone and is being reconnected; I/O waits.
    Reconnecting,
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
            DeviceState::Reconnecting => "reconnecting",
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
    /// Pid of the driver domain, the one running the backend (0 if none).
    pub driver_pid: u32,
    /// Pid of the tap domain in `interpose` and `intercept` mode (in `intercept` it is the
    /// driver domain too: it terminates every request).
    pub tap_pid: Option<u32>,
    /// The tap domain's resident memory.
    pub tap_memory: Option<Rss>,
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
    /// The sandbox layers in force in the driver domain, as it reported them.
    pub sandbox: Option<bulkhead_sandbox::Layers>,
    /// The same for the tap domain in `interpose` and `intercept` mode.
    pub tap_sandbox: Option<bulkhead_sandbox::Layers>,
    /// Where the filters run.
    pub tap: String,
    /// The filters, frontend side first, with their figures (as the domain counted them).
    pub filters: Vec<FilterStatus>,
    /// A `vdev` device's card: its model's domain and what the model has done.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub card: Option<crate::CardStatus>,
    /// Its views (`[[device.view]]`), each exported under its own name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub views: Vec<crate::ViewStatus>,
    /// Applications attached to it or its views (`bulkhead_client::attach`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attached: Vec<crate::AttachedStatus>,
}

/// One filter in the status report.
#[derive(Debug, Clone, Serialize)]
pub struct FilterStatus {
    /// Its figures, tagged with its `type`.
    #[serde(flatten)]
    pub report: bulkhead_filters::FilterReport,
    /// The same in one line.
    pub summary: String,
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

/// A manual restart, handed to the watcher thread: domains must be spawned by a thread that
/// lives as long as they do, since PR_SET_PDEATHSIG fires when the spawning *thread* exits.
type RestartRequest = (String, DeviceChange, std::sync::mpsc::Sender<Result<u32, String>>);

/// A change to a running device. Each replaces the device's domains with a new generation
/// running the changed chain: requests in flight are reissued to it, so applications pause and
/// nothing fails (qemu's blockdev-reopen and dm's suspend and reload are the models).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceChange {
    /// The same chain, on fresh domains (`bulkhead restart`).
    Restart,
    /// Run the filters in another place (`bulkhead tap DEVICE MODE`).
    Tap(bulkhead_config::Tap),
    /// Insert a filter, described as a `[[device.filter]]` table's body, at a position
    /// (0: nearest the frontend; `None`: nearest the backend).
    AddFilter {
        /// Where.
        at: Option<usize>,
        /// The table, e.g. `type = "delay"\nread_us = 100`.
        table: String,
    },
    /// Remove the filter at a position (0: nearest the frontend).
    RemoveFilter(usize),
    /// Take, revert to or delete a snapshot of the device's `cow` overlay: the next
    /// generation carries it out as it opens, before any request (so everything acknowledged
    /// before the change is in a snapshot it takes).
    Snapshot(bulkhead_filters::cow::SnapshotOp),
}

struct Inner {
    devices: Vec<DeviceRuntime>,
    shutting_down: AtomicBool,
    requests: std::sync::Mutex<Vec<RestartRequest>>,
    wake: bulkhead_doorbell::EventFd,
}

/// The supervisor: owns every device's runtime and a watcher thread.
pub struct Supervisor {
    inner: Arc<Inner>,
    watcher: std::sync::Mutex<Option<JoinHandle<()>>>,
    started: Instant,
    stopping: AtomicBool,
    /// Sequence numbers of snapshot operations.
    snapshot_seq: std::sync::atomic::AtomicU64,
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
        for (i, d) in config.devices.iter().enumerate() {
            match DeviceRuntime::start(d, i as u32, &exe) {
                Ok(rt) => devices.push(rt),
                Err(e) => {
                    // Stop what was started before failing.
                    let partial = Supervisor {
                        inner: Arc::new(Inner::new(devices)),
                        watcher: std::sync::Mutex::new(None),
                        started: Instant::now(),
                        stopping: AtomicBool::new(false),
                        snapshot_seq: std::sync::atomic::AtomicU64::new(0),
                    };
                    partial.shutdown();
                    return Err(e);
                }
            }
        }
        let inner = Arc::new(Inner::new(devices));
        let w = inner.clone();
        let watcher = std::thread::Builder::new().name("watcher".into()).spawn(move || watch(w)).expect("spawn watcher");
        Ok(Supervisor {
            inner,
            watcher: std::sync::Mutex::new(Some(watcher)),
            started: Instant::now(),
            stopping: AtomicBool::new(false),
            snapshot_seq: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The devices, for the exports.
    pub fn devices(&self) -> Vec<Arc<bulkhead_client::Device>> {
        self.inner
            .devices
            .iter()
            .flat_map(|d| std::iter::once(d.device.clone()).chain(d.views.iter().map(|v| v.device.clone())))
            .collect()
    }

    /// Changes the QoS of the running view `view`: `changes` are `key=value` settings of
    /// [`bulkhead_qos::KEYS`] applied over its current caps. The domain takes them on its
    /// next look at the view; a restarted domain keeps them. Returns the caps now in force.
    pub fn set_qos(&self, view: &str, changes: &[(String, String)]) -> Result<bulkhead_qos::Caps, String> {
        let (rt, v) = self
            .inner
            .devices
            .iter()
            .find_map(|d| d.views.iter().find(|v| v.name == view).map(|v| (d, v)))
            .ok_or_else(|| format!("no view `{view}`"))?;
        let mut caps = v.caps();
        for (k, val) in changes {
            caps.set(k, val)?;
        }
        let caps = caps.with_default_bursts();
        v.set_caps(caps, &rt.state)?;
        eprintln!("bulkhead: view {view}: QoS now {caps}");
        Ok(caps)
    }

    /// Serves an application's request to attach (`bulkhead_client::attach`) on its control
    /// connection `conn`: offers the geometry, checks the queues it sends, adds them to the
    /// domain, and keeps them there across restarts until the application hangs up, then
    /// takes them out. Returns when it has.
    pub fn attach_session(&self, mut conn: std::os::unix::net::UnixStream, req: &serde_json::Value) {
        use bulkhead_client::attach::wire::{AttachRequest, FromApp, FromServe};
        let tell = |conn: &mut std::os::unix::net::UnixStream, msg: &FromServe| {
            let mut line = serde_json::to_vec(msg).expect("message serialises");
            line.push(b'\n');
            std::io::Write::write_all(conn, &line)
        };
        let refuse = |conn: &mut std::os::unix::net::UnixStream, why: String| {
            let _ = tell(conn, &FromServe::Error(why));
        };
        let ask: AttachRequest = match serde_json::from_value(req.clone()) {
            Ok(a) => a,
            Err(e) => return refuse(&mut conn, format!("bad attach request: {e}")),
        };
        let found = self.inner.devices.iter().find_map(|d| {
            if d.name == ask.name {
                return Some((d, None));
            }
            d.views.iter().position(|v| v.name == ask.name).map(|i| (d, Some(i as u32)))
        });
        let Some((rt, view)) = found else {
            return refuse(&mut conn, format!("no device or view `{}`", ask.name));
        };
        if rt.proc_.lock().unwrap_or_else(|e| e.into_inner()).interposed() {
            return refuse(
                &mut conn,
                format!("{}: attaching needs tap = \"passthrough\" or \"intercept\" (this device interposes)", ask.name),
            );
        }
        if !(1..=bulkhead_config::MAX_ATTACH).contains(&ask.queues) {
            return refuse(&mut conn, format!("{}: {} queues asked (1..={})", ask.name, ask.queues, bulkhead_config::MAX_ATTACH));
        }
        let free = rt.attach.free(view);
        if free < ask.queues as usize {
            return refuse(
                &mut conn,
                format!("{}: {free} attach slot(s) free, {} asked (its `attach` key sets how many)", ask.name, ask.queues),
            );
        }
        let dev = match view {
            None => &rt.device,
            Some(i) => &rt.views[i as usize].device,
        };
        let qcfg = rt.launcher.queue_config();
        let offer = crate::attach::offer(dev.size(), &qcfg, dev.read_only(), dev.min_block());
        if tell(&mut conn, &FromServe::Offer(offer)).is_err() {
            return;
        }
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let mut buf = [0u8; 256];
        let (n, fds) = match bulkhead_sys::recv_with_fds(std::os::fd::AsFd::as_fd(&conn), &mut buf, true) {
            Ok(Some((n, fds))) if n > 0 => (n, fds),
            _ => return,
        };
        let count = match serde_json::from_slice::<FromApp>(buf[..n].trim_ascii_end()) {
            Ok(FromApp::Queues { count }) if count == ask.queues => count,
            Ok(other) => return refuse(&mut conn, format!("expected the {} queue(s) asked, got {other:?}", ask.queues)),
            Err(e) => return refuse(&mut conn, format!("bad message: {e}")),
        };
        let queues = match crate::attach::queues_from(fds, count) {
            Ok(q) => q,
            Err(e) => return refuse(&mut conn, e),
        };
        for (i, q) in queues.iter().enumerate() {
            if let Err(e) = crate::attach::check_queue(q, qcfg.nslots, qcfg.arena_bytes as u64) {
                return refuse(&mut conn, format!("queue {i}: {e}"));
            }
        }
        let joined = {
            let _one_at_a_time = rt.restart_lock.lock().unwrap_or_else(|e| e.into_inner());
            rt.attach.join(&ask.name, view, &conn, queues)
        };
        let (id, session) = match joined {
            Ok(j) => j,
            Err(e) => return refuse(&mut conn, e),
        };
        let slots = session.slots();
        eprintln!("bulkhead: {}: attached pid {} ({} queue(s))", ask.name, session_pid(&conn), count);
        if tell(&mut conn, &FromServe::Attached { slots }).is_ok() {
            crate::attach::listen(conn, &session);
        }
        let _one_at_a_time = rt.restart_lock.lock().unwrap_or_else(|e| e.into_inner());
        rt.attach.leave(id);
        eprintln!("bulkhead: {}: detached", ask.name);
    }

    /// Every outage of device `name` measured so far, ms (empty for an unknown device).
    pub fn outages_ms(&self, name: &str) -> Vec<f64> {
        self.inner.devices.iter().find(|d| d.name == name).map(|d| d.control.outages_ms()).unwrap_or_default()
    }

    /// The current status.
    pub fn status(&self) -> StatusReport {
        let me = std::process::id();
        let devices = self
            .inner
            .devices
            .iter()
            .map(|rt| {
                let outages = rt.control.outages_ms();
                let p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
                let chain = rt.launcher.chain.lock().unwrap_or_else(|e| e.into_inner());
                let running = p.life.state() == DeviceState::Running;
                DeviceStatus {
                    name: rt.name.clone(),
                    state: p.life.state(),
                    driver_pid: if running { p.driver_pid() } else { 0 },
                    tap_pid: (running && p.tap).then_some(p.pid),
                    tap_memory: if running && p.tap { proc_info::rss(p.pid) } else { None },
                    mode: rt.mode.as_str().to_string(),
                    backend: rt.backend_desc.clone(),
                    size_bytes: rt.device.size(),
                    queues: rt.queues,
                    requests_completed: rt.device.counters.completed.load(Ordering::Relaxed),
                    requests_failed: rt.device.counters.failed.load(Ordering::Relaxed),
                    restarts: p.life.restarts(),
                    last_outage_ms: outages.last().copied(),
                    p99_outage_ms: p99(&outages),
                    driver_memory: if running { proc_info::rss(p.driver_pid()) } else { None },
                    failure: p.life.failure().map(String::from),
                    sandbox: match (&p.lower, running) {
                        (_, false) => None,
                        (Some(l), true) => l.layers.clone(),
                        (None, true) => p.layers.clone(),
                    },
                    tap_sandbox: if running && p.tap { p.layers.clone() } else { None },
                    tap: chain.tap.as_str().to_string(),
                    filters: chain
                        .filters
                        .iter()
                        .map(|f| {
                            let report = bulkhead_filters::FilterReport::read(&f.spec, &f.page);
                            FilterStatus { summary: report.summary(), report }
                        })
                        .collect(),
                    card: rt.launcher.card.as_ref().map(|c| c.status()),
                    views: rt.views.iter().map(|v| v.status(&rt.state)).collect(),
                    attached: rt.attach.status(),
                }
            })
            .collect();
        StatusReport {
            frontend: ProcessMemory { pid: me, rss: proc_info::rss(me) },
            uptime_s: self.started.elapsed().as_secs_f64(),
            devices,
        }
    }

    /// Restarts a device's domain on demand (also a failed one: its restart history is
    /// cleared). Returns the new driver pid.
    pub fn restart_device(&self, name: &str) -> Result<u32, String> {
        self.change_device(name, DeviceChange::Restart)
    }

    /// The snapshots of device `name`'s `cow` overlay, read from the overlay's snapshot table
    /// (display only: the table is checked as untrusted input).
    pub fn snapshots(&self, name: &str) -> Result<Vec<bulkhead_image::snapshot::SnapshotInfo>, String> {
        let rt = self.inner.devices.iter().find(|d| d.name == name).ok_or_else(|| format!("no device `{name}`"))?;
        let path = {
            let chain = rt.launcher.chain.lock().unwrap_or_else(|e| e.into_inner());
            let cow = chain.filters.iter().find(|f| matches!(f.spec, bulkhead_filters::FilterSpec::Cow { .. }));
            cow.and_then(|f| f.overlay.clone()).ok_or("the device has no cow filter")?
        };
        let f = std::fs::File::open(&path).map_err(|e| format!("overlay {}: {e}", path.display()))?;
        bulkhead_image::snapshot::list(&f).map_err(|e| format!("overlay {}: {e}", path.display()))
    }

    /// Takes, reverts to or deletes snapshot `snap` of device `name` (see
    /// [`DeviceChange::Snapshot`]); waits until the new generation has carried it out. A revert
    /// needs the device idle: it is refused while requests are in flight or completing.
    pub fn snapshot(&self, name: &str, action: bulkhead_filters::cow::SnapshotAction, snap: &str) -> Result<u32, String> {
        use bulkhead_filters::cow::{OpResult, SnapshotAction, SnapshotOp};
        bulkhead_image::snapshot::check_name(snap).map_err(|e| e.to_string())?;
        let existing = self.snapshots(name)?;
        let exists = existing.iter().any(|s| s.name == snap);
        match action {
            SnapshotAction::Create if exists => return Err(format!("a snapshot named `{snap}` exists already")),
            SnapshotAction::Revert | SnapshotAction::Delete if !exists => return Err(format!("no snapshot named `{snap}`")),
            _ => {}
        }
        let rt = self.inner.devices.iter().find(|d| d.name == name).ok_or_else(|| format!("no device `{name}`"))?;
        if action == SnapshotAction::Revert {
            let before = rt.device.counters.completed.load(Ordering::Relaxed) + rt.device.counters.failed.load(Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(250));
            let after = rt.device.counters.completed.load(Ordering::Relaxed) + rt.device.counters.failed.load(Ordering::Relaxed);
            let in_flight = rt.device.in_flight();
            if in_flight > 0 || after != before {
                return Err(format!(
                    "the device is busy ({in_flight} requests in flight, {} completed in the last 250 ms): a revert changes \
                     everything under its users; stop its I/O (unmount its file system) and retry",
                    after - before
                ));
            }
        }
        let seq = self.snapshot_seq.fetch_add(1, Ordering::Relaxed) + 1;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let date = (u32::try_from(now.as_secs()).unwrap_or(u32::MAX), now.subsec_nanos());
        let op = SnapshotOp { seq, action, name: snap.to_string(), date };
        let pid = self.change_device(name, DeviceChange::Snapshot(op))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let result = {
                let chain = rt.launcher.chain.lock().unwrap_or_else(|e| e.into_inner());
                let cow = chain.filters.iter().find(|f| matches!(f.spec, bulkhead_filters::FilterSpec::Cow { .. }));
                cow.and_then(|f| bulkhead_filters::cow::op_result(&f.page, seq))
            };
            match result {
                Some(OpResult::Done) => return Ok(pid),
                Some(OpResult::NotFound) => return Err(format!("no snapshot named `{snap}`")),
                Some(OpResult::Exists) => return Err(format!("a snapshot named `{snap}` exists already")),
                Some(OpResult::Failed) => {
                    return Err(format!(
                        "the driver domain could not {} snapshot `{snap}`; its log line (`cow: snapshot …`) says why",
                        action.as_str()
                    ))
                }
                None if Instant::now() > deadline => {
                    return Err("the driver domain did not carry the snapshot out in 60 s".into())
                }
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Changes a running device (see [`DeviceChange`]) and starts its next generation;
    /// returns the new driver pid. A change that is not valid is refused, saying why, and the
    /// device runs on as it was.
    pub fn change_device(&self, name: &str, change: DeviceChange) -> Result<u32, String> {
        if !self.inner.devices.iter().any(|d| d.name == name) {
            return Err(format!("no device `{name}`"));
        }
        if self.inner.shutting_down.load(Ordering::Acquire) {
            return Err("shutting down".into());
        }
        let (tx, rx) = std::sync::mpsc::channel();
        self.inner.requests.lock().unwrap_or_else(|e| e.into_inner()).push((name.to_string(), change, tx));
        self.inner.wake.ring();
        rx.recv_timeout(Duration::from_secs(30)).map_err(|_| "the supervisor did not answer".to_string())?
    }

    /// Flushes every device, then ends every domain (SIGTERM, SIGKILL after 3 s). Idempotent.
    ///
    /// The flushes run while the watcher still works, so a domain that dies during them is
    /// restarted and the flush completes on the next generation; each is bounded by 5 s.
    pub fn shutdown(&self) {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut flushes = Vec::new();
        for rt in &self.inner.devices {
            if rt.proc_.lock().unwrap_or_else(|e| e.into_inner()).life.state() != DeviceState::Running {
                continue;
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let dev = rt.device.clone();
            std::thread::spawn(move || {
                let _ = tx.send(dev.flush(0));
            });
            flushes.push((rt.name.clone(), rx));
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (name, rx) in flushes {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("bulkhead: device {name}: final flush failed: {e}"),
                Err(_) => {
                    eprintln!("bulkhead: device {name}: final flush did not complete within 5 s")
                }
            }
        }
        self.inner.shutting_down.store(true, Ordering::Release);
        let w = self.watcher.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = w {
            let _ = w.join();
        }
        for rt in &self.inner.devices {
            // Releases any caller still waiting (their requests fail with EIO).
            rt.control.fail("shutting down");
        }
        for rt in &self.inner.devices {
            let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(mut child) = p.child.take() {
                let _ = child.signal(libc::SIGTERM);
                let deadline = Instant::now() + Duration::from_secs(3);
                loop {
                    match child.try_wait() {
                        Ok(Some(_)) => break,
                        Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                        _ => {
                            eprintln!("bulkhead: device {}: driver did not stop; killing it", rt.name);
                            p.child = Some(child);
                            p.kill_current(&rt.name);
                            break;
                        }
                    }
                }
            }
            for c in &mut p.lingering {
                let _ = c.wait_timeout(Duration::from_secs(1));
            }
            p.reap_lingering();
            p.pidfd = None;
            p.life.stopped();
            drop(p);
            // The card's model goes last: its driver is gone.
            if let Some(card) = &rt.launcher.card {
                card.stop_model(Duration::from_secs(3));
            }
        }
        // The domains' last words reach the log before serve exits.
        crate::domain_log::finish_all(Duration::from_secs(1));
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Inner {
    fn new(devices: Vec<DeviceRuntime>) -> Self {
        Inner {
            devices,
            shutting_down: AtomicBool::new(false),
            requests: std::sync::Mutex::new(Vec::new()),
            wake: bulkhead_doorbell::EventFd::new().expect("eventfd"),
        }
    }
}

fn p99(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    Some(s[((s.len() as f64 * 0.99).ceil() as usize).clamp(1, s.len()) - 1])
}

/// What the watcher sees of a device now.
fn observe(rt: &DeviceRuntime) -> Observation {
    Observation {
        answered: rt.control.answered(),
        pending: rt.control.in_flight(),
        heartbeat: rt.state.get(bulkhead_spec::state_slots::HEARTBEAT),
        held: rt.state.get(bulkhead_spec::state_slots::HELD),
        beat: rt.state.get(bulkhead_spec::state_slots::LOOP),
        attached: rt.attach.attached(),
    }
}

/// Restarts the watchdog's clock of a device that just got a new generation.
fn progress_seen(rt: &DeviceRuntime) {
    let obs = observe(rt);
    rt.proc_.lock().unwrap_or_else(|e| e.into_inner()).life.progress_seen(Instant::now(), obs);
}

/// Descriptors the watcher polls for each device: its top domain's pidfd, the pidfd of the
/// domain below it, its device model's pidfd (`vdev`), and its alarm.
const PER_DEVICE: usize = 4;

/// Watches every domain: death (pidfd), a broken channel (the device's alarm), and no progress
/// with requests pending (the watchdog). Any of them restarts the domain.
fn watch(inner: Arc<Inner>) {
    for rt in &inner.devices {
        progress_seen(rt);
    }
    while !inner.shutting_down.load(Ordering::Acquire) {
        let mut pfds = Vec::new();
        let mut polled_pids = Vec::new();
        for rt in &inner.devices {
            let p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            let running = p.life.state() == DeviceState::Running;
            let mut pidfd = |fd: Option<&std::os::fd::OwnedFd>| match (fd, running) {
                (Some(fd), true) => pfds.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }),
                _ => pfds.push(libc::pollfd { fd: -1, events: 0, revents: 0 }),
            };
            pidfd(p.pidfd.as_ref());
            pidfd(p.lower.as_ref().map(|l| &l.pidfd));
            let model = rt.launcher.card.as_ref().and_then(|c| c.model_pidfd()).filter(|_| running);
            pfds.push(libc::pollfd { fd: model.unwrap_or(-1), events: libc::POLLIN, revents: 0 });
            polled_pids.push(if running && p.pidfd.is_some() { p.pid } else { 0 });
            pfds.push(libc::pollfd { fd: rt.control.alarm_fd(), events: libc::POLLIN, revents: 0 });
            for v in &rt.views {
                v.sample();
            }
        }
        pfds.push(libc::pollfd { fd: inner.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        // A failed wait is a short one: the loop looks again.
        let _ = bulkhead_sys::poll(&mut pfds, 10);
        if inner.shutting_down.load(Ordering::Acquire) {
            break;
        }
        inner.wake.drain();
        let requests = std::mem::take(&mut *inner.requests.lock().unwrap_or_else(|e| e.into_inner()));
        for (name, change, reply) in requests {
            let Some(rt) = inner.devices.iter().find(|d| d.name == name) else {
                continue;
            };
            let why = match rt.change_chain(&change) {
                Ok(why) => why,
                Err(e) => {
                    let _ = reply.send(Err(e));
                    continue;
                }
            };
            let tap_alone = {
                let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
                p.life.reset();
                // A filter inserted or removed in a tap domain of its own changes that domain
                // alone: the driver domain below runs on.
                let filters = matches!(change, DeviceChange::AddFilter { .. } | DeviceChange::RemoveFilter(_));
                filters && p.interposed() && p.life.state() == DeviceState::Running
            };
            if tap_alone {
                replace_alone(rt, Domain::Top, &why, Instant::now(), &inner.shutting_down);
            } else {
                restart(rt, &why, Instant::now(), &inner.shutting_down);
            }
            progress_seen(rt);
            let p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            let _ = reply.send(match p.life.state() {
                DeviceState::Running => Ok(p.driver_pid()),
                _ => Err(p.life.failure().unwrap_or("restart failed").to_string()),
            });
        }
        let now = Instant::now();
        for (i, rt) in inner.devices.iter().enumerate() {
            {
                let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
                if !p.lingering.is_empty() {
                    p.reap_lingering();
                }
            }
            let retry = rt.proc_.lock().unwrap_or_else(|e| e.into_inner()).life.retry_due(now);
            if retry {
                let _one_at_a_time = rt.restart_lock.lock().unwrap_or_else(|e| e.into_inner());
                relaunch(rt, "remote server still unreachable", &inner.shutting_down);
                progress_seen(rt);
                continue;
            }
            let model_died = pfds[PER_DEVICE * i + 2].revents != 0;
            if model_died {
                if let Some(why) = rt.launcher.card.as_ref().and_then(|c| c.model_exited()) {
                    // The driver's card is gone: the device restarts, and its next launch
                    // starts a new model over the same storage before the new driver.
                    let running = rt.proc_.lock().unwrap_or_else(|e| e.into_inner()).life.state() == DeviceState::Running;
                    if running && !inner.shutting_down.load(Ordering::Acquire) {
                        restart(rt, &why, now, &inner.shutting_down);
                        progress_seen(rt);
                        continue;
                    }
                }
            }
            let died = pfds[PER_DEVICE * i].revents != 0 || pfds[PER_DEVICE * i + 1].revents != 0;
            let broken = rt.control.take_broken_report();
            let mut why = None;
            // Whether what happened concerns the tap domain of an `interpose` device alone: it
            // is then replaced alone, over the driver domain that stays.
            let tap_alone;
            // The pidfd polled may belong to a domain a concurrent restart already replaced:
            // act only if the process polled is still the device's, and has really exited.
            let exited = died.then(|| {
                let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
                if p.pid != polled_pids[i] {
                    return None;
                }
                let role = if p.tap { "tap" } else { "driver" };
                if let Some(status) = p.child.as_mut()?.try_wait().ok().flatten() {
                    p.child = None;
                    p.pidfd = None;
                    if status.code() == Some(crate::LOST_EXIT as i32) {
                        // The domain below broke the channel or vanished: both go.
                        let what = if p.lower.is_some() {
                            "the driver domain below it"
                        } else if rt.launcher.reconnect_timeout().is_some() {
                            "its remote server"
                        } else {
                            "its backend (it said why above)"
                        };
                        return Some((format!("{role} domain (pid {}) lost {what}", p.pid), Some(Domain::Both)));
                    }
                    if status.code() == Some(crate::GUARD_EXIT as i32) {
                        // Write capture stopped a filter's write before it landed; the domain
                        // said which above. Its state is intact; it restarts like any other.
                        let e = format!("{role} domain (pid {}) stopped a guarded filter's write (reported above)", p.pid);
                        return Some((e, Some(Domain::Top)));
                    }
                    return Some((format!("{role} domain (pid {}) exited: {status}", p.pid), Some(Domain::Top)));
                }
                let lower = p.lower.as_mut()?;
                let status = lower.child.try_wait().ok()??;
                let pid = lower.child.id();
                p.retire_lower();
                Some((format!("driver domain (pid {pid}) below the tap domain exited: {status}"), Some(Domain::Below)))
            });
            if let Some(Some((e, which))) = exited {
                if which == Some(Domain::Below) && !inner.shutting_down.load(Ordering::Acquire) {
                    // The tap domain lives on: replace the domain below alone.
                    replace_alone(rt, Domain::Below, &e, now, &inner.shutting_down);
                    progress_seen(rt);
                    continue;
                }
                tap_alone = which == Some(Domain::Top);
                why = Some(e);
            } else if broken {
                let p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
                let role = if p.tap { "tap" } else { "driver" };
                why = Some(format!("{role} domain (pid {}) broke the channel protocol", p.pid));
                tap_alone = true;
            } else {
                let obs = observe(rt);
                let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
                // A domain that is exiting has released its memory before its pidfd says so: it
                // is as good as dead. It may never finish on its own if what the kernel finishes
                // for it goes through this very device (a filesystem its mount namespace held a
                // copy of, which `bulkhead_sandbox::mounts` now lets go of when it confines
                // itself), and only its successor lets that end. Looked for only once answers
                // have stopped.
                let quiet = p.life.quiet_for(now) >= EXIT_CHECK_AFTER;
                if obs.pending > 0 && quiet && p.life.state() == DeviceState::Running {
                    let below = p.lower.as_ref().map(|l| l.child.id()).filter(|&pid| proc_info::memory_released(pid));
                    if let Some(pid) = below {
                        let child = p.retire_lower();
                        p.lingering.extend(child);
                        drop(p);
                        let e = format!("driver domain (pid {pid}) below the tap domain is exiting (its memory released)");
                        replace_alone(rt, Domain::Below, &e, now, &inner.shutting_down);
                        progress_seen(rt);
                        continue;
                    }
                    if p.child.is_some() && proc_info::memory_released(p.pid) {
                        let role = if p.tap { "tap" } else { "driver" };
                        why = Some(format!("{role} domain (pid {}) is exiting (its memory released)", p.pid));
                    }
                }
                if why.is_none() && p.life.state() == DeviceState::Running {
                    if let Some(wedged) = p.life.watch(now, obs) {
                        // A tap domain waiting on a wedged domain below is silent too: replaced
                        // alone first, the one below must let go of its queues in time, or both
                        // are replaced.
                        let role = if p.tap { "tap" } else { "driver" };
                        why = Some(format!("{role} domain (pid {}) {wedged}", p.pid));
                    }
                }
                tap_alone = why.is_some();
            }
            if let Some(why) = why {
                let p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
                if p.life.state() != DeviceState::Running {
                    continue;
                }
                let tap_alone = tap_alone && p.interposed();
                drop(p);
                if tap_alone && !inner.shutting_down.load(Ordering::Acquire) {
                    replace_alone(rt, Domain::Top, &why, now, &inner.shutting_down);
                } else {
                    restart(rt, &why, now, &inner.shutting_down);
                }
                progress_seen(rt);
            }
        }
    }
}

/// The process at the other end of `conn` (0 if the socket cannot say).
fn session_pid(conn: &std::os::unix::net::UnixStream) -> i32 {
    bulkhead_sys::peer_credentials(std::os::fd::AsFd::as_fd(conn)).map_or(0, |(pid, _)| pid)
}

/// Replaces a device's domain: kills what is left of the old one, launches the next generation
/// with the same backend descriptors and hands its queues to the frontend, which reissues every
/// request that had no response. Crash loops back off exponentially; past the restart limit
/// the device turns failed.
pub(crate) fn restart(rt: &DeviceRuntime, why: &str, detected: Instant, shutting_down: &AtomicBool) {
    let _one_at_a_time = rt.restart_lock.lock().unwrap_or_else(|e| e.into_inner());
    rt.control.outage_started(detected);
    let delay = {
        let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
        p.kill_current(&rt.name);
        p.pidfd = None;
        match p.life.on_failure(why, detected, rt.control.answered()) {
            Decision::Restart { delay } => delay,
            Decision::Fail { reason } => {
                drop(p);
                eprintln!("bulkhead: device {}: {reason}", rt.name);
                rt.control.fail(&reason);
                rt.attach.fail(&reason);
                return;
            }
        }
    };
    // A driver that breaks every generation restarts many times a second: rate-limited.
    rt.control.log_limited(|| format!("{why}; restarting"));
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
    if shutting_down.load(Ordering::Acquire) {
        return;
    }
    relaunch(rt, why, shutting_down);
}

/// How long a device with requests pending must have answered nothing before the watcher
/// looks whether its domains are exiting (a look reads /proc for each of their threads).
const EXIT_CHECK_AFTER: Duration = Duration::from_millis(5);

/// How long each step of replacing one domain of an `interpose` device alone may take: the tap
/// domain starting its channel below over, or the driver domain below letting go of its queues
/// and attaching again, and the frontend's users starting theirs over. Past it, both domains
/// are replaced.
const SWITCH_STEP: Duration = Duration::from_secs(1);

/// Which of an `interpose` device's domains an event concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Domain {
    /// The domain the frontend reaches (the tap domain).
    Top,
    /// The driver domain below the tap domain.
    Below,
    /// Both: what happened says nothing about which is at fault.
    Both,
}

/// Replaces one domain of an `interpose` device alone, the other running on (see
/// [`replace_below`] and [`replace_tap`]). Counts against the restart limit like any restart;
/// if the other domain does not follow, or a step fails, both are replaced together.
fn replace_alone(rt: &DeviceRuntime, which: Domain, why: &str, detected: Instant, shutting_down: &AtomicBool) {
    let fallback = {
        let _one_at_a_time = rt.restart_lock.lock().unwrap_or_else(|e| e.into_inner());
        let done = match which {
            Domain::Top => replace_tap(rt, why, detected),
            Domain::Below => replace_below(rt, why, detected),
            Domain::Both => Err(Some(why.to_string())),
        };
        match done {
            Ok(()) => return,
            Err(fallback) => fallback,
        }
    };
    if let Some(fallback) = fallback {
        restart(rt, &fallback, detected, shutting_down);
    }
}

/// Counts a restart of one domain of an `interpose` device against the restart limit, logging
/// `why` with what happens to the other; waits out the crash-loop backoff. `Err(None)`: past
/// the limit, both domains were killed and the device failed.
fn count_restart<'a>(
    rt: &'a DeviceRuntime,
    mut p: MutexGuard<'a, DomainProc>,
    why: &str,
    detected: Instant,
    answered: u64,
    other: &str,
) -> Result<MutexGuard<'a, DomainProc>, Option<String>> {
    match p.life.on_failure(why, detected, answered) {
        Decision::Restart { delay } => {
            rt.control.log_limited(|| format!("{why}; replacing it ({other} runs on)"));
            if !delay.is_zero() {
                drop(p);
                std::thread::sleep(delay);
                p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            }
            Ok(p)
        }
        Decision::Fail { reason } => {
            p.kill_current(&rt.name);
            drop(p);
            eprintln!("bulkhead: device {}: {reason}", rt.name);
            rt.control.fail(&reason);
            rt.attach.fail(&reason);
            Err(None)
        }
    }
}

/// Waits up to [`SWITCH_STEP`] for `done`, while the process behind `pidfd` lives; says what
/// went wrong otherwise.
fn await_domain(pidfd: Option<RawFd>, mut done: impl FnMut() -> bool) -> Result<(), &'static str> {
    let deadline = Instant::now() + SWITCH_STEP;
    while !done() {
        let dead = pidfd.is_none_or(|fd| {
            let mut pfd = [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }];
            bulkhead_sys::poll(&mut pfd, 0).is_ok_and(|n| n > 0)
        });
        if dead {
            return Err("died");
        }
        if Instant::now() >= deadline {
            return Err("did not follow in time");
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(())
}

/// Replaces the driver domain below a tap domain, which has exited, leaving the tap domain
/// running: the tap domain starts the channel below over as the next generation and sends
/// again what had no answer, and a new driver domain attaches to the same queues. The frontend
/// above sees a pause, not a reissue. Runs under the device's restart lock. `Err(Some(why))`:
/// restart the whole device for `why`; `Err(None)`: the device failed (restart limit).
fn replace_below(rt: &DeviceRuntime, why: &str, detected: Instant) -> Result<(), Option<String>> {
    let answered = rt.control.answered();
    let p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
    if p.below.is_none() || p.life.state() != DeviceState::Running {
        return Err(Some(why.to_string()));
    }
    rt.control.time_outage(detected);
    let mut p = count_restart(rt, p, why, detected, answered, "the tap domain")?;
    let (tap_pid, tap_pidfd) = (p.pid, p.pidfd.as_ref().map(|fd| fd.as_raw_fd()));
    let below = p.below.as_mut().expect("checked above");
    let generation = below.generation.wrapping_add(1).max(1);
    below.control.request_restart(generation);
    below.wake_tap();
    // The tap domain starts its queues below over and says so; if it dies meanwhile, or says
    // nothing in time, both domains are replaced.
    await_domain(tap_pidfd, || below.control.ready() == u64::from(generation))
        .map_err(|e| Some(format!("{why}; the tap domain (pid {tap_pid}) {e}")))?;
    below.generation = generation;
    // A fresh line for the new domain below: nothing the old one wrote there can mislead it.
    below.driver_line = rt.launcher.driver_line().map_err(|e| Some(format!("{why}; {e}")))?;
    p.drain_retired(&rt.name);
    let below = p.below.as_mut().expect("checked above");
    let lower = rt
        .launcher
        .spawn_below(below, None)
        .map_err(|e| Some(format!("{why}; a new driver domain below could not start: {e}")))?;
    p.lower = Some(lower);
    p.life.on_launched(Instant::now(), answered);
    drop(p);
    rt.control.outage_over_if_idle();
    Ok(())
}

/// Replaces the tap domain of an `interpose` device, which has exited, wedged or broken the
/// channel (or whose filters changed), leaving the driver domain below it running: the driver
/// domain lets go of the channel between them, the frontend starts its queues over in place
/// and sends again what had no answer, a new tap domain attaches to both channels, and the
/// driver domain attaches again. The backend's state (a remote connection, a file's cache)
/// stays. Runs under the device's restart lock; errors as [`replace_below`]'s.
fn replace_tap(rt: &DeviceRuntime, why: &str, detected: Instant) -> Result<(), Option<String>> {
    rt.control.outage_started(detected);
    let answered = rt.control.answered();
    let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
    if !p.interposed() || p.life.state() != DeviceState::Running {
        return Err(Some(why.to_string()));
    }
    p.kill_top(&rt.name);
    let mut p = count_restart(rt, p, why, detected, answered, "the driver domain below")?;
    let driver = p.lower.as_ref().map(|l| (l.child.id(), l.pidfd.as_raw_fd())).expect("interposed");
    let failed = |what: &str| Some(format!("{why}; the driver domain below (pid {}) {what}", driver.0));
    let below = p.below.as_mut().expect("interposed");
    let generation = below.generation.wrapping_add(1).max(1);
    // The driver domain lets go of the channel between the two, finishing what it holds.
    below.driver_line.request_detach(generation);
    await_domain(Some(driver.1), || below.driver_line.detached(generation)).map_err(&failed)?;
    below.generation = generation;
    // The frontend's queues start over on the same files: the driver domain maps their arenas.
    let above = rt.device.generation().wrapping_add(1).max(1);
    rt.control.start_over_in_place(above, SWITCH_STEP).map_err(|e| Some(format!("{why}; {e}")))?;
    // A fresh line for the new tap domain: nothing the old one wrote there can mislead it.
    below.control = rt.launcher.tap_line().map_err(|e| Some(format!("{why}; {e}")))?;
    let top = {
        let chain = rt.launcher.chain.lock().unwrap_or_else(|e| e.into_inner());
        rt.launcher.spawn_tap(below, &chain).map_err(|e| Some(format!("{why}; a new tap domain could not start: {e}")))?
    };
    // It has attached above and written the headers below: the driver domain attaches again.
    p.install_top(top);
    let below = p.below.as_ref().expect("interposed");
    below.driver_line.request_attach(generation);
    await_domain(Some(driver.1), || below.driver_line.attached(generation)).map_err(&failed)?;
    p.life.on_launched(Instant::now(), answered);
    drop(p);
    rt.control.outage_over_if_idle();
    Ok(())
}

/// Launches the next generation of a device's domain (the caller holds its restart lock). A
/// remote server that cannot be reached is retried with backoff, the device `reconnecting`,
/// until its reconnect timeout; any other failure turns the device failed.
fn relaunch(rt: &DeviceRuntime, why: &str, shutting_down: &AtomicBool) {
    if shutting_down.load(Ordering::Acquire) {
        return;
    }
    let generation = rt.device.generation().wrapping_add(1);
    let answered = rt.control.answered();
    let outcome = match rt.launcher.launch(generation) {
        Ok(mut l) => {
            let line = l.top.attach_line.take();
            let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(down) = p.life.on_launched(Instant::now(), answered) {
                eprintln!("bulkhead: device {}: reconnected after {} ms", rt.name, down.as_millis());
            }
            p.install(l.top, l.lower, l.below);
            drop(p);
            rt.control.install_generation(l.fronts);
            // Attached applications start their queues over, and the new domain takes them.
            rt.attach.rejoin(line);
            return;
        }
        Err(LaunchError::Connect(e)) if rt.launcher.reconnect_timeout().is_some() => {
            let timeout = rt.launcher.reconnect_timeout();
            let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            (p.life.on_launch_failed(why, &e, timeout, Instant::now()), e)
        }
        Err(e) => {
            let e = e.to_string();
            let mut p = rt.proc_.lock().unwrap_or_else(|e| e.into_inner());
            (p.life.on_launch_failed(why, &e, None, Instant::now()), e)
        }
    };
    match outcome {
        (Retry::After(delay), e) => rt.control.log_limited(|| format!("{e}; trying again in {} ms", delay.as_millis())),
        (Retry::Fail { reason }, _) => {
            eprintln!("bulkhead: device {}: {reason}", rt.name);
            rt.control.fail(&reason);
            rt.attach.fail(&reason);
        }
    }
}
