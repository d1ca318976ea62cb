//! The supervisor: starts every device's domains, watches them, changes them while they
//! serve, and ends them all when `serve` stops.
//!
//! Its threads are fixed in number whatever the devices: the watcher ([`crate::watcher`]),
//! which sees what happens and has each device's lifecycle decide what to do, and the workers
//! ([`crate::workers`]), which do it. Calls from the control socket change a device the same
//! way, through a job on a worker.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bulkhead_config::Config;

use crate::device::DeviceRuntime;
use crate::error::Error;
use crate::hub::Hub;
use crate::kept::{FdStore, Keep};
use crate::lifecycle::Event;
use crate::mailbox::Mailbox;
use crate::spares::{SpareCounts, Spares};
use crate::spawn::current_exe;
use crate::state::{Clock, DeviceState, Monotonic, Shape};
use crate::status::{device_status, ProcessMemory, StatusReport};
use crate::workers::{Workers, WORKERS};

/// How long a call from the control socket waits for a job that holds its device.
const CLAIM_WAIT: Duration = Duration::from_secs(30);

/// How long a change waits for its job to finish.
const CHANGE_WAIT: Duration = Duration::from_secs(60);

/// A change to a running device. Each replaces the device's domains with a new generation
/// running the changed chain: requests in flight are reissued to it, so applications pause and
/// nothing fails (qemu's blockdev-reopen and dm's suspend and reload are the models).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceChange {
    /// The same chain, on fresh domains (`bulkhead device restart`).
    Restart,
    /// Run the filters in another place (`bulkhead device tap DEVICE MODE`).
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

/// The supervisor: owns every device's runtime, the watcher and the workers.
pub struct Supervisor {
    hub: Arc<Hub>,
    watcher: Mutex<Option<JoinHandle<()>>>,
    started: Instant,
    stopped: AtomicBool,
    /// Sequence numbers of snapshot operations.
    snapshot_seq: std::sync::atomic::AtomicU64,
    /// What domains are exec'd from.
    exe: PathBuf,
    /// Where descriptors are kept across a restart of `serve`.
    keep: Keep,
    /// Held while a device is added or removed: one at a time.
    changes: Mutex<()>,
    /// The spare domains kept ready.
    spares: Arc<Spares>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor").field("devices", &self.hub.devices.len()).finish()
    }
}

impl Supervisor {
    /// Starts the domains of every device of `config` from `exe` (default: this executable),
    /// several at a time, on the supervisor's workers (which the domains then live as long
    /// as), and starts watching them. If a device cannot start, those that did are ended and
    /// the first device's error (in configuration order) is returned.
    pub fn start(config: &Config, exe: Option<&Path>) -> Result<Self, Error> {
        Self::start_keeping(config, exe, None)
    }

