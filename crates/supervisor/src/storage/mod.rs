//! A device's storage, opened by the supervisor once when the device starts (the domain opens
//! nothing): each kind of backend opens and checks its own, and says what it holds.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use bulkhead_config::{BackendConfig, DeviceConfig, ImageFormat};
use bulkhead_sandbox::Policy;

use crate::error::Error;
use crate::kept::Keep;

mod local;
mod nbd;
pub(crate) mod qcow2;

pub(crate) use local::auto_engine;
pub(crate) use nbd::connect as connect_nbd;

/// The backend's storage as the supervisor opened it.
pub(crate) struct Storage {
    /// Bytes of the device it makes (0: an rbd image whose size a domain is to learn).
    pub size: u64,
    /// The backend in words, for status.
    pub desc: String,
    /// Descriptors every generation of the domain gets.
    pub fds: Vec<OwnedFd>,
    /// Each image's format, for a disk image (the image, then its backing files).
    pub formats: Vec<bulkhead_image::Format>,
    /// A `vdev` device's card and its model's domain.
    pub card: Option<crate::vdev::CardDevice>,
    /// An `rbd` device's cluster addresses, and what its domains say once they have opened it.
    pub rbd: Option<(crate::rbd::Reach, crate::rbd::Opened)>,
}

impl Storage {
    /// Storage of `size` bytes held in `fds`.
    fn held(size: u64, desc: String, fds: Vec<OwnedFd>) -> Storage {
        Storage { size, desc, fds, formats: Vec::new(), card: None, rbd: None }
    }

    /// Opens (or creates) the storage of `backend` for device `name` as `cfg` sizes it, to
    /// write if `active` (and the backend is not read-only); a `vdev` device's model domain is
    /// exec'd from `exe`, as the device's other domains are.
    pub fn open(
        name: &str,
        cfg: &DeviceConfig,
        backend: &BackendConfig,
        active: bool,
        sandbox: Policy,
        exe: &Path,
        keep: &Keep,
    ) -> Result<Storage, Error> {
        let size = cfg.size.as_ref().map(|s| s.get_ref().0);
        if let Some(s) = Storage::reopen(backend, active, size) {
            return s;
        }
        let required = |what: &str| size.ok_or_else(|| Error::invalid(format!("size is required for a {what} device")));
        match backend {
            BackendConfig::Ram => local::ram(name, required("ram")?, keep),
            BackendConfig::Null => Ok(Storage::held(required("null")?, "null".into(), Vec::new())),
            BackendConfig::File { .. } => unreachable!("opened above"),
            BackendConfig::Nbd { uri, target, export, connect_timeout_ms, .. } => {
                nbd::open(uri, target, export, Duration::from_millis(*connect_timeout_ms), size)
            }
            BackendConfig::Rbd { mon_host, networks, pool, namespace, image, read_only, .. } => {
                // Without `size`, the image's: `Launcher::open` asks a domain for it.
                let reach = crate::rbd::Reach::resolve(mon_host, networks).map_err(|e| e.context("backend mon_host"))?;
                let ns = if namespace.is_empty() { String::new() } else { format!("{namespace}/") };
                let desc = format!("rbd:{pool}/{ns}{image}{}", if *read_only { ",ro" } else { "" });
                let opened = crate::rbd::Opened::of_device(name, keep.clone());
                Ok(Storage { rbd: Some((reach, opened)), ..Storage::held(size.unwrap_or(0), desc, Vec::new()) })
            }
            BackendConfig::Vdev { card, wait } => {
                let size = required("vdev")?;
                let c = crate::vdev::CardDevice::start(name, card, size, sandbox, exe)?;
                let desc = crate::vdev::describe(card, c.name(), *wait);
                Ok(Storage { card: Some(c), ..Storage::held(size, desc, Vec::new()) })
            }
        }
    }
}

impl Storage {
    /// Opens a file or an image again (`None` for any other backend, whose domains open it
    /// themselves), to write if `active`: a device activated or deactivated keeps nothing of
    /// the descriptors before, so an inactive one never held one that writes.
    pub fn reopen(backend: &BackendConfig, active: bool, size: Option<u64>) -> Option<Result<Storage, Error>> {
        match backend {
            BackendConfig::File { path, read_only, format: ImageFormat::Qcow2, .. } => {
                Some(qcow2::open(path, *read_only, active))
            }
            BackendConfig::File { path, direct, engine, read_only, .. } => {
                Some(local::file(path, *direct, *engine, *read_only, active, size))
            }
            _ => None,
        }
    }
}

/// The device's size: `configured` if it fits in the `have` bytes of `what`, else all of
/// them in whole sectors; never none.
fn fit(configured: Option<u64>, have: u64, what: &str) -> Result<u64, Error> {
    let size = match configured {
        Some(s) if s > have => return Err(Error::invalid(format!("size {s} exceeds the {have} bytes of {what}"))),
        Some(s) => s,
        None => have / 512 * 512,
    };
    if size == 0 {
        return Err(Error::invalid(format!("{what} is empty")));
    }
    Ok(size)
}
