//! Descriptors kept outside `serve`, so that a `serve` started after this one dies or is
//! upgraded finds them: here, each `ram` device's memfd (its contents). The store itself is
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