    /// As [`start`](Self::start), keeping in `store` what must outlive this `serve` (each
    /// `ram` device's contents, each `rbd` device's lock owners) and taking what an earlier
    /// `serve` kept there.
    pub fn start_keeping(config: &Config, exe: Option<&Path>, store: Option<Arc<dyn FdStore>>) -> Result<Self, Error> {
        let exe: PathBuf = exe.map(Path::to_path_buf).unwrap_or_else(current_exe);
        let keep = Keep::new(store);
        let setup = |e: std::io::Error| Error::failed(format!("supervisor: {e}"));
        let clock: Arc<dyn Clock> = Arc::new(Monotonic);
        let mailbox = Arc::new(Mailbox::new().map_err(setup)?);
        let workers = Workers::start(WORKERS).map_err(setup)?;
        let registry = crate::hub::Registry::default();
        let spares = Spares::start(*config.domains.spares.get_ref() as usize, exe.clone()).map_err(setup)?;
        let (tx, rx) = mpsc::channel();
        for cfg in &config.devices {
            let i = registry.next_id();
            let (cfg, exe, keep, clock, mailbox, tx, spares) =
                (cfg.clone(), exe.clone(), keep.clone(), clock.clone(), mailbox.clone(), tx.clone(), spares.clone());
            workers.submit(move || {
                let _ = tx.send((i, DeviceRuntime::start(&cfg, i, &exe, &keep, clock, mailbox, &spares)));
            });
        }
        drop(tx);
        let mut started: Vec<Option<Result<DeviceRuntime, Error>>> = (0..config.devices.len()).map(|_| None).collect();
        for (i, r) in rx {
            started[i] = Some(r);
        }
        let mut first_error = None;
        for r in started.into_iter().flatten() {
            match r {
                Ok(rt) => registry.insert(Arc::new(rt)),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let failed = first_error.is_some();
        let standbys = crate::standby::Places::new(*config.domains.standbys.get_ref() as usize);
        let hub = Arc::new(Hub { devices: registry, mailbox, workers, stopping: AtomicBool::new(false), clock, standbys });
        let watcher = if failed { None } else { Some(crate::watcher::start(hub.clone()).map_err(setup)) };
        let sup = Supervisor {
            hub,
            watcher: Mutex::new(None),
            started: Instant::now(),
            stopped: AtomicBool::new(false),
            exe,
            keep,
            changes: Mutex::new(()),
            spares,
            snapshot_seq: std::sync::atomic::AtomicU64::new(0),
        };
        match (first_error, watcher) {
            (Some(e), _) | (None, Some(Err(e))) => {
                // End what was started before failing.
                sup.shutdown();
                Err(e)
            }
            (None, w) => {
                *sup.watcher.lock().unwrap_or_else(|e| e.into_inner()) = w.and_then(Result::ok);
                Ok(sup)
            }
        }
    }

    /// What the pool of spare domains has done, and the pids of those waiting now.
    pub fn spares(&self) -> (SpareCounts, Vec<u32>) {
        (self.spares.counts(), self.spares.pids())
    }

    /// When each of the last spare starts (up to 1,024) began and ended, for benchmarks to
    /// tell the outages that shared the host's CPUs with one from those that did not.
    pub fn spare_starts(&self) -> Vec<(Instant, Instant)> {
        self.spares.starts()
    }

    /// The device named `name`.
    fn device(&self, name: &str) -> Result<Arc<DeviceRuntime>, Error> {
        self.hub.devices.find(name).ok_or_else(|| Error::not_found(format!("no device `{name}`")))
    }

    /// Whether a device `name` is served.
    pub fn has_device(&self, name: &str) -> bool {
        self.hub.devices.find(name).is_some()
    }

    /// Whether a view `name` is served.
    pub fn has_view(&self, name: &str) -> bool {
        self.hub.devices.all().iter().any(|d| d.view(name).is_some())
    }

    /// The devices and their views, for the exports.
    pub fn devices(&self) -> Vec<Arc<bulkhead_client::Device>> {
        self.hub.devices.all().iter().flat_map(|d| d.frontends()).collect()
    }

    /// Device `name`'s frontend and its views', for the exports (empty for an unknown device).
    pub fn frontends(&self, name: &str) -> Vec<Arc<bulkhead_client::Device>> {
        self.hub.devices.find(name).map(|d| d.frontends()).unwrap_or_default()
    }

    /// The device a device or view `name` belongs to.
    pub fn owner_of(&self, name: &str) -> Option<String> {
        self.hub.devices.all().iter().find(|d| d.name == name || d.view(name).is_some()).map(|d| d.name.clone())
    }

    /// Starts device `cfg` (a `[[device]]` table, checked) while the others serve, and watches
    /// it; returns its frontend and its views' for the exports. Refused if its name or one of
    /// its views' is taken, or while `serve` stops; a device that cannot start leaves nothing
    /// behind.
    pub fn add_device(&self, cfg: &bulkhead_config::DeviceConfig) -> Result<Vec<Arc<bulkhead_client::Device>>, Error> {
        let _one = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let name = cfg.name.get_ref().clone();
        let device = format!("device `{name}`");
        if self.hub.stopping.load(Ordering::Acquire) || self.stopped.load(Ordering::Acquire) {
            return Err(Error::busy("serve is shutting down").context(&device));
        }
        for n in std::iter::once(&name).chain(cfg.views.iter().map(|v| v.name.get_ref())) {
            if self.hub.devices.name_taken(n) {
                return Err(Error::invalid(format!("a device or view named `{n}` is served already")).context(&device));
            }
        }
        let id = self.hub.devices.next_id();
        let (tx, rx) = mpsc::channel();
        let (c, exe, keep) = (cfg.clone(), self.exe.clone(), self.keep.clone());
        let (clock, mailbox, spares) = (self.hub.clock.clone(), self.hub.mailbox.clone(), self.spares.clone());
        // The domains live as long as the worker that execs them (or the spares' keeper).
        self.hub.workers.submit(move || {
            let _ = tx.send(DeviceRuntime::start(&c, id, &exe, &keep, clock, mailbox, &spares));
        });
        let rt = rx.recv().map_err(|_| Error::failed("the supervisor's workers are gone").context(&device))??;
        let rt = Arc::new(rt);
        let fronts = rt.frontends();
        self.hub.devices.insert(rt);
        self.hub.mailbox.post(crate::mailbox::Note::Added(id));
        Ok(fronts)
    }

    /// Stops serving device `name`, which the exports no longer offer: waits up to `drain`
    /// for the requests in flight, flushes it, ends its domains and forgets it. Refused while
    /// applications are attached to it or its views, unless `force` (their requests then fail).
    pub fn remove_device(&self, name: &str, force: bool, drain: Duration) -> Result<(), Error> {
        let _one = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let rt = self.device(name)?;
        let attached = rt.attach.attached();
        if attached > 0 && !force {
            return Err(Error::in_use(format!("{attached} application queue(s) are attached to `{name}` or its views")));
        }
        // Held to the end: no restart or change starts meanwhile, and the watcher leaves it be.
        let (claim, slot) = rt.claim(CLAIM_WAIT)?;
        drop(slot);
        drain_and_flush(&rt, &format!("device {name}"), &rt.device, || rt.control.in_flight(), drain);
        self.hub.devices.remove(rt.id);
        self.keep.forget_device(name);
        self.hub.mailbox.post(crate::mailbox::Note::Removed(rt.id));
        rt.control.fail("device removed");
        end_each(std::slice::from_ref(&rt), Duration::from_secs(3));
        drop(claim);
        log::info!("device {name}: removed");
        Ok(())
    }

    /// Adds view `view` (a `[[device.view]]` table, checked) to the running device `device`.
    /// The device's domains are replaced by a generation that serves the view too: the
    /// device's and its other views' users see a pause, as in a restart, with nothing failed;
    /// other devices do not notice. Returns the view's frontend, for the exports.
    pub fn add_view(&self, device: &str, view: &bulkhead_config::View) -> Result<Arc<bulkhead_client::Device>, Error> {
        let _one = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        if self.hub.stopping.load(Ordering::Acquire) || self.stopped.load(Ordering::Acquire) {
            return Err(Error::busy("serve is shutting down"));
        }
        let rt = self.device(device)?;
        let name = view.name.get_ref().clone();
        if self.hub.devices.name_taken(&name) {
            return Err(Error::invalid(format!("a device or view named `{name}` is served already")));
        }
        let (claim, mut slot) = rt.claim(CLAIM_WAIT)?;
        let refuse = |slot, claim, why: Error| {
            // The slot's lock goes before the claim, whose release takes it.
            drop(slot);
            drop(claim);
            Err(why)
        };
        let state = slot.life.state();
        if state != DeviceState::Running {
            let why = format!("device `{device}` is {}: views are added to a running device", state.as_str());
            return refuse(slot, claim, Error::busy(why));
        }
        let setup = match crate::views::ViewSetup::resolve(device, std::slice::from_ref(view), rt.launcher.size()) {
            Ok(mut s) => s.remove(0),
            Err(e) => return refuse(slot, claim, e),
        };
        let count = rt.launcher.layout().views.len();
        if count >= bulkhead_qos::page::MAX_VIEWS {
            return refuse(slot, claim, Error::invalid(format!("device `{device}` has {count} views, the most it may have")));
        }
        rt.launcher.change_layout(|l| l.views.push(setup.clone()));
        crate::views::reset_entry(&rt.state, count, &setup.caps);
        rt.attach.add_view(count as u32, setup.attach);
        let why = format!("view {name} added");
        let disposition = slot.life.on_event(Event::Changed { why, filters_only: false }, rt.control.answered());
        drop(slot);
        let (tx, rx) = mpsc::channel();
        claim.pass_on();
        self.hub.dispatch(rt.id, disposition, self.hub.clock.now(), Some(tx));
        let outcome = rx.recv_timeout(CHANGE_WAIT).map_err(|_| Error::failed("the supervisor did not answer")).and_then(|r| r);
        if let Some(v) = rt.view(&name) {
            return Ok(v.device.clone());
        }
        // The new generation did not start: the view goes from the layout again.
        let why = outcome.err().unwrap_or_else(|| Error::failed("the new generation did not serve it"));
        if let Ok((claim, slot)) = rt.claim(CLAIM_WAIT) {
            drop(slot);
            if rt.view(&name).is_none() && rt.launcher.layout().find(&name) == Some(count) {
                rt.launcher.change_layout(|l| l.views.truncate(count));
                rt.attach.remove_view(count as u32);
            }
            drop(claim);
        }
        Err(why.context(format!("view `{name}` could not start")))
    }

    /// Removes view `name` from its running device, once the exports no longer offer it:
    /// waits up to `drain` for its requests in flight, flushes, fails whatever is left, and
    /// replaces the device's domains by a generation without it (its users see a pause, as in
    /// a restart). Refused while applications are attached to it, unless `force` (they are
    /// told it failed). Returns the device it belonged to.
    pub fn remove_view(&self, name: &str, force: bool, drain: Duration) -> Result<String, Error> {
        let _one = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        if self.hub.stopping.load(Ordering::Acquire) || self.stopped.load(Ordering::Acquire) {
            return Err(Error::busy("serve is shutting down"));
        }
        let all = self.hub.devices.all();
        let (rt, view) = all
            .iter()
            .find_map(|d| d.view(name).map(|v| (d.clone(), v)))
            .ok_or_else(|| Error::not_found(format!("no view `{name}`")))?;
        let attached = rt.attach.attached_to(name);
        if attached > 0 && !force {
            return Err(Error::in_use(format!("{attached} application(s) are attached to view `{name}`")));
        }
        let (claim, slot) = rt.claim(CLAIM_WAIT)?;
        drop(slot);
        rt.attach.cut_off(name, "view removed");
        drain_and_flush(&rt, &format!("view {name}"), &view.device, || view.device.in_flight(), drain);
        rt.control.fail_view(view.index(), "view removed");
        rt.leave_view(name);
        let why = format!("view {name} removed");
        let disposition = rt.lock().life.on_event(Event::Changed { why, filters_only: false }, rt.control.answered());
        let (tx, rx) = mpsc::channel();
        claim.pass_on();
        self.hub.dispatch(rt.id, disposition, self.hub.clock.now(), Some(tx));
        // The view is gone whatever became of the new generation.
        match rx.recv_timeout(CHANGE_WAIT) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => log::warn!("device {}: after view {name} was removed: {e}", rt.name),
            Err(_) => log::warn!("device {}: the supervisor did not answer after view {name} was removed", rt.name),
        }
        log::info!("device {}: view {name} removed", rt.name);
        Ok(rt.name.clone())
    }

    /// Changes the QoS of the running view `view`: `changes` are `key=value` settings of
    /// [`bulkhead_qos::KEYS`] applied over its current caps. The domain takes them on its
    /// next look at the view; a restarted domain keeps them. Returns the caps now in force.
    pub fn set_qos(&self, view: &str, changes: &[(String, String)]) -> Result<bulkhead_qos::Caps, Error> {
        let all = self.hub.devices.all();
        let (rt, v) =
            all.iter().find_map(|d| d.view(view).map(|v| (d, v))).ok_or_else(|| Error::not_found(format!("no view `{view}`")))?;
        let mut caps = v.caps();
        for (k, val) in changes {
            caps.set(k, val).map_err(|e| Error::invalid(e.to_string()))?;
        }
        let caps = caps.with_default_bursts();
        v.set_caps(caps, &rt.state)?;
        log::info!("view {view}: QoS now {caps}");
        Ok(caps)
    }

    /// Serves an application's request to attach (`bulkhead_client::attach`) on its control
    /// connection `conn`: offers the geometry, checks the queues it sends, adds them to the
    /// domain, and keeps them there across restarts until the application hangs up, then
    /// takes them out. Returns when it has.
    pub fn attach_session(&self, mut conn: std::os::unix::net::UnixStream, ask: bulkhead_control::Attach) {
        use bulkhead_client::attach::wire::{FromApp, FromServe};
        let tell = |conn: &mut std::os::unix::net::UnixStream, msg: &FromServe| {
            let mut line = serde_json::to_vec(msg).expect("message serialises");
            line.push(b'\n');
            std::io::Write::write_all(conn, &line)
        };
        use bulkhead_control::ControlError;
        let refuse = |conn: &mut std::os::unix::net::UnixStream, why: ControlError| {
            let _ = tell(conn, &FromServe::Error(why));
        };
        let all = self.hub.devices.all();
        let found = all.iter().find_map(|d| {
            if d.name == ask.name {
                return Some((d, None));
            }
            d.view(&ask.name).map(|v| (d, Some(v)))
        });
        let Some((rt, view)) = found else {
            return refuse(&mut conn, ControlError::not_found(format!("no device or view `{}`", ask.name)));
        };
        if rt.lock().life.shape() == Shape::Interpose {
            return refuse(
                &mut conn,
                ControlError::invalid(format!(
                    "{}: attaching needs tap = \"passthrough\" or \"intercept\" (this device interposes)",
                    ask.name
                )),
            );
        }
        if !(1..=bulkhead_config::MAX_ATTACH).contains(&ask.queues) {
            return refuse(
                &mut conn,
                ControlError::invalid(format!("{}: {} queues asked (1..={})", ask.name, ask.queues, bulkhead_config::MAX_ATTACH)),
            );
        }
        let free = rt.attach.free(view.as_ref().map(|v| v.index() as u32));
        if free < ask.queues as usize {
            return refuse(
                &mut conn,
                ControlError::new(
                    bulkhead_control::ErrorCode::InUse,
                    format!("{}: {free} attach slot(s) free, {} asked (its `attach` key sets how many)", ask.name, ask.queues),
                ),
            );
        }
        let dev = match &view {
            None => &rt.device,
            Some(v) => &v.device,
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
            Ok(other) => {
                return refuse(
                    &mut conn,
                    ControlError::bad_request(format!("expected the {} queue(s) asked, got {other:?}", ask.queues)),
                )
            }
            Err(e) => return refuse(&mut conn, ControlError::bad_request(format!("bad message: {e}"))),
        };
        let queues = match crate::attach::queues_from(fds, count) {
            Ok(q) => q,
            Err(e) => return refuse(&mut conn, e.into()),
        };
        for (i, q) in queues.iter().enumerate() {
            if let Err(e) = crate::attach::check_queue(q, qcfg.nslots, qcfg.arena_bytes as u64) {
                return refuse(&mut conn, ControlError::invalid(format!("queue {i}: {e}")));
            }
        }
        // One at a time with restarts, which carry attached queues over.
        let joined = rt.claim(CLAIM_WAIT).and_then(|(claim, slot)| {
            drop(slot);
            // A view's place is read under the claim: views before it may have gone.
            let joined = match &view {
                Some(v) if rt.view(&v.name).is_none() => Err(Error::not_found(format!("view `{}` was removed", v.name))),
                v => rt.attach.join(&ask.name, v.as_ref().map(|v| v.index() as u32), &conn, queues),
            };
            drop(claim);
            joined
        });
        let (id, session) = match joined {
            Ok(j) => j,
            Err(e) => return refuse(&mut conn, e.into()),
        };
        let slots = session.slots();
        log::info!("{}: attached pid {} ({} queue(s))", ask.name, session_pid(&conn), count);
        if tell(&mut conn, &FromServe::Attached { slots }).is_ok() {
            crate::attach::listen(conn, &session);
        }
        match rt.claim(CLAIM_WAIT) {
            Ok((claim, slot)) => {
                drop(slot);
                rt.attach.leave(id);
                drop(claim);
            }
            Err(e) => log::warn!("{}: cannot detach: {e}", ask.name),
        }
        log::info!("{}: detached", ask.name);
    }

    /// Every outage of device `name` measured so far, ms (empty for an unknown device).
    pub fn outages_ms(&self, name: &str) -> Vec<f64> {
        self.device(name).map(|d| d.control.outages_ms()).unwrap_or_default()
    }

    /// The same outages, each with when it was detected.
    pub fn outages(&self, name: &str) -> Vec<(Instant, f64)> {
        self.device(name).map(|d| d.control.outages()).unwrap_or_default()
    }

    /// The current status. It never waits for a restart: a device whose domains are being
    /// replaced says so.
    pub fn status(&self) -> StatusReport {
        let me = std::process::id();
        StatusReport {
            frontend: ProcessMemory { pid: me, rss: crate::proc_info::rss(me) },
            uptime_s: self.started.elapsed().as_secs_f64(),
            devices: self.hub.devices.all().iter().map(|rt| device_status(rt)).collect(),
            fuse: None,
            vhost_user: None,
            ublk: None,
            spares: self.spares_status(),
        }
    }

    /// The pool of spare domains.
    fn spares_status(&self) -> bulkhead_control::SparesStatus {
        let (c, pids) = self.spares();
        bulkhead_control::SparesStatus {
            wanted: self.spares.wanted() as u32,
            ready: pids.into_iter().map(|pid| ProcessMemory { pid, rss: crate::proc_info::rss(pid) }).collect(),
            started: c.started,
            taken: c.taken,
            lost: c.lost,
            standbys_most: self.hub.standbys.most() as u32,
            standbys_held: self.hub.standbys.held() as u32,
        }
    }

    /// Restarts a device's domains on demand (also a failed device's: its restart history is
    /// cleared). Returns the new driver pid.
    pub fn restart_device(&self, name: &str) -> Result<u32, Error> {
        self.change_device(name, DeviceChange::Restart)
    }

    /// The snapshots of device `name`'s `cow` overlay, read from the overlay's snapshot table
    /// (display only: the table is checked as untrusted input).
    pub fn snapshots(&self, name: &str) -> Result<Vec<bulkhead_image::snapshot::SnapshotInfo>, Error> {
        let rt = self.device(name)?;
        let path = rt.cow().and_then(|f| f.overlay.clone()).ok_or_else(|| Error::invalid("the device has no cow filter"))?;
        let f = std::fs::File::open(&path).map_err(|e| Error::failed(format!("overlay {}: {e}", path.display())))?;
        bulkhead_image::snapshot::list(&f).map_err(|e| Error::failed(format!("overlay {}: {e}", path.display())))
    }

    /// Takes, reverts to or deletes snapshot `snap` of device `name` (see
    /// [`DeviceChange::Snapshot`]); waits until the new generation has carried it out. A revert
    /// needs the device idle: it is refused while requests are in flight or completing.
    pub fn snapshot(&self, name: &str, action: bulkhead_filters::cow::SnapshotAction, snap: &str) -> Result<u32, Error> {
        use bulkhead_filters::cow::{OpResult, SnapshotAction, SnapshotOp};
        bulkhead_image::snapshot::check_name(snap).map_err(|e| Error::invalid(e.to_string()))?;
        let existing = self.snapshots(name)?;
        let exists = existing.iter().any(|s| s.name == snap);
        match action {
            SnapshotAction::Create if exists => return Err(Error::invalid(format!("a snapshot named `{snap}` exists already"))),
            SnapshotAction::Revert | SnapshotAction::Delete if !exists => {
                return Err(Error::not_found(format!("no snapshot named `{snap}`")))
            }
            _ => {}
        }
        let rt = self.device(name)?;
        if action == SnapshotAction::Revert {
            let before = rt.device.counters.completed.load(Ordering::Relaxed) + rt.device.counters.failed.load(Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(250));
            let after = rt.device.counters.completed.load(Ordering::Relaxed) + rt.device.counters.failed.load(Ordering::Relaxed);
            let in_flight = rt.device.in_flight();
            if in_flight > 0 || after != before {
                return Err(Error::busy(format!(
                    "the device is busy ({in_flight} requests in flight, {} completed in the last 250 ms): a revert changes \
                     everything under its users; stop its I/O (unmount its file system) and retry",
                    after - before
                )));
            }
        }
        let seq = self.snapshot_seq.fetch_add(1, Ordering::Relaxed) + 1;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let date = (u32::try_from(now.as_secs()).unwrap_or(u32::MAX), now.subsec_nanos());
        let op = SnapshotOp { seq, action, name: snap.to_string(), date };
        let pid = self.change_device(name, DeviceChange::Snapshot(op))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let result = rt.cow().and_then(|f| bulkhead_filters::cow::op_result(&f.page, seq));
            match result {
                Some(OpResult::Done) => return Ok(pid),
                Some(OpResult::NotFound) => return Err(Error::not_found(format!("no snapshot named `{snap}`"))),
                Some(OpResult::Exists) => return Err(Error::invalid(format!("a snapshot named `{snap}` exists already"))),
                Some(OpResult::Failed) => {
                    return Err(Error::failed(format!(
                        "the driver domain could not {} snapshot `{snap}`; its log line (`cow: snapshot …`) says why",
                        action.as_str()
                    )))
                }
                None if Instant::now() > deadline => {
                    return Err(Error::failed("the driver domain did not carry the snapshot out in 60 s"))
                }
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Changes a running device (see [`DeviceChange`]) and starts its next generation (or,
    /// for a filter of an `interpose` device, its next tap domain); returns the new driver pid
    /// once it runs. A change that is not valid is refused, saying why, and the device runs on
    /// as it was.
    pub fn change_device(&self, name: &str, change: DeviceChange) -> Result<u32, Error> {
        let rt = self.device(name)?;
        if self.hub.stopping.load(Ordering::Acquire) {
            return Err(Error::busy("shutting down"));
        }
        let (claim, mut slot) = rt.claim(CLAIM_WAIT)?;
        let why = match rt.change_chain(&change) {
            Ok(why) => why,
            Err(e) => {
                // The slot's lock goes before the claim, whose release takes it.
                drop(slot);
                drop(claim);
                return Err(e);
            }
        };
        let filters_only = matches!(change, DeviceChange::AddFilter { .. } | DeviceChange::RemoveFilter(_));
        let disposition = slot.life.on_event(Event::Changed { why, filters_only }, rt.control.answered());
        drop(slot);
        let (tx, rx) = mpsc::channel();
        claim.pass_on();
        self.hub.dispatch(rt.id, disposition, self.hub.clock.now(), Some(tx));
        rx.recv_timeout(CHANGE_WAIT).map_err(|_| Error::failed("the supervisor did not answer"))?
    }

    /// Makes device `name` write (`active`) or stop writing, as the two ends of a live
    /// migration hand its storage over (`bulkhead device activate`, `device deactivate`).
    /// Returns the new driver pid, or `None` if the device was so already.
    ///
    /// Deactivating waits up to `drain` for the requests in flight (the guest is stopped by
    /// then: its rings were drained) and flushes the device; if either cannot be done it is
    /// refused and the device writes on. Either way the running generation is asked to stop
    /// (SIGTERM) and given [`GRACE`] to, so a file is closed after its last write and an rbd
    /// domain releases the image's exclusive lock as it closes it, for the other end to take at
    /// once (a killed domain holds it until the cluster notices, ~30 s). The next generation
    /// runs on storage opened again, read-only or not ([`Launcher::set_active`]).
    ///
    /// [`Launcher::set_active`]: crate::launcher::Launcher::set_active
    pub fn set_active(&self, name: &str, active: bool, drain: Duration) -> Result<Option<u32>, Error> {
        let _one = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let rt = self.device(name)?;
        if self.hub.stopping.load(Ordering::Acquire) {
            return Err(Error::busy("shutting down"));
        }
        let (claim, slot) = rt.claim(CLAIM_WAIT)?;
        if rt.launcher.held().active == active {
            return Ok(None);
        }
        let state = slot.life.state();
        drop(slot);
        if !active {
            if state != DeviceState::Running {
                return Err(Error::busy(format!(
                    "the device is {}: it is deactivated once it runs, after a flush",
                    state.as_str()
                )));
            }
            let deadline = Instant::now() + drain;
            while rt.control.in_flight() > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            let left = rt.control.in_flight();
            if left > 0 {
                return Err(Error::busy(format!(
                    "{left} request(s) still in flight after {} ms: stop the guest (or the device's users) first; the \
                     device stays active",
                    drain.as_millis()
                )));
            }
            flush_one(&rt.device, GRACE)
                .map_err(|e| e.context("the flush before deactivating failed; the device stays active"))?;
        }
        rt.launcher.set_active(active)?;
        end_gently(&rt, GRACE);
        let why = if active { "activated: it writes" } else { "deactivated: it writes no more" };
        let disposition = rt.lock().life.on_event(Event::Changed { why: why.into(), filters_only: false }, rt.control.answered());
        let (tx, rx) = mpsc::channel();
        claim.pass_on();
        self.hub.dispatch(rt.id, disposition, self.hub.clock.now(), Some(tx));
        let pid = rx.recv_timeout(CHANGE_WAIT).map_err(|_| Error::failed("the supervisor did not answer"))??;
        Ok(Some(pid))
    }

    /// Flushes every device, then ends every domain (SIGTERM, SIGKILL after 3 s), then the
    /// supervisor's threads. Idempotent.
    ///
    /// The flushes run while the watcher still works, so a domain that dies during them is
    /// restarted and the flush completes on the next generation; each is bounded by 5 s.
    pub fn shutdown(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        self.flush_all(Duration::from_secs(5));
        self.hub.stopping.store(true, Ordering::Release);
        self.hub.mailbox.ring();
        let w = self.watcher.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = w {
            let _ = w.join();
        }
        // Jobs under way finish (none starts a generation now).
        if !self.hub.workers.wait_idle(Duration::from_secs(40)) {
            log::warn!("a restart did not finish within 40 s; stopping anyway");
        }
        let all = self.hub.devices.all();
        for rt in &all {
            // Releases any caller still waiting (their requests fail with EIO).
            rt.control.fail("shutting down");
        }
        end_each(&all, Duration::from_secs(3));
        // The domains are gone: the threads that started them may end.
        self.hub.workers.stop();
        self.spares.stop();
        // The domains' last words reach the log before serve exits.
        crate::domain_log::finish_all(Duration::from_secs(1));
    }

    /// Flushes every running device, a few at a time, within `limit` in all.
    fn flush_all(&self, limit: Duration) {
        let running: Vec<Arc<DeviceRuntime>> =
            self.hub.devices.all().into_iter().filter(|rt| rt.lock().life.state() == DeviceState::Running).collect();
        flush_each(&running, limit);
    }
}

/// Waits up to `drain` for `what`'s requests in flight (`in_flight`) to finish, then flushes
/// `front` if `rt` runs; what is left is logged (it fails when `what` goes).
fn drain_and_flush(
    rt: &DeviceRuntime,
    what: &str,
    front: &Arc<bulkhead_client::Device>,
    in_flight: impl Fn() -> usize,
    drain: Duration,
) {
    let deadline = Instant::now() + drain;
    while in_flight() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let left = in_flight();
    if left > 0 {
        log::warn!("{what}: {left} request(s) still in flight after {} ms; they fail", drain.as_millis());
    }
    if rt.lock().life.state() == DeviceState::Running {
        flush_devices(&[(what.to_string(), front.clone())], Duration::from_secs(5));
    }
}

/// Flushes `running`, a few at a time, within `limit` in all.
fn flush_each(running: &[Arc<DeviceRuntime>], limit: Duration) {
    let devices: Vec<(String, Arc<bulkhead_client::Device>)> =
        running.iter().map(|rt| (rt.name.clone(), rt.device.clone())).collect();
    flush_devices(&devices, limit);
}

/// Flushes `running` (named frontends), a few at a time, within `limit` in all.
fn flush_devices(running: &[(String, Arc<bulkhead_client::Device>)], limit: Duration) {
    let running = running.to_vec();
    if running.is_empty() {
        return;
    }
    let next = Arc::new(AtomicUsize::new(0));
    let running = Arc::new(running);
    let (tx, rx) = mpsc::channel();
    for _ in 0..running.len().min(FLUSHERS) {
        let (next, running, tx) = (next.clone(), running.clone(), tx.clone());
        // A flush a dead domain never answers keeps its thread: it is not waited for.
        let _ = std::thread::Builder::new().name("flush".into()).spawn(move || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some((_, dev)) = running.get(i) else { break };
            if tx.send((i, dev.flush(0))).is_err() {
                break;
            }
        });
    }
    drop(tx);
    let deadline = Instant::now() + limit;
    let mut answered = vec![false; running.len()];
    while let Ok((i, r)) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        answered[i] = true;
        if let Err(e) = r {
            log::warn!("{}: final flush failed: {e}", running[i].0);
        }
    }
    for (i, _) in answered.iter().enumerate().filter(|(_, a)| !**a) {
        log::warn!("{}: final flush did not complete within {} s", running[i].0, limit.as_secs());
    }
}

/// How long a domain asked to stop before its device is activated or deactivated has to.
const GRACE: Duration = Duration::from_secs(5);

/// Flushes `device` within `limit`; a flush its domain does not answer in time is left to the
/// thread that sent it.
fn flush_one(device: &Arc<bulkhead_client::Device>, limit: Duration) -> Result<(), Error> {
    let (tx, rx) = mpsc::channel();
    let dev = device.clone();
    let _ = std::thread::Builder::new().name("flush".into()).spawn(move || {
        let _ = tx.send(dev.flush(0));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Error::failed(e.to_string())),
        Err(_) => Err(Error::failed(format!("not answered within {} s", limit.as_secs()))),
    }
}

/// Asks the running domains of device `rt` (claimed by the caller) to stop, waits up to
/// `grace` for them, kills those left, and buries them: the next launch finds none.
fn end_gently(rt: &DeviceRuntime, grace: Duration) {
    let (mut domains, below, graveyard) = crate::jobs::take_all(rt);
    for d in &domains {
        let _ = d.child.signal(libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    for d in &mut domains {
        let left = deadline.saturating_duration_since(Instant::now());
        if !matches!(d.child.wait_timeout(left), Ok(Some(_))) {
            log::warn!("device {}: domain (pid {}) did not stop within {} s; killing it", rt.name, d.pid(), grace.as_secs());
        }
    }
    crate::jobs::bury_all(rt, domains, below, graveyard);
}

/// Asks every domain of `devices` to stop (SIGTERM), waits up to `grace` for them all, kills
/// those left, then stops the cards' models.
fn end_each(devices: &[Arc<DeviceRuntime>], grace: Duration) {
    let mut ending = Vec::new();
    for rt in devices {
        let mut slot = rt.lock();
        let (domains, below) = slot.domains.take_all();
        let mut graveyard = std::mem::take(&mut slot.graveyard);
        let standbys = [slot.standby.take(), slot.tap_standby.take()];
        slot.life.stopped();
        drop(slot);
        for s in standbys.into_iter().flatten() {
            s.bury(&rt.name, &mut graveyard);
        }
        for d in &domains {
            let _ = d.child.signal(libc::SIGTERM);
        }
        ending.push((rt, domains, below, graveyard));
    }
    let deadline = Instant::now() + grace;
    for (rt, domains, below, mut graveyard) in ending {
        for mut d in domains {
            let left = deadline.saturating_duration_since(Instant::now());
            if !matches!(d.child.wait_timeout(left), Ok(Some(_))) {
                log::warn!("device {}: domain (pid {}) did not stop; killing it", rt.name, d.pid());
            }
            graveyard.bury(&rt.name, d);
        }
        drop(below);
        graveyard.wait_all(Duration::from_secs(1));
        rt.lock().graveyard = graveyard;
        // The card's model goes last: its driver is gone.
        if let Some(card) = &rt.launcher.card {
            card.stop_model(grace);
        }
    }
}

/// Threads that flush devices at shutdown.
const FLUSHERS: usize = 8;

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The process at the other end of `conn` (0 if the socket cannot say).
fn session_pid(conn: &std::os::unix::net::UnixStream) -> i32 {
    bulkhead_sys::peer_credentials(std::os::fd::AsFd::as_fd(conn)).map_or(0, |(pid, _)| pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_supervisor_of_no_devices_starts_answers_refuses_unknown_names_and_stops_twice() {
        let config = Config { devices: Vec::new(), ..Config::embedded_default() };
        let sup = Supervisor::start(&config, None).unwrap();
        assert!(sup.status().devices.is_empty());
        assert!(sup.devices().is_empty());
        assert_eq!(sup.change_device("nope", DeviceChange::Restart).unwrap_err(), Error::not_found("no device `nope`"));
        assert_eq!(sup.set_qos("v", &[]).unwrap_err(), Error::not_found("no view `v`"));
        assert!(sup.outages_ms("nope").is_empty());
        sup.shutdown();
        sup.shutdown();
    }
}
