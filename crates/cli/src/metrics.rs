//! The Prometheus endpoint (`[metrics] listen`): `GET /metrics` in the OpenMetrics text format,
//! encoded by `prometheus-client` and served by `tiny_http`, on a TCP address or a unix socket.
//!
//! Nothing is counted for it: each scrape reads the counters the devices keep anyway (the
//! frontend's per-operation counters and latency histograms, the queues' spin and sleep time),
//! the supervisor's status (restarts, outages, domain memory), `/proc` (domain CPU) and the
//! exports' own counters.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use bulkhead_client::{Device, LATENCY_BOUNDS_US, OPS};
use bulkhead_config::MetricsListen;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::live::Live;

/// Restart outages' histogram bounds, ms.
const OUTAGE_BOUNDS_MS: [f64; 13] = [1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0];

/// The running endpoint; stopped when dropped.
pub struct Endpoint {
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
    socket: Option<PathBuf>,
    /// Where it listens, in words.
    pub address: String,
}

impl Endpoint {
    /// Listens at `at` and serves scrapes of `live` on a thread of its own.
    pub fn start(at: &MetricsListen, live: Arc<Live>) -> anyhow::Result<Endpoint> {
        let (server, socket, address) = match at {
            MetricsListen::Tcp(addr) => {
                let s = tiny_http::Server::http(addr)
                    .map_err(|e| anyhow::anyhow!("key `metrics.listen`: cannot listen on {addr}: {e}"))?;
                let address = format!("http://{}/metrics", s.server_addr().to_ip().map_or(addr.clone(), |a| a.to_string()));
                (s, None, address)
            }
            MetricsListen::Unix(path) => {
                let _ = std::fs::remove_file(path);
                let s = tiny_http::Server::http_unix(path)
                    .map_err(|e| anyhow::anyhow!("key `metrics.listen`: cannot listen on {}: {e}", path.display()))?;
                (s, Some(path.clone()), format!("unix:{} GET /metrics", path.display()))
            }
        };
        let server = Arc::new(server);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Scrape { live }));
        let s = server.clone();
        let thread = std::thread::Builder::new().name("metrics".into()).spawn(move || serve(&s, &registry))?;
        Ok(Endpoint { server, thread: Some(thread), socket, address })
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = &self.socket {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn serve(server: &tiny_http::Server, registry: &Registry) {
    for req in server.incoming_requests() {
        let path = req.url().split('?').next().unwrap_or("");
        let response = if *req.method() != tiny_http::Method::Get {
            tiny_http::Response::from_string("only GET\n").with_status_code(405)
        } else if path != "/metrics" {
            tiny_http::Response::from_string("bulkhead: metrics are at /metrics\n").with_status_code(404)
        } else {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, registry) {
                Ok(()) => tiny_http::Response::from_string(body).with_header(
                    "Content-Type: application/openmetrics-text; version=1.0.0; charset=utf-8"
                        .parse::<tiny_http::Header>()
                        .expect("a valid header"),
                ),
                Err(e) => tiny_http::Response::from_string(format!("cannot encode: {e}\n")).with_status_code(500),
            }
        };
        // A scraper that went away is its own business.
        let _ = req.respond(response);
    }
}

/// Reads everything at scrape time.
struct Scrape {
    live: Arc<Live>,
}

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scrape")
    }
}

type Labels = Vec<(String, String)>;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// One metric family being written: its samples, each with its labels.
struct Family<'e, 'a> {
    enc: &'e mut DescriptorEncoder<'a>,
}

impl Family<'_, '_> {
    fn counter(&mut self, name: &str, help: &str, unit: Option<Unit>, samples: &[(Labels, f64)]) -> std::fmt::Result {
        self.values(name, help, unit, MetricType::Counter, samples)
    }

    fn gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, samples: &[(Labels, f64)]) -> std::fmt::Result {
        self.values(name, help, unit, MetricType::Gauge, samples)
    }

    /// A counter or gauge family: one value per label set.
    fn values(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        kind: MetricType,
        samples: &[(Labels, f64)],
    ) -> std::fmt::Result {
        if samples.is_empty() {
            return Ok(());
        }
        let mut m = self.enc.encode_descriptor(name, help, unit.as_ref(), kind)?;
        for (l, v) in samples {
            let e = m.encode_family(l)?;
            match kind {
                MetricType::Counter => ConstCounter::new(*v).encode(e)?,
                _ => ConstGauge::new(*v).encode(e)?,
            }
        }
        Ok(())
    }

    /// `samples`: labels, sum, count, and per-bucket (not cumulative) counts by upper bound.
    #[allow(clippy::type_complexity)]
    fn histogram(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        samples: &[(Labels, f64, u64, Vec<(f64, u64)>)],
    ) -> std::fmt::Result {
        if samples.is_empty() {
            return Ok(());
        }
        let mut m = self.enc.encode_descriptor(name, help, unit.as_ref(), MetricType::Histogram)?;
        for (l, sum, count, buckets) in samples {
            m.encode_family(l)?.encode_histogram::<prometheus_client::encoding::NoLabelSet>(*sum, *count, buckets, None)?;
        }
        Ok(())
    }
}

