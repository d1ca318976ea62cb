//! What `bulkhead status` reports, and how it is read from a running device without waiting
//! for a job that holds it.

use std::sync::atomic::Ordering;

use serde::Serialize;

use crate::device::DeviceRuntime;
use crate::proc_info::{self, Rss};
use crate::state::DeviceState;

/// Resident memory of one process.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessMemory {
    /// Process id.
    pub pid: u32,
    /// Resident memory.
    pub rss: Option<Rss>,
}

/// One device in the status report.
#[derive(Debug, Clone, Serialize)]
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
    /// Where the filters run.
    pub tap: String,
    /// The filters, frontend side first, with their figures (as the domain counted them).
    pub filters: Vec<FilterStatus>,
    /// A `vdev` device's card: its model's domain and what the model has done.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub card: Option<crate::vdev::CardStatus>,
    /// Its views (`[[device.view]]`), each exported under its own name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub views: Vec<crate::views::ViewStatus>,
    /// Applications attached to it or its views (`bulkhead_client::attach`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attached: Vec<crate::attach::AttachedStatus>,
}

/// One filter in the status report.
#[derive(Debug, Clone, Serialize)]
pub struct FilterStatus {
    /// Its figures, tagged with its `type`.
    #[serde(flatten)]
    pub report: bulkhead_filters::FilterReport,
    /// The same in one line.
    pub summary: String,
}

/// The whole status report.
#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    /// The `serve` process (supervisor and frontends).
    pub frontend: ProcessMemory,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Devices.
    pub devices: Vec<DeviceStatus>,
}

/// The status of one device, read in moments: the slot's lock is held only to copy what it
/// shows, so a device whose domains are being replaced answers at once.
pub(crate) fn device_status(rt: &DeviceRuntime) -> DeviceStatus {
    let (state, restarting, faces, restarts, failure) = {
        let slot = rt.lock();
        (slot.life.state(), slot.busy, slot.faces.clone(), slot.life.restarts(), slot.life.failure().map(String::from))
    };
    let running = state == DeviceState::Running;
    let outages = rt.control.outages_ms();
    let chain = rt.launcher.chain();
    let driver_pid = if running { faces.driver_pid } else { 0 };
    let tap_pid = faces.tap_pid.filter(|_| running);
    DeviceStatus {
        name: rt.name.clone(),
        state,
        restarting,
        driver_pid,
        tap_pid,
        tap_memory: tap_pid.and_then(proc_info::rss),
        mode: rt.launcher.mode().as_str().to_string(),
        backend: rt.launcher.backend_desc.clone(),
        size_bytes: rt.device.size(),
        queues: rt.device.queue_count(),
        requests_completed: rt.device.counters.completed.load(Ordering::Relaxed),
        requests_failed: rt.device.counters.failed.load(Ordering::Relaxed),
        restarts,
        last_outage_ms: outages.last().copied(),
        p99_outage_ms: p99(&outages),
        driver_memory: if running && driver_pid != 0 { proc_info::rss(driver_pid) } else { None },
        failure,
        sandbox: faces.driver_layers.filter(|_| running),
        tap_sandbox: faces.tap_layers.filter(|_| running && tap_pid.is_some()),
        tap: chain.tap.as_str().to_string(),
        filters: chain
            .filters
            .iter()
            .map(|f| {
                let report = bulkhead_filters::FilterReport::read(&f.spec, &f.page);
                FilterStatus { summary: report.summary(), report }
            })
            .collect(),
        card: rt.launcher.card.as_ref().map(|c| c.status()),
        views: rt.views.iter().map(|v| v.status(&rt.state)).collect(),
        attached: rt.attach.status(),
    }
}

fn p99(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    Some(s[((s.len() as f64 * 0.99).ceil() as usize).clamp(1, s.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_99th_percentile_of_outages_is_the_one_at_or_above_99_percent() {
        assert_eq!(p99(&[]), None);
        assert_eq!(p99(&[3.0]), Some(3.0));
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(p99(&v), Some(198.0));
        assert_eq!(p99(&[5.0, 1.0, 9.0]), Some(9.0));
    }
}
