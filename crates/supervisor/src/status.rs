//! What `bulkhead status` reports, and how it is read from a running device without waiting
//! for a job that holds it.

use std::sync::atomic::Ordering;

use crate::device::DeviceRuntime;
use crate::proc_info;
use crate::state::{DeviceState, Shape};

pub use bulkhead_control::{DeviceStatus, FilterStatus, ProcessMemory, StatusReport};

/// The status of one device, read in moments: the slot's lock is held only to copy what it
/// shows, so a device whose domains are being replaced answers at once.
pub(crate) fn device_status(rt: &DeviceRuntime) -> DeviceStatus {
    let obs = rt.observe();
    let (state, restarting, faces, restarts, failure, shape, awaiting, standby, standby_restarts) = {
        let slot = rt.lock();
        let life = &slot.life;
        let failure = life.failure().map(String::from);
        let standby = (slot.standby.as_ref().map(|s| s.pid()), slot.tap_standby.as_ref().map(|s| s.pid()));
        let awaiting = life.awaiting_remote(&obs);
        (
            life.state(),
            slot.busy,
            slot.faces.clone(),
            life.restarts(),
            failure,
            life.shape(),
            awaiting,
            standby,
            slot.standby_used,
        )
    };
    let running = state == DeviceState::Running;
    // A domain that runs but whose remote has stopped answering (requests fail by timeout)
    // is waiting for the remote as a domain that cannot connect is.
    // Read from the page of the domain that holds the backend: below the tap domain when
    // there is one. The other page may keep what an earlier shape left there.
    let page = if shape == Shape::Interpose { &rt.below_state } else { &rt.state };
    let stalled = running && page.get(bulkhead_spec::state_slots::STALLED) == 1;
    let (state, failure) = if stalled {
        let why = "the remote stopped answering: requests fail after the backend's timeout until it answers";
        (DeviceState::Reconnecting, failure.or_else(|| Some(why.to_string())))
    } else if awaiting {
        // A domain that has not reached its remote: started for one that did not answer the
        // ones before it, or trying for a while.
        let why = "the remote has not answered the domain started for it: it waits for it";
        (DeviceState::Reconnecting, failure.or_else(|| Some(why.to_string())))
    } else {
        (state, failure)
    };
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
        active: rt.launcher.held().active,
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
        views: rt.views().iter().map(|v| v.status(&rt.state)).collect(),
        io: rt.device.io_figures(),
        attached: rt.attach.status(),
        standby: standby.0.map(|pid| bulkhead_control::ProcessMemory { pid, rss: proc_info::rss(pid) }),
        tap_standby: standby.1.map(|pid| bulkhead_control::ProcessMemory { pid, rss: proc_info::rss(pid) }),
        standby_restarts,
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
