//! What the supervisor tells a domain: which inherited descriptor is which, and how to serve.
//!
//! A domain is exec'd as `bulkhead driver DEVICE` with a JSON spec in its environment
//! ([`SPEC_ENV`]); this crate is that JSON's shape, shared by
//! the supervisor that writes it and the driver runtime that reads it, with no I/O of its own.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use bulkhead_doorbell::{BudgetPolicy, NotifyMode};
use bulkhead_filters::FilterSpec;
use serde::{Deserialize, Serialize};

/// The environment variable through which a domain gets its [`DomainSpec`] as JSON: out of
/// its command line, which `ps` shows every user (the command line names the device only).
pub const SPEC_ENV: &str = "BULKHEAD_DOMAIN_SPEC";

/// The whole description of one domain, passed as JSON in [`SPEC_ENV`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DomainSpec {
    /// Device name (for logs).
    pub device: String,
    /// Device size in bytes, as the queues above see it.
    pub size: u64,
    /// Bytes of the backend (or the channel below), which filters that keep a header there
    /// (`crypt`) make larger than `size`.
    pub backend_size: u64,
    /// `irq`, `poll` or `adaptive`.
    pub mode: String,
    /// Fixed spin budget in ns; `None` tunes itself.
    pub budget_ns: Option<u64>,
    /// The queues.
    pub queues: Vec<QueueSpec>,
    /// The views some queues serve (the others serve the whole device).
    #[serde(default)]
    pub views: Vec<ViewSpec>,
    /// The backend.
    pub backend: BackendSpec,
    /// Filters over the backend, frontend side first.
    #[serde(default)]
    pub filters: Vec<FilterSlot>,
    /// The domain's own state page (its heartbeat for the supervisor's watchdog; whether its
    /// backend's remote stopped answering), if given.
    #[serde(default)]
    pub state_fd: Option<i32>,
    /// How often the domain beats there while layers hold requests, ms.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A driver domain below a tap domain: the supervisor's line about replacing the tap
    /// domain while this one stays (`bulkhead_channel::AboveControl`): its page and doorbell.
    #[serde(default)]
    pub above_control_fds: Option<[i32; 2]>,
    /// Room for attached applications' queues, added and removed while the domain runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attach: Option<AttachSpec>,
    /// The device is inactive (the destination of a live migration before its switchover):
    /// every write, discard and write-zeroes is refused before any filter sees it, and the
    /// backend is opened read-only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inactive: bool,
    /// Sandbox policy.
    pub sandbox: SandboxSpec,
    /// A pipe on which the domain reports its sandbox layers once confined (then closes it).
    pub report_fd: Option<i32>,
    /// A standby domain, started ahead of its device's next restart: once built, confined and
    /// reported it waits until this eventfd is written before it opens its chain or touches
    /// anything the running domain uses, and serves from then on (see ARCHITECTURE.md,
    /// "Standby domains").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby_fd: Option<i32>,
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
    /// The view the queue serves (an index into [`DomainSpec::views`]); `None`: the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub view: Option<u32>,
}

/// A part of the device some queues serve: every request on them is checked against it and
/// moved by its offset. Its caps are in the domain's state page (`bulkhead_qos::page`), under
/// its index, where the supervisor may change them while the domain runs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ViewSpec {
    /// Name (for logs).
    pub name: String,
    /// Where it starts in the device, bytes.
    pub offset: u64,
    /// Its size, bytes.
    pub size: u64,
    /// Writes, discards and write-zeroes are refused.
    pub read_only: bool,
}

/// Slots for queues of applications attached while the domain runs (`bulkhead_client::attach`),
/// each of the geometry of the spec's queues, and the line on which the supervisor adds and
/// removes them ([`attach_line`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AttachSpec {
    /// The domain's end of the line (a seqpacket socket).
    pub fd: i32,
    /// The view each slot's queue serves (`None`: the device).
    pub slots: Vec<Option<u32>>,
}

/// The supervisor's line to a domain about attached queues: one message each way per change,
/// a queue's five descriptors (ring, write arena read-only, read arena, kick, irq) sent with
/// its [`Add`](attach_line::ToDomain::Add).
pub mod attach_line {
    use serde::{Deserialize, Serialize};

