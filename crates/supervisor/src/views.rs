//! Views: parts of a device, each exported under a name of its own over channels of its own, served
//! by the device's domain (section 5.4 of Fraser et al., "Safe Hardware Access with the Xen Virtual
//! Machine Monitor").
//!
//! A view is a [`Device`] of its own to the exports — its own queues, its own generations —
//! while the domain behind it is the device's: a restart starts every view's queues over with
//! the device's. [`Controls`] is the supervisor's face of all of them at once. A view's caps
//! live in the device's state page ([`bulkhead_qos::page`]), where the domain reads them when
//! they change and writes back its credit.

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::error::Error;
use bulkhead_channel::FrontQueue;
use bulkhead_client::{Device, DeviceControl};
use bulkhead_filters::state::StatePage;
use bulkhead_qos::{page, Caps};

/// A view of a running device.
#[derive(Debug)]
pub struct ViewRuntime {
    /// Its name (its FUSE file and NBD export name).
    pub name: String,
    /// Where it starts in the device.
    pub offset: u64,
    /// Its size.
    pub size: u64,
    /// Writes are refused.
    pub read_only: bool,
    /// Its queues.
    pub queues: usize,
    /// Its frontend, shared with the exports.
    pub device: Arc<Device>,
    /// Its index in the domain's spec and state page (lower when a view before it goes).
    index: AtomicUsize,
    /// Its caps, as last set.
    caps: Mutex<Caps>,
    /// Bytes it had moved when its throughput was last sampled, and when.
    sample: Mutex<Sample>,
}

#[derive(Debug)]
struct Sample {
    at: Instant,
    bytes: u64,
    ops: u64,
    /// Throughput over the last sampling interval: bytes/s and requests/s.
    rate: (f64, f64),
}

/// How often a view's throughput is sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

pub use bulkhead_control::ViewStatus;

impl ViewRuntime {
    /// A view over `fronts`, its caps written to `state` for the domain to read.
    pub(crate) fn new(
        setup: &ViewSetup,
        index: usize,
        fronts: Vec<FrontQueue>,
        state: &StatePage,
    ) -> (ViewRuntime, DeviceControl) {
        let (device, control) = Device::new(&setup.name, setup.size, fronts, None);
        device.set_read_only(setup.read_only);
        write_caps(state, index, &setup.caps);
        let v = ViewRuntime {
            name: setup.name.clone(),
            offset: setup.offset,
            size: setup.size,
            read_only: setup.read_only,
            queues: setup.queues,
            device,
            index: AtomicUsize::new(index),
            caps: Mutex::new(setup.caps),
            sample: Mutex::new(Sample { at: Instant::now(), bytes: 0, ops: 0, rate: (0.0, 0.0) }),
        };
        (v, control)
    }

    /// Its index in the domain's spec and state page.
    pub(crate) fn index(&self) -> usize {
        self.index.load(Ordering::Acquire)
    }

    /// Moves it to index `to` (a view before it went): its entry in the state page moves
    /// with it. Only while no domain runs.
    pub(crate) fn move_to(&self, to: usize, state: &StatePage) {
        let from = self.index();
        for f in 0..page::STRIDE {
            state.set(page::slot(to, f), state.get(page::slot(from, f)));
        }
        self.index.store(to, Ordering::Release);
    }

