//! bulkhead's keeper: the process `bulkhead serve` becomes when `[keeper] enabled` is set and no
//! service manager keeps descriptors for it. It holds descriptors and nothing else (no device,
//! no domain, no request passes through it), starts the real `serve` as its child, and starts
//! it again when it dies or hands over for an upgrade, passing it everything it holds.
//!
//! It speaks the part of systemd's protocol that `serve` uses, so `serve` has one way to keep
//! descriptors whichever keeper it has: `serve` sends `FDSTORE=1` with `FDNAME=` and the
//! descriptors on `NOTIFY_SOCKET` (here `<run-dir>/keeper.sock`), `FDSTOREREMOVE=1` to drop a
//! name, `READY=1` once serving and `STOPPING=1` when it ends for good; the next `serve` gets
//! the descriptors as descriptors 3 and up, with `LISTEN_FDS`, `LISTEN_PID` and
//! `LISTEN_FDNAMES`. One extension: `X_BULKHEAD_HANDOVER=1` says the exit that follows is an
//! upgrade. Unlike systemd, a name stored again replaces what it held.
//!
//! Which binary it starts: the one at its own path, so a replaced binary is what an upgrade
//! (and, as under systemd, a restart after a crash) runs. It also holds open the binary of the
//! last `serve` that was serving: when the binary at the path ends, or is not serving within
//! half of `give_up_ms`, before it ever said READY, the keeper starts that one instead, telling
//! it why in `BULKHEAD_FELL_BACK`, so a broken upgrade costs a pause and not the exports.
//!
//! One thread, one `poll` over the notify socket, a signalfd and the child's pidfd.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use bulkhead_sys::process::Ended;

use crate::kept::{FELL_BACK_ENV, HANDOVER, KEEPER_ENV};

/// The socket `serve` notifies the keeper on.
pub fn socket_path(run_dir: &Path) -> PathBuf {
    run_dir.join("keeper.sock")
}

/// The `serve` the keeper started.
struct Child {
    pid: u32,
    pidfd: OwnedFd,
    started: Instant,
    /// It said READY=1.
    ready: bool,
    /// It said STOPPING=1: it ends for good.
    stopping: bool,
    /// It said it hands over: its exit is an upgrade.
    handing_over: bool,
    /// Started from the binary at the keeper's path, not the last one that was serving.
    from_path: bool,
    /// The keeper killed it for not serving in time.
    killed: bool,
}

