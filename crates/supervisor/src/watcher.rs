//! The watcher: one thread, woken by events, that sees what happens to every device's domains
//! and has the lifecycle decide what to do about it.
//!
//! It waits in one epoll on every domain's pidfd (readable once the process exits), each
//! device's alarms (rung when a queue reports its channel broken), each `vdev` card's model
//! domain, and its mailbox (a claim let go of, a job wanting another). Each of those is watched
//! once-only: one that fires while a job holds its device stays silent until the job lets go,
//! and the watcher then watches the device's new domains. Between events it looks at the
//! devices on a timer: every device at [`SLOW`], and the devices with requests pending at
//! [`FAST`], which is what the watchdog and the look for exiting domains need. An idle
//! `serve` thus wakes a few times a second whatever the number of devices, and its threads do
//! not grow with them.
//!
//! The watcher never waits on a domain, a lock held by a job, or a process: what takes time
//! is a job on a worker.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bulkhead_sys::epoll::Epoll;

use crate::device::{DeviceRuntime, Slot};
use crate::hub::Hub;
use crate::lifecycle::{Disposition, Event};
use crate::mailbox::{Note, Reply};
use crate::state::{DeviceState, Role};

/// How often every device is looked at: the watchdog's resolution when nothing is pending,
/// and the attached applications' beat check.
pub(crate) const SLOW: Duration = Duration::from_millis(250);

/// How often a device with requests pending is looked at: a domain that is exiting (its
/// memory released, its pidfd not yet readable) is found within about this.
pub(crate) const FAST: Duration = Duration::from_millis(10);

/// The mailbox's token.
const MAILBOX: u64 = u64::MAX;

/// What a device's descriptor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The pidfd of the domain the frontend reaches.
    Top = 1,
    /// The pidfd of the driver domain below a tap domain.
    Below = 2,
    /// The pidfd of a card's model domain.
    Model = 3,
    /// One of the device's alarms.
    Alarm = 4,
}

fn token(device: usize, kind: Kind) -> u64 {
    ((device as u64) << 4) | kind as u64
}

fn parse(token: u64) -> Option<(usize, Kind)> {
    let kind = match token & 0xf {
        1 => Kind::Top,
        2 => Kind::Below,
        3 => Kind::Model,
        4 => Kind::Alarm,
        _ => return None,
    };
    Some(((token >> 4) as usize, kind))
}

/// What the watcher keeps of one device: copies of the descriptors it watches, so their
/// numbers cannot be reused while it does.
#[derive(Debug, Default)]
struct Watched {
    /// The pidfds of the domains running when it last looked (and the model's).
    pids: Vec<(OwnedFd, Kind)>,
    /// The alarms.
    alarms: Vec<OwnedFd>,
}

/// Something due at a time.
#[derive(Debug)]
enum Timer {
    /// A restart after its back-off (the device is claimed for it).
    Job { device: usize, disposition: Disposition, detected: Instant, reply: Option<Reply> },
    /// A `reconnecting` device's next attempt.
    Retry(usize),
    /// Starting a device's standby domain, once its restart is well over.
    Standby(usize),
}

/// How long after a restart the device's next standby starts: the new domain's first requests
/// go first.
const STANDBY_AFTER: Duration = Duration::from_millis(2);

struct Watcher {
    hub: Arc<Hub>,
    epoll: Epoll,
    /// By device id.
    watched: HashMap<usize, Watched>,
    timers: BTreeMap<(Instant, u64), Timer>,
    seq: u64,
    /// Devices with requests pending at the last look.
    hot: Vec<usize>,
    next_full: Instant,
    next_fast: Instant,
}

/// Starts the watcher's thread.
pub(crate) fn start(hub: Arc<Hub>) -> std::io::Result<JoinHandle<()>> {
    let epoll = Epoll::new()?;
    epoll.add(hub.mailbox.bell(), MAILBOX)?;
    let now = hub.clock.now();
    let mut w = Watcher {
        watched: HashMap::new(),
        hub,
        epoll,
        timers: BTreeMap::new(),
        seq: 0,
        hot: Vec::new(),
        next_full: now,
        next_fast: now,
    };
    for i in w.hub.devices.ids() {
        w.watch(i)?;
    }
    std::thread::Builder::new().name("watcher".into()).spawn(move || w.run())
}

