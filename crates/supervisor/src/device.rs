//! One device as the supervisor runs it: its frontend and views, its launcher, and the slot
//! that holds its domains and lifecycle.
//!
//! What may change a device's domains — a restart, a change, an application attaching — is a
//! job, and one job at a time holds the device's claim ([`Claim`]). A job takes what it works
//! on out of the slot, works with no lock held (killing, waiting, exec'ing), and puts the
//! result back; the slot's lock is only ever held for a moment, so `status` answers while a
//! domain is replaced.

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use bulkhead_client::Device;
use bulkhead_config::{DeviceConfig, Tap};
use bulkhead_filters::state::StatePage;
use bulkhead_filters::FilterSpec;

use crate::attach::AttachPoint;
use crate::chain::{shared_page, FilterSetup};
use crate::domains::{Domains, Faces, Graveyard};
use crate::error::Error;
use crate::launcher::{Launched, Launcher};
use crate::lifecycle::{Lifecycle, Observation};
use crate::mailbox::{Mailbox, Note};
use crate::state::{Clock, RestartPolicy, Shape};
use crate::views::{Controls, ViewRuntime};

/// The part of a device that changes as its domains do.
#[derive(Debug)]
pub(crate) struct Slot {
    /// Its running domains (taken out by a job while it replaces them).
    pub domains: Domains,
    /// What `status` shows of them, as last installed.
    pub faces: Faces,
    /// State, restart history and the watchdog's view.
    pub life: Lifecycle,
    /// Killed domains not yet reaped, and the rings of dead ones.
    pub graveyard: Graveyard,
    /// A job holds the device's claim.
    pub busy: bool,
    /// Its next generation, waiting to take over ([`crate::standby`]).
    pub standby: Option<crate::standby::Standby>,
    /// It has restarted, and keeps a standby from then on when it can.
    pub standby_wanted: bool,
    /// An `interpose` device's next tap domain, waiting to take over from the running one.
    pub tap_standby: Option<crate::standby::Standby>,
    /// Its tap domain has been replaced alone, and it keeps a standby tap domain from then on
    /// when it can.
    pub tap_standby_wanted: bool,
    /// A worker is making its standby.
    pub standby_preparing: bool,
    /// Restarts a standby took.
    pub standby_used: u64,
}

impl Slot {
    /// Takes the standby, if any, for the restart about to begin; having restarted once, the
    /// device keeps one from now on where it can.
    pub fn take_standby(&mut self) -> Option<crate::standby::Standby> {
        self.standby_wanted = true;
        self.standby.take()
    }

    /// The place of a standby of the kind `tap` says: the tap domain's, or the other.
    pub fn standby_place(&mut self, tap: bool) -> &mut Option<crate::standby::Standby> {
        if tap {
            &mut self.tap_standby
        } else {
            &mut self.standby
        }
    }

    /// Takes the standby tap domain, if any, for the replacement of the tap domain about to
    /// begin; the device keeps one from now on where it can.
    pub fn take_tap_standby(&mut self) -> Option<crate::standby::Standby> {
        self.tap_standby_wanted = true;
        self.tap_standby.take()
    }
}

/// A configured device: frontend, views, attached applications, launcher and domains.
#[derive(Debug)]
pub struct DeviceRuntime {
    /// Device name.
    pub name: String,
    /// The frontend, shared with the exports.
    pub device: Arc<Device>,
    /// Its views, each exported as a device of its own; they come and go while it runs.
    views: RwLock<Vec<Arc<ViewRuntime>>>,
    /// The supervisor's face of it and of its views.
    pub(crate) control: Controls,
    /// Applications attached to it and its views.
    pub(crate) attach: AttachPoint,
    /// Restart policy.
    pub(crate) policy: RestartPolicy,
    /// The domain's state page: its heartbeat while layers hold requests, the views' caps.
    pub(crate) state: StatePage,
    /// The state page of the domain below a tap domain, if the device has one: only its
    /// [`STALLED`](bulkhead_spec::state_slots::STALLED) slot is read.
    pub(crate) below_state: StatePage,
    pub(crate) launcher: Launcher,
    slot: Mutex<Slot>,
    /// Rung when the claim is let go of.
    released: Condvar,
    /// Views being removed: the job that replaces the domains takes them out once the old
    /// domains are gone ([`DeviceRuntime::drop_leaving`]).
    leaving: Mutex<Vec<String>>,
    /// Its place among the supervisor's devices.
    pub(crate) id: usize,
    /// Where a claim let go of is told to the watcher.
    mailbox: Arc<Mailbox>,
}

