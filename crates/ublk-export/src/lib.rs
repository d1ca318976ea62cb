//! The ublk export: each device and view as a block device of the kernel's own,
//! `/dev/ublkbN`, served by `serve`.
//!
//! ublk (Linux ≥ 6.0) is the kernel's userspace block driver: the kernel hands each request to
//! a server through one io_uring per queue and takes the answer back, with no protocol in
//! between. Here `serve` is the server. Its workers carry each request down the device's
//! channel to the driver domain, moving the data once each way between the kernel's request and
//! the channel's arena (`UBLK_F_USER_COPY`, Linux ≥ 6.5). The ublk control and character
//! devices and their io_urings belong to `serve`, the trusted side: no domain ever holds a
//! ublk descriptor.
//!
//! A restart of a driver domain is a pause, as on every export: its requests move to the next
//! generation. With a keeper (`[keeper] enabled`, or systemd's file-descriptor store), a
//! device is made with `UBLK_F_USER_RECOVERY` and `UBLK_F_USER_RECOVERY_REISSUE`: when `serve`
//! dies or hands over to a new binary, the kernel keeps `/dev/ublkbN` and its requests, and the
//! next `serve` takes the device over (`START_USER_RECOVERY`, `END_USER_RECOVERY`); the kernel
//! then reissues what the dead one had taken. Without a keeper nothing would take the device
//! over, so it is made without recovery: a `serve` that stops deletes its devices, one that
//! crashes leaves them failing every request until the next `serve` of the run directory
//! replaces them.
//!
//! Built on libublk, the ublk project's own Rust library; its control commands and queues are
//! tied to the thread that made them, so each device has a thread that owns its control
//! device, and each queue a thread of its own.
#![deny(missing_docs)]

mod device;
mod numbers;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use bulkhead_client::Device;
use bulkhead_control::UblkStatus;

use device::{End, Exported, Setup};
use numbers::Numbers;
pub use worker::QueueStats;

/// Why the ublk export refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// This host cannot export ublk devices: what is missing.
    #[error("{0}")]
    Unavailable(String),
    /// The number a device is to have is another device's.
    #[error("`{name}`: /dev/ublkb{number} is already there ({state}): another ublk server's, or another run directory's")]
    Taken {
        /// The device or view.
        name: String,
        /// The number.
        number: u32,
        /// What the kernel says of the device that has it.
        state: &'static str,
    },
    /// A device or view is in use through its block device (mounted, or opened exclusively).
    #[error("`{name}`: {path} is in use (mounted, or held by another program)")]
    InUse {
        /// The device or view.
        name: String,
        /// Its block device.
        path: String,
    },
    /// Making, taking over or ending a device failed.
    #[error("`{name}`: {what}")]
    Failed {
        /// The device or view.
        name: String,
        /// What failed.
        what: String,
    },
    /// The run directory's record of numbers cannot be read or written.
    #[error("{path}: {source}")]
    Numbers {
        /// The record.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What the ublk export runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the run directory keeps each device's number (`<run-dir>/ublk`).
    pub dir: PathBuf,
    /// Requests in flight per queue.
    pub depth: u16,
    /// A keeper will start the next `serve`: devices are left to it rather than deleted when
    /// this one ends without a stop, and taken over from the one before.
    pub recovery: bool,
    /// Numbers the configuration gives, by device or view.
    pub numbers: Vec<(String, u32)>,
}

/// What this kernel's ublk driver can do, as [`probe`] found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Support {
    /// The driver's `UBLK_F_*` features.
    pub features: u64,
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()).unwrap_or_else(|_| "unknown".into())
}

fn at_least(release: &str, major: u32, minor: u32) -> bool {
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse::<u32>().ok());
    matches!((parts.next(), parts.next()), (Some(a), Some(b)) if (a, b) >= (major, minor))
}

