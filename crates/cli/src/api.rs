//! The control API as `serve` answers it: each call of [`bulkhead_control::Service`] over the
//! supervisor and the exports.

use std::sync::Arc;

use crate::kept::Keeper;
use bulkhead_control::{Activate, Activity, Deactivate, Geometry};
use bulkhead_control::{
    AddDevice, AddFilter, Changed, ConfigText, ControlError, DeviceRemoved, DevicesAdded, DumpConfig, Hello, HelloReply,
    ListSnapshots, QosReply, Reload, Reloaded, RemoveDevice, RemoveFilter, Restart, Service, SetQos, SetTap, Snapshot,
    SnapshotAction, SnapshotEntry, Snapshots, Status, StatusReport,
};
use bulkhead_control::{AddView, RemoveView, Upgrade, Upgrading, ViewAdded, ViewRemoved};
use bulkhead_supervisor::{DeviceChange, Supervisor};

use crate::live::{Edit, Live};

/// What answers the control socket in `serve`.
pub struct ServeApi {
    /// The supervisor, the exports and the running configuration.
    pub live: Arc<Live>,
    /// What keeps the descriptors across a restart of `serve`.
    pub keeper: Keeper,
    /// Why this `serve` runs the binary of the one before it, if the keeper fell back to it.
    pub fell_back: Option<String>,
}

impl ServeApi {
    fn sup(&self) -> &Supervisor {
        &self.live.sup
    }

    fn known_device(&self, name: &str) -> Result<(), ControlError> {
        if self.sup().has_device(name) {
            Ok(())
        } else {
            Err(ControlError::not_found(format!("no device `{name}`")))
        }
    }

    /// What device `name`'s guests see of it.
    fn geometry(&self, name: &str) -> Result<Geometry, ControlError> {
        let fronts = self.sup().frontends(name);
        let dev = fronts.first().ok_or_else(|| ControlError::not_found(format!("no device `{name}`")))?;
        Ok(Geometry { size_bytes: dev.size(), block_size: dev.min_block().max(512), read_only: dev.read_only() })
    }

    /// Makes `device` write or not, after checking it against what the other end's was.
    fn set_active(&self, device: String, active: bool, expect: Option<Geometry>) -> Result<Activity, ControlError> {
        self.known_device(&device)?;
        let geometry = self.geometry(&device)?;
        if let Some(why) = expect.and_then(|e| geometry.mismatch(&e)) {
            return Err(ControlError::invalid(format!(
                "device `{device}`: not the device the other end had: {why}; it stays inactive"
            )));
        }
        let changed = self
            .sup()
            .set_active(&device, active, crate::live::DRAIN)
            .map_err(|e| ControlError::from(e.context(format!("device `{device}`"))))?;
        if changed.is_some() {
            self.live.note(Edit::Active { device: &device, active });
        }
        let driver_pid = match changed {
            Some(pid) => pid,
            None => self.sup().status().devices.iter().find(|d| d.name == device).map_or(0, |d| d.driver_pid),
        };
        Ok(Activity { device, active, changed: changed.is_some(), driver_pid, geometry })
    }

    /// Applies `change` to `device` and answers with its new driver domain.
    fn change(&self, device: String, change: DeviceChange) -> Result<Changed, ControlError> {
        self.known_device(&device)?;
        match self.sup().change_device(&device, change) {
            Ok(driver_pid) => Ok(Changed { device, driver_pid }),
            Err(e) => Err(ControlError::failed(format!("device `{device}`: {e}"))),
        }
    }
}

impl Service for ServeApi {
    fn hello(&self, _: Hello) -> Result<HelloReply, ControlError> {
        Ok(HelloReply {
            protocol: bulkhead_control::PROTOCOL_VERSION,
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            fell_back: self.fell_back.clone(),
        })
    }

    fn status(&self, _: Status) -> Result<StatusReport, ControlError> {
        let mut report = self.sup().status();
        report.fuse = self.live.exports.fuse_status();
        report.vhost_user = self.live.exports.vhost_status();
        report.ublk = self.live.exports.ublk_status();
        Ok(report)
    }

    fn restart(&self, c: Restart) -> Result<Changed, ControlError> {
        self.change(c.device, DeviceChange::Restart)
    }

    fn set_tap(&self, c: SetTap) -> Result<Changed, ControlError> {
        let done = self.change(c.device.clone(), DeviceChange::Tap(c.mode))?;
        self.live.note(Edit::Tap { device: &c.device, mode: c.mode });
        Ok(done)
    }