    /// Longest message either way, bytes.
    pub const MAX_MESSAGE: usize = 256;

    /// What the supervisor asks.
    #[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
    #[serde(deny_unknown_fields, rename_all = "snake_case")]
    pub enum ToDomain {
        /// Serve the queue whose descriptors come with this message in `slot`.
        Add {
            /// The slot (an index into [`AttachSpec::slots`](super::AttachSpec::slots)).
            slot: u32,
        },
        /// Let go of the queue in `slot`: finish what it holds of it, answering nothing, and
        /// close its descriptors.
        Remove {
            /// The slot.
            slot: u32,
        },
    }

    /// What the domain answers.
    #[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
    #[serde(deny_unknown_fields, rename_all = "snake_case")]
    pub enum FromDomain {
        /// The queue is served.
        Added {
            /// The slot.
            slot: u32,
        },
        /// The slot is empty.
        Removed {
            /// The slot.
            slot: u32,
        },
        /// The request was refused.
        Refused {
            /// The slot.
            slot: u32,
            /// Why.
            why: String,
        },
    }
}

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
    /// Its secret (a passphrase in a sealed memory file), if it has one.
    #[serde(default)]
    pub secret_fd: Option<i32>,
    /// Write capture for it.
    #[serde(default)]
    pub guard: bulkhead_filters::GuardSpec,
}

/// One queue of the channel below a tap domain.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LowerQueueSpec {
    /// Slots per ring.
    pub nslots: u32,
    /// Descriptors: ring, kick, irq.
    pub fds: [i32; 3],
    /// The queue's own arenas (write, read), when it does not share those of the channel above.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arena_fds: Option<[i32; 2]>,
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
        /// The io_uring engine's ring, lent by the supervisor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ring: Option<RingSpec>,
    },
    /// A qcow2 image over its backing files, each opened by the supervisor.
    Qcow2 {
        /// The image, then each backing file after the image that names it: descriptor and
        /// format (`qcow2` or `raw`).
        layers: Vec<(i32, String)>,
        /// Refuse writes (every backing file is read-only anyway).
        read_only: bool,
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
    /// A Ceph RBD image through librbd, which the domain loads before it is confined and
    /// connects once it is; the supervisor brokers each connection to the cluster.
    Rbd {
        /// A pipe holding the client's secret key (read once, at start).
        key_fd: i32,
        /// A pipe on which the domain tells the supervisor its client address once connected
        /// (the owner name its exclusive lock will carry).
        owner_fd: i32,
        /// Monitor addresses, as `mon_host` takes them.
        mon_host: String,
        /// Client name, without `client.`.
        user: String,
        /// Pool.
        pool: String,
        /// Namespace in the pool ("" for none).
        namespace: String,
        /// Image.
        image: String,
        /// librbd's client cache (writes acknowledged before they are stored; a FUA write
        /// or a flush then flushes it).
        cache: bool,
        /// Refuse writes.
        read_only: bool,
        /// A request the cluster does not answer for this long fails (ms).
        op_timeout_ms: u64,
        /// Connecting to the cluster may take this long (ms).
        connect_timeout_ms: u64,
        /// The smallest discard librbd carries out (bytes; smaller ones it would drop).
        discard_granularity: u64,
        /// Client addresses of this device's earlier domains: their exclusive lock is broken
        /// at once, any other owner's is waited for.
        break_owners: Vec<String>,
    },
    /// Null device.
    Null,
    /// A virtual device's reference driver, over the card the device-model domain models
    /// (`bulkhead_vdev::domain`).
    Vdev {
        /// The card's spec (its JSON, checked by the domain).
        card: String,
        /// `interrupt` or `poll`.
        wait: String,
        /// Descriptors: the card's register page, its DMA memory, its interrupt (an eventfd),
        /// and the trap line to the model's domain.
        fds: [i32; 4],
    },
    /// The channel to the domain below (a tap domain in `interpose` mode is its frontend). It
    /// shares the arenas of the channel above, queue for queue.
    Channel {
        /// Its queues, one per queue above: slots, and descriptors ring, kick, irq.
        queues: Vec<LowerQueueSpec>,
        /// Its generation.
        generation: u32,
        /// The supervisor's line about replacing the domain below
        /// (`bulkhead_channel::BelowControl`): its page and doorbell.
        control_fds: Option<[i32; 2]>,
    },
}

