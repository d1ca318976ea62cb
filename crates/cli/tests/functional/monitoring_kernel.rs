//! The monitoring that ships (packaging/monitoring): the alert rules pass `promtool check
//! rules` and their own unit tests (`promtool test rules`); a real Prometheus scrapes a running
//! `serve`, loads the rules, answers a query for a device's IOPS while I/O runs, and accepts
//! every query of the Grafana dashboard.

#[path = "../common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::*;

fn monitoring() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/monitoring").canonicalize().unwrap()
}

#[test]
fn the_alert_rules_are_valid_and_pass_their_unit_tests() {
    if !tools(&["promtool"]) {
        return;
    }
    for args in [["check", "rules", "bulkhead-alerts.yml"], ["test", "rules", "bulkhead-alerts.test.yml"]] {
        let out = Command::new("promtool").args(args).current_dir(monitoring()).output().unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `GET path` on 127.0.0.1:`port`: the status line's code and the body.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes()).ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// Percent-encodes a query for a URL.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus's answer to an instant query.
fn query(port: u16, q: &str) -> serde_json::Value {
    let (code, body) = get(port, &format!("/api/v1/query?query={}", encode(q))).expect("prometheus answers");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    assert_eq!((code, v["status"].as_str()), (200, Some("success")), "{q}: {body}");
    v
}

/// Prometheus, ended with the test.
struct Prometheus(std::process::Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_real_prometheus_scrapes_serve_and_answers_a_device_s_iops() {
    require_kernel!();
    if !tools(&["prometheus"]) {
        return;
    }
    let tmp = TempDir::new("monitoring");
    let metrics = free_port();
    let config = format!(
        "[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n[nbd]\nenabled = false\n[[device]]\nname = \"d\"\nsize = \"64M\"\n\
         [device.backend]\ntype = \"ram\"\n"
    );
    let serve = Serve::start(&tmp.path().join("run"), Some(&config), &["d"]);
    let prom_port = free_port();
    let prom_cfg = tmp.path().join("prometheus.yml");
    std::fs::write(
        &prom_cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: bulkhead\n    \
             static_configs:\n      - targets: ['127.0.0.1:{metrics}']\n",
            monitoring().join("bulkhead-alerts.yml").display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(tmp.path().join("prometheus.log")).unwrap();
    let _prom = Prometheus(
        Command::new("prometheus")
            .arg(format!("--config.file={}", prom_cfg.display()))
            .arg(format!("--storage.tsdb.path={}", tmp.path().join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let prom_log = || std::fs::read_to_string(tmp.path().join("prometheus.log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(get(prom_port, "/-/ready"), Some((200, _))) {
        assert!(Instant::now() < deadline, "prometheus did not start: {}", prom_log());
        std::thread::sleep(Duration::from_millis(200));
    }
    // Reads through the FUSE file, 4 KiB direct, for a few seconds of scrapes.
    let file = serve.fuse_file("d");
    let writer = std::thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(8);
        while Instant::now() < end {
            dd(Path::new("/dev/zero"), &file, &["bs=4k", "count=2048", "oflag=direct", "conv=notrunc"]);
        }
    });
    std::thread::sleep(Duration::from_secs(5));
    let q = "sum(rate(bulkhead_requests_total{job=\"bulkhead\", device=\"d\"}[4s]))";
    let deadline = Instant::now() + Duration::from_secs(30);
    let iops = loop {
        let v = query(prom_port, q);
        let iops: f64 = v["data"]["result"][0]["value"][1].as_str().and_then(|s| s.parse().ok()).unwrap_or(0.0);
        if iops > 0.0 {
            break iops;
        }
        assert!(Instant::now() < deadline, "no IOPS for device d in prometheus: {v}\n{}", prom_log());
        std::thread::sleep(Duration::from_millis(500));
    };
    writer.join().unwrap();
    eprintln!("prometheus: device d at {iops:.0} IOPS");
    // The rules loaded, none firing on a healthy serve.
    let (_, rules) = get(prom_port, "/api/v1/rules").unwrap();
    let rules: serde_json::Value = serde_json::from_str(&rules).unwrap();
    let loaded = rules["data"]["groups"][0]["rules"].as_array().map_or(0, Vec::len);
    assert_eq!(loaded, 5, "{rules}");
    let firing = query(prom_port, "ALERTS{alertstate=\"firing\"}");
    assert_eq!(firing["data"]["result"].as_array().map_or(0, Vec::len), 0, "{firing}");
    // Every query of the dashboard is one Prometheus accepts, and the device's answers.
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(monitoring().join("bulkhead-dashboard.json")).unwrap()).unwrap();
    let mut asked = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let expr = expr.replace("$__rate_interval", "10s").replace("$instance", ".*").replace("$device", ".*");
            query(prom_port, &expr);
            asked += 1;
        }
    }
    assert!(asked >= 8, "{asked} dashboard queries");
}