/// The claim on a device: whoever holds it alone changes the device's domains. Let go of when
/// dropped.
#[derive(Debug)]
#[must_use = "the claim is let go of when dropped"]
pub(crate) struct Claim<'a> {
    rt: &'a DeviceRuntime,
}

impl Claim<'_> {
    /// Hands the claim to the job the caller gives the device to, which lets go of it
    /// ([`DeviceRuntime::release`]).
    pub fn pass_on(self) {
        std::mem::forget(self);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.rt.release();
    }
}

impl DeviceRuntime {
    /// Opens the backend storage for `cfg`, the `index`-th device of the configuration, and
    /// starts generation 1 of its domains from `exe`. The domains die with the calling thread
    /// (see [`crate::spawn::exec_confined`]): call it from one of the supervisor's workers.
    pub(crate) fn start(
        cfg: &DeviceConfig,
        id: usize,
        exe: &Path,
        keep: &crate::kept::Keep,
        clock: Arc<dyn Clock>,
        mailbox: Arc<Mailbox>,
        spares: &Arc<crate::spares::Spares>,
    ) -> Result<Self, Error> {
        let index = id as u32;
        let name = cfg.name.get_ref().clone();
        let device = format!("device `{name}`");
        // Writable here too: the views' caps are set in it.
        let (state_fd, state) = shared_page(&format!("bulkhead-{name}-domain"), true).map_err(|e| e.context(&device))?;
        let (below_fd, below_state) = shared_page(&format!("bulkhead-{name}-below"), false).map_err(|e| e.context(&device))?;
        let launcher = Launcher::open(cfg, index, exe, keep, [state_fd, below_fd], spares).map_err(|e| e.context(&device))?;
        let policy = RestartPolicy {
            watchdog: Duration::from_millis(cfg.watchdog_ms()),
            limit: *cfg.restart_limit.get_ref(),
            window: Duration::from_millis(*cfg.restart_window_ms.get_ref()),
            reconnect: launcher.reconnect_timeout(),
        };
        let attach = AttachPoint::new(&name, launcher.layout().attach_slots());
        let Launched { mut fronts, domains, attach_line } = launcher.launch(1).map_err(|e| e.context(&device))?;
        attach.rejoin(attach_line);
        let nqueues = *cfg.queues.get_ref() as usize;
        let view_fronts = fronts.split_off(nqueues);
        let (device, control) = Device::new(&name, launcher.size(), fronts, None);
        device.set_min_block(launcher.min_block());
        let controls = Controls::new(control, nqueues);
        let shape = domains.shape().unwrap_or(Shape::of(cfg.tap));
        let slot = Slot {
            faces: domains.faces(),
            domains,
            life: Lifecycle::new(&name, policy, shape, clock),
            graveyard: Graveyard::default(),
            busy: false,
            standby: None,
            standby_wanted: false,
            tap_standby: None,
            tap_standby_wanted: false,
            standby_preparing: false,
            standby_used: 0,
        };
        let rt = DeviceRuntime {
            name,
            device,
            views: RwLock::new(Vec::new()),
            leaving: Mutex::new(Vec::new()),
            control: controls,
            attach,
            policy,
            state,
            below_state,
            launcher,
            slot: Mutex::new(slot),
            released: Condvar::new(),
            id,
            mailbox,
        };
        rt.new_views(view_fronts);
        Ok(rt)
    }

    /// Its frontend and its views', for the exports.
    pub fn frontends(&self) -> Vec<Arc<Device>> {
        std::iter::once(self.device.clone()).chain(self.views().into_iter().map(|v| v.device.clone())).collect()
    }