/// CPU seconds a process has used (user + system), from `/proc/PID/stat`.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / bulkhead_sys::clock_ticks_per_second().max(1) as f64)
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sup = &self.live.sup;
        let report = sup.status();
        // Every device and view, with the device it belongs to.
        let mut fronts: Vec<(Arc<Device>, String)> = Vec::new();
        for d in &report.devices {
            for f in sup.frontends(&d.name) {
                fronts.push((f, d.name.clone()));
            }
        }
        let mut fam = Family { enc: &mut enc };
        requests(&mut fam, &fronts)?;
        domains(&mut fam, &report, sup)?;
        qos_and_serve(&mut fam, &report)?;
        exports(&mut fam, &self.live)
    }
}

/// Each device's and view's requests, as its frontend counted them.
fn requests(fam: &mut Family<'_, '_>, fronts: &[(Arc<Device>, String)]) -> std::fmt::Result {
    let of = |f: &Device, dev: &str| labels(&[("device", f.name()), ("of", dev)]);
    let mut requests = Vec::new();
    let mut errors = Vec::new();
    let mut bytes = Vec::new();
    let mut latency = Vec::new();
    for (f, dev) in fronts {
        let totals = f.op_totals();
        for (c, (_, op)) in totals.iter().zip(OPS.iter()) {
            let n = c.requests;
            let mut l = of(f, dev);
            l.push(("op".into(), op.to_string()));
            requests.push((l.clone(), n as f64));
            errors.push((l.clone(), c.errors as f64));
            bytes.push((l.clone(), c.bytes as f64));
            let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS_US
                .iter()
                .map(|b| *b as f64 / 1e6)
                .chain(std::iter::once(f64::INFINITY))
                .zip(c.buckets.iter().copied())
                .collect();
            let count = buckets.iter().map(|(_, n)| n).sum();
            latency.push((l, c.latency_sum_ns as f64 / 1e9, count, buckets));
        }
    }
    fam.counter("bulkhead_requests", "Requests the driver answered, by operation.", None, &requests)?;
    fam.counter("bulkhead_request_errors", "Of them, answered with an error.", None, &errors)?;
    fam.counter("bulkhead_request", "Bytes the answered requests asked for, by operation.", Some(Unit::Bytes), &bytes)?;
    fam.histogram(
        "bulkhead_request_latency",
        "From a request's first submission to its answer (reissues after a restart included).",
        Some(Unit::Seconds),
        &latency,
    )?;
    let failed: Vec<_> = fronts.iter().map(|(f, d)| (of(f, d), f.counters.failed.load(Ordering::Relaxed) as f64)).collect();
    fam.counter(
        "bulkhead_requests_failed",
        "Requests that failed, the driver's errors and those given up (device failed, removed, timed out).",
        None,
        &failed,
    )?;
    let in_flight: Vec<_> = fronts.iter().map(|(f, d)| (of(f, d), f.in_flight() as f64)).collect();
    fam.gauge("bulkhead_requests_in_flight", "Requests submitted and not yet answered.", None, &in_flight)?;
    let spin: Vec<_> = fronts.iter().map(|(f, d)| (of(f, d), f.wait_totals().0 as f64 / 1e9)).collect();
    fam.counter("bulkhead_queue_spin", "Time the frontend's queues spun waiting for answers.", Some(Unit::Seconds), &spin)?;
    let sleep: Vec<_> = fronts.iter().map(|(f, d)| (of(f, d), f.wait_totals().1 as f64 / 1e9)).collect();
    fam.counter("bulkhead_queue_sleep", "Time the frontend's queues slept waiting for answers.", Some(Unit::Seconds), &sleep)?;

    Ok(())
}