impl Watcher {
    fn run(&mut self) {
        let mut ready = Vec::new();
        while !self.hub.stopping.load(Ordering::Acquire) {
            let now = self.hub.clock.now();
            let mut due = self.next_full.min(if self.hot.is_empty() { self.next_full } else { self.next_fast });
            if let Some(((t, _), _)) = self.timers.first_key_value() {
                due = due.min(*t);
            }
            ready.clear();
            // A failed wait is a short one: the loop looks again.
            let _ = self.epoll.wait(Some(due.saturating_duration_since(now)), &mut ready);
            if self.hub.stopping.load(Ordering::Acquire) {
                break;
            }
            for &t in &ready {
                if t == MAILBOX {
                    continue;
                }
                if let Some((device, kind)) = parse(t) {
                    self.on_ready(device, kind);
                }
            }
            for note in self.hub.mailbox.take() {
                self.on_note(note);
            }
            self.run_timers();
            let now = self.hub.clock.now();
            if now >= self.next_full {
                self.next_full = now + SLOW;
                self.next_fast = now + FAST;
                let all = self.hub.devices.ids();
                self.hot = self.look(&all, true);
            } else if !self.hot.is_empty() && now >= self.next_fast {
                self.next_fast = now + FAST;
                let hot = std::mem::take(&mut self.hot);
                self.hot = self.look(&hot, false);
            }
        }
    }

    /// Starts watching device `i`, new to the watcher: its alarms and its domains.
    fn watch(&mut self, i: usize) -> std::io::Result<()> {
        let Some(rt) = self.hub.devices.get(i) else { return Ok(()) };
        let alarms = rt.alarms()?;
        for a in &alarms {
            self.epoll.add_once(a.as_fd(), token(i, Kind::Alarm))?;
        }
        self.watched.insert(i, Watched { pids: Vec::new(), alarms });
        self.rewatch(i);
        let obs = rt.observe();
        rt.lock().life.progress_seen(obs);
        Ok(())
    }

    /// Stops watching device `i`, which is no longer served: its descriptors, its timers.
    fn unwatch(&mut self, i: usize) {
        if let Some(w) = self.watched.remove(&i) {
            for (fd, _) in &w.pids {
                let _ = self.epoll.delete(fd.as_fd());
            }
            for a in &w.alarms {
                let _ = self.epoll.delete(a.as_fd());
            }
        }
        self.timers.retain(|_, t| match t {
            Timer::Job { device, .. } => *device != i,
            Timer::Retry(d) | Timer::Standby(d) => *d != i,
        });
        self.hot.retain(|&d| d != i);
    }

    /// Watches device `i`'s current domains (and its card's model) in place of those it
    /// watched, and its alarms again.
    fn rewatch(&mut self, i: usize) {
        let (Some(rt), Some(watched)) = (self.hub.devices.get(i), self.watched.get_mut(&i)) else { return };
        for (fd, _) in std::mem::take(&mut watched.pids) {
            let _ = self.epoll.delete(fd.as_fd());
        }
        let mut pids = Vec::new();
        {
            let slot = rt.lock();
            for (role, d) in slot.domains.each() {
                let kind = match role {
                    Role::Top => Kind::Top,
                    Role::Below => Kind::Below,
                };
                if let Ok(fd) = d.pidfd().try_clone_to_owned() {
                    pids.push((fd, kind));
                }
            }
        }
        if let Some(fd) = rt.model_pidfd() {
            pids.push((fd, Kind::Model));
        }
        for (fd, kind) in &pids {
            if let Err(e) = self.epoll.add_once(fd.as_fd(), token(i, *kind)) {
                log::warn!("device {}: cannot watch a domain: {e}", rt.name);
            }
        }
        // Views come and go with a generation: the alarms are taken again.
        let alarms = match rt.alarms() {
            Ok(a) => Some(a),
            Err(e) => {
                log::warn!("device {}: cannot watch its alarms again: {e}", rt.name);
                None
            }
        };
        if let Some(w) = self.watched.get_mut(&i) {
            w.pids = pids;
            if let Some(alarms) = alarms {
                for a in std::mem::replace(&mut w.alarms, alarms) {
                    let _ = self.epoll.delete(a.as_fd());
                }
                for a in &w.alarms {
                    if let Err(e) = self.epoll.add_once(a.as_fd(), token(i, Kind::Alarm)) {
                        log::warn!("device {}: cannot watch an alarm: {e}", rt.name);
                    }
                }
                return;
            }
        }
        self.rearm_alarms(i);
    }

    fn rearm_alarms(&self, i: usize) {
        for a in self.watched.get(&i).map(|w| &w.alarms[..]).unwrap_or_default() {
            let _ = self.epoll.rearm(a.as_fd(), token(i, Kind::Alarm));
        }
    }

