//! `serve`'s side of the keeper: the descriptors an earlier `serve` left (handed over at start
//! as systemd hands them, `LISTEN_FDS` and `LISTEN_FDNAMES`), and keeping new ones (`FDSTORE=1`
//! with `FDNAME=` on `NOTIFY_SOCKET`). One protocol, two keepers: systemd's file-descriptor
//! store, or bulkhead's own (`keeper.rs`), which speaks the part of it used here.
//!
//! What is kept, by name:
//! - `lock`: the run directory's lock, so no other `serve` takes the directory meanwhile;
//! - `fuse`: the FUSE session's `/dev/fuse` descriptors; `fuse-state`: which node id is which
//!   device, and its open count;
//! - `config`: the running configuration (devices and views added since start included);
//! - `nbd-unix`, `nbd-tcp`: the NBD listening sockets;
//! - `ram.DEVICE`: each `ram` device's memfd, its contents.

use std::collections::HashMap;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use sd_notify::NotifyState;

/// Set by bulkhead's keeper in the environment of the `serve` it starts.
pub const KEEPER_ENV: &str = "BULKHEAD_KEEPER";
/// Set by bulkhead's keeper when it starts the binary of the last `serve` that was serving
/// because the one at its path did not start: why.
pub const FELL_BACK_ENV: &str = "BULKHEAD_FELL_BACK";
/// Sent to the keeper before an upgrade: the exit that follows is a hand-over.
pub const HANDOVER: &str = "X_BULKHEAD_HANDOVER=1";

/// Which keeper holds what `serve` keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keeper {
    /// Nothing is kept: a `serve` that ends takes its exports with it.
    None,
    /// bulkhead's keeper, the process that started this `serve`.
    Own,
    /// systemd's file-descriptor store (`FileDescriptorStoreMax=` in the unit).
    Systemd,
}

impl Keeper {
    /// The keeper of this process: bulkhead's if it started us, systemd's if a service
    /// manager is listening and the configuration asks for one.
    pub fn of_this_process(enabled: bool) -> Keeper {
        if std::env::var_os(KEEPER_ENV).is_some() {
            Keeper::Own
        } else if enabled && std::env::var_os("NOTIFY_SOCKET").is_some() {
            Keeper::Systemd
        } else {
            Keeper::None
        }
    }

    /// As `status` and the log say it.
    pub fn name(self) -> &'static str {
        match self {
            Keeper::None => "none",
            Keeper::Own => "keeper",
            Keeper::Systemd => "systemd",
        }
    }
}

/// The descriptors handed over at start, and the store to keep new ones in.
pub struct Kept {
    keeper: Keeper,
    handed: Mutex<HashMap<String, Vec<OwnedFd>>>,
    /// Said once: a store that cannot be reached.
    warned: std::sync::atomic::AtomicBool,
}

impl Kept {
    /// Takes what was handed over in `LISTEN_FDS` (when `LISTEN_PID` is this process) and
    /// clears those variables, so domains do not inherit them. Call it before any thread
    /// starts.
    // SAFETY: the unsafe calls below claim the descriptors handed over at exec; each says why.
    #[allow(unsafe_code)]
    pub fn from_env(keeper: Keeper) -> Kept {
        let mut handed: HashMap<String, Vec<OwnedFd>> = HashMap::new();
        match sd_notify::listen_fds_with_names() {
            Ok(fds) => {
                for (raw, name) in fds {
                    // SAFETY: LISTEN_PID names this process, so descriptors 3..3+LISTEN_FDS
                    // were opened for it and nothing else owns them.
                    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                    // SAFETY: a system call with integer arguments only, on a descriptor we own.
                    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
                    handed.entry(name).or_default().push(fd);
                }
            }
            Err(e) => log::warn!("the descriptors handed over at start cannot be read: {e}"),
        }
        for var in ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"] {
            // SAFETY: called at the start of `serve`, before any thread is started.
            unsafe { std::env::remove_var(var) };
        }
        Kept { keeper, handed: Mutex::new(handed), warned: std::sync::atomic::AtomicBool::new(false) }
    }

    /// Whether an earlier `serve` left a FUSE session: this one takes over.
    pub fn takes_over(&self) -> bool {
        let handed = self.lock();
        handed.contains_key("fuse") || handed.contains_key("config")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<OwnedFd>>> {
        self.handed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes every descriptor handed over under `name`.
    pub fn take_all(&self, name: &str) -> Vec<OwnedFd> {
        self.lock().remove(name).unwrap_or_default()
    }

    /// Takes the text of the memory file handed over under `name`.
    pub fn take_text(&self, name: &str) -> Option<String> {
        let fd = self.take_all(name).into_iter().next()?;
        let mut f = std::fs::File::from(fd);
        let mut text = String::new();
        match f.rewind().and_then(|()| f.read_to_string(&mut text)) {
            Ok(_) => Some(text),
            Err(e) => {
                log::warn!("the kept `{name}` cannot be read: {e}");
                None
            }
        }
    }

    /// Keeps `fds` under `name`, replacing what was kept under it.
    pub fn keep_fds(&self, name: &str, fds: &[BorrowedFd<'_>]) {
        if self.keeper == Keeper::None || fds.is_empty() {
            return;
        }
        // systemd keeps several under one name; bulkhead's keeper replaces them.
        if self.keeper == Keeper::Systemd {
            self.forget_name(name);
        }
        self.send(&[NotifyState::FdStore, NotifyState::FdName(name), NotifyState::Custom("FDPOLL=0")], fds);
    }

    /// Keeps `text` under `name`, in a memory file of its own.
    pub fn keep_text(&self, name: &str, text: &str) {
        if self.keeper == Keeper::None {
            return;
        }
        let made = bulkhead_sys::memfd::create(&format!("bulkhead-kept-{name}"), 0).map_err(|e| e.to_string()).and_then(|fd| {
            let mut f = std::fs::File::from(fd);
            f.write_all(text.as_bytes()).map_err(|e| e.to_string())?;
            Ok(OwnedFd::from(f))
        });
        match made {
            Ok(fd) => self.keep_fds(name, &[fd.as_fd()]),
            Err(e) => log::warn!("cannot keep `{name}` across a restart of serve: {e}"),
        }
    }

    fn forget_name(&self, name: &str) {
        self.send(&[NotifyState::FdStoreRemove, NotifyState::FdName(name)], &[]);
    }

    /// Tells the keeper that the exit that follows hands everything over (an upgrade).
    pub fn hand_over(&self) {
        self.send(&[NotifyState::Custom(HANDOVER), NotifyState::Status("handing over to a new serve")], &[]);
    }

    fn send(&self, states: &[NotifyState], fds: &[BorrowedFd<'_>]) {
        let sent = if fds.is_empty() { sd_notify::notify(states) } else { sd_notify::notify_with_fds(states, fds) };
        if let Err(e) = sent {
            if !self.warned.swap(true, std::sync::atomic::Ordering::AcqRel) {
                log::warn!("cannot reach the keeper ({}): {e}; a crash of serve now ends its exports", self.keeper.name());
            }
        }
    }
}

impl bulkhead_supervisor::kept::FdStore for Kept {
    fn take(&self, name: &str) -> Option<OwnedFd> {
        self.take_all(name).into_iter().next()
    }

    fn keep(&self, name: &str, fd: BorrowedFd<'_>) {
        self.keep_fds(name, &[fd]);
    }

    fn forget(&self, name: &str) {
        if self.keeper != Keeper::None {
            self.forget_name(name);
        }
    }
}