/// Whether this host can export ublk devices, and what its driver can do; the error says
/// what is missing (the control device, the `ublk_drv` module, the kernel version, a feature).
pub fn probe() -> Result<Support, Error> {
    let release = kernel_release();
    if !Path::new("/dev/ublk-control").exists() {
        let why = if !at_least(&release, 6, 0) {
            format!("ublk needs Linux ≥ 6.0 (this is {release})")
        } else if !Path::new("/sys/module/ublk_drv").exists() {
            format!("the ublk_drv module is not loaded (`modprobe ublk_drv`; Linux {release} has it only if built with CONFIG_BLK_DEV_UBLK)")
        } else {
            "the ublk_drv module is loaded but /dev/ublk-control was not made (is /dev a devtmpfs?)".to_string()
        };
        return Err(Error::Unavailable(format!("/dev/ublk-control does not exist: {why}")));
    }
    let Some(features) = libublk::ctrl::UblkCtrl::get_features() else {
        return Err(Error::Unavailable(format!(
            "/dev/ublk-control: this kernel's ublk cannot say its features (Linux ≥ 6.5 is needed for the copies the export makes; this is {release})"
        )));
    };
    let needed = [
        (libublk::sys::UBLK_F_USER_COPY, "UBLK_F_USER_COPY (Linux ≥ 6.5)"),
        (libublk::sys::UBLK_F_USER_RECOVERY, "UBLK_F_USER_RECOVERY (Linux ≥ 6.0)"),
        (libublk::sys::UBLK_F_USER_RECOVERY_REISSUE, "UBLK_F_USER_RECOVERY_REISSUE (Linux ≥ 6.0)"),
    ];
    let missing: Vec<&str> = needed.iter().filter(|(f, _)| features & u64::from(*f) == 0).map(|(_, n)| *n).collect();
    if !missing.is_empty() {
        return Err(Error::Unavailable(format!(
            "/dev/ublk-control: this kernel's ublk ({release}) lacks {}",
            missing.join(", ")
        )));
    }
    Ok(Support { features })
}

/// The ublk export of a `serve`: the devices and views it serves as `/dev/ublkbN`.
pub struct UblkExport {
    settings: Settings,
    numbers: Mutex<Numbers>,
    devices: Mutex<Vec<Exported>>,
}