    fn rearm(&self, i: usize, kind: Kind) {
        if kind == Kind::Alarm {
            return self.rearm_alarms(i);
        }
        for (fd, k) in self.watched.get(&i).map(|w| &w.pids[..]).unwrap_or_default() {
            if *k == kind {
                let _ = self.epoll.rearm(fd.as_fd(), token(i, kind));
            }
        }
    }

    /// One of device `i`'s descriptors is ready.
    fn on_ready(&mut self, i: usize, kind: Kind) {
        let Some(rt) = self.hub.devices.get(i) else { return };
        let now = self.hub.clock.now();
        let mut slot = rt.lock();
        if slot.busy {
            // A job holds the device: what this was about is the job's. The device's domains
            // are watched anew when it lets go.
            return;
        }
        let running = slot.life.state() == DeviceState::Running;
        let event = match kind {
            Kind::Top | Kind::Below => {
                let role = if kind == Kind::Top { Role::Top } else { Role::Below };
                match slot.domains.get_mut(role) {
                    Some(d) => match d.child.try_wait() {
                        Ok(Some(status)) => {
                            Some(Event::Exited { role, pid: d.pid(), code: status.code(), status: status.to_string() })
                        }
                        Ok(None) => None,
                        Err(e) => {
                            Some(Event::Exited { role, pid: d.pid(), code: None, status: format!("cannot be waited for: {e}") })
                        }
                    },
                    None => None,
                }
            }
            Kind::Model => rt.launcher.card.as_ref().and_then(|c| c.model_exited()).map(|why| Event::ModelExited { why }),
            Kind::Alarm => {
                let broken = rt.control.take_broken_report();
                let pid = slot.domains.top().map(|d| d.pid());
                broken.then_some(pid).flatten().map(|pid| Event::BrokeChannel { pid })
            }
        };
        let event = match event {
            Some(e) if running => e,
            // A failed or reconnecting device runs no domain: its descriptors are watched anew
            // when a job starts one.
            Some(_) => return,
            // Nothing happened after all: watch on.
            None => {
                drop(slot);
                return self.rearm(i, kind);
            }
        };
        let disposition = slot.life.on_event(event, rt.control.answered());
        self.begin(i, &rt, slot, disposition, now);
    }

    /// Claims device `i` (`rt`, its slot locked) for what `disposition` asks, detected at
    /// `detected`, and acts on it. A restart whose standby it lets start at once
    /// ([`start_early`](crate::standing_by::start_early)) runs here when no application is
    /// attached: it only installs the standby's queues and buries the old domain, waiting on
    /// nothing, and a worker's wake-up would be one more wait for a CPU inside the outage.
    /// Attached applications' queues are handed to the new domain over its line, a wait this
    /// thread leaves to a worker.
    fn begin(
        &mut self,
        i: usize,
        rt: &DeviceRuntime,
        mut slot: MutexGuard<'_, Slot>,
        disposition: Disposition,
        detected: Instant,
    ) {
        slot.busy = true;
        let started = crate::standing_by::start_early(rt, &mut slot, &disposition);
        drop(slot);
        if started && rt.attach.attached() == 0 {
            crate::jobs::run(rt, disposition, detected, None, &self.hub.stopping);
        } else {
            self.act(i, disposition, detected, None);
        }
    }

    /// Acts on a disposition for device `i`, claimed by the caller: at once on a worker, or
    /// after its back-off.
    fn act(&mut self, i: usize, disposition: Disposition, detected: Instant, reply: Option<Reply>) {
        match disposition {
            Disposition::Restart { delay, .. } if !delay.is_zero() => {
                let at = self.hub.clock.now() + delay;
                self.schedule(at, Timer::Job { device: i, disposition, detected, reply });
            }
            d => self.hub.dispatch(i, d, detected, reply),
        }
    }

    /// Schedules device `i`'s standby if it wants one and has none.
    fn want_standby(&mut self, i: usize) {
        let Some(rt) = self.hub.devices.get(i) else { return };
        // A device that cannot keep one (a remote backend, no spares) is not asked again.
        let wanted = crate::standing_by::wants(&rt.lock()) && rt.launcher.standby_possible();
        let pending = self.timers.values().any(|t| matches!(t, Timer::Standby(d) if *d == i));
        if wanted && !pending && self.hub.standbys.enabled() {
            let at = self.hub.clock.now() + STANDBY_AFTER;
            self.schedule(at, Timer::Standby(i));
        }
    }

