//! The control socket against malformed and hostile clients, with a service of the test's own.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bulkhead_control::*;

/// Answers every call; counts the changes that reach it.
#[derive(Default)]
struct Fake {
    changes: AtomicU64,
}

impl Service for Fake {
    fn hello(&self, _: Hello) -> Result<HelloReply, ControlError> {
        Ok(HelloReply { protocol: PROTOCOL_VERSION, version: "test".into(), pid: std::process::id(), fell_back: None })
    }
    fn status(&self, _: Status) -> Result<StatusReport, ControlError> {
        Ok(StatusReport {
            frontend: ProcessMemory { pid: 1, rss: None },
            uptime_s: 1.0,
            devices: Vec::new(),
            fuse: None,
            vhost_user: None,
            ublk: None,
            spares: Default::default(),
        })
    }
    fn restart(&self, c: Restart) -> Result<Changed, ControlError> {
        if c.device != "disk0" {
            return Err(ControlError::not_found(format!("no device `{}`", c.device)));
        }
        self.changes.fetch_add(1, Ordering::Relaxed);
        Ok(Changed { device: c.device, driver_pid: 42 })
    }
    fn set_tap(&self, c: SetTap) -> Result<Changed, ControlError> {
        self.changes.fetch_add(1, Ordering::Relaxed);
        Ok(Changed { device: c.device, driver_pid: 43 })
    }
    fn activate(&self, c: bulkhead_control::Activate) -> Result<bulkhead_control::Activity, ControlError> {
        Err(ControlError::not_found(format!("no device `{}`", c.device)))
    }
    fn deactivate(&self, c: bulkhead_control::Deactivate) -> Result<bulkhead_control::Activity, ControlError> {
        Err(ControlError::not_found(format!("no device `{}`", c.device)))
    }
    fn add_filter(&self, c: AddFilter) -> Result<Changed, ControlError> {
        self.changes.fetch_add(1, Ordering::Relaxed);
        Ok(Changed { device: c.device, driver_pid: 44 })
    }
    fn remove_filter(&self, c: RemoveFilter) -> Result<Changed, ControlError> {
        self.changes.fetch_add(1, Ordering::Relaxed);
        Ok(Changed { device: c.device, driver_pid: 45 })
    }
    fn snapshot(&self, c: Snapshot) -> Result<Changed, ControlError> {
        self.changes.fetch_add(1, Ordering::Relaxed);
        Ok(Changed { device: c.device, driver_pid: 46 })
    }
    fn list_snapshots(&self, c: ListSnapshots) -> Result<Snapshots, ControlError> {
        Ok(Snapshots { device: c.device, snapshots: Vec::new() })
    }
    fn set_qos(&self, c: SetQos) -> Result<QosReply, ControlError> {
        let qos = bulkhead_qos::Caps::default();
        Ok(QosReply { view: c.view, summary: qos.to_string(), qos })
    }

    fn add_device(&self, _: AddDevice) -> Result<DevicesAdded, ControlError> {
        Err(ControlError::invalid("not here"))
    }

    fn remove_device(&self, c: RemoveDevice) -> Result<DeviceRemoved, ControlError> {
        Err(ControlError::not_found(format!("no device `{}`", c.name)))
    }

    fn add_view(&self, c: bulkhead_control::AddView) -> Result<bulkhead_control::ViewAdded, ControlError> {
        Err(ControlError::not_found(format!("no device `{}`", c.device)))
    }

    fn remove_view(&self, c: bulkhead_control::RemoveView) -> Result<bulkhead_control::ViewRemoved, ControlError> {
        Err(ControlError::not_found(format!("no view `{}`", c.name)))
    }

    fn dump_config(&self, _: DumpConfig) -> Result<ConfigText, ControlError> {
        Ok(ConfigText { toml: String::new() })
    }

    fn reload(&self, _: Reload) -> Result<Reloaded, ControlError> {
        Err(ControlError::invalid("not here"))
    }

    fn upgrade(&self, _: Upgrade) -> Result<Upgrading, ControlError> {
        Err(ControlError::invalid("not here"))
    }
}

