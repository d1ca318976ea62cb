//! What the supervisor tells a domain: which inherited descriptor is which, and how to serve.

use bulkhead_filters::{FilterFds, FilterSpec};
use serde::{Deserialize, Serialize};

/// The whole description of one domain, passed as JSON on its command line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DomainSpec {
    /// Device name (for logs).
    pub device: String,
    /// Device size in bytes.
    pub size: u64,
    /// `irq`, `poll` or `adaptive`.
    pub mode: String,
    /// Fixed spin budget in ns; `None` tunes itself.
    pub budget_ns: Option<u64>,
    /// The queues.
    pub queues: Vec<QueueSpec>,
    /// The backend.
    pub backend: BackendSpec,
    /// Filters over the backend, frontend side first.
    #[serde(default)]
    pub filters: Vec<FilterSlot>,
    /// The domain's own state page (its heartbeat for the supervisor's watchdog), if given.
    #[serde(default)]
    pub state_fd: Option<i32>,
    /// How often the domain beats there while layers hold requests, ms.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Yield the CPU when spinning idle (the two domains of an `interpose` device).
    #[serde(default)]
    pub yield_when_idle: bool,
    /// Sandbox policy.
    pub sandbox: SandboxSpec,
    /// A pipe on which the domain reports its sandbox layers once confined (then closes it).
    pub report_fd: Option<i32>,
}

/// The sandbox part of a spec.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// Required, best effort, or off.
    pub policy: bulkhead_sandbox::Policy,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        SandboxSpec { policy: bulkhead_sandbox::Policy::BestEffort }
    }
}

/// One queue's descriptors and geometry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QueueSpec {
    /// Slots per ring.
    pub nslots: u32,
    /// Bytes in each arena.
    pub arena_bytes: u64,
    /// Descriptors: ring, write arena (read-only), read arena, kick, irq.
    pub fds: [i32; 5],
}

/// Spins a tap domain's wait on the domain below makes before it starts yielding the CPU.
const YIELD_AFTER_SPINS: u32 = 64;

fn default_heartbeat_ms() -> u64 {
    100
}

/// One filter and its descriptors.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FilterSlot {
    /// What the filter is.
    pub spec: FilterSpec,
    /// Its state page.
    pub state_fd: i32,
    /// Its output (trace file), if it has one.
    pub output_fd: Option<i32>,
}

/// One queue of the channel below a tap domain.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LowerQueueSpec {
    /// Slots per ring.
    pub nslots: u32,
    /// Descriptors: ring, kick, irq.
    pub fds: [i32; 3],
}

/// The backend and its descriptors.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackendSpec {
    /// Ramdisk over an inherited memfd.
    Ram {
        /// The memfd.
        fd: i32,
    },
    /// File or block device.
    File {
        /// Main descriptor (O_DIRECT when `buffered_fd` is set).
        fd: i32,
        /// Buffered descriptor for unaligned requests when direct.
        buffered_fd: Option<i32>,
        /// Refuse writes.
        read_only: bool,
        /// `sync` or `io_uring`.
        engine: String,
    },
    /// A remote NBD export over a socket the supervisor connected.
    Nbd {
        /// The connected socket (negotiation not yet done).
        fd: i32,
        /// Export name.
        export: String,
        /// Negotiation and any wait for a reply are bounded by this, ms.
        timeout_ms: u64,
    },
    /// Null device.
    Null,
    /// The channel to the domain below (a tap domain in `interpose` mode is its frontend). It
    /// shares the arenas of the channel above, queue for queue.
    Channel {
        /// Its queues, one per queue above: slots, and descriptors ring, kick, irq.
        queues: Vec<LowerQueueSpec>,
        /// Its generation.
        generation: u32,
    },
}

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bulkhead_backends::{ChannelBackend, Engine, FileBackend, NbdBackend, NullBackend, RamBackend};
use bulkhead_block::{Backend, Chain};
use bulkhead_channel::{BackQueue, BackQueueFds, BudgetPolicy, ForwardQueueFds, FrontQueue, NotifyMode, QueueConfig};
use bulkhead_ring::ArenaSizes;

use crate::{Domain, DriverError};