/// A ring the supervisor lent a domain (`bulkhead_sys::uring::LentRing`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RingSpec {
    /// Descriptors: the ring, and the eventfd it rings on each completion.
    pub fds: [i32; 2],
    /// `struct io_uring_params` as the kernel filled it in.
    pub params: Vec<u8>,
}

/// What the supervisor tells a device-model domain (`bulkhead vdev model DEVICE`, the JSON in [`SPEC_ENV`]): the
/// card, and which inherited descriptor is which. The model's domain lives as long as its
/// device; each driver generation sends it a new trap on the line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Device name (for logs).
    pub device: String,
    /// The card's spec (its JSON, checked by the domain).
    pub card: String,
    /// Bytes of the card's storage.
    pub media_size: u64,
    /// Descriptors: the card's register page, its DMA memory, its storage (a memory file), its
    /// interrupt (an eventfd), the model's end of the trap line, and the counter page.
    pub fds: [i32; 6],
    /// Sandbox policy.
    pub sandbox: SandboxSpec,
    /// A pipe on which the domain reports its sandbox layers once confined (then closes it).
    pub report_fd: Option<i32>,
}

impl ModelSpec {
    /// The seccomp role of a device-model domain.
    pub fn seccomp_role(&self) -> bulkhead_sandbox::seccomp::Role {
        bulkhead_sandbox::seccomp::Role::VdevModel
    }
}

/// Slots of a domain's state page (its heartbeat for the supervisor's watchdog): a counter
/// bumped at least every heartbeat interval while the domain's loop turns with requests held
/// by layers, and the requests layers hold.
pub mod state_slots {
    /// Bumped while the loop turns with requests held.
    pub const HEARTBEAT: usize = 1;
    /// Requests layers hold.
    pub const HELD: usize = 2;
    /// Bumped at least every half heartbeat while the loop turns, busy or idle; while
    /// applications are attached the loop wakes for it. The watchdog's sign of life when the
    /// requests in flight are an attached application's, which the supervisor cannot count.
    pub const LOOP: usize = 3;
    /// 1 while the backend's remote has stopped answering (requests fail by timeout), else 0;
    /// written by the domain whose backend it is.
    pub const STALLED: usize = 4;
}

impl DomainSpec {
    /// The notification mode.
    pub fn notify_mode(&self) -> Result<NotifyMode, String> {
        self.mode.parse()
    }

    /// The seccomp role its backend needs.
    pub fn seccomp_role(&self) -> bulkhead_sandbox::seccomp::Role {
        use bulkhead_sandbox::seccomp::Role;
        let role = match &self.backend {
            BackendSpec::Ram { .. } | BackendSpec::Null => Role::Memory,
            BackendSpec::File { engine, .. } if engine == "io_uring" => Role::FileIoUring,
            BackendSpec::File { .. } | BackendSpec::Qcow2 { .. } => Role::FileSync,
            BackendSpec::Nbd { .. } => Role::Network,
            BackendSpec::Rbd { .. } => Role::Rbd,
            BackendSpec::Channel { .. } => Role::Tap,
            BackendSpec::Vdev { .. } => Role::Vdev,
        };
        // A filter that keeps a file of its own (a cow overlay) reads and writes it.
        if self.filters.iter().any(|f| matches!(f.spec, FilterSpec::Cow { .. })) {
            return match role {
                Role::Memory => Role::FileSync,
                Role::Network => Role::NetworkFile,
                Role::Tap => Role::TapFile,
                Role::Vdev => Role::VdevFile,
                r => r,
            };
        }
        role
    }