struct Setup {
    dir: PathBuf,
    server: ControlServer,
    fake: Arc<Fake>,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.server.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(name: &str) -> Setup {
    let dir = std::env::temp_dir().join(format!("bulkhead-control-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fake = Arc::new(Fake::default());
    let server = ControlServer::start(&socket_path(&dir), Access::owner_only(), fake.clone(), None).unwrap();
    Setup { dir, server, fake }
}

fn raw(path: &Path) -> (UnixStream, BufReader<UnixStream>) {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let r = BufReader::new(s.try_clone().unwrap());
    (s, r)
}

fn answer(r: &mut BufReader<UnixStream>) -> serde_json::Value {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

#[test]
fn typed_calls_get_typed_replies_and_errors_carry_codes() {
    let s = start("typed");
    let mut c = Client::connect(&s.dir).unwrap();
    assert_eq!(c.call(Hello {}).unwrap().protocol, PROTOCOL_VERSION);
    assert!(c.call(Status {}).unwrap().devices.is_empty());
    assert_eq!(c.call(Restart { device: "disk0".into() }).unwrap().driver_pid, 42);
    match c.call(Restart { device: "nope".into() }) {
        Err(ClientError::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::NotFound);
            assert_eq!(e.message, "no device `nope`");
        }
        other => panic!("{other:?}"),
    }
    let q = c.call(SetQos { view: "v".into(), set: Default::default() }).unwrap();
    assert_eq!(q.view, "v");
    // No serve at all: said in words.
    let gone = std::env::temp_dir().join("bulkhead-control-no-such-run-dir");
    assert!(Client::connect(&gone).unwrap_err().to_string().contains("no bulkhead serve is running"));
}

#[test]
fn malformed_lines_are_answered_by_what_is_wrong_and_reach_no_call() {
    let s = start("malformed");
    let (mut w, mut r) = raw(&socket_path(&s.dir));
    let cases: &[(&str, &str, &str)] = &[
        ("not json", "bad_request", "not a JSON request"),
        (r#"{"cmd":"frob"}"#, "bad_request", "unknown variant `frob`"),
        (r#"{"cmd":"restart"}"#, "bad_request", "missing field `device`"),
        (r#"{"cmd":"restart","device":7}"#, "bad_request", "invalid type"),
        (r#"{"cmd":"restart","device":"disk0","force":true}"#, "bad_request", "unknown field `force`"),
        (r#"{"cmd":"filter_remove","device":"disk0","at":-1}"#, "bad_request", "invalid value"),
        (r#"{"cmd":"tap","device":"disk0","mode":7}"#, "bad_request", "invalid type"),
        (r#"{"cmd":"device_add"}"#, "bad_request", "missing field `table`"),
        (r#"{"cmd":"device_add","table":["[[device]]"]}"#, "bad_request", "invalid type"),
        (r#"{"cmd":"device_remove","name":"disk0","force":"yes"}"#, "bad_request", "invalid type"),
        (r#"{"cmd":"reload","path":"/etc/passwd"}"#, "bad_request", "unknown field `path`"),
        (r#"{"cmd":"view_add","table":"name = \"v\""}"#, "bad_request", "missing field `device`"),
        (r#"{"cmd":"view_remove","name":"v","at":0}"#, "bad_request", "unknown field `at`"),
        (r#"{"cmd":"status","version":2}"#, "unsupported_version", "this serve speaks 1"),
        (r#"{"cmd":"status","version":"1"}"#, "bad_request", "`version` must be a number"),
        (r#"{"cmd":"attach","name":"disk0"}"#, "bad_request", "first line"),
        ("[]", "bad_request", "JSON object"),
        ("", "bad_request", "not a JSON request"),
    ];
    // The first line goes first so the `attach` case is a later line.
    writeln!(w, r#"{{"cmd":"hello"}}"#).unwrap();
    assert!(answer(&mut r)["ok"]["protocol"].is_number());
    for (line, code, says) in cases {
        writeln!(w, "{line}").unwrap();
        let a = answer(&mut r);
        assert_eq!(a["error"]["code"], *code, "{line}: {a}");
        assert!(a["error"]["message"].as_str().unwrap().contains(says), "{line}: {a}");
    }
    // Not UTF-8.
    w.write_all(b"{\"cmd\":\"st\xffatus\"}\n").unwrap();
    assert_eq!(answer(&mut r)["error"]["code"], "bad_request");
    assert_eq!(s.fake.changes.load(Ordering::Relaxed), 0, "no malformed request reached a call");
    // The connection still serves.
    writeln!(w, r#"{{"cmd":"restart","device":"disk0"}}"#).unwrap();
    assert_eq!(answer(&mut r)["ok"]["driver_pid"], 42);
}

#[test]
fn oversized_and_truncated_lines_end_their_connection_and_nothing_else() {
    let s = start("oversized");
    let path = socket_path(&s.dir);
    // Longer than the limit, as the first line (read a byte at a time) and as a later one.
    for later in [false, true] {
        let (mut w, mut r) = raw(&path);
        if later {
            writeln!(w, r#"{{"cmd":"hello"}}"#).unwrap();
            assert!(answer(&mut r).get("ok").is_some());
        }
        let big = vec![b'x'; MAX_LINE + 10];
        // The server may close while the rest is still being written.
        let _ = w.write_all(&big);
        let a = answer(&mut r);
        assert_eq!(a["error"]["code"], "too_large", "{a}");
        let mut rest = String::new();
        assert_eq!(r.read_line(&mut rest).unwrap_or(0), 0, "connection closed after a line too long");
    }
    // Cut short: half a request, then the client stops writing.
    let (mut w, mut r) = raw(&path);
    w.write_all(br#"{"cmd":"rest"#).unwrap();
    w.shutdown(std::net::Shutdown::Write).unwrap();
    let a = answer(&mut r);
    assert!(a["error"]["message"].as_str().unwrap().contains("cut short"), "{a}");
    // Others are served throughout.
    assert_eq!(Client::connect(&s.dir).unwrap().call(Hello {}).unwrap().protocol, PROTOCOL_VERSION);
}

#[test]
fn a_client_that_never_reads_and_a_crowd_of_idle_ones_do_not_stall_others() {
    let s = start("stall");
    let path = socket_path(&s.dir);
    // Sends requests and never reads an answer: its own connection fills and is dropped.
    let mut greedy = UnixStream::connect(&path).unwrap();
    greedy.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let flood = std::thread::spawn(move || {
        let line = b"{\"cmd\":\"status\"}\n".repeat(1000);
        while greedy.write_all(&line).is_ok() {}
    });
    // Idle connections up to the limit and beyond: those past it are refused in words.
    let mut idle = Vec::new();
    let mut refused = 0;
    for _ in 0..80 {
        let c = UnixStream::connect(&path).unwrap();
        c.set_nonblocking(true).unwrap();
        idle.push(c);
    }
    std::thread::sleep(Duration::from_millis(300));
    for c in &mut idle {
        let mut buf = [0u8; 512];
        if let Ok(n) = c.read(&mut buf) {
            if n > 0 && String::from_utf8_lossy(&buf[..n]).contains("control connections open") {
                refused += 1;
            }
        }
    }
    assert!(refused > 0, "connections past the limit are refused");
    // Free some room: a well-behaved client is then served at once.
    idle.truncate(10);
    std::thread::sleep(Duration::from_millis(200));
    let t = std::time::Instant::now();
    let mut c = Client::connect(&s.dir).unwrap();
    assert_eq!(c.call(Restart { device: "disk0".into() }).unwrap().driver_pid, 42);
    assert!(t.elapsed() < Duration::from_secs(5), "served in {:?}", t.elapsed());
    drop(idle);
    flood.join().unwrap();
}

#[test]
fn the_socket_is_its_owners_alone_and_peers_are_checked_again() {
    use std::os::unix::fs::PermissionsExt;
    let s = start("access");
    let path = socket_path(&s.dir);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    if bulkhead_sys::euid() != 0 || std::process::Command::new("setpriv").arg("--version").output().is_err() {
        assert!(std::env::var_os("BULKHEAD_REQUIRE_KERNEL").is_none(), "needs root and setpriv");
        eprintln!("SKIP: the check of another user needs root and setpriv");
        return;
    }
    // Open the way in the file system, as a careless administrator might: SO_PEERCRED still
    // refuses a user who is neither the owner nor in the group.
    std::fs::set_permissions(&s.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let script = format!(
        // The server may answer and close before the request is sent: what it said is still
        // there to read after a broken pipe.
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})\ntry:\n    s.sendall(b'{{\"cmd\":\"restart\",\"device\":\"disk0\"}}\\n')\nexcept BrokenPipeError:\n    pass\nprint(s.recv(4096).decode())",
        path.display().to_string()
    );
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", &script])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("\"denied\"") && said.contains("user 65534"), "{said} {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(s.fake.changes.load(Ordering::Relaxed), 0);
}

#[test]
fn a_group_opens_the_socket_to_its_members() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = std::env::temp_dir().join(format!("bulkhead-control-group-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let access = Access::with_group("12345").unwrap();
    let mut server = ControlServer::start(&socket_path(&dir), access, Arc::new(Fake::default()), None).unwrap();
    let meta = std::fs::metadata(socket_path(&dir)).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    if bulkhead_sys::euid() == 0 {
        assert_eq!(meta.gid(), 12345);
    }
    assert!(Access::with_group("no-such-group-here").unwrap_err().contains("no group `no-such-group-here`"));
    server.stop();
    std::fs::remove_dir_all(dir).unwrap();
}
