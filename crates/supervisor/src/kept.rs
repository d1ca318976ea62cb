//! Descriptors kept outside `serve`, so that a `serve` started after this one dies or is
//! upgraded finds them: here, each `ram` device's memfd (its contents), and each `rbd`
//! device's earlier lock owners (so the next `serve`'s domain breaks the dead domain's lock at
//! once instead of waiting for it to expire). The store itself is
//! `serve`'s (systemd's file-descriptor store or bulkhead's keeper); the supervisor only takes
//! what was kept and says what to keep.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, OnceLock};

/// Where descriptors are kept across a restart of `serve`.
pub trait FdStore: Send + Sync {
    /// Takes the descriptor kept under `name` by an earlier `serve`, if there is one.
    fn take(&self, name: &str) -> Option<OwnedFd>;
    /// Keeps `fd` under `name`, replacing what was kept under it.
    fn keep(&self, name: &str, fd: BorrowedFd<'_>);
    /// Keeps nothing under `name` any more.
    fn forget(&self, name: &str);
}

static STORE: OnceLock<Arc<dyn FdStore>> = OnceLock::new();

/// Makes `store` where this process's supervisor keeps descriptors (once, before
/// [`Supervisor::start`](crate::Supervisor::start); a second call is ignored).
pub fn install(store: Arc<dyn FdStore>) {
    let _ = STORE.set(store);
}

pub(crate) fn store() -> Option<&'static Arc<dyn FdStore>> {
    STORE.get()
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
pub(crate) fn names_of(device: &str) -> [String; 2] {
    [ram_name(device), rbd_owners_name(device)]
}

/// Keeps `text` under `name`, in a memory file, if a store is installed.
pub(crate) fn keep_text(name: &str, text: &str) {
    let Some(store) = store() else { return };
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
pub(crate) fn take_text(name: &str) -> Option<String> {
    let fd = store()?.take(name)?;
    let mut f = std::fs::File::from(fd);
    let mut text = String::new();
    std::io::Seek::rewind(&mut f).ok()?;
    std::io::Read::read_to_string(&mut f, &mut text).ok()?;
    Some(text)
}