/// Takes ownership of an inherited descriptor named in the spec.
///
/// # Safety
/// `fd` must be open, inherited for this purpose, and claimed only once.
unsafe fn claim(fd: i32) -> Result<OwnedFd, DriverError> {
    // SAFETY: F_GETFD only checks that the descriptor is open.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(DriverError::Setup(format!("descriptor {fd} named in the spec is not open")));
    }
    // SAFETY: the caller guarantees the descriptor is ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl DomainSpec {
    /// The notification mode.
    pub fn notify_mode(&self) -> Result<NotifyMode, DriverError> {
        self.mode.parse().map_err(DriverError::Setup)
    }

    /// The seccomp role its backend needs.
    pub fn seccomp_role(&self) -> bulkhead_sandbox::seccomp::Role {
        use bulkhead_sandbox::seccomp::Role;
        match &self.backend {
            BackendSpec::Ram { .. } | BackendSpec::Null => Role::Memory,
            BackendSpec::File { engine, .. } if engine == "io_uring" => Role::FileIoUring,
            BackendSpec::File { .. } => Role::FileSync,
            BackendSpec::Nbd { .. } => Role::Network,
            BackendSpec::Channel { .. } => Role::Tap,
        }
    }

    /// The spin budget policy.
    pub fn budget(&self) -> BudgetPolicy {
        self.budget_ns.map(BudgetPolicy::Fixed).unwrap_or(BudgetPolicy::DEFAULT_AUTO)
    }

    /// Builds the domain from descriptors inherited at exec.
    ///
    /// # Safety
    /// Every descriptor named in the spec must be inherited for this domain and not used by
    /// anything else in the process.
    pub unsafe fn build_inherited(&self, stop: Arc<AtomicBool>) -> Result<Domain, DriverError> {
        let lower_stop = stop.clone();
        let mode = self.notify_mode()?;
        let mut queues = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            // SAFETY: forwarded from this function's contract.
            let [ring, write_arena, read_arena, kick, irq] = q.fds.map(|fd| unsafe { claim(fd) });
            let fds = BackQueueFds { ring: ring?, write_arena: write_arena?, read_arena: read_arena?, kick: kick?, irq: irq? };
            let arenas = ArenaSizes { write: q.arena_bytes, read: q.arena_bytes };
            queues.push(BackQueue::from_fds(fds, q.nslots, arenas, self.size).map_err(|e| DriverError::Setup(e.to_string()))?);
        }
        let setup = |e: bulkhead_backends::BackendError| DriverError::Setup(e.to_string());
        let backend: Box<dyn Backend> = match &self.backend {
            // SAFETY: forwarded from this function's contract.
            BackendSpec::Ram { fd } => Box::new(RamBackend::new(unsafe { claim(*fd)? }, self.size).map_err(setup)?),
            BackendSpec::File { fd, buffered_fd, read_only, engine } => {
                let engine = match engine.as_str() {
                    "sync" => Engine::Sync,
                    "io_uring" => Engine::IoUring,
                    other => return Err(DriverError::Setup(format!("unknown engine `{other}`"))),
                };
                // SAFETY: forwarded from this function's contract.
                let main = unsafe { claim(*fd)? };
                let buffered = match buffered_fd {
                    // SAFETY: as above.
                    Some(b) => Some(unsafe { claim(*b)? }),
                    None => None,
                };
                Box::new(FileBackend::new(main, buffered, *read_only, engine).map_err(setup)?)
            }
            BackendSpec::Nbd { fd, export, timeout_ms } => {
                // SAFETY: forwarded from this function's contract.
                let sock = unsafe { claim(*fd)? };
                Box::new(NbdBackend::new(sock, export, self.size, std::time::Duration::from_millis(*timeout_ms)))
            }
            BackendSpec::Null => Box::new(NullBackend::new(self.size)),
            BackendSpec::Channel { queues: lower, generation } => {
                if lower.len() != queues.len() {
                    return Err(DriverError::Setup("the channel below needs one queue per queue above".into()));
                }
                let mut fronts = Vec::with_capacity(lower.len());
                for (q, above) in lower.iter().zip(&self.queues) {
                    // SAFETY: forwarded from this function's contract.
                    let [ring, kick, irq] = q.fds.map(|fd| unsafe { claim(fd) });
                    let cfg = QueueConfig {
                        nslots: q.nslots,
                        arena_bytes: above.arena_bytes as usize,
                        mode,
                        budget: self.budget(),
                        generation: *generation,
                    };
                    let mut front = FrontQueue::forwarding(ForwardQueueFds { ring: ring?, kick: kick?, irq: irq? }, &cfg)
                        .map_err(|e| DriverError::Setup(format!("channel below: {e}")))?;
                    front.set_yield_after(YIELD_AFTER_SPINS);
                    fronts.push(front);
                }
                let windows = queues.iter().map(BackQueue::arena_windows).collect();
                Box::new(ChannelBackend::new(fronts, windows, self.size, lower_stop))
            }
        };
        let mut layers = Vec::with_capacity(self.filters.len());
        for f in &self.filters {
            // SAFETY: forwarded from this function's contract.
            let state = unsafe { claim(f.state_fd)? };
            let output = match f.output_fd {
                // SAFETY: as above.
                Some(fd) => Some(unsafe { claim(fd)? }),
                None => None,
            };
            layers.push(
                bulkhead_filters::build(&f.spec, FilterFds { state, output }).map_err(|e| DriverError::Setup(e.to_string()))?,
            );
        }
        let chain = Chain::new(layers, backend);
        // The device may use a prefix of what the chain offers (a file longer than `size`).
        if chain.size() < self.size {
            return Err(DriverError::Setup(format!("the chain offers {} bytes, the device is {}", chain.size(), self.size)));
        }
        let state = match self.state_fd {
            // SAFETY: as above.
            Some(fd) => Some(unsafe { claim(fd)? }),
            None => None,
        };
        let mut domain = Domain::new(queues, chain, mode, self.budget(), stop)?;
        domain.set_yield_when_idle(self.yield_when_idle);
        if let Some(fd) = state {
            let page = bulkhead_filters::state::StatePage::map(std::os::fd::AsRawFd::as_raw_fd(&fd), true)
                .map_err(|e| DriverError::Setup(format!("state page: {e}")))?;
            domain.set_state_page(page, self.heartbeat_ms);
        }
        Ok(domain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips_through_json_and_refuses_unknown_fields() {
        let spec = DomainSpec {
            device: "disk0".into(),
            size: 1 << 30,
            mode: "adaptive".into(),
            budget_ns: None,
            queues: vec![QueueSpec { nslots: 64, arena_bytes: 8 << 20, fds: [3, 4, 5, 6, 7] }],
            backend: BackendSpec::File { fd: 8, buffered_fd: Some(9), read_only: false, engine: "io_uring".into() },
            filters: vec![
                FilterSlot { spec: FilterSpec::Trace { device_number: 3 }, state_fd: 11, output_fd: Some(12) },
                FilterSlot { spec: FilterSpec::Stats {}, state_fd: 13, output_fd: None },
            ],
            state_fd: Some(14),
            heartbeat_ms: 250,
            yield_when_idle: true,
            sandbox: SandboxSpec::default(),
            report_fd: Some(10),
        };
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<DomainSpec>(&json).unwrap(), spec);
        let bad = json.replace("\"mode\"", "\"mood\"");
        assert!(serde_json::from_str::<DomainSpec>(&bad).is_err());
    }

    #[test]
    fn closed_descriptor_is_a_setup_error() {
        let spec = DomainSpec {
            device: "d".into(),
            size: 4096,
            mode: "poll".into(),
            budget_ns: None,
            queues: vec![QueueSpec { nslots: 8, arena_bytes: 4096, fds: [1000, 1001, 1002, 1003, 1004] }],
            backend: BackendSpec::Null,
            filters: Vec::new(),
            state_fd: None,
            heartbeat_ms: 100,
            yield_when_idle: false,
            sandbox: SandboxSpec::default(),
            report_fd: None,
        };
        // SAFETY: the descriptors named are not open, which is what is being tested.
        let e = unsafe { spec.build_inherited(Arc::new(AtomicBool::new(false))) }.unwrap_err();
        assert!(e.to_string().contains("descriptor 1000"), "{e}");
    }
}
