//! `serve` managed while it runs: started with no devices, devices of three kinds and views
//! added while fio verifies a file system on the first, a device removed (and one in use
//! refused), an edited configuration reloaded (and an edit that cannot apply refused), the
//! running configuration dumped, and the metrics scraped and checked against what fio did;
//! views added to and removed from a device while fio verifies on a sibling view.

#[path = "../common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bulkhead_testkit::require_kernel;
use common::{exe, fio_verify, tools, Ext4, Serve, TempDir};

/// Runs `bulkhead ARGS --run-dir RUN`, feeding `stdin`; returns (success, stdout, stderr).
fn cli(run: &Path, args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    let mut cmd = Command::new(exe());
    cmd.args(args).arg("--run-dir").arg(run);
    cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn ok(run: &Path, args: &[&str], stdin: Option<&str>) -> String {
    let (good, out, err) = cli(run, args, stdin);
    assert!(good, "bulkhead {args:?} failed: {err}");
    out
}

fn refused(run: &Path, args: &[&str], stdin: Option<&str>) -> String {
    let (good, out, err) = cli(run, args, stdin);
    assert!(!good, "bulkhead {args:?} was not refused: {out}");
    err
}

/// `GET /metrics` on the endpoint's unix socket: the body.
fn scrape(sock: &Path) -> String {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bulkhead\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
    body.to_string()
}

/// The value of the sample `name{labels}` (labels as the text format writes them).
fn sample(metrics: &str, name: &str, labels: &str) -> f64 {
    let key = format!("{name}{{{labels}}} ");
    let line = metrics.lines().find(|l| l.starts_with(&key)).unwrap_or_else(|| panic!("no sample {key} in\n{metrics}"));
    line[key.len()..].trim().parse().unwrap()
}

fn device_names(serve: &Serve) -> Vec<String> {
    let s = serve.status_json();
    s["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()).collect()
}

#[test]
fn devices_come_and_go_a_reload_applies_and_metrics_agree_with_fio_while_fio_verifies() {
    require_kernel!();
    if !tools(&["fio", "mkfs.ext4", "e2fsck"]) {
        return;
    }
    let tmp = TempDir::new("live");
    let run = tmp.path().join("run");
    let metrics_sock = tmp.path().join("metrics.sock");
    let config_path = run.with_extension("toml");
    let base =
        format!("[nbd]\nenabled = true\n\n[vhost_user]\nenabled = true\n\n[metrics]\nlisten = \"{}\"\n", metrics_sock.display());
    let mut serve = Serve::start(&run, Some(&base), &[]);
    assert!(device_names(&serve).is_empty(), "serve started with no devices");
    assert!(scrape(&metrics_sock).ends_with("# EOF\n"), "an empty serve answers a scrape");

    // A bad table is refused naming the key and the line, and starts nothing.
    let bad = "[[device]]\nname = \"x\"\nsize = \"64M\"\nqueues = 99\n[device.backend]\ntype = \"ram\"\n";
    let err = refused(&run, &["device", "add", "-"], Some(bad));
    assert!(err.contains("line 4") && err.contains("`queues`"), "{err}");
    let err = refused(&run, &["device", "add", "-"], Some("[fuse]\nthreads = 2\n"));
    assert!(err.contains("key `fuse`") && err.contains("only [[device]] tables"), "{err}");
    assert!(device_names(&serve).is_empty());

    // The first device, a ram disk, with ext4 and fio verify on it.
    let out =
        ok(&run, &["device", "add", "-"], Some("[[device]]\nname = \"r0\"\nsize = \"256M\"\n[device.backend]\ntype = \"ram\"\n"));
    assert!(out.contains("r0: added, exported on fuse, nbd, vhost_user"), "{out}");
    let mut fs = Ext4::make(&serve.fuse_file("r0"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    let fio = std::thread::spawn(move || fio_verify(&mnt, "randrw", "4k-64k", "32M", 30));

    // While it runs: a file device with a view, and a virtual card.
    let file = tmp.path().join("f1.img");
    std::fs::File::create(&file).unwrap().set_len(128 << 20).unwrap();
    let tables = format!(
        "[[device]]\nname = \"f1\"\n[device.backend]\ntype = \"file\"\npath = \"{}\"\n[[device.filter]]\ntype = \"delay\"\n\
         read_us = 5\n[[device.view]]\nname = \"f1-v\"\nsize = \"32M\"\niops = 5000\n\n\
         [[device]]\nname = \"c2\"\nsize = \"64M\"\n[device.backend]\ntype = \"vdev\"\nseed = 7\n",
        file.display()
    );
    let adds = tmp.path().join("adds.toml");
    std::fs::write(&adds, &tables).unwrap();
    let out = ok(&run, &["device", "add", adds.to_str().unwrap()], None);
    assert!(out.contains("f1: added with views f1-v, exported on fuse, nbd, vhost_user"), "{out}");
    assert!(out.contains("c2: added"), "{out}");
    assert_eq!(device_names(&serve), ["r0", "f1", "c2"]);
    for name in ["r0", "f1", "f1-v", "c2"] {
        assert!(serve.fuse_file(name).exists(), "no FUSE file for {name}");
        assert!(run.join("vhost").join(format!("{name}.sock")).exists(), "no vhost-user socket for {name}");
    }
    // Each new device serves: what is written reads back, through its FUSE file.
    for name in ["f1-v", "c2"] {
        let path = serve.fuse_file(name);
        let block: Vec<u8> = (0..65536u32).map(|i| (i * 7 + name.len() as u32) as u8).collect();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().write_all(&block).unwrap();
        let mut back = vec![0u8; block.len()];
        std::fs::File::open(&path).unwrap().read_exact(&mut back).unwrap();
        assert!(back == block, "{name} did not read back what was written");
    }
    // A view added to a running device, beside the one it came with.
    let out = ok(&run, &["view", "add", "f1", "name = \"f1-w\"", "offset = \"64M\"", "size = \"32M\""], None);
    assert!(out.contains("f1-w: added to f1, exported on fuse, nbd, vhost_user"), "{out}");
    assert!(serve.fuse_file("f1-w").exists() && run.join("vhost/f1-w.sock").exists());
    // A name taken is refused.
    let err = refused(&run, &["device", "add", adds.to_str().unwrap()], None);
    assert!(err.contains("`f1` is served already"), "{err}");

    // The device in use is refused; the idle card goes, with its exports and domains.
    let err = refused(&run, &["device", "remove", "r0"], None);
    assert!(err.contains("in use") && err.contains("FUSE file is open"), "{err}");
    let err = refused(&run, &["device", "remove", "f1-v"], None);
    assert!(err.contains("is a view of device `f1`"), "{err}");
    let c2 = serve.status_json()["devices"][2].clone();
    let c2_pid = c2["driver_pid"].as_u64().unwrap() as i32;
    let out = ok(&run, &["device", "remove", "c2"], None);
    assert!(out.contains("c2: removed"), "{out}");
    assert_eq!(device_names(&serve), ["r0", "f1"]);
    assert!(!serve.fuse_file("c2").exists() && !run.join("vhost/c2.sock").exists(), "c2 is still exported");
    assert!(!Path::new(&format!("/proc/{c2_pid}")).exists(), "c2's driver domain {c2_pid} outlived its device");

    // The running configuration, as a file serve would start from.
    let dump = ok(&run, &["config", "dump"], None);
    assert!(dump.contains("name = \"r0\"") && dump.contains("name = \"f1-v\"") && !dump.contains("name = \"c2\""), "{dump}");
    bulkhead_config::Config::parse(&dump, "dump").unwrap_or_else(|e| panic!("the dump does not parse: {e}\n{dump}"));

    // A reload that cannot apply is refused whole, naming the key.
    let bigger = dump.replacen("size = \"256M\"", "size = \"512M\"", 1);
    std::fs::write(&config_path, &bigger).unwrap();
    let err = refused(&run, &["reload"], None);
    assert!(err.contains("device `r0`: key `size` changed") && err.contains("nothing was applied"), "{err}");
    // One that can: a QoS change, a filter changed, and a new device.
    let edited = dump.replace("iops = 5000", "iops = 2000").replace("read_us = 5", "read_us = 1")
        + "\n[[device]]\nname = \"r3\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n";
    std::fs::write(&config_path, &edited).unwrap();
    let out = ok(&run, &["reload"], None);
    assert!(out.contains("added r3"), "{out}");
    assert!(out.contains("view `f1-v`: QoS 2000 IOPS"), "{out}");
    assert!(out.contains("filter delay inserted at position 0"), "{out}");
    assert_eq!(device_names(&serve), ["r0", "f1", "r3"]);
    let qos = serve.status_json()["devices"][1]["views"][0]["qos"]["iops"].as_u64();
    assert_eq!(qos, Some(2000));
    // SIGHUP does the same: with nothing edited since, nothing changes.
    bulkhead_sys::signal(serve.pid(), libc::SIGHUP).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !serve.log_text().contains("reload applied: added [], removed [], changed []") {
        assert!(std::time::Instant::now() < deadline, "no reload on SIGHUP: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }

    // Metrics under load agree with what fio did: 4 KiB direct I/O through the FUSE file is
    // one request each.
    let r3 = serve.fuse_file("r3");
    let fio_out = Command::new("fio")
        .args(["--name=count", "--ioengine=psync", "--direct=1", "--bs=4k", "--rw=randrw", "--rwmixread=50"])
        .args(["--io_size=8M", "--size=64M", "--randrepeat=1", "--output-format=json"])
        .arg(format!("--filename={}", r3.display()))
        .output()
        .unwrap();
    assert!(fio_out.status.success(), "{}", String::from_utf8_lossy(&fio_out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&fio_out.stdout).unwrap();
    let (reads, writes) =
        (report["jobs"][0]["read"]["total_ios"].as_u64().unwrap(), report["jobs"][0]["write"]["total_ios"].as_u64().unwrap());
    assert_eq!(reads + writes, 2048);
    let m = scrape(&metrics_sock);
    let r3 = "device=\"r3\",of=\"r3\"";
    assert_eq!(sample(&m, "bulkhead_requests_total", &format!("{r3},op=\"read\"")) as u64, reads, "reads");
    assert_eq!(sample(&m, "bulkhead_requests_total", &format!("{r3},op=\"write\"")) as u64, writes, "writes");
    assert_eq!(sample(&m, "bulkhead_request_bytes_total", &format!("{r3},op=\"write\"")) as u64, writes * 4096);
    assert_eq!(sample(&m, "bulkhead_request_latency_seconds_count", &format!("{r3},op=\"read\"")) as u64, reads);
    assert_eq!(sample(&m, "bulkhead_request_errors_total", &format!("{r3},op=\"write\"")), 0.0);
    // The file system's device is busy meanwhile, and every export and domain is there.
    assert!(sample(&m, "bulkhead_requests_total", "device=\"r0\",of=\"r0\",op=\"write\"") > 0.0);
    assert_eq!(sample(&m, "bulkhead_export_fuse_opens", "export=\"fuse\",device=\"r0\""), 1.0);
    assert!(sample(&m, "bulkhead_domain_resident_bytes", "device=\"r0\",domain=\"driver\"") > 0.0);
    assert!(m.contains("bulkhead_qos_throttle_waits_total{device=\"f1-v\",of=\"f1\"}"), "{m}");
    assert!(!m.contains("device=\"c2\""), "a removed device is gone from the metrics");

    // fio on the first device saw nothing of it all.
    let report = fio.join().expect("fio verify on r0 failed");
    assert_eq!(report["jobs"][0]["error"], 0);
    fs.unmount_and_check();
    drop(fs);
    // Now idle, it goes too.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (good, _, err) = cli(&run, &["device", "remove", "r0"], None);
        if good {
            break;
        }
        // The loop device's release of the file reaches serve a moment after it is detached.
        assert!(std::time::Instant::now() < deadline && err.contains("in use"), "{err}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(device_names(&serve), ["f1", "r3"]);
    assert!(serve.stop().success(), "{}", serve.log_text());
    assert!(!metrics_sock.exists(), "the metrics socket outlived serve");
}

#[test]
fn remove_with_force_cuts_off_an_nbd_client_and_the_device_goes() {
    require_kernel!();
    if !tools(&["qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("live-force");
    let run = tmp.path().join("run");
    let metrics_sock = tmp.path().join("metrics.sock");
    let config = format!(
        "[metrics]\nlisten = \"{}\"\n[nbd]\nenabled = true\n[fuse]\nenabled = false\n[[device]]\nname = \"d\"\nsize = \"64M\"\n\
         [device.backend]\ntype = \"ram\"\n",
        metrics_sock.display()
    );
    let mut serve = Serve::start(&run, Some(&config), &[]);
    let uri = serve.nbd_uri("d");
    // An interactive client that stays connected, taking commands on its stdin.
    let mut client = Command::new("qemu-io")
        .args(["-f", "raw", &uri])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut commands = client.stdin.take().unwrap();
    commands.write_all(b"write -P 0x5a 0 4k\n").unwrap();
    let clients = "export=\"nbd\",device=\"d\"";
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while sample(&scrape(&metrics_sock), "bulkhead_export_clients", clients) != 1.0 {
        assert!(std::time::Instant::now() < deadline, "the client never showed in the metrics");
        std::thread::sleep(Duration::from_millis(50));
    }
    let err = refused(&run, &["device", "remove", "d"], None);
    assert!(err.contains("1 NBD client(s) are connected") && err.contains("--force"), "{err}");
    let out = ok(&run, &["device", "remove", "d", "--force"], None);
    assert!(out.contains("cut off") && out.contains("NBD client"), "{out}");
    // The client's next request fails: its connection is gone.
    commands.write_all(b"read -P 0x5a 0 4k\nquit\n").unwrap();
    drop(commands);
    let done = client.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&done.stdout), String::from_utf8_lossy(&done.stderr));
    assert!(said.contains("wrote 4096/4096"), "the write before the removal: {said}");
    assert!(!said.contains("read 4096/4096"), "the cut-off client's read succeeded: {said}");
    assert!(device_names(&serve).is_empty());
    assert!(serve.stop().success(), "{}", serve.log_text());
}

#[test]
fn views_come_and_go_on_a_running_device_while_fio_verifies_on_a_sibling_view_and_another_device() {
    require_kernel!();
    if !tools(&["fio", "mkfs.ext4", "e2fsck"]) {
        return;
    }
    let tmp = TempDir::new("live-views");
    let run = tmp.path().join("run");
    let config_path = run.with_extension("toml");
    let config = "[nbd]\nenabled = true\n\n[[device]]\nname = \"d\"\nsize = \"256M\"\n[device.backend]\ntype = \"ram\"\n\
                  [[device.view]]\nname = \"fsv\"\nsize = \"128M\"\n\n\
                  [[device]]\nname = \"other\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n";
    let mut serve = Serve::start(&run, Some(config), &["d", "fsv", "other"]);
    let other_pid = serve.driver_pid(1);
    // ext4 and fio verify on one view of `d`, fio verify over NBD on another device.
    let mut fs = Ext4::make(&serve.fuse_file("fsv"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    let fio = std::thread::spawn(move || fio_verify(&mnt, "randrw", "4k-64k", "32M", 25));
    let uri = serve.nbd_uri("other");
    let nbd_fio = std::thread::spawn(move || common::fio_nbd_verify(&uri, "other", "32M", 20, 120));

    // A view added beside it, and what is written through it lands at its offset in `d`.
    let out = ok(&run, &["view", "add", "d", "name = \"v2\"", "offset = \"128M\"", "size = \"64M\"", "iops = 5000"], None);
    assert!(out.contains("v2: added to d, exported on fuse, nbd"), "{out}");
    let block: Vec<u8> = (0..65536u32).map(|i| (i * 13 + 5) as u8).collect();
    {
        use std::os::unix::fs::FileExt;
        std::fs::OpenOptions::new().write(true).open(serve.fuse_file("v2")).unwrap().write_all_at(&block, 4096).unwrap();
        let mut back = vec![0u8; block.len()];
        std::fs::File::open(serve.fuse_file("d")).unwrap().read_exact_at(&mut back, (128 << 20) + 4096).unwrap();
        assert!(back == block, "v2 does not map to its offset in d");
    }
    let views = |serve: &Serve| -> Vec<String> {
        let s = serve.status_json();
        s["devices"][0]["views"].as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(views(&serve), ["fsv", "v2"]);

    // Bad tables and names are refused, naming the key and the line.
    let err = refused(&run, &["view", "add", "d", "name = \"v3\"", "offset = \"200M\"", "size = \"64M\""], None);
    assert!(err.contains("line 3") && err.contains("key `size`") && err.contains("past the device's end"), "{err}");
    let err = refused(&run, &["view", "add", "d", "name = \"other\""], None);
    assert!(err.contains("`other` is served already"), "{err}");
    let err = refused(&run, &["view", "add", "fsv", "name = \"v3\""], None);
    assert!(err.contains("`fsv` is a view of device `d`"), "{err}");
    let err = refused(&run, &["view", "remove", "fsv"], None);
    assert!(err.contains("in use") && err.contains("FUSE file is open"), "{err}");
    let err = refused(&run, &["view", "remove", "d"], None);
    assert!(err.contains("`d` is a device"), "{err}");

    // The idle view goes with its exports; its name can be used again, elsewhere in `d`.
    let out = ok(&run, &["view", "remove", "v2"], None);
    assert!(out.contains("v2: removed from d"), "{out}");
    assert!(!serve.fuse_file("v2").exists(), "v2 is still exported");
    assert_eq!(views(&serve), ["fsv"]);
    ok(&run, &["view", "add", "d", "-"], Some("name = \"v2\"\noffset = \"192M\"\n"));
    assert_eq!(serve.status_json()["devices"][0]["views"][1]["offset"], 192u64 << 20);

    // A reload removes one view and adds another; a view whose place changed is refused.
    let dump = ok(&run, &["config", "dump"], None);
    let moved = dump.replace("offset = \"192M\"", "offset = \"128M\"");
    std::fs::write(&config_path, &moved).unwrap();
    let err = refused(&run, &["reload"], None);
    assert!(err.contains("view `v2`: key `offset` changed") && err.contains("nothing was applied"), "{err}");
    let edited = dump.replace("name = \"v2\"", "name = \"v4\"");
    std::fs::write(&config_path, &edited).unwrap();
    let out = ok(&run, &["reload"], None);
    assert!(out.contains("view `v2` removed") && out.contains("view `v4` added"), "{out}");
    assert_eq!(views(&serve), ["fsv", "v4"]);
    assert!(serve.fuse_file("v4").exists() && !serve.fuse_file("v2").exists());
    let dump = ok(&run, &["config", "dump"], None);
    assert!(dump.contains("name = \"v4\"") && !dump.contains("name = \"v2\""), "{dump}");

    // The file system on the sibling view, and the other device, saw nothing of it all.
    let report = fio.join().expect("fio verify on fsv failed");
    assert_eq!(report["jobs"][0]["error"], 0);
    let job = nbd_fio.join().expect("fio verify on other failed");
    assert_eq!(job["error"], 0);
    fs.unmount_and_check();
    drop(fs);
    let s = serve.status_json();
    assert_eq!(s["devices"][1]["restarts"], 0, "the other device restarted");
    assert_eq!(serve.driver_pid(1), other_pid, "the other device's driver domain changed");
    assert_eq!(s["devices"][0]["requests_failed"], 0, "a request on d failed");
    assert!(serve.stop().success(), "{}", serve.log_text());
}
