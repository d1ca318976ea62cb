//! Real Linux guests under QEMU (TCG) for the vhost-user tests, `bulkhead-bench vm`, and the
//! kernel lab.
//!
//! The kit (a kernel and a busybox initramfs made from Debian packages by
//! `scripts/guest-kit.sh`) is built once and cached. Each guest gets the kit's initramfs
//! followed by a small archive of its own: its script as `/run.sh` and the static `guest-io`
//! checker as `/bin/guest-io`. The guest's serial console (kernel messages, the script's
//! output, and its `dmesg` at the end) is collected line by line; [`Vm`] kills QEMU when
//! dropped, so a failing test leaves no guest behind.
//!
//! The lab ([`Lab`], `scripts/guest-lab.sh`) is a guest of a newer kernel (bookworm-backports'
//! 6.12, with ublk and nbd) that runs this host's own programs: the host's root is its root,
//! read-only over 9p, with tmpfs on `/run` and `/var/tmp`. So `bulkhead serve` itself, fio and
//! e2fsprogs run there as built and installed here, on a kernel this host may lack.
#![deny(missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What went wrong with a guest: the kit could not be made, QEMU could not start, or the
/// guest reported an error or did not finish. Its words carry the console lines that show it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct GuestError(pub String);

/// The workspace's root, where this was built from.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Where the package `bulkhead-bench` puts what a benchmark runs besides its program, beside
/// the running program: `<prefix>/share/bulkhead-bench` (scripts) and `<prefix>/lib/bulkhead-bench`
/// (programs) for `<prefix>/bin/bulkhead-bench`; `what` is `share` or `lib`.
fn installed(exe: &Path, what: &str) -> Option<PathBuf> {
    let prefix = exe.parent()?.parent()?;
    let dir = prefix.join(what).join("bulkhead-bench");
    dir.is_dir().then_some(dir)
}

/// A script the benchmarks and tests run (`scripts/ceph-dev.sh`): the installed package's copy
/// when the running program is the package's, else the source tree's. The error names both
/// places looked in.
pub fn script(name: &str) -> Result<PathBuf, GuestError> {
    let exe = std::env::current_exe().unwrap_or_default();
    let from_package = installed(&exe, "share").map(|d| d.join("scripts").join(name));
    let from_source = workspace().join("scripts").join(name);
    match from_package {
        Some(p) if p.is_file() => Ok(p),
        _ if from_source.is_file() => Ok(from_source),
        _ => Err(GuestError(format!(
            "{name} is in neither {} (the bulkhead-bench package's) nor {} (the source tree's)",
            installed(&exe, "share").unwrap_or_else(|| PathBuf::from("<prefix>/share/bulkhead-bench")).join("scripts").display(),
            from_source.display()
        ))),
    }
}

/// The cached kit.
#[derive(Debug, Clone)]
pub struct Kit {
    /// The kernel, uncompressed (QEMU boots it through PVH).
    pub vmlinux: PathBuf,
    /// The base initramfs.
    pub initrd: PathBuf,
    /// The static `guest-io`.
    pub guest_io: PathBuf,
}

impl Kit {
    /// The kit, built first if it is not cached (`scripts/guest-kit.sh`), with `guest-io`
    /// built static for it (`cargo build`, target directory `target/guest`).
    pub fn ensure() -> Result<Kit, GuestError> {
        let out = Command::new(script("guest-kit.sh")?).output().map_err(|e| GuestError(format!("scripts/guest-kit.sh: {e}")))?;
        if !out.status.success() {
            return Err(GuestError(format!("scripts/guest-kit.sh failed: {}", String::from_utf8_lossy(&out.stderr))));
        }
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let guest_io = guest_io()?;
        Ok(Kit { vmlinux: dir.join("vmlinux"), initrd: dir.join("initrd.cpio.gz"), guest_io })
    }
}

/// The cached kernel lab: a kernel with ublk and nbd, and an initramfs that switches to the
/// host's root.
#[derive(Debug, Clone)]
pub struct Lab {
    /// The kernel, uncompressed.
    pub vmlinux: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// The kernel package it came from.
    pub kernel: String,
}

