//! What `status` answers: every device, view and export of a `serve`, with its figures.

use serde::{Deserialize, Serialize};

/// The whole status report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The `serve` process (supervisor and frontends).
    pub frontend: ProcessMemory,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Devices.
    pub devices: Vec<DeviceStatus>,
    /// The FUSE export (absent when it is off).
    pub fuse: Option<FuseStatus>,
    /// The vhost-user-blk export (absent when it is off).
    pub vhost_user: Option<Vec<VhostStatus>>,
    /// The ublk export (absent when it is off).
    #[serde(default)]
    pub ublk: Option<Vec<UblkStatus>>,
    /// The spare domains kept ready (`[domains] spares`).
    #[serde(default)]
    pub spares: SparesStatus,
}

/// The pool of spare domains: those waiting now, and what it has done since `serve` started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SparesStatus {
    /// How many it keeps.
    pub wanted: u32,
    /// Those waiting now, each with its memory.
    pub ready: Vec<ProcessMemory>,
    /// Spares started.
    pub started: u64,
    /// Spares given a device (each a domain that was not exec'd).
    pub taken: u64,
    /// Spares that ended while they waited, or could not take a device.
    pub lost: u64,
    /// Standby domains that may be kept at once (`[domains] standbys`).
    #[serde(default)]
    pub standbys_most: u32,
    /// Standby domains waiting now.
    #[serde(default)]
    pub standbys_held: u32,
}

/// Resident memory of one process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessMemory {
    /// Process id.
    pub pid: u32,
    /// Resident memory.
    pub rss: Option<Rss>,
}

/// Resident memory of a process, in KiB, as /proc/PID/status reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rss {
    /// Total resident set (`VmRSS`).
    pub total_kib: u64,
    /// Private anonymous memory (`RssAnon`): heap, stacks.
    pub anon_kib: u64,
    /// Shared memory mapped and touched (`RssShmem`): rings, arenas, ramdisk pages.
    pub shmem_kib: u64,
}

/// State of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    /// Its domains run and serve (or are being replaced: requests wait and are reissued).
    Running,
    /// Its remote server is gone and is being reconnected (I/O waits), or is there but has
    /// stopped answering (I/O fails after the backend's timeout; the domain is kept).
    Reconnecting,
    /// Its domain is gone; I/O fails promptly.
    Failed,
    /// Stopped at shutdown.
    Stopped,
}

impl DeviceState {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceState::Running => "running",
            DeviceState::Reconnecting => "reconnecting",
            DeviceState::Failed => "failed",
            DeviceState::Stopped => "stopped",
        }
    }
}

/// One device in the status report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// Name.
    pub name: String,
    /// State.
    pub state: DeviceState,
    /// Its domains are being replaced: requests wait, and are reissued to the new ones.
    pub restarting: bool,
    /// Pid of the driver domain, the one running the backend (0 if none).
    pub driver_pid: u32,
    /// Pid of the tap domain in `interpose` and `intercept` mode (in `intercept` it is the
    /// driver domain too: it terminates every request).
    pub tap_pid: Option<u32>,
    /// The tap domain's resident memory.
    pub tap_memory: Option<Rss>,
    /// Notification mode.
    pub mode: String,
    /// Backend description.
    pub backend: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Queues.
    pub queues: usize,
    /// Requests completed successfully.
    pub requests_completed: u64,
    /// Requests failed.
    pub requests_failed: u64,
    /// Domain restarts.
    pub restarts: u64,
    /// Last restart outage, ms.
    pub last_outage_ms: Option<f64>,
    /// 99th percentile restart outage, ms.
    pub p99_outage_ms: Option<f64>,
    /// Driver resident memory.
    pub driver_memory: Option<Rss>,
    /// Why the device failed.
    pub failure: Option<String>,
    /// The sandbox layers in force in the driver domain, as it reported them.
    pub sandbox: Option<bulkhead_sandbox::Layers>,
    /// The same for the tap domain in `interpose` and `intercept` mode.
    pub tap_sandbox: Option<bulkhead_sandbox::Layers>,
    /// It writes (`false`: inactive, the destination of a live migration before its
    /// switchover).
    #[serde(default = "yes")]
    pub active: bool,
    /// Where the filters run.
    pub tap: String,
    /// The filters, frontend side first, with their figures (as the domain counted them).
    pub filters: Vec<FilterStatus>,
    /// A `vdev` device's card: its model's domain and what the model has done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub card: Option<CardStatus>,
    /// Its views (`[[device.view]]`), each exported under its own name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub views: Vec<ViewStatus>,
    /// What its frontend has had answered.
    #[serde(default)]
    pub io: IoFigures,
    /// Applications attached to it or its views (`bulkhead_client::attach`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attached: Vec<AttachedStatus>,
    /// Its standby domain: its next generation, confined and waiting to take over at the next
    /// restart (a device keeps one after its first restart, within `[domains] standbys`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby: Option<ProcessMemory>,
    /// An `interpose` device's standby tap domain: confined, its channels mapped, waiting to
    /// take over from the running tap domain (kept after the tap domain's first replacement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap_standby: Option<ProcessMemory>,
    /// Restarts its standbys took, making no domain then.
    #[serde(default)]
    pub standby_restarts: u64,
}

/// What a device's or a view's frontend has had answered, for rates over time (`bulkhead top`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoFigures {
    /// Requests answered, every operation.
    pub requests: u64,
    /// Bytes read requests asked for.
    pub bytes_read: u64,
    /// Bytes write requests asked for.
    pub bytes_written: u64,
    /// Upper bounds of the latency buckets, µs (a last bucket holds the rest).
    pub latency_bounds_us: Vec<u64>,
    /// Requests by latency, every operation, one count per bucket.
    pub latency_buckets: Vec<u64>,
}

