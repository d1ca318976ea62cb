//! What the supervisor's threads share: the devices, the watcher's mailbox, the workers, and
//! whether `serve` is stopping. Jobs are handed to the workers from here.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use crate::device::DeviceRuntime;
use crate::lifecycle::Disposition;
use crate::mailbox::{Mailbox, Reply};
use crate::state::Clock;
use crate::workers::Workers;

/// The devices being served, by id. Devices come and go while `serve` runs; an id is never
/// given twice, so a note or a timer about a removed device finds nothing rather than another
/// device.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    map: RwLock<BTreeMap<usize, Arc<DeviceRuntime>>>,
    next: AtomicUsize,
}

impl Registry {
    /// A fresh id.
    pub fn next_id(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Device `id`, if it is still served.
    pub fn get(&self, id: usize) -> Option<Arc<DeviceRuntime>> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).get(&id).cloned()
    }

    /// Every device, in the order they were added.
    pub fn all(&self) -> Vec<Arc<DeviceRuntime>> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// The ids of every device.
    pub fn ids(&self) -> Vec<usize> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).keys().copied().collect()
    }

    /// The device named `name`.
    pub fn find(&self, name: &str) -> Option<Arc<DeviceRuntime>> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).values().find(|d| d.name == name).cloned()
    }

    /// Whether a device or a view is named `name`.
    pub fn name_taken(&self, name: &str) -> bool {
        self.map.read().unwrap_or_else(|e| e.into_inner()).values().any(|d| d.name == name || d.view(name).is_some())
    }

    pub fn insert(&self, rt: Arc<DeviceRuntime>) {
        self.map.write().unwrap_or_else(|e| e.into_inner()).insert(rt.id, rt);
    }

    pub fn remove(&self, id: usize) -> Option<Arc<DeviceRuntime>> {
        self.map.write().unwrap_or_else(|e| e.into_inner()).remove(&id)
    }

    pub fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// The supervisor's shared state.
#[derive(Debug)]
pub(crate) struct Hub {
    pub devices: Registry,
    pub mailbox: Arc<Mailbox>,
    pub workers: Workers,
    /// `serve` is stopping: no new generation starts.
    pub stopping: AtomicBool,
    pub clock: Arc<dyn Clock>,
    /// Room for the devices' standby domains.
    pub standbys: Arc<crate::standby::Places>,
}

impl Hub {
    /// Carries out `disposition` on device `device`, which the caller has claimed, on a worker
    /// (see [`crate::jobs::run`]). A device removed meanwhile is left alone.
    pub fn dispatch(self: &Arc<Self>, device: usize, disposition: Disposition, detected: Instant, reply: Option<Reply>) {
        let hub = self.clone();
        self.workers.submit(move || {
            if let Some(rt) = hub.devices.get(device) {
                crate::jobs::run(&rt, disposition, detected, reply, &hub.stopping);
            }
        });
    }

    /// Starts a standby for device `device` on a worker, if it still wants one
    /// ([`crate::standing_by::prepare`]).
    pub fn prepare_standby(self: &Arc<Self>, device: usize) {
        let hub = self.clone();
        self.workers.submit(move || {
            if let (Some(rt), false) = (hub.devices.get(device), hub.stopping.load(Ordering::Acquire)) {
                crate::standing_by::prepare(&rt, &hub.standbys);
            }
        });
    }

    /// Tries a `reconnecting` device's launch again on a worker; the caller has claimed it.
    pub fn retry(self: &Arc<Self>, device: usize) {
        let hub = self.clone();
        self.workers.submit(move || {
            if let Some(rt) = hub.devices.get(device) {
                crate::jobs::retry(&rt, &hub.stopping);
            }
        });
    }
}