    fn activate(&self, c: Activate) -> Result<Activity, ControlError> {
        self.set_active(c.device, true, c.expect)
    }

    fn deactivate(&self, c: Deactivate) -> Result<Activity, ControlError> {
        self.set_active(c.device, false, None)
    }

    fn add_filter(&self, c: AddFilter) -> Result<Changed, ControlError> {
        let done = self.change(c.device.clone(), DeviceChange::AddFilter { at: c.at, table: c.table.clone() })?;
        self.live.note(Edit::FilterAdded { device: &c.device, at: c.at, table: &c.table });
        Ok(done)
    }

    fn remove_filter(&self, c: RemoveFilter) -> Result<Changed, ControlError> {
        let done = self.change(c.device.clone(), DeviceChange::RemoveFilter(c.at))?;
        self.live.note(Edit::FilterRemoved { device: &c.device, at: c.at });
        Ok(done)
    }

    fn snapshot(&self, c: Snapshot) -> Result<Changed, ControlError> {
        self.known_device(&c.device)?;
        match self.sup().snapshot(&c.device, c.op, &c.name) {
            Ok(driver_pid) => {
                if c.op == SnapshotAction::Revert {
                    self.live.exports.invalidate(&c.device);
                }
                Ok(Changed { device: c.device, driver_pid })
            }
            Err(e) => Err(ControlError::failed(format!("device `{}`: snapshot {} `{}`: {e}", c.device, c.op.as_str(), c.name))),
        }
    }

    fn list_snapshots(&self, c: ListSnapshots) -> Result<Snapshots, ControlError> {
        self.known_device(&c.device)?;
        let list = self.sup().snapshots(&c.device).map_err(|e| ControlError::failed(format!("device `{}`: {e}", c.device)))?;
        let snapshots = list
            .into_iter()
            .map(|i| SnapshotEntry {
                id: i.id,
                name: i.name,
                date_sec: i.date_sec,
                date_nsec: i.date_nsec,
                disk_size: i.disk_size,
                vm_state_size: i.vm_state_size,
            })
            .collect();
        Ok(Snapshots { device: c.device, snapshots })
    }

    fn set_qos(&self, c: SetQos) -> Result<QosReply, ControlError> {
        if !self.sup().has_view(&c.view) {
            return Err(ControlError::not_found(format!("no view `{}`", c.view)));
        }
        let changes: Vec<(String, String)> = c.set.into_iter().collect();
        match self.sup().set_qos(&c.view, &changes) {
            Ok(qos) => {
                if !changes.is_empty() {
                    self.live.note(Edit::Qos { view: &c.view, caps: qos });
                }
                Ok(QosReply { summary: qos.to_string(), view: c.view, qos })
            }
            Err(e) => Err(ControlError::invalid(format!("view `{}`: {e}", c.view))),
        }
    }

    fn add_device(&self, c: AddDevice) -> Result<DevicesAdded, ControlError> {
        self.live.add_devices(&c.table).map(|devices| DevicesAdded { devices })
    }

    fn remove_device(&self, c: RemoveDevice) -> Result<DeviceRemoved, ControlError> {
        self.live.remove_device(&c.name, c.force).map(|cut_off| DeviceRemoved { name: c.name, cut_off })
    }

    fn add_view(&self, c: AddView) -> Result<ViewAdded, ControlError> {
        self.live.add_view(&c.device, &c.table)
    }

    fn remove_view(&self, c: RemoveView) -> Result<ViewRemoved, ControlError> {
        self.live.remove_view(&c.name, c.force)
    }

    fn dump_config(&self, _: DumpConfig) -> Result<ConfigText, ControlError> {
        Ok(ConfigText { toml: self.live.dump() })
    }

    fn reload(&self, _: Reload) -> Result<Reloaded, ControlError> {
        // The unit's ExecReload= asks here: systemd hears of it as it does of a SIGHUP.
        crate::notify::reloading();
        let r = self.live.reload();
        crate::notify::ready(&self.live.sup);
        r
    }

    fn upgrade(&self, _: Upgrade) -> Result<Upgrading, ControlError> {
        if self.keeper == Keeper::None {
            return Err(ControlError::invalid(
                "an upgrade needs a keeper to hold the exports meanwhile: set `[keeper] enabled = true`, or run under systemd with FileDescriptorStoreMax=",
            ));
        }
        crate::upgrade::request();
        Ok(Upgrading { pid: std::process::id(), keeper: self.keeper.name().into() })
    }
}