    /// Its caps.
    pub fn caps(&self) -> Caps {
        *self.caps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes its caps; the domain takes them on its next look at the view, and a restarted
    /// domain finds them in the page.
    pub(crate) fn set_caps(&self, caps: Caps, state: &StatePage) -> Result<(), Error> {
        caps.check().map_err(|e| Error::invalid(e.to_string()))?;
        let mut c = self.caps.lock().unwrap_or_else(|e| e.into_inner());
        write_caps(state, self.index(), &caps);
        *c = caps;
        Ok(())
    }

    fn moved(&self) -> (u64, u64) {
        let c = &self.device.counters;
        (
            c.bytes_read.load(Ordering::Relaxed) + c.bytes_written.load(Ordering::Relaxed),
            c.completed.load(Ordering::Relaxed) + c.failed.load(Ordering::Relaxed),
        )
    }

    /// Samples its throughput if a second has passed (called by the watcher's loop).
    pub(crate) fn sample(&self) {
        let mut s = self.sample.lock().unwrap_or_else(|e| e.into_inner());
        let dt = s.at.elapsed();
        if dt < SAMPLE_EVERY {
            return;
        }
        let (bytes, ops) = self.moved();
        let secs = dt.as_secs_f64();
        s.rate = ((bytes - s.bytes) as f64 / secs, (ops - s.ops) as f64 / secs);
        s.at = Instant::now();
        s.bytes = bytes;
        s.ops = ops;
    }

    /// Its status.
    pub(crate) fn status(&self, state: &StatePage) -> ViewStatus {
        let caps = self.caps();
        let rate = self.sample.lock().unwrap_or_else(|e| e.into_inner()).rate;
        let slot = |f| state.get(page::slot(self.index(), f));
        ViewStatus {
            name: self.name.clone(),
            offset: self.offset,
            size_bytes: self.size,
            read_only: self.read_only,
            queues: self.queues,
            qos: caps,
            qos_summary: caps.to_string(),
            credit_bytes: slot(page::CREDIT_BYTES) as i64,
            credit_ios: slot(page::CREDIT_IOS) as i64,
            credit_waits: slot(page::WAITS),
            throttled_s: slot(page::HELD_NS) as f64 / 1e9,
            io: self.device.io_figures(),
            requests_completed: self.device.counters.completed.load(Ordering::Relaxed),
            requests_failed: self.device.counters.failed.load(Ordering::Relaxed),
            throughput_mib_s: rate.0 / (1 << 20) as f64,
            iops: rate.1,
        }
    }
}

/// Clears view `index`'s entry in the page and writes `caps` there: for a view new to the
/// device, before a domain runs that serves it.
pub(crate) fn reset_entry(state: &StatePage, index: usize, caps: &Caps) {
    for f in 0..page::STRIDE {
        state.set(page::slot(index, f), 0);
    }
    write_caps(state, index, caps);
}

/// Writes view `index`'s caps to the page: the sequence number odd while they are written.
fn write_caps(state: &StatePage, index: usize, caps: &Caps) {
    let seq = page::slot(index, page::SEQ);
    let s = state.get(seq);
    let writing = if s.is_multiple_of(2) { s + 1 } else { s + 2 };
    state.set(seq, writing);
    std::sync::atomic::fence(Ordering::Release);
    for (i, v) in caps.to_slots().into_iter().enumerate() {
        state.set(page::slot(index, page::CAPS + i), v);
    }
    std::sync::atomic::fence(Ordering::Release);
    state.set(seq, writing + 1);
}

/// A view as configured, resolved against its device's size.
#[derive(Debug, Clone)]
pub(crate) struct ViewSetup {
    pub name: String,
    pub offset: u64,
    pub size: u64,
    pub read_only: bool,
    pub queues: usize,
    /// Slots for attached applications' queues.
    pub attach: usize,
    pub caps: Caps,
}

impl ViewSetup {
    /// Resolves the `[[device.view]]` tables of `device` against its size `size`.
    pub(crate) fn resolve(device: &str, views: &[bulkhead_config::View], size: u64) -> Result<Vec<ViewSetup>, Error> {
        let mut out = Vec::with_capacity(views.len());
        for v in views {
            let name = v.name.get_ref().clone();
            let (offset, len) = (v.offset(), v.size_in(size));
            if len == 0 || offset.checked_add(len).is_none_or(|end| end > size) {
                return Err(Error::invalid(format!(
                    "device `{device}`: view `{name}`: {len} bytes at offset {offset} do not lie within the device ({size} bytes)"
                )));
            }
            out.push(ViewSetup {
                name,
                offset,
                size: len,
                read_only: v.read_only,
                queues: v.queue_count() as usize,
                attach: v.attach_slots() as usize,
                caps: v.caps(),
            });
        }
        Ok(out)
    }

    /// What the domain is told of it.
    pub(crate) fn spec(&self) -> bulkhead_spec::ViewSpec {
        bulkhead_spec::ViewSpec { name: self.name.clone(), offset: self.offset, size: self.size, read_only: self.read_only }
    }
}

/// The supervisor's face of a device and its views at once: the device's control first, then
/// each view's, each with its number of queues (a new generation's queues come in that order).
/// Views come and go while the device runs.
#[derive(Debug)]
pub struct Controls {
    parts: RwLock<Vec<(DeviceControl, usize)>>,
}

impl Controls {
    /// The device's control over its own `queues` queues.
    pub(crate) fn new(device: DeviceControl, queues: usize) -> Controls {
        Controls { parts: RwLock::new(vec![(device, queues)]) }
    }

    fn parts(&self) -> RwLockReadGuard<'_, Vec<(DeviceControl, usize)>> {
        self.parts.read().unwrap_or_else(|e| e.into_inner())
    }

    fn parts_mut(&self) -> RwLockWriteGuard<'_, Vec<(DeviceControl, usize)>> {
        self.parts.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a view's control over its `queues` queues.
    pub(crate) fn push(&self, view: DeviceControl, queues: usize) {
        self.parts_mut().push((view, queues));
    }

    /// Fails view `index`: its requests fail at once, now and later.
    pub(crate) fn fail_view(&self, index: usize, reason: &str) {
        if let Some((c, _)) = self.parts().get(index + 1) {
            c.fail(reason);
        }
    }

    /// Takes view `index`'s control out.
    pub(crate) fn remove_view(&self, index: usize) -> DeviceControl {
        self.parts_mut().remove(index + 1).0
    }

    fn each<T>(&self, f: impl FnMut(&DeviceControl) -> T) -> Vec<T> {
        self.parts().iter().map(|(c, _)| c).map(f).collect()
    }

