//! Descriptors kept outside `serve`, so that a `serve` started after this one dies or is
//! upgraded finds them: here, each `ram` device's memfd (its contents), and each `rbd`
//! device's earlier lock owners (so the next `serve`'s domain breaks the dead domain's lock at
//! once instead of waiting for it to expire). The store itself is
//! `serve`'s (systemd's file-descriptor store or bulkhead's keeper); the supervisor only takes
//! what was kept and says what to keep.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

/// Where descriptors are kept across a restart of `serve`.
pub trait FdStore: Send + Sync {
    /// Takes the descriptor kept under `name` by an earlier `serve`, if there is one.
    fn take(&self, name: &str) -> Option<OwnedFd>;
    /// Keeps `fd` under `name`, replacing what was kept under it.
    fn keep(&self, name: &str, fd: BorrowedFd<'_>);
    /// Keeps nothing under `name` any more.
    fn forget(&self, name: &str);
}

/// Where this supervisor keeps descriptors, if anywhere (its `serve` has a keeper or runs
/// under systemd's descriptor store): given to [`Supervisor::start_keeping`](crate::Supervisor::start_keeping),
/// and from there to every device that keeps something.
#[derive(Clone, Default)]
pub(crate) struct Keep(Option<Arc<dyn FdStore>>);

impl std::fmt::Debug for Keep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Keep(store)" } else { "Keep(none)" })
    }
}

impl Keep {
    pub(crate) fn new(store: Option<Arc<dyn FdStore>>) -> Keep {
        Keep(store)
    }

    /// Takes what an earlier `serve` kept under `name`.
    pub(crate) fn take(&self, name: &str) -> Option<OwnedFd> {
        self.0.as_ref()?.take(name)
    }

    /// Keeps `fd` under `name`, if there is a store.
    pub(crate) fn keep(&self, name: &str, fd: BorrowedFd<'_>) {
        if let Some(s) = &self.0 {
            s.keep(name, fd);
        }
    }

    /// Keeps nothing more for `device` (it was removed).
    pub(crate) fn forget_device(&self, device: &str) {
        if let Some(s) = &self.0 {
            for kept in names_of(device) {
                s.forget(&kept);
            }
        }
    }

    /// Keeps `text` under `name`, in a memory file, if there is a store.
    pub(crate) fn keep_text(&self, name: &str, text: &str) {
        let Some(store) = &self.0 else { return };
        match bulkhead_sys::memfd::create(name, 0) {
            Ok(fd) => {
                let mut f = std::fs::File::from(fd);
                if let Err(e) = std::io::Write::write_all(&mut f, text.as_bytes()) {
                    log::warn!("cannot keep {name}: {e}");
                    return;
                }
                store.keep(name, std::os::fd::AsFd::as_fd(&f));
            }
            Err(e) => log::warn!("cannot keep {name}: {e}"),
        }
    }

    /// Takes the text an earlier `serve` kept under `name`.
    pub(crate) fn take_text(&self, name: &str) -> Option<String> {
        let fd = self.take(name)?;
        let mut f = std::fs::File::from(fd);
        let mut text = String::new();
        std::io::Seek::rewind(&mut f).ok()?;
        std::io::Read::read_to_string(&mut f, &mut text).ok()?;
        Some(text)
    }
}

/// The name a `ram` device's memfd is kept under.
pub(crate) fn ram_name(device: &str) -> String {
    format!("ram.{device}")
}

/// The name an `rbd` device's earlier domains' client addresses are kept under.
pub(crate) fn rbd_owners_name(device: &str) -> String {
    format!("rbd-owners.{device}")
}

/// Everything kept for `device`, for when it is removed.
fn names_of(device: &str) -> [String; 2] {
    [ram_name(device), rbd_owners_name(device)]
}
