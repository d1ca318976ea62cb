//! Attaching to a device or a view of a running `bulkhead serve` from another process.
//!
//! The application makes its own queues (rings, arenas, doorbells: [`QueueSetup`]), so their
//! memory is its alone and the write arenas are sealed after it maps them; it sends the driver
//! domain's descriptors over the control socket (`SCM_RIGHTS`), and `serve` hands them to the
//! domain that serves the device, which adds them to its slots while it runs. From then on
//! requests go from the application to the domain with no hop through `serve`.
//!
//! When the domain is restarted, `serve` asks the application to start its queues over in
//! place as the next generation (every unanswered request placed again, nothing failed), and
//! the new domain takes the same queues: as for the exports, the restart is a pause.
//!
//! The conversation, one JSON line each (see [`wire`]): the application asks
//! `{"cmd":"attach","name":N,"queues":Q}`; `serve` offers the geometry; the application sends
//! `{"queues":{"count":Q}}` with 5 × Q descriptors; `serve` answers `attached`. Then, for as long
//! as the connection stays open, `serve` may send `restart` (answered `restarted`) or `fail`.
//! Closing the connection detaches.

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bulkhead_channel::{QueueConfig, QueueSetup};
use bulkhead_doorbell::{BudgetPolicy, NotifyMode};

use crate::{Device, DeviceControl};

/// The messages of the conversation.
pub mod wire {
    use serde::{Deserialize, Serialize};

    /// What the device is, and how the application's queues must be made.
    #[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
    #[serde(deny_unknown_fields)]
    pub struct Offer {
        /// Bytes.
        pub size: u64,
        /// Slots per ring.
        pub nslots: u32,
        /// Bytes of each arena.
        pub arena_bytes: u64,
        /// `poll`, `irq` or `adaptive`.
        pub mode: String,
        /// A fixed spin budget, ns (`None`: tuned).
        pub budget_ns: Option<u64>,
        /// The domain refuses writes on it.
        pub read_only: bool,
        /// Bytes a request's offset and length must be multiples of.
        pub min_block: u32,
    }

    /// What `serve` says.
    #[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
    #[serde(deny_unknown_fields, rename_all = "snake_case")]
    pub enum FromServe {
        /// The attach is possible: make the queues.
        Offer(Offer),
        /// The queues are served.
        Attached {
            /// The slots they took (for status).
            slots: Vec<u32>,
        },
        /// The domain was replaced: start every queue over in place as `generation`.
        Restart {
            /// The generation.
            generation: u32,
        },
        /// The device failed: no domain serves it any more.
        Fail {
            /// Why.
            reason: String,
        },
        /// The request was refused.
        Error(bulkhead_control::ControlError),
    }

    /// What the application says after its first line.
    #[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
    #[serde(deny_unknown_fields, rename_all = "snake_case")]
    pub enum FromApp {
        /// Its queues' descriptors come with this message, five per queue (ring, write arena
        /// read-only, read arena, kick, irq).
        Queues {
            /// How many queues.
            count: u32,
        },
        /// Every queue started over as `generation`.
        Restarted {
            /// The generation.
            generation: u32,
        },
        /// It could not start over.
        Refused {
            /// Why.
            why: String,
        },
    }
}

use bulkhead_control::ControlError;
use wire::{FromApp, FromServe};

/// Why an attach failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The control socket could not be reached or the conversation broke.
    #[error("{path}: {source}")]
    Io {
        /// The control socket.
        path: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// `serve` refused (no such device or view, no free slot, a device that is failed…); the
    /// code says which.
    #[error("{0}")]
    Refused(bulkhead_control::ControlError),
    /// The queues could not be made.
    #[error("cannot make a queue: {0}")]
    Queue(String),
}

/// Options of [`attach_with`].
#[derive(Debug, Clone, Copy)]
pub struct AttachOptions {
    /// Queues wanted (each takes one of the device's or view's `attach` slots).
    pub queues: u32,
}

impl Default for AttachOptions {
    fn default() -> Self {
        AttachOptions { queues: 1 }
    }
}

/// A device or view of a running `serve`, attached: use it through [`device`](Self::device)
/// (or `*`, which dereferences to the [`Device`]). Dropping it detaches: `serve` takes the
/// queues out of the domain, which lets go of their memory.
#[derive(Debug)]
pub struct Attached {
    device: Arc<Device>,
    conn: UnixStream,
    follower: Option<JoinHandle<()>>,
    slots: Vec<u32>,
}

/// Attaches to `name` (a device or a view) of the `serve` whose run directory is `run_dir`,
/// with one queue.
pub fn attach(run_dir: &Path, name: &str) -> Result<Attached, AttachError> {
    attach_with(run_dir, name, AttachOptions::default())
}

pub use bulkhead_control::read_line;

fn send(conn: &mut UnixStream, msg: &impl serde::Serialize) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).expect("message serialises");
    line.push(b'\n');
    conn.write_all(&line)
}

