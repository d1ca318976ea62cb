//! One test per bug that reached `main`, each named for what broke and saying what it was, so
//! that it stays fixed. Tests of a capability live with the capability's other tests; these
//! pin a behaviour that once went wrong.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{sh, tools, Serve, TempDir};

/// A removal that was refused after the device had been taken off the exports offered it on
/// NBD again without its `nbd_allow` list, so that any TCP peer could reach a device its
/// configuration restricted. The exports now hand back what they took, and the removal puts
/// back exactly that: here the supervisor refuses (an application is attached, which only
/// it sees), and afterwards TLS is still required and the allow list still refuses
/// 127.0.0.1, for the device and for its view. (The exports' own tests refuse at every step
/// of the withdrawal in turn.)
#[test]
fn a_refused_removal_puts_the_nbd_export_back_with_its_allow_list_and_tls() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let tmp = TempDir::new("regress-allow");
    let keys = tmp.path().join("keys.psk");
    std::fs::write(&keys, "alice:000102030405060708090a0b0c0d0e0f\n").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = format!(
        "[fuse]\nenabled = false\n[nbd]\ntcp = \"127.0.0.1:{port}\"\ntls = \"require\"\ntls_psk = \"{}\"\n\
         [[device]]\nname = \"d\"\nsize = \"16M\"\nnbd_allow = [\"10.0.0.0/8\"]\n[device.backend]\ntype = \"ram\"\n\
         [[device.view]]\nname = \"d-v\"\nsize = \"8M\"\nnbd_allow = [\"10.0.0.0/8\"]\n",
        keys.display()
    );
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !serve.run_dir.join("control.sock").exists() {
        assert!(Instant::now() < deadline, "serve did not start: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let nbds = |e: &str| format!("nbds://alice@127.0.0.1:{port}/{e}?tls-psk-file={}", keys.display());
    let refused_as = |uri: &str, why: &str| {
        let out = Command::new("nbdinfo").args(["--size", uri]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{uri}: expected a refusal for {why}: {out:?}");
    };
    let check = |when: &str| {
        for e in ["d", "d-v"] {
            refused_as(&format!("nbd://127.0.0.1:{port}/{e}"), "TLS");
            refused_as(&nbds(e), "policy");
            let unix = format!("nbd+unix:///{e}?socket={}", serve.run_dir.join("nbd.sock").display());
            assert!(!sh("nbdinfo", &["--size", &unix]).trim().is_empty(), "{when}: `{e}` not on the unix socket");
        }
    };
    check("before");

    let app = bulkhead_client::attach(&serve.run_dir, "d").expect("attach");
    let out = Command::new(common::exe()).args(["device", "remove", "d", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("attached"), "the removal was not refused: {out:?}");
    check("after the refused removal");

    drop(app);
    let out = Command::new(common::exe()).args(["device", "remove", "d", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let unix = format!("nbd+unix:///d?socket={}", serve.run_dir.join("nbd.sock").display());
    assert!(!Command::new("nbdinfo").args(["--size", &unix]).output().unwrap().status.success(), "`d` still exported");
}