    fn schedule(&mut self, at: Instant, timer: Timer) {
        self.seq += 1;
        self.timers.insert((at, self.seq), timer);
    }

    fn on_note(&mut self, note: Note) {
        match note {
            Note::Added(i) => {
                if let Err(e) = self.watch(i) {
                    log::warn!("cannot watch a new device: {e}");
                }
            }
            Note::Removed(i) => self.unwatch(i),
            Note::Released(i) => {
                let Some(rt) = self.hub.devices.get(i) else { return };
                self.rewatch(i);
                let obs = rt.observe();
                let retry = {
                    let mut slot = rt.lock();
                    slot.life.progress_seen(obs);
                    slot.life.retry_at().filter(|_| !slot.busy)
                };
                if let Some(at) = retry {
                    self.schedule(at, Timer::Retry(i));
                }
                if obs.pending > 0 && !self.hot.contains(&i) {
                    self.hot.push(i);
                }
                self.want_standby(i);
            }
            Note::Then { device, disposition, detected, reply } => self.act(device, disposition, detected, reply),
        }
    }

    fn run_timers(&mut self) {
        let now = self.hub.clock.now();
        while let Some(entry) = self.timers.first_entry() {
            if entry.key().0 > now {
                break;
            }
            match entry.remove() {
                Timer::Job { device, disposition, detected, reply } => self.hub.dispatch(device, disposition, detected, reply),
                Timer::Standby(i) => self.hub.prepare_standby(i),
                Timer::Retry(i) => {
                    let Some(rt) = self.hub.devices.get(i) else { continue };
                    let mut slot = rt.lock();
                    let due = slot.life.retry_at().is_some_and(|t| t <= now);
                    if due && !slot.busy {
                        slot.busy = true;
                        drop(slot);
                        self.hub.retry(i);
                    }
                }
            }
        }
    }

    /// Looks at `devices`: the watchdog, domains that are exiting, the graveyard, and (in a
    /// `full` look) the views' throughput. Returns those with requests pending.
    fn look(&mut self, devices: &[usize], full: bool) -> Vec<usize> {
        let mut hot = Vec::new();
        for &i in devices {
            let Some(rt) = self.hub.devices.get(i) else { continue };
            if full {
                for v in rt.views() {
                    v.sample();
                }
            }
            let obs = rt.observe();
            if obs.pending > 0 {
                hot.push(i);
            }
            let mut slot = rt.lock();
            if slot.busy {
                continue;
            }
            if !slot.graveyard.is_empty() {
                slot.graveyard.reap();
            }
            // A standby that died while it waited, or that a change left behind, is replaced;
            // one that could not be made (no spare was ready) is tried again.
            let unfit =
                |s: &Option<crate::standby::Standby>| s.as_ref().is_some_and(|s| !crate::standing_by::fits(s, &rt, &slot));
            let (unfit, unfit_tap) = (unfit(&slot.standby), unfit(&slot.tap_standby));
            if unfit || unfit_tap || (full && crate::standing_by::wants(&slot)) {
                let gone = [slot.standby.take_if(|_| unfit), slot.tap_standby.take_if(|_| unfit_tap)];
                for s in gone.into_iter().flatten() {
                    let name = rt.name.clone();
                    self.hub.workers.submit(move || s.dismiss(&name));
                }
                drop(slot);
                self.want_standby(i);
                slot = rt.lock();
                if slot.busy {
                    continue;
                }
            }
            let mut event = None;
            if slot.life.worth_looking_for_exit(&obs) {
                // The domain below first: a tap domain waiting on it is quiet too.
                for role in [Role::Below, Role::Top] {
                    if let Some(d) = slot.domains.get(role) {
                        if crate::proc_info::memory_released(d.pid()) {
                            event = Some(Event::Exiting { role, pid: d.pid() });
                            break;
                        }
                    }
                }
            }
            let disposition = match event {
                Some(e) => Some(slot.life.on_event(e, obs.answered)),
                None => match slot.domains.top().map(|d| d.pid()) {
                    Some(pid) => slot.life.tick(obs, pid),
                    None => None,
                },
            };
            if let Some(d) = disposition {
                let now = self.hub.clock.now();
                self.begin(i, &rt, slot, d, now);
            }
        }
        hot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_their_device_and_descriptor() {
        for (d, k) in [(0, Kind::Top), (7, Kind::Below), (999, Kind::Model), (1 << 40, Kind::Alarm)] {
            assert_eq!(parse(token(d, k)), Some((d, k)));
        }
        assert_eq!(parse(MAILBOX), None, "the mailbox is no device's");
    }
}