impl IoFigures {
    /// The latency under which `q` (0..1) of the requests between `earlier` and `self` were
    /// answered, µs: a bucket's upper bound (`None`: no request, or past the last bound).
    pub fn quantile_since(&self, earlier: &IoFigures, q: f64) -> Option<u64> {
        let d: Vec<u64> = self
            .latency_buckets
            .iter()
            .enumerate()
            .map(|(i, n)| n.saturating_sub(earlier.latency_buckets.get(i).copied().unwrap_or(0)))
            .collect();
        let total: u64 = d.iter().sum();
        if total == 0 {
            return None;
        }
        let want = (total as f64 * q).ceil() as u64;
        let mut seen = 0;
        for (i, n) in d.iter().enumerate() {
            seen += n;
            if seen >= want {
                return self.latency_bounds_us.get(i).copied();
            }
        }
        None
    }
}

/// One filter in the status report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FilterStatus {
    /// Its figures, tagged with its `type`.
    #[serde(flatten)]
    pub report: bulkhead_filters::FilterReport,
    /// The same in one line.
    pub summary: String,
}

/// A view in `status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ViewStatus {
    /// Name.
    pub name: String,
    /// Where it starts in the device.
    pub offset: u64,
    /// Its size.
    pub size_bytes: u64,
    /// Writes are refused.
    pub read_only: bool,
    /// Its queues.
    pub queues: usize,
    /// Its caps.
    pub qos: bulkhead_qos::Caps,
    /// The caps in words.
    pub qos_summary: String,
    /// Byte credit the domain reports (negative: a debt being paid back). Untrusted.
    pub credit_bytes: i64,
    /// Request credit the domain reports. Untrusted.
    pub credit_ios: i64,
    /// Requests that waited for credit, as the domain reports. Untrusted.
    pub credit_waits: u64,
    /// Time its requests were held back for credit or behind a heavier view, s.
    #[serde(default)]
    pub throttled_s: f64,
    /// What its frontend has had answered.
    #[serde(default)]
    pub io: IoFigures,
    /// Requests answered (frontend count).
    pub requests_completed: u64,
    /// Requests failed (frontend count).
    pub requests_failed: u64,
    /// Throughput over the last second, MiB/s (frontend count).
    pub throughput_mib_s: f64,
    /// Requests per second over the last second (frontend count).
    pub iops: f64,
}

/// An attached application.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachedStatus {
    /// The device or view.
    pub name: String,
    /// Its process.
    pub pid: i32,
    /// Its user.
    pub uid: u32,
    /// The slots its queues hold.
    pub slots: Vec<u32>,
}

/// A `vdev` device's card.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardStatus {
    /// The card's name, as its datasheet gives it.
    pub card: String,
    /// The model domain's pid (0 while none runs).
    pub model_pid: u32,
    /// Its sandbox layers, as it reported them.
    pub model_sandbox: Option<bulkhead_sandbox::Layers>,
    /// Device-model domains started (1 unless one died).
    pub model_starts: u64,
    /// What the model has done since the current one started.
    pub stats: bulkhead_vdev::domain::CardStats,
}

/// How the FUSE export talks to the kernel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "transport", rename_all = "snake_case")]
pub enum FuseStatus {
    /// Worker threads on `/dev/fuse`.
    DevFuse {
        /// Worker threads.
        threads: usize,
        /// Why not io_uring, when it was asked for.
        why_not_io_uring: Option<String>,
    },
    /// FUSE over io_uring.
    IoUring {
        /// Rings.
        queues: usize,
        /// Requests each ring holds.
        depth: usize,
    },
}

/// One device's ublk export: its block device and the requests of its queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UblkStatus {
    /// The device or view.
    pub device: String,
    /// Its number: the block device is `/dev/ublkb<number>`.
    pub number: u32,
    /// The block device.
    pub path: std::path::PathBuf,
    /// Taken over from an earlier `serve` (the kernel held it meanwhile) rather than made.
    pub recovered: bool,
    /// Its queues (one per channel queue).
    pub queues: u16,
    /// Requests in flight per queue.
    pub depth: u16,
    /// Requests taken from the kernel, summed over the queues.
    pub taken: u64,
    /// Requests answered with an error.
    pub failed: u64,
    /// Most requests at the device at once on one queue.
    pub max_in_flight: u64,
}

/// One device's vhost-user-blk export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VhostStatus {
    /// The device or view.
    pub device: String,
    /// Its socket.
    pub socket: std::path::PathBuf,
    /// A frontend is connected.
    pub connected: bool,
    /// Frontends served since start.
    pub sessions: u64,
    /// The connected frontend's virtqueues.
    pub queues: Vec<VhostQueueStatus>,
}

/// One virtqueue of a vhost-user-blk export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VhostQueueStatus {
    /// Requests taken from the guest.
    pub taken: u64,
    /// Requests returned to it.
    pub returned: u64,
    /// Requests refused as malformed or unsupported.
    pub refused: u64,
    /// Requests the device failed.
    pub failed: u64,
    /// Requests served again after a restart of `serve`.
    pub resubmitted: u64,
    /// Most requests at the device at once.
    pub max_in_flight: u64,
    /// Calls sent again to a guest that went on waiting for requests already returned (its
    /// interrupt was missed).
    #[serde(default)]
    pub recalls: u64,
    /// The queue stopped on a malformed ring.
    pub broken: bool,
}

fn yes() -> bool {
    true
}