impl Lab {
    /// The lab, built first if it is not cached (`scripts/guest-lab.sh`).
    pub fn ensure() -> Result<Lab, GuestError> {
        let out = Command::new(script("guest-lab.sh")?).output().map_err(|e| GuestError(format!("scripts/guest-lab.sh: {e}")))?;
        if !out.status.success() {
            return Err(GuestError(format!("scripts/guest-lab.sh failed: {}", String::from_utf8_lossy(&out.stderr))));
        }
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let kernel = std::fs::read_to_string(dir.join("kernel")).unwrap_or_default().trim().to_string();
        Ok(Lab { vmlinux: dir.join("vmlinux"), initrd: dir.join("initrd.cpio.gz"), kernel })
    }
}

/// How to run a lab guest.
#[derive(Debug, Clone)]
pub struct LabOptions {
    /// The shell script it runs (the host's `/bin/sh`, with the host's programs on `PATH`).
    pub script: String,
    /// Memory, MiB.
    pub memory_mib: u32,
    /// Virtual CPUs.
    pub cpus: u32,
    /// Where the combined initramfs is written.
    pub scratch: PathBuf,
}

/// `guest-io`, static: the package's (`<prefix>/lib/bulkhead-bench/guest-io`), or built from
/// the source tree.
fn guest_io() -> Result<PathBuf, GuestError> {
    let exe = std::env::current_exe().unwrap_or_default();
    if let Some(p) = installed(&exe, "lib").map(|d| d.join("guest-io")).filter(|p| p.is_file()) {
        return Ok(p);
    }
    if !workspace().join("Cargo.toml").is_file() {
        return Err(GuestError(format!(
            "guest-io is not installed beside {} and there is no source tree at {} to build it from",
            exe.display(),
            workspace().display()
        )));
    }
    build_guest_io(&workspace())
}