/// Runs the keeper for `run_dir` until its `serve` ends for good, or gives up `give_up` after
/// a `serve` died without another coming back. `lock` is the run directory's lock, already
/// held.
pub fn run(run_dir: &Path, lock: std::fs::File, give_up: Duration) -> anyhow::Result<ExitCode> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let args: Vec<OsString> = std::env::args_os().collect();
    let sock_path = socket_path(run_dir);
    let _ = std::fs::remove_file(&sock_path);
    let sock = UnixDatagram::bind(&sock_path).with_context(|| format!("cannot bind {}", sock_path.display()))?;
    // Only this user may hand descriptors to the keeper (the run directory is also its own).
    std::fs::set_permissions(&sock_path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    sock.set_nonblocking(true)?;
    let signals = bulkhead_sys::process::SignalFd::new(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGCHLD])?;
    let mut held: BTreeMap<String, Vec<OwnedFd>> = BTreeMap::new();
    held.insert("lock".into(), vec![OwnedFd::from(lock)]);
    // The binary this keeper runs is the one its first serve runs.
    let last_good = std::fs::File::open("/proc/self/exe").map(OwnedFd::from).ok();
    let mut keeper = Keeper { exe, args, sock_path, held, child: None, quit: None, down_since: None, failures: 0, last_good };
    log::info!("keeper {} holds serve's descriptors in {}", std::process::id(), run_dir.display());
    keeper.spawn(None)?;
    let mut fall_back: Option<String> = None;
    let mut ever_ready = false;
    let mut respawn_at: Option<Instant> = None;
    let mut buf = vec![0u8; 4096];
    loop {
        let now = Instant::now();
        if let Some(since) = keeper.down_since {
            if now.duration_since(since) >= give_up && keeper.child.as_ref().is_none_or(|c| !c.ready) {
                return Ok(keeper.give_up(run_dir, give_up));
            }
        }
        if let Some(c) = keeper.child.as_mut() {
            // A new binary that hangs at start is ended, and the last good one started instead.
            if ever_ready && c.from_path && !c.ready && !c.killed && now.duration_since(c.started) >= give_up / 2 {
                log::warn!(
                    "keeper: serve (pid {}) from {} is not serving after {:.1} s; ending it",
                    c.pid,
                    keeper.exe.display(),
                    (give_up / 2).as_secs_f64()
                );
                let _ = bulkhead_sys::signal(c.pid, libc::SIGKILL);
                c.killed = true;
            }
        }
        if keeper.child.is_none() {
            if let Some(at) = respawn_at {
                if now >= at {
                    respawn_at = None;
                    if let Err(e) = keeper.spawn(fall_back.take()) {
                        log::error!("keeper: cannot start serve: {e}");
                        keeper.failures += 1;
                        respawn_at = Some(Instant::now() + backoff(keeper.failures));
                    }
                }
            }
        }
        let wait_ms = keeper.wait_ms(now, respawn_at, give_up);
        let mut fds = vec![
            libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: signals.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        if let Some(c) = &keeper.child {
            fds.push(libc::pollfd { fd: c.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        match bulkhead_sys::poll(&mut fds, wait_ms) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).context("keeper: poll"),
        }
        if fds[0].revents != 0 {
            while let Ok(Some((n, got))) = bulkhead_sys::recv_with_fds(sock.as_fd(), &mut buf, false) {
                Keeper::message(&mut keeper.held, &buf[..n], got, keeper.child.as_mut());
            }
            if let Some(c) = keeper.child.as_ref().filter(|c| c.ready) {
                if keeper.down_since.take().is_some() || !ever_ready {
                    log::info!("keeper: serve (pid {}) is serving", c.pid);
                    // Its binary is the one to fall back on from now on.
                    match std::fs::File::open(format!("/proc/{}/exe", c.pid)) {
                        Ok(f) => keeper.last_good = Some(f.into()),
                        Err(e) => log::warn!("keeper: cannot hold serve's binary open: {e}"),
                    }
                }
                ever_ready = true;
                keeper.failures = 0;
            }
        }
        if fds[1].revents != 0 {
            while let Some(sig) = signals.read() {
                match sig {
                    libc::SIGINT | libc::SIGTERM => {
                        let Some(c) = &keeper.child else {
                            log::info!("keeper: signal {sig} with no serve running; ending");
                            return Ok(keeper.give_up(run_dir, give_up));
                        };
                        keeper.quit = Some(sig);
                        let _ = bulkhead_sys::signal(c.pid, sig);
                    }
                    libc::SIGHUP => {
                        if let Some(c) = &keeper.child {
                            let _ = bulkhead_sys::signal(c.pid, libc::SIGHUP);
                        }
                    }
                    _ => {} // SIGCHLD: the pidfd says it
                }
            }
        }
        if fds.len() > 2 && fds[2].revents != 0 {
            if let Some(code) = keeper.child_ended(&sock, &mut buf, &mut ever_ready, &mut fall_back, &mut respawn_at)? {
                return Ok(code);
            }
        }
    }
}

impl Keeper {
    /// How long the keeper may sleep before something is due: a respawn, giving up, or ending
    /// a new `serve` that is not serving in time; at most a second.
    fn wait_ms(&self, now: Instant, respawn_at: Option<Instant>, give_up: Duration) -> i32 {
        let mut wait_ms: i32 = 1000;
        if let Some(at) = respawn_at {
            wait_ms = wait_ms.min(at.saturating_duration_since(now).as_millis() as i32 + 1);
        }
        if let Some(since) = self.down_since {
            wait_ms = wait_ms.min((since + give_up).saturating_duration_since(now).as_millis() as i32 + 1);
        }
        if let Some(c) = self.child.as_ref().filter(|c| !c.ready && !c.killed) {
            wait_ms = wait_ms.min((c.started + give_up / 2).saturating_duration_since(now).as_millis() as i32 + 1);
        }
        wait_ms
    }

    /// The `serve` it started has ended: reads what it said last, and returns the keeper's
    /// exit code if that was the end, or schedules the next `serve` (`respawn_at`).
    fn child_ended(
        &mut self,
        sock: &UnixDatagram,
        buf: &mut [u8],
        ever_ready: &mut bool,
        fall_back: &mut Option<String>,
        respawn_at: &mut Option<Instant>,
    ) -> anyhow::Result<Option<ExitCode>> {
        let mut c = self.child.take().expect("polled with a child");
        let ended = bulkhead_sys::process::wait_child(c.pid).context("keeper: waitpid")?;
        // What it said just before it ended (a hand-over, STOPPING) is read first.
        while let Ok(Some((n, got))) = bulkhead_sys::recv_with_fds(sock.as_fd(), buf, false) {
            Keeper::message(&mut self.held, &buf[..n], got, Some(&mut c));
        }
        *ever_ready |= c.ready;
        let how = ended;
        if self.quit.is_some() || (c.stopping && !c.handing_over) {
            log::info!("keeper: serve (pid {}) {how}; ending", c.pid);
            let _ = std::fs::remove_file(&self.sock_path);
            let code = if let Ended::Exited(code) = ended { code } else { 1 };
            return Ok(Some(ExitCode::from(code.clamp(0, 255) as u8)));
        }
        if !*ever_ready && !c.ready {
            // The first serve never started (a bad configuration): nothing to keep.
            log::error!("keeper: serve (pid {}) {how} before it was serving; ending", c.pid);
            let _ = std::fs::remove_file(&self.sock_path);
            return Ok(Some(ExitCode::FAILURE));
        }
        if c.handing_over {
            log::info!("keeper: serve (pid {}) handed over and {how}; starting {}", c.pid, self.exe.display());
            self.failures = 0;
        } else if c.from_path && !c.ready && self.last_good.is_some() {
            let why = if c.killed { "was not serving in time".to_string() } else { format!("{how} before it was serving") };
            let note = format!("serve (pid {}) from {} {why}", c.pid, self.exe.display());
            log::error!("keeper: {note}; starting the binary of the last serve that was serving instead");
            *fall_back = Some(note);
            self.failures = 0;
        } else {
            log::warn!(
                "keeper: serve (pid {}) {how} after {:.1} s; starting it again (the requests it had wait in the kernel)",
                c.pid,
                c.started.elapsed().as_secs_f64()
            );
            if !c.ready {
                self.failures += 1;
            }
        }
        self.down_since.get_or_insert(Instant::now());
        *respawn_at = Some(Instant::now() + if self.failures == 0 { Duration::ZERO } else { backoff(self.failures) });
        Ok(None)
    }
}

/// The wait before starting again a `serve` that died before it was serving: 100 ms,
/// doubling to 1.6 s.
fn backoff(failures: u32) -> Duration {
    Duration::from_millis(100 << failures.clamp(1, 5).saturating_sub(1))
}

struct Keeper {
    exe: PathBuf,
    args: Vec<OsString>,
    sock_path: PathBuf,
    held: BTreeMap<String, Vec<OwnedFd>>,
    child: Option<Child>,
    /// A signal asked the keeper to end, once its `serve` has.
    quit: Option<i32>,
    /// Since when no `serve` has been serving.
    down_since: Option<Instant>,
    /// `serve`s in a row that died before they were serving.
    failures: u32,
    /// The binary of the last `serve` that was serving (at first, the keeper's own).
    last_good: Option<OwnedFd>,
}

impl Keeper {
    /// Handles one message from `serve` (`child`, the one running or the one that just
    /// ended): stores or drops descriptors, notes READY, STOPPING and a hand-over.
    fn message(held: &mut BTreeMap<String, Vec<OwnedFd>>, msg: &[u8], fds: Vec<OwnedFd>, child: Option<&mut Child>) {
        let text = String::from_utf8_lossy(msg);
        let mut name = None;
        let (mut store, mut remove) = (false, false);
        let mut said = Vec::new();
        for line in text.lines() {
            match line.split_once('=') {
                Some(("FDSTORE", "1")) => store = true,
                Some(("FDSTOREREMOVE", "1")) => remove = true,
                Some(("FDNAME", n)) => name = Some(n.to_string()),
                Some(("READY", "1")) | Some(("STOPPING", "1")) => said.push(line),
                _ if line == HANDOVER => said.push(line),
                _ => {}
            }
        }
        let name = name.unwrap_or_else(|| "stored".into());
        if remove {
            held.remove(&name);
        }
        if store && !fds.is_empty() {
            held.insert(name, fds);
        }
        if let Some(c) = child {
            for line in said {
                match line {
                    "READY=1" => c.ready = true,
                    "STOPPING=1" => c.stopping = true,
                    _ => c.handing_over = true,
                }
            }
        }
    }

    /// Starts `serve` again with everything held, as descriptors 3 and up: the binary at the
    /// keeper's path, or, with `fall_back` (why), the last one that was serving.
    fn spawn(&mut self, fall_back: Option<String>) -> anyhow::Result<()> {
        let names: Vec<&str> = self.held.iter().flat_map(|(n, fds)| fds.iter().map(move |_| n.as_str())).collect();
        let fds: Vec<_> = self.held.values().flatten().map(|fd| fd.as_fd()).collect();
        let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
            .filter(|(k, _)| {
                !["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET", KEEPER_ENV, FELL_BACK_ENV]
                    .contains(&&*k.to_string_lossy())
            })
            .collect();
        env.push((KEEPER_ENV.into(), "1".into()));
        // The held binary is reached through the keeper's descriptor table
        // (/proc/<keeper>/fd/N), which what the child closes before its exec does not touch.
        let exe = match (&fall_back, &self.last_good) {
            (Some(note), Some(bin)) => {
                env.push((FELL_BACK_ENV.into(), note.into()));
                PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), bin.as_raw_fd()))
            }
            _ => self.exe.clone(),
        };
        env.push(("NOTIFY_SOCKET".into(), self.sock_path.clone().into_os_string()));
        // SIGTERM when the keeper dies: `serve` then shuts down cleanly rather than running
        // on with nothing to survive its own crash.
        let (pid, pidfd) = bulkhead_sys::process::spawn_with_fds(&exe, &self.args, &env, &fds, &names, libc::SIGTERM)
            .with_context(|| format!("cannot start {}", exe.display()))?;
        log::info!(
            "keeper: started serve (pid {pid}) with {} kept descriptor{}",
            fds.len(),
            if fds.len() == 1 { "" } else { "s" }
        );
        self.child = Some(Child {
            pid,
            pidfd,
            started: Instant::now(),
            ready: false,
            stopping: false,
            handing_over: false,
            from_path: exe == self.exe,
            killed: false,
        });
        Ok(())
    }

    /// No `serve` came back: ends the FUSE connection (closing its last descriptors makes the
    /// kernel fail what waits, so applications get errors instead of hanging), detaches the
    /// dead mount, deletes the ublk devices the kernel holds for the next `serve` (their users
    /// get errors too), and ends.
    fn give_up(&mut self, run_dir: &Path, after: Duration) -> ExitCode {
        let had_fuse = self.held.contains_key("fuse");
        if self.down_since.is_some() {
            log::error!(
                "keeper: no serve has come back within {:.1} s; ending the FUSE connection (its users get errors) and stopping",
                after.as_secs_f64()
            );
        }
        if let Some(c) = self.child.take() {
            let _ = bulkhead_sys::signal(c.pid, libc::SIGKILL);
            let _ = bulkhead_sys::process::wait_child(c.pid);
        }
        self.held.clear();
        if had_fuse {
            if let Err(e) = bulkhead_sys::detach_mount(&run_dir.join("fuse")) {
                log::warn!("keeper: cannot detach {}: {e}", run_dir.join("fuse").display());
            }
            let _ = std::fs::remove_dir(run_dir.join("fuse"));
        }
        let ublk = run_dir.join("ublk");
        if ublk.exists() {
            bulkhead_ublk_export::abandon(&ublk);
        }
        for f in [self.sock_path.clone(), run_dir.join("nbd.sock"), run_dir.join("serve.lock")] {
            let _ = std::fs::remove_file(f);
        }
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> OwnedFd {
        bulkhead_sys::memfd::create("keeper-test", 0).unwrap()
    }

    fn child() -> Child {
        let pidfd = bulkhead_sys::pidfd_open(std::process::id()).unwrap();
        Child {
            pid: std::process::id(),
            pidfd,
            started: Instant::now(),
            ready: false,
            stopping: false,
            handing_over: false,
            from_path: true,
            killed: false,
        }
    }

    #[test]
    fn stored_names_replace_what_they_held_and_removals_drop_them() {
        let mut held = BTreeMap::new();
        Keeper::message(&mut held, b"FDSTORE=1\nFDNAME=fuse\nFDPOLL=0\n", vec![memfd(), memfd()], None);
        Keeper::message(&mut held, b"FDSTORE=1\nFDNAME=config\n", vec![memfd()], None);
        assert_eq!(held["fuse"].len(), 2);
        // Stored again: replaced, not added to.
        Keeper::message(&mut held, b"FDSTORE=1\nFDNAME=fuse\n", vec![memfd()], None);
        assert_eq!(held["fuse"].len(), 1);
        Keeper::message(&mut held, b"FDSTOREREMOVE=1\nFDNAME=config\n", vec![], None);
        assert_eq!(held.keys().collect::<Vec<_>>(), ["fuse"]);
        // A store without descriptors changes nothing; one without a name is `stored`.
        Keeper::message(&mut held, b"FDSTORE=1\nFDNAME=fuse\n", vec![], None);
        assert_eq!(held["fuse"].len(), 1);
        Keeper::message(&mut held, b"FDSTORE=1\n", vec![memfd()], None);
        assert!(held.contains_key("stored"));
    }

    #[test]
    fn ready_stopping_and_a_hand_over_are_noted_on_the_child() {
        let mut held = BTreeMap::new();
        let mut c = child();
        Keeper::message(&mut held, b"READY=1\nSTATUS=serving 1 of 1 device\n", vec![], Some(&mut c));
        assert!(c.ready && !c.stopping && !c.handing_over);
        Keeper::message(&mut held, format!("{HANDOVER}\nSTATUS=handing over\n").as_bytes(), vec![], Some(&mut c));
        assert!(c.handing_over && !c.stopping);
        Keeper::message(&mut held, b"STOPPING=1\n", vec![], Some(&mut c));
        assert!(c.stopping);
        // Not the same as READY: a line that only starts alike.
        let mut d = child();
        Keeper::message(&mut held, b"READY=10\nX_READY=1\n", vec![], Some(&mut d));
        assert!(!d.ready);
    }

    #[test]
    fn a_serve_that_keeps_dying_is_started_again_less_and_less_often() {
        let waits: Vec<u128> = (1..=7).map(|f| backoff(f).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1600, 1600, 1600]);
    }
}