    /// Its views now.
    pub fn views(&self) -> Vec<Arc<ViewRuntime>> {
        self.views.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// View `name`, if it has one.
    pub(crate) fn view(&self, name: &str) -> Option<Arc<ViewRuntime>> {
        self.views.read().unwrap_or_else(|e| e.into_inner()).iter().find(|v| v.name == name).cloned()
    }

    /// Hands a new generation's queues (in the order the launch made them) to the frontend
    /// and its views; the queues left over are those of views new to this generation, which
    /// start here.
    pub(crate) fn install_generation(&self, fronts: Vec<bulkhead_channel::FrontQueue>) {
        let rest = self.control.install_generation(fronts);
        if !rest.is_empty() {
            self.new_views(rest);
        }
    }

    /// Starts the views of the layout that have no frontend yet, on `fronts`.
    fn new_views(&self, mut fronts: Vec<bulkhead_channel::FrontQueue>) {
        let layout = self.launcher.layout();
        let min_block = self.launcher.min_block();
        let mut views = self.views.write().unwrap_or_else(|e| e.into_inner());
        for (i, v) in layout.views.iter().enumerate().skip(views.len()) {
            if fronts.len() < v.queues {
                log::error!("device {}: view {}: {} queues for {}", self.name, v.name, fronts.len(), v.queues);
                break;
            }
            let rest = fronts.split_off(v.queues);
            let (view, control) = ViewRuntime::new(v, i, std::mem::replace(&mut fronts, rest), &self.state);
            view.device.set_min_block(min_block);
            self.control.push(control, v.queues);
            views.push(Arc::new(view));
        }
    }

    /// Marks view `name` to be taken out when the domains are next replaced (the caller holds
    /// the claim and hands it to that job).
    pub(crate) fn leave_view(&self, name: &str) {
        self.leaving.lock().unwrap_or_else(|e| e.into_inner()).push(name.to_string());
    }

    /// Takes out the views marked to leave: the old domains are gone, the next not started.
    /// Whether views are waiting to be taken out with the next generation.
    pub(crate) fn views_leaving(&self) -> bool {
        !self.leaving.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    pub(crate) fn drop_leaving(&self) {
        let leaving = std::mem::take(&mut *self.leaving.lock().unwrap_or_else(|e| e.into_inner()));
        for name in leaving {
            self.drop_view(&name);
        }
    }

    /// Takes view `name` out of the layout the next generation runs, with its frontend, its
    /// entry in the state page and its attach slots; the views after it move down one place.
    /// Only while no domain runs and the claim is held. Returns its frontend.
    fn drop_view(&self, name: &str) -> Option<Arc<ViewRuntime>> {
        let mut views = self.views.write().unwrap_or_else(|e| e.into_inner());
        let index = views.iter().position(|v| v.name == name)?;
        let gone = views.remove(index);
        self.control.remove_view(index);
        for (i, v) in views.iter().enumerate().skip(index) {
            v.move_to(i, &self.state);
        }
        self.launcher.change_layout(|l| l.views.remove(index));
        self.attach.remove_view(index as u32);
        Some(gone)
    }

    /// The slot, for a moment.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits up to `timeout` for the job holding the device to finish, then claims it; the
    /// slot comes with the claim, locked.
    pub(crate) fn claim(&self, timeout: Duration) -> Result<(Claim<'_>, MutexGuard<'_, Slot>), Error> {
        let deadline = Instant::now() + timeout;
        let mut slot = self.lock();
        while slot.busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = format!("device `{}` is busy: a restart has held it for {} s", self.name, timeout.as_secs());
                return Err(Error::busy(why));
            }
            slot = self.released.wait_timeout(slot, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        slot.busy = true;
        Ok((Claim { rt: self }, slot))
    }

    /// Lets go of the claim a job held (set by whoever handed it the job), and tells the
    /// watcher, which watches the domains the job left.
    pub(crate) fn release(&self) {
        self.lock().busy = false;
        self.released.notify_all();
        self.mailbox.post(Note::Released(self.id));
    }

    /// Hands the claim a job held on to the job it wants next (`then`), through the watcher.
    pub(crate) fn hand_on(&self, then: Note) {
        debug_assert!(self.lock().busy, "a job hands on a claim it holds");
        self.mailbox.post(then);
    }

    /// What the watcher sees of the device now.
    pub(crate) fn observe(&self) -> Observation {
        Observation {
            answered: self.control.answered(),
            pending: self.control.in_flight(),
            heartbeat: self.state.get(bulkhead_spec::state_slots::HEARTBEAT),
            held: self.state.get(bulkhead_spec::state_slots::HELD),
            beat: self.state.get(bulkhead_spec::state_slots::LOOP),
            below_beat: self.below_state.get(bulkhead_spec::state_slots::LOOP),
            attached: self.attach.attached(),
        }
    }

    /// Copies of its alarms, the device's and each view's, for the watcher to keep.
    pub(crate) fn alarms(&self) -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
        self.control.alarms()
    }

    /// Applies `change` to the chain the next generation runs; returns what to log for the
    /// restart, or why the change is refused (the chain is then as it was).
    pub(crate) fn change_chain(&self, change: &crate::DeviceChange) -> Result<String, Error> {
        use crate::DeviceChange;
        match change {
            DeviceChange::Restart => Ok("restart requested".into()),
            DeviceChange::Tap(t) => {
                if *t == Tap::Intercept {
                    self.launcher.soft_terminal()?;
                }
                self.launcher.change_chain(|chain| {
                    let was = std::mem::replace(&mut chain.tap, *t);
                    Ok(format!("tap mode {} → {}", was.as_str(), t.as_str()))
                })
            }
            DeviceChange::AddFilter { at, table } => {
                let watchdog_ms = self.policy.watchdog.as_millis() as u64;
                self.launcher.change_chain(|chain| {
                    let at = at.unwrap_or(chain.filters.len());
                    if at > chain.filters.len() {
                        let why = format!("position {at} is past the end of the chain ({} filters)", chain.filters.len());
                        return Err(Error::invalid(why));
                    }
                    let f = bulkhead_config::parse_filter(table, &self.name, at, watchdog_ms)
                        .map_err(|e| Error::invalid(e.to_string()))?;
                    if f.spec.transforms() {
                        return Err(Error::invalid(format!(
                            "a {} filter changes what the device holds; it cannot be added to a running device",
                            f.spec.type_name()
                        )));
                    }
                    let setup = FilterSetup::new(&self.name, self.launcher.index, f)?;
                    let what = setup.spec.type_name();
                    chain.filters.insert(at, Arc::new(setup));
                    Ok(format!("filter {what} inserted at position {at}"))
                })
            }
            DeviceChange::Snapshot(op) => self.launcher.change_chain(|chain| {
                if chain.cow().is_none() {
                    return Err(Error::invalid("the device has no cow filter"));
                }
                chain.snapshot = Some(op.clone());
                Ok(format!("snapshot {} `{}`", op.action.as_str(), op.name))
            }),
            DeviceChange::RemoveFilter(at) => self.launcher.change_chain(|chain| {
                if *at >= chain.filters.len() {
                    return Err(Error::not_found(format!("no filter at position {at} ({} filters)", chain.filters.len())));
                }
                if chain.filters[*at].spec.transforms() {
                    return Err(Error::invalid(format!(
                        "the {} filter at position {at} holds what the device holds; it cannot be removed from a running device",
                        chain.filters[*at].spec.type_name()
                    )));
                }
                let gone = chain.filters.remove(*at);
                Ok(format!("filter {} at position {at} removed", gone.spec.type_name()))
            }),
        }
    }

    /// Its `cow` filter, if it has one.
    pub(crate) fn cow(&self) -> Option<Arc<FilterSetup>> {
        self.launcher.chain().filters.iter().find(|f| matches!(f.spec, FilterSpec::Cow { .. })).cloned()
    }

    /// A copy of its model domain's pidfd (a `vdev` device), for the watcher to keep while it
    /// watches it.
    pub(crate) fn model_pidfd(&self) -> Option<std::os::fd::OwnedFd> {
        self.launcher.card.as_ref()?.model_pidfd()
    }
}