    /// The spin budget policy.
    pub fn budget(&self) -> BudgetPolicy {
        self.budget_ns.map(BudgetPolicy::Fixed).unwrap_or(BudgetPolicy::DEFAULT_AUTO)
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
            backend_size: 1 << 30,
            mode: "adaptive".into(),
            budget_ns: None,
            queues: vec![QueueSpec { nslots: 64, arena_bytes: 8 << 20, fds: [3, 4, 5, 6, 7], view: None }],
            views: Vec::new(),
            backend: BackendSpec::File {
                fd: 8,
                buffered_fd: Some(9),
                read_only: false,
                engine: "io_uring".into(),
                ring: Some(RingSpec { fds: [15, 16], params: vec![1; 120] }),
            },
            filters: vec![
                FilterSlot {
                    spec: FilterSpec::Trace { device_number: 3 },
                    state_fd: 11,
                    output_fd: Some(12),
                    secret_fd: None,
                    guard: Default::default(),
                },
                FilterSlot {
                    spec: FilterSpec::Stats {},
                    state_fd: 13,
                    output_fd: None,
                    secret_fd: Some(14),
                    guard: Default::default(),
                },
            ],
            state_fd: Some(14),
            heartbeat_ms: 250,
            above_control_fds: None,
            attach: None,
            inactive: false,
            sandbox: SandboxSpec::default(),
            report_fd: Some(10),
            standby_fd: None,
        };
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<DomainSpec>(&json).unwrap(), spec);
        let bad = json.replace("\"mode\"", "\"mood\"");
        assert!(serde_json::from_str::<DomainSpec>(&bad).is_err());
    }
}

/// The hand-over of a device to a spare domain (`bulkhead spare`), on the sequenced-packet line
/// at the spare's descriptor 3. The spare sends [`handover::READY`] once sandboxed. The
/// supervisor then sends the spec's JSON and the descriptors: the spec's, in the order it
/// numbers them from 3, then the write end of the domain's output pipe. The first message is a
/// header ([`handover::header`]) followed by the JSON's first bytes; each later one a
/// [`handover::MORE`] byte and the next bytes. Each carries at most [`handover::CHUNK`] bytes of
/// JSON and [`handover::FDS_PER_MESSAGE`] descriptors; a small device's fits in the first.
/// Before them, the supervisor may send [`handover::SOON`] as a message of its own.
pub mod handover {
    /// What the spare sends once its sandbox is in place.
    pub const READY: u8 = b'R';
    /// What the supervisor may send, alone, when a restart begins that will want a spare: it
    /// wakes the spare (and its CPU) while the restart buries the old domain, so that the
    /// device, when it comes a few hundred microseconds later, finds both awake.
    pub const SOON: u8 = b'S';
    /// The first byte of the header.
    pub const HEADER: u8 = b'H';
    /// Bytes of the header.
    pub const HEADER_LEN: usize = 9;
    /// The first byte of every message after the first.
    pub const MORE: u8 = b'M';
    /// Most bytes of JSON in one message.
    pub const CHUNK: usize = 48 * 1024;
    /// Most descriptors sent with one message.
    pub const FDS_PER_MESSAGE: usize = 64;
    /// Longest spec a spare takes.
    pub const MAX_JSON: usize = 16 << 20;

    /// The header: the spec's length in bytes and the number of descriptors in all.
    pub fn header(json_len: usize, fds: usize) -> [u8; HEADER_LEN] {
        let mut h = [HEADER; HEADER_LEN];
        h[1..5].copy_from_slice(&(json_len as u32).to_le_bytes());
        h[5..9].copy_from_slice(&(fds as u32).to_le_bytes());
        h
    }

    /// The spec's length and the descriptor count of a header; `None` if `h` is not one.
    pub fn parse_header(h: &[u8]) -> Option<(usize, usize)> {
        if h.len() != HEADER_LEN || h[0] != HEADER {
            return None;
        }
        let json = u32::from_le_bytes(h[1..5].try_into().ok()?) as usize;
        let fds = u32::from_le_bytes(h[5..9].try_into().ok()?) as usize;
        Some((json, fds))
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_header_reads_back_and_nothing_else_reads_as_one() {
            assert_eq!(super::parse_header(&super::header(70_000, 9)), Some((70_000, 9)));
            assert_eq!(super::parse_header(b"M12345678"), None);
            assert_eq!(super::parse_header(&super::header(1, 1)[..8]), None);
        }
    }
}