    /// Requests answered on the device and its views (the watchdog's progress measure).
    pub fn answered(&self) -> u64 {
        self.parts().iter().map(|(c, _)| c.answered()).sum()
    }

    /// Requests in flight on the device and its views.
    pub fn in_flight(&self) -> usize {
        self.parts().iter().map(|(c, _)| c.in_flight()).sum()
    }

    /// The alarm doorbells of the device and each view, rung when a queue reports its channel
    /// broken.
    pub fn alarms(&self) -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
        self.each(DeviceControl::alarm).into_iter().collect()
    }

    /// Whether any queue reported a broken channel; clears every report.
    pub fn take_broken_report(&self) -> bool {
        self.each(DeviceControl::take_broken_report).into_iter().fold(false, |any, b| b | any)
    }

    /// Logs for the device, rate-limited.
    pub fn log_limited(&self, line: impl FnOnce() -> String) {
        self.parts()[0].0.log_limited(line);
    }

    /// Marks the start of an outage everywhere.
    pub fn outage_started(&self, at: Instant) {
        self.each(|c| c.outage_started(at));
    }

    /// Times an outage the frontends do not see as one.
    pub fn time_outage(&self, at: Instant) {
        self.each(|c| c.time_outage(at));
    }

    /// Ends the outages being timed where nothing waits.
    pub fn outage_over_if_idle(&self) {
        self.each(DeviceControl::outage_over_if_idle);
    }

    /// Installs a new generation: `queues` in the order the launch made them. Returns those
    /// left over: the queues of views new in this generation.
    pub fn install_generation(&self, mut queues: Vec<FrontQueue>) -> Vec<FrontQueue> {
        for (c, n) in self.parts().iter() {
            let rest = queues.split_off((*n).min(queues.len()));
            c.install_generation(std::mem::replace(&mut queues, rest));
        }
        queues
    }

    /// Starts every queue of the device and its views over in place as `generation`.
    pub fn start_over_in_place(&self, generation: u32, timeout: Duration) -> Result<(), Error> {
        let until = Instant::now() + timeout;
        for (c, _) in self.parts().iter() {
            c.start_over_in_place(generation, until.saturating_duration_since(Instant::now()))
                .map_err(|e| Error::failed(e.to_string()))?;
        }
        Ok(())
    }

    /// The device's outages, ms (its views see the same ones).
    pub fn outages_ms(&self) -> Vec<f64> {
        self.parts()[0].0.outages_ms()
    }

    /// The same outages, each with when it was detected.
    pub fn outages(&self) -> Vec<(Instant, f64)> {
        self.parts()[0].0.outages()
    }

    /// Fails the device and its views.
    pub fn fail(&self, reason: &str) {
        self.each(|c| c.fail(reason));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(table: &str) -> bulkhead_config::View {
        let cfg =
            format!("[[device]]\nname = \"d\"\nsize = \"1G\"\n[device.backend]\ntype = \"ram\"\n[[device.view]]\n{table}\n");
        bulkhead_config::Config::parse(&cfg, "test").unwrap().devices.remove(0).views.remove(0)
    }

    #[test]
    fn views_resolve_against_the_size_the_filters_leave_and_refuse_to_reach_past_it() {
        let v = view("name = \"a\"\noffset = \"512M\"");
        let set = ViewSetup::resolve("d", std::slice::from_ref(&v), 1 << 30).unwrap();
        assert_eq!((set[0].offset, set[0].size, set[0].queues), (512 << 20, 512 << 20, 1));
        // The same view over a device the filters made smaller no longer fits.
        let e = ViewSetup::resolve("d", &[v], 256 << 20).unwrap_err();
        assert!(e.message().contains("view `a`") && e.message().contains("do not lie within the device"), "{e}");
    }

    #[test]
    fn caps_are_written_to_the_state_page_whole_and_bad_caps_are_refused() {
        let (_fd, page) = crate::chain::shared_page("bulkhead-views-test", true).unwrap();
        let setup = &ViewSetup::resolve("d", &[view("name = \"a\"\niops = 100")], 1 << 30).unwrap()[0];
        let front = bulkhead_channel::pair(&bulkhead_channel::QueueConfig::default(), 1 << 30).unwrap().0;
        let (v, _control) = ViewRuntime::new(setup, 0, vec![front], &page);
        assert_eq!(v.caps().iops, 100);
        // The sequence number is even once the caps are whole.
        assert_eq!(page.get(page::slot(0, page::SEQ)) % 2, 0);
        let bad = Caps { burst_ios: 5, iops: 0, ..v.caps() };
        assert!(v.set_caps(bad, &page).is_err(), "a burst without a rate is refused");
        assert_eq!(v.caps().iops, 100, "and the caps in force stay");
        let status = v.status(&page);
        assert_eq!((status.name.as_str(), status.size_bytes), ("a", 1 << 30));
    }
}