/// Each device's domains: restarts, state, outages, memory and CPU.
fn domains(
    fam: &mut Family<'_, '_>,
    report: &bulkhead_control::StatusReport,
    sup: &bulkhead_supervisor::Supervisor,
) -> std::fmt::Result {
    // Per device: its domains.
    let dev = |n: &str| labels(&[("device", n)]);
    let restarts: Vec<_> = report.devices.iter().map(|d| (dev(&d.name), d.restarts as f64)).collect();
    fam.counter("bulkhead_domain_restarts", "Times the device's domains were replaced.", None, &restarts)?;
    let state: Vec<_> = report
        .devices
        .iter()
        .map(|d| {
            let mut l = dev(&d.name);
            l.push(("state".into(), format!("{:?}", d.state).to_lowercase()));
            (l, 1.0)
        })
        .collect();
    fam.gauge("bulkhead_device_state", "The device's state (1 for the state it is in).", None, &state)?;
    let outages: Vec<_> = report
        .devices
        .iter()
        .map(|d| {
            let list = sup.outages_ms(&d.name);
            let mut per = vec![0u64; OUTAGE_BOUNDS_MS.len() + 1];
            for o in &list {
                per[OUTAGE_BOUNDS_MS.iter().position(|b| o <= b).unwrap_or(OUTAGE_BOUNDS_MS.len())] += 1;
            }
            let buckets: Vec<(f64, u64)> =
                OUTAGE_BOUNDS_MS.iter().map(|b| b / 1e3).chain(std::iter::once(f64::INFINITY)).zip(per).collect();
            (dev(&d.name), list.iter().sum::<f64>() / 1e3, list.len() as u64, buckets)
        })
        .collect();
    fam.histogram(
        "bulkhead_restart_outage",
        "How long the device's users waited while its domains were replaced.",
        Some(Unit::Seconds),
        &outages,
    )?;
    let mut rss = Vec::new();
    let mut cpu = Vec::new();
    for d in &report.devices {
        let domains = [("driver", Some(d.driver_pid).filter(|p| *p != 0), d.driver_memory), ("tap", d.tap_pid, d.tap_memory)];
        for (role, pid, mem) in domains {
            let Some(pid) = pid else { continue };
            let l = labels(&[("device", &d.name), ("domain", role)]);
            if let Some(m) = mem {
                rss.push((l.clone(), (m.total_kib * 1024) as f64));
            }
            if let Some(s) = cpu_seconds(pid) {
                cpu.push((l, s));
            }
        }
    }
    fam.gauge("bulkhead_domain_resident", "Resident memory of the device's domains.", Some(Unit::Bytes), &rss)?;
    fam.counter("bulkhead_domain_cpu", "CPU time of the device's current domains.", Some(Unit::Seconds), &cpu)?;
    Ok(())
}

/// The views' QoS, and `serve`'s own CPU and memory.
fn qos_and_serve(fam: &mut Family<'_, '_>, report: &bulkhead_control::StatusReport) -> std::fmt::Result {
    let mut waits = Vec::new();
    let mut held = Vec::new();
    for d in &report.devices {
        for v in &d.views {
            waits.push((labels(&[("device", &v.name), ("of", &d.name)]), v.credit_waits as f64));
            held.push((labels(&[("device", &v.name), ("of", &d.name)]), v.throttled_s));
        }
    }
    fam.counter(
        "bulkhead_qos_throttled",
        "Time a view's requests were held back for QoS credit or behind a heavier view (counted when released).",
        Some(Unit::Seconds),
        &held,
    )?;
    fam.counter("bulkhead_qos_throttle_waits", "Times a view's requests waited for QoS credit.", None, &waits)?;
    let me = std::process::id();
    if let Some(s) = cpu_seconds(me) {
        fam.counter("bulkhead_serve_cpu", "CPU time of serve itself.", Some(Unit::Seconds), &[(Vec::new(), s)])?;
    }
    if let Some(m) = report.frontend.rss {
        fam.gauge(
            "bulkhead_serve_resident",
            "Resident memory of serve.",
            Some(Unit::Bytes),
            &[(Vec::new(), (m.total_kib * 1024) as f64)],
        )?;
    }

    Ok(())
}

/// The exports' connections and users.
fn exports(fam: &mut Family<'_, '_>, live: &Live) -> std::fmt::Result {
    // The exports.
    let x = live.export_figures();
    let e = |export: &str| labels(&[("export", export)]);
    if let Some(n) = &x.nbd {
        fam.counter("bulkhead_export_connections", "Connections accepted.", None, &[(e("nbd"), n.accepted as f64)])?;
        fam.counter(
            "bulkhead_export_rejections",
            "Connections refused (over `max_connections`) or closed for breaking the protocol or a deadline.",
            None,
            &[
                (labels(&[("export", "nbd"), ("why", "limit")]), n.refused as f64),
                (labels(&[("export", "nbd"), ("why", "protocol")]), n.dropped as f64),
            ],
        )?;
        let per: Vec<_> = n.clients.iter().map(|(name, c)| (labels(&[("export", "nbd"), ("device", name)]), *c as f64)).collect();
        fam.gauge("bulkhead_export_clients", "Clients connected now, by device.", None, &per)?;
    }
    if !x.fuse_opens.is_empty() {
        let per: Vec<_> =
            x.fuse_opens.iter().map(|(name, o)| (labels(&[("export", "fuse"), ("device", name)]), *o as f64)).collect();
        fam.gauge("bulkhead_export_fuse_opens", "Opens of each device's FUSE file not yet released.", None, &per)?;
    }
    if let Some(v) = &x.vhost {
        let sessions: Vec<_> =
            v.iter().map(|s| (labels(&[("export", "vhost_user"), ("device", &s.device)]), s.sessions as f64)).collect();
        fam.counter("bulkhead_export_vhost_sessions", "Virtual machines that connected, by device.", None, &sessions)?;
        let connected: Vec<_> = v
            .iter()
            .map(|s| (labels(&[("export", "vhost_user"), ("device", &s.device)]), f64::from(u8::from(s.connected))))
            .collect();
        fam.gauge("bulkhead_export_vhost_connected", "Whether a virtual machine is connected, by device.", None, &connected)?;
    }
    Ok(())
}