fn build_guest_io(root: &Path) -> Result<PathBuf, GuestError> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = "x86_64-unknown-linux-gnu";
    let dir = root.join("target/guest");
    let out = Command::new(cargo)
        .current_dir(root)
        .env("RUSTFLAGS", "-C target-feature=+crt-static -C strip=symbols")
        .args(["build", "--release", "--locked", "-q", "-p", "bulkhead-guest-io", "--target", target, "--target-dir"])
        .arg(&dir)
        .output()
        .map_err(|e| GuestError(format!("cargo: {e}")))?;
    if !out.status.success() {
        return Err(GuestError(format!("building guest-io failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    Ok(dir.join(target).join("release/guest-io"))
}

/// A file in a newc cpio archive.
fn cpio_entry(out: &mut Vec<u8>, name: &str, mode: u32, data: &[u8], ino: u32) {
    let namesize = name.len() + 1;
    let header = format!(
        "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
        0,
        0,
        1,
        0,
        data.len(),
        0,
        0,
        0,
        0,
        0
    );
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
    out.extend_from_slice(data);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// A newc archive of `files` (path, mode, contents), ended by its trailer.
pub fn cpio(files: &[(&str, u32, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, (name, mode, data)) in files.iter().enumerate() {
        cpio_entry(&mut out, name, *mode, data, i as u32 + 1);
    }
    cpio_entry(&mut out, "TRAILER!!!", 0, &[], 0);
    out
}

/// A disk of the guest: a vhost-user-blk socket.
#[derive(Debug, Clone)]
pub struct Disk {
    /// The socket.
    pub socket: PathBuf,
    /// Virtqueues.
    pub queues: u16,
}

/// How to run a guest.
#[derive(Debug, Clone)]
pub struct VmOptions {
    /// Its disks, `/dev/vda` onwards.
    pub disks: Vec<Disk>,
    /// The shell script it runs (`/run.sh`, busybox `sh`).
    pub script: String,
    /// Memory, MiB.
    pub memory_mib: u32,
    /// Virtual CPUs (the guest's virtio-blk uses as many queues as it has CPUs, at most).
    pub cpus: u32,
    /// Where the combined initramfs is written.
    pub scratch: PathBuf,
}

/// The serial console's lines so far, and whether QEMU has ended.
#[derive(Debug, Default)]
struct Console {
    lines: Vec<String>,
    ended: bool,
}

/// A running guest.
pub struct Vm {
    child: Option<Child>,
    console: Arc<(Mutex<Console>, Condvar)>,
    reader: Option<std::thread::JoinHandle<()>>,
    initrd: PathBuf,
}

/// What a guest printed, once it ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Every console line.
    pub lines: Vec<String>,
    /// `/run.sh`'s exit status, if the guest got that far.
    pub status: Option<i32>,
}

impl Outcome {
    /// The lines that say a request failed in the guest: block-layer I/O errors, "not a
    /// head" (a used ring naming a head the guest did not make available), failed inserts,
    /// and failures `guest-io` reported.
    pub fn errors(&self) -> Vec<&String> {
        self.lines
            .iter()
            .filter(|l| {
                l.contains("I/O error")
                    || l.contains("not a head")
                    || l.contains("GUESTIO FAIL")
                    || l.contains("GUEST FAIL")
                    || l.contains("blk_update_request")
                    || l.contains("EXT4-fs error")
            })
            .collect()
    }

    /// Checks the guest ran its script to a zero status, printed its dmesg, and saw no error.
    pub fn check(&self) -> Result<(), GuestError> {
        let errors = self.errors();
        if !errors.is_empty() {
            return Err(GuestError(format!("guest errors: {errors:?}\n{}", self.script_output())));
        }
        if !self.lines.iter().any(|l| l.contains("GUEST DMESG END")) {
            return Err(GuestError(format!("the guest did not finish\n{}", self.tail(60))));
        }
        match self.status {
            Some(0) => Ok(()),
            s => Err(GuestError(format!("the guest's script ended with {s:?}\n{}", self.script_output()))),
        }
    }

    /// What the script printed (between `GUEST UP` and `GUEST EXIT`), or everything if the
    /// guest did not get that far.
    pub fn script_output(&self) -> String {
        // The firmware's last words may share the line ("Booting from ROM..GUEST UP 2.4").
        let start = self.lines.iter().position(|l| l.contains("GUEST UP")).unwrap_or(0);
        let end = self.lines.iter().position(|l| l.starts_with("GUEST EXIT")).map_or(self.lines.len(), |e| e + 1);
        self.lines[start..end.max(start)].join("\n")
    }

    /// The last `n` lines.
    pub fn tail(&self, n: usize) -> String {
        self.lines[self.lines.len().saturating_sub(n)..].join("\n")
    }

    /// Lines starting with `prefix`.
    pub fn with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a String> + 'a {
        self.lines.iter().filter(move |l| l.starts_with(prefix))
    }
}

/// Writes `base` followed by an archive of `files` to `scratch`: the initramfs a guest boots.
fn write_initrd(base: &Path, files: &[(&str, u32, &[u8])], scratch: &Path) -> Result<(), GuestError> {
    let mut initrd = std::fs::read(base).map_err(|e| GuestError(format!("{}: {e}", base.display())))?;
    // The kernel finds a following archive only at a four-byte boundary.
    while !initrd.len().is_multiple_of(4) {
        initrd.push(0);
    }
    initrd.extend_from_slice(&cpio(files));
    std::fs::write(scratch, &initrd).map_err(|e| GuestError(format!("{}: {e}", scratch.display())))
}

/// QEMU booting `vmlinux` with `initrd`, `mem` MiB and `cpus` CPUs, its console on stdio.
fn qemu(vmlinux: &Path, initrd: &Path, mem: u32, cpus: u32) -> Command {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-accel", "tcg", "-m"])
        .arg(format!("{mem}"))
        .arg("-smp")
        .arg(cpus.max(1).to_string())
        .args(["-nodefaults", "-no-user-config", "-nographic", "-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(vmlinux)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", "console=ttyS0 quiet panic=-1"]);
    cmd
}

impl Vm {
    /// Boots a guest of `kit` as `opts` says.
    pub fn boot(kit: &Kit, opts: &VmOptions) -> Result<Vm, GuestError> {
        Vm::boot_with(kit, opts, &[])
    }

    /// As [`boot`](Self::boot), with more of QEMU's arguments: a QMP socket, or `-incoming`
    /// and `-S` for the destination of a migration (the same `opts` as the source's, with a
    /// scratch file of its own).
    pub fn boot_with(kit: &Kit, opts: &VmOptions, more: &[String]) -> Result<Vm, GuestError> {
        let io_bin = std::fs::read(&kit.guest_io).map_err(|e| GuestError(format!("{}: {e}", kit.guest_io.display())))?;
        // Each command is echoed (`+ …`) so that a failing one shows in the console.
        let script = format!("#!/bin/sh\nset -ex\n{}\n", opts.script);
        write_initrd(
            &kit.initrd,
            &[("bin/guest-io", 0o100755, &io_bin), ("run.sh", 0o100755, script.as_bytes())],
            &opts.scratch,
        )?;
        let mem = opts.memory_mib;
        let mut cmd = qemu(&kit.vmlinux, &opts.scratch, mem, opts.cpus);
        cmd.args(["-object", &format!("memory-backend-memfd,id=mem,size={mem}M,share=on"), "-numa", "node,memdev=mem"]);
        for (i, d) in opts.disks.iter().enumerate() {
            cmd.arg("-chardev").arg(format!("socket,id=disk{i},path={},reconnect=1", d.socket.display()));
            cmd.arg("-device").arg(format!("vhost-user-blk-pci,chardev=disk{i},num-queues={}", d.queues));
        }
        cmd.args(more);
        Vm::spawn(cmd, &opts.scratch)
    }

    /// Boots a lab guest as `opts` says: the host's root, read-only, on the lab's kernel.
    pub fn boot_lab(lab: &Lab, opts: &LabOptions) -> Result<Vm, GuestError> {
        // Each command is echoed (`+ …`) so that a failing one shows in the console.
        let script = format!("#!/bin/sh\nset -ex\n{}\n", opts.script);
        write_initrd(&lab.initrd, &[("run.sh", 0o100755, script.as_bytes())], &opts.scratch)?;
        let mut cmd = qemu(&lab.vmlinux, &opts.scratch, opts.memory_mib, opts.cpus);
        // multidevs=remap: the host's files keep distinct inode numbers in the guest even where
        // they come from several file systems.
        cmd.args(["-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"]);
        Vm::spawn(cmd, &opts.scratch)
    }

    fn spawn(mut cmd: Command, scratch: &Path) -> Result<Vm, GuestError> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| GuestError(format!("qemu-system-x86_64: {e}")))?;
        let console = Arc::new((Mutex::new(Console::default()), Condvar::new()));
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let c = console.clone();
        let reader = std::thread::spawn(move || {
            let err_console = c.clone();
            let errs = std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let (m, cv) = &*err_console;
                    m.lock().unwrap_or_else(|e| e.into_inner()).lines.push(format!("qemu: {line}"));
                    cv.notify_all();
                }
            });
            let mut r = BufReader::new(stdout);
            let mut buf = Vec::new();
            while r.read_until(b'\n', &mut buf).unwrap_or(0) > 0 {
                let line = String::from_utf8_lossy(&buf).trim_end_matches(['\r', '\n']).to_string();
                buf.clear();
                let (m, cv) = &*c;
                m.lock().unwrap_or_else(|e| e.into_inner()).lines.push(line);
                cv.notify_all();
            }
            let _ = errs.join();
            let (m, cv) = &*c;
            m.lock().unwrap_or_else(|e| e.into_inner()).ended = true;
            cv.notify_all();
        });
        Ok(Vm { child: Some(child), console, reader: Some(reader), initrd: scratch.to_path_buf() })
    }

    /// QEMU's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Waits up to `timeout` for a console line containing `needle`; returns it.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        let (m, cv) = &*self.console;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(l) = g.lines.iter().find(|l| l.contains(needle)) {
                return Some(l.clone());
            }
            let now = Instant::now();
            if g.ended || now >= deadline {
                return None;
            }
            g = cv.wait_timeout(g, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// The console so far.
    pub fn lines(&self) -> Vec<String> {
        self.console.0.lock().unwrap_or_else(|e| e.into_inner()).lines.clone()
    }

    /// Waits up to `timeout` for the guest to power off (killing it after that), and returns
    /// what it printed.
    pub fn finish(mut self, timeout: Duration) -> Outcome {
        let deadline = Instant::now() + timeout;
        if let Some(c) = self.child.as_mut() {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.kill();
        let lines = self.lines();
        let status = lines.iter().rev().find_map(|l| l.strip_prefix("GUEST EXIT ").and_then(|s| s.trim().parse().ok()));
        Outcome { lines, status }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let _ = std::fs::remove_file(&self.initrd);
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
    }
}

/// QEMU's arguments for a QMP socket at `path`, for [`Qmp::connect`].
pub fn qmp_args(path: &Path) -> Vec<String> {
    vec!["-qmp".into(), format!("unix:{},server=on,wait=off", path.display())]
}

/// A QMP connection to a QEMU started with `-qmp unix:PATH,server=on,wait=off`: commands
/// in, answers out, events skipped.
pub struct Qmp {
    reader: BufReader<std::os::unix::net::UnixStream>,
    writer: std::os::unix::net::UnixStream,
}

impl Qmp {
    /// Connects to `path` (waiting up to `timeout` for QEMU to make it) and leaves
    /// capabilities negotiation.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp, GuestError> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(GuestError(format!("qmp {}: {e}", path.display()))),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
        let writer = stream.try_clone().map_err(|e| GuestError(format!("qmp: {e}")))?;
        let mut q = Qmp { reader: BufReader::new(stream), writer };
        q.line()?;
        q.execute("qmp_capabilities", "{}")?;
        Ok(q)
    }

    fn line(&mut self) -> Result<String, GuestError> {
        let mut l = String::new();
        match self.reader.read_line(&mut l) {
            Ok(0) => Err(GuestError("qmp: QEMU closed the connection".into())),
            Ok(_) => Ok(l),
            Err(e) => Err(GuestError(format!("qmp: {e}"))),
        }
    }

    /// Waits up to `timeout` for the migration this QEMU is making to end: its status
    /// (`completed`, `failed` or `cancelled`) and QEMU's downtime, ms (`query-migrate`).
    pub fn migration_ended(&mut self, timeout: Duration) -> Result<(String, f64), GuestError> {
        let deadline = Instant::now() + timeout;
        loop {
            let answer = self.execute("query-migrate", "{}")?;
            let v: serde_json::Value =
                serde_json::from_str(&answer).map_err(|e| GuestError(format!("query-migrate: {e}: {}", answer.trim())))?;
            let status = v["return"]["status"].as_str().unwrap_or("").to_string();
            if matches!(status.as_str(), "completed" | "failed" | "cancelled") {
                return Ok((status, v["return"]["downtime"].as_f64().unwrap_or(0.0)));
            }
            if Instant::now() >= deadline {
                return Err(GuestError(format!("the migration did not end in {timeout:?}: {}", answer.trim())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `command` with `arguments` (a JSON object); its answer's line (`{"return": …}`),
    /// or its error.
    pub fn execute(&mut self, command: &str, arguments: &str) -> Result<String, GuestError> {
        writeln!(self.writer, r#"{{"execute":"{command}","arguments":{arguments}}}"#)
            .map_err(|e| GuestError(format!("qmp {command}: {e}")))?;
        loop {
            let l = self.line()?;
            if l.starts_with(r#"{"return""#) {
                return Ok(l);
            }
            if l.starts_with(r#"{"error""#) {
                return Err(GuestError(format!("qmp {command}: {}", l.trim())));
            }
        }
    }
}

/// Writes `text` to the guest's console log file `path` (for a failing test's artifacts).
pub fn save_console(path: &Path, lines: &[String]) {
    if let Ok(mut f) = std::fs::File::create(path) {
        for l in lines {
            let _ = writeln!(f, "{l}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packaged_program_finds_its_scripts_beside_it_and_a_built_one_in_the_source_tree() {
        let root = std::env::temp_dir().join(format!("bulkhead-guest-prefix-{}", std::process::id()));
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::create_dir_all(root.join("usr/share/bulkhead-bench/scripts")).unwrap();
        let exe = root.join("usr/bin/bulkhead-bench");
        assert_eq!(installed(&exe, "share"), Some(root.join("usr/share/bulkhead-bench")));
        assert_eq!(installed(&exe, "lib"), None);
        assert_eq!(installed(&workspace().join("target/release/bulkhead-bench"), "share"), None);
        assert!(script("ceph-dev.sh").unwrap().ends_with("scripts/ceph-dev.sh"));
        let missing = script("no-such.sh").unwrap_err().to_string();
        assert!(missing.contains("no-such.sh") && missing.contains("source tree"), "{missing}");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_newc_archive_is_aligned_and_ends_in_its_trailer() {
        let a = cpio(&[("run.sh", 0o100755, b"echo hi\n")]);
        assert_eq!(a.len() % 4, 0);
        assert!(a.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&a);
        assert!(text.contains("run.sh\0") && text.contains("echo hi") && text.contains("TRAILER!!!"));
        // The header's file size field is the data's length.
        assert_eq!(&a[54..62], b"00000008");
    }
}