impl UblkExport {
    /// Exports each of `devices`; on a failure, the ones already exported are deleted again
    /// and the error returned.
    pub fn start(settings: Settings, devices: Vec<Arc<Device>>) -> Result<UblkExport, Error> {
        probe()?;
        let numbers =
            Numbers::load(&settings.dir).map_err(|source| Error::Numbers { path: settings.dir.join("numbers.json"), source })?;
        let export = UblkExport { settings, numbers: Mutex::new(numbers), devices: Mutex::new(Vec::new()) };
        for dev in devices {
            if let Err(e) = export.add(dev) {
                export.shutdown();
                return Err(e);
            }
        }
        Ok(export)
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Exported>> {
        self.devices.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn numbers(&self) -> MutexGuard<'_, Numbers> {
        self.numbers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn numbers_error(&self, source: std::io::Error) -> Error {
        Error::Numbers { path: self.settings.dir.join("numbers.json"), source }
    }

    /// Exports `dev` as a `/dev/ublkbN`: the one an earlier `serve` left for it, or a new one
    /// (of the number the configuration gives, or kept for it, or the kernel's choice).
    pub fn add(&self, dev: Arc<Device>) -> Result<(), Error> {
        let name = dev.name().to_string();
        if self.lock().iter().any(|e| e.dev.name() == name) {
            return Err(Error::Failed { name, what: "it is exported already".into() });
        }
        let configured = self.settings.numbers.iter().find(|(n, _)| *n == name).map(|&(_, num)| num);
        let kept = self.numbers().get(&name);
        let number = configured.or(kept);
        let setup = Setup {
            dev,
            number,
            ours: kept.is_some() && kept == number,
            depth: self.settings.depth,
            recovery: self.settings.recovery,
        };
        let exported = Exported::start(setup)?;
        log::info!(
            "`{name}`: {} ({})",
            exported.path(),
            if exported.recovered { "taken over from the serve before" } else { "made" }
        );
        if let Err(e) = self.numbers().set(&name, exported.number) {
            exported.end(End::Delete);
            return Err(self.numbers_error(e));
        }
        self.lock().push(exported);
        Ok(())
    }

    /// Whether `name`'s block device is in use: mounted, or held exclusively by a program.
    pub fn in_use(&self, name: &str) -> bool {
        self.lock().iter().find(|e| e.dev.name() == name).is_some_and(|e| held(&e.path()))
    }

    /// Takes `name` off the export, deleting its block device; without `force`, refused while
    /// the block device is in use. Returns the device, if it was exported.
    pub fn remove(&self, name: &str, force: bool) -> Result<Option<Arc<Device>>, Error> {
        let mut devices = self.lock();
        let Some(i) = devices.iter().position(|e| e.dev.name() == name) else { return Ok(None) };
        if !force && held(&devices[i].path()) {
            return Err(Error::InUse { name: name.to_string(), path: devices[i].path() });
        }
        let e = devices.remove(i);
        drop(devices);
        let dev = e.dev.clone();
        e.end(End::Delete);
        if let Err(e) = self.numbers().forget(name) {
            log::warn!("`{name}`: {e}");
        }
        Ok(Some(dev))
    }

    /// The block device of `name`, if it is exported.
    pub fn path_of(&self, name: &str) -> Option<PathBuf> {
        self.lock().iter().find(|e| e.dev.name() == name).map(|e| PathBuf::from(e.path()))
    }

    /// Each exported device's block device and counters.
    pub fn status(&self) -> Vec<UblkStatus> {
        self.lock()
            .iter()
            .map(|e| {
                let sum = |f: fn(&QueueStats) -> u64| e.stats.iter().map(f).sum::<u64>();
                UblkStatus {
                    device: e.dev.name().to_string(),
                    number: e.number,
                    path: PathBuf::from(e.path()),
                    recovered: e.recovered,
                    queues: e.queues,
                    depth: e.depth,
                    taken: sum(|q| q.taken.load(Ordering::Relaxed)),
                    failed: sum(|q| q.failed.load(Ordering::Relaxed)),
                    max_in_flight: e.stats.iter().map(|q| q.max_in_flight.load(Ordering::Relaxed)).max().unwrap_or(0),
                }
            })
            .collect()
    }

    /// Deletes every block device (`serve` stops): the requests in flight are answered first.
    pub fn shutdown(&self) {
        let all: Vec<Exported> = self.lock().drain(..).collect();
        for e in all.into_iter().rev() {
            e.end(End::Delete);
        }
    }

    /// Leaves every block device to the next `serve` (a hand-over): the kernel keeps them and
    /// their requests until it takes them over. Without recovery, as [`shutdown`](Self::shutdown).
    pub fn release(&self) {
        let how = if self.settings.recovery { End::Leave } else { End::Delete };
        let all: Vec<Exported> = self.lock().drain(..).collect();
        for e in all.into_iter().rev() {
            e.end(how);
        }
    }
}

/// Whether block device `path` is mounted or held exclusively (an exclusive open fails with
/// EBUSY).
fn held(path: &str) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_EXCL).open(path) {
        Ok(_) => false,
        Err(e) => e.raw_os_error() == Some(libc::EBUSY),
    }
}

/// Deletes every device a run directory's `serve`s had made and that the kernel still holds
/// (a keeper giving up on `serve`: the devices' users get errors instead of waiting for
/// ever). Returns how many it deleted.
pub fn abandon(dir: &Path) -> usize {
    let Ok(numbers) = Numbers::load(dir) else { return 0 };
    let mut n = 0;
    for (name, number) in numbers.all() {
        let Ok(ctrl) = libublk::ctrl::UblkCtrl::new_simple(number as i32) else { continue };
        let _ = ctrl.kill_dev();
        match ctrl.del_dev() {
            Ok(_) => {
                n += 1;
                log::info!("`{name}`: /dev/ublkb{number} deleted");
            }
            Err(e) => log::warn!("`{name}`: cannot delete /dev/ublkb{number}: {e}"),
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_compare_by_major_then_minor() {
        assert!(at_least("6.12.95+deb12-amd64", 6, 5));
        assert!(at_least("6.5.0", 6, 5));
        assert!(!at_least("6.1.0-26-amd64", 6, 5));
        assert!(!at_least("5.19.17", 6, 0));
        assert!(!at_least("garbage", 6, 0));
    }

    #[test]
    fn a_host_without_ublk_is_refused_naming_what_is_missing() {
        if Path::new("/dev/ublk-control").exists() {
            return;
        }
        let e = probe().unwrap_err().to_string();
        assert!(e.contains("/dev/ublk-control") && (e.contains("ublk_drv") || e.contains("Linux")), "{e}");
    }
}