fn receive(conn: &mut UnixStream) -> std::io::Result<FromServe> {
    let line = read_line(conn)?.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "serve hung up"))?;
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// [`attach`], with options.
pub fn attach_with(run_dir: &Path, name: &str, opts: AttachOptions) -> Result<Attached, AttachError> {
    let path = run_dir.join("control.sock");
    let io = |source| AttachError::Io { path: path.display().to_string(), source };
    let mut conn = UnixStream::connect(&path).map_err(io)?;
    conn.set_read_timeout(Some(Duration::from_secs(30))).map_err(io)?;
    let first = bulkhead_control::Request::Attach(bulkhead_control::Attach { name: name.into(), queues: opts.queues });
    conn.write_all(format!("{}\n", bulkhead_control::request_line(&first)).as_bytes()).map_err(io)?;
    let offer = match receive(&mut conn).map_err(io)? {
        FromServe::Offer(o) => o,
        FromServe::Error(e) => return Err(AttachError::Refused(e)),
        other => return Err(AttachError::Refused(ControlError::bad_request(format!("unexpected answer {other:?}")))),
    };
    let mode: NotifyMode = offer.mode.parse().map_err(|e| AttachError::Refused(ControlError::bad_request(e)))?;
    let cfg = QueueConfig {
        nslots: offer.nslots,
        arena_bytes: offer.arena_bytes as usize,
        mode,
        budget: offer.budget_ns.map_or(BudgetPolicy::DEFAULT_AUTO, BudgetPolicy::Fixed),
        generation: 1,
    };
    let mut fronts = Vec::with_capacity(opts.queues as usize);
    let mut backs = Vec::with_capacity(opts.queues as usize);
    for q in 0..opts.queues {
        let (front, fds) =
            QueueSetup::create(&format!("attach-{name}-q{q}"), &cfg).map_err(|e| AttachError::Queue(e.to_string()))?;
        fronts.push(front);
        backs.push(fds);
    }
    let fds: Vec<BorrowedFd<'_>> = backs.iter().flat_map(|b| b.as_array().map(|fd| fd.as_fd())).collect();
    let msg = serde_json::to_vec(&FromApp::Queues { count: opts.queues }).expect("message serialises");
    let mut line = msg;
    line.push(b'\n');
    bulkhead_sys::send_with_fds(conn.as_fd(), &line, &fds, true).map_err(io)?;
    // The domain holds its own copies now; the application keeps only its mappings and
    // doorbells.
    drop(fds);
    drop(backs);
    let slots = match receive(&mut conn).map_err(io)? {
        FromServe::Attached { slots } => slots,
        FromServe::Error(e) => return Err(AttachError::Refused(e)),
        other => return Err(AttachError::Refused(ControlError::bad_request(format!("unexpected answer {other:?}")))),
    };
    let (device, control) = Device::new(name, offer.size, fronts, None);
    device.set_read_only(offer.read_only);
    device.set_min_block(offer.min_block);
    conn.set_read_timeout(None).map_err(io)?;
    let reader = conn.try_clone().map_err(io)?;
    let follower =
        std::thread::Builder::new().name(format!("bulkhead-attach-{name}")).spawn(move || follow(reader, control)).map_err(io)?;
    Ok(Attached { device, conn, follower: Some(follower), slots })
}

/// Follows what `serve` says about the device until the connection closes: starts the queues
/// over for each new domain, and fails the device when `serve` says it failed or goes away.
fn follow(mut conn: UnixStream, control: DeviceControl) {
    let why = loop {
        let msg = match read_line(&mut conn) {
            Ok(Some(line)) => serde_json::from_str::<FromServe>(&line),
            Ok(None) => break "serve ended the attachment".to_string(),
            Err(e) => break format!("the attachment broke: {e}"),
        };
        match msg {
            Ok(FromServe::Restart { generation }) => {
                let answer = match control.start_over_in_place(generation, Duration::from_secs(1)) {
                    Ok(()) => FromApp::Restarted { generation },
                    Err(why) => FromApp::Refused { why },
                };
                if send(&mut conn, &answer).is_err() {
                    break "serve ended the attachment".to_string();
                }
            }
            Ok(FromServe::Fail { reason }) => control.fail(&reason),
            Ok(other) => break format!("unexpected message from serve: {other:?}"),
            Err(e) => break format!("unreadable message from serve: {e}"),
        }
    };
    control.fail(&why);
}

impl Attached {
    /// The device, to read and write.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The `serve` slots the queues took (as `bulkhead status` lists them).
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// Detaches now (as dropping does).
    pub fn detach(self) {}
}

impl std::ops::Deref for Attached {
    type Target = Device;
    fn deref(&self) -> &Device {
        &self.device
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = self.conn.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.follower.take() {
            let _ = t.join();
        }
    }
}
