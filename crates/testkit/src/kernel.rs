//! Kernel-facing test helpers: capability checks and cleanup guards.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// Why a kernel test cannot run here, or `None` if it can.
pub fn missing_kernel_support() -> Option<String> {
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mount, losetup)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Some("no loop device support".into());
    }
    for tool in ["losetup", "mkfs.ext4", "mount", "umount"] {
        if which(tool).is_none() {
            return Some(format!("{tool} not installed"));
        }
    }
    None
}

/// Finds an executable on PATH (plus the sbin directories).
pub fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found =
        path.split(':').chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"]).map(|d| Path::new(d).join(tool)).find(|p| p.is_file());
    found
}

/// Skips the calling test with a message when kernel support is missing, unless
/// `BULKHEAD_REQUIRE_KERNEL=1` (set by CI), where missing support fails the test.
#[macro_export]
macro_rules! require_kernel {
    () => {
        if let Some(why) = $crate::kernel::missing_kernel_support() {
            if std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() == Ok("1") {
                panic!("kernel support required but missing: {why}");
            }
            eprintln!("SKIP: {why}");
            return;
        }
    };
}

/// Runs a command, panicking with its output if it fails; returns stdout.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    if !out.status.success() {
        panic!(
            "{cmd} {args:?} failed: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A loop device, detached on drop.
#[derive(Debug)]
pub struct LoopGuard {
    /// `/dev/loopN`.
    pub dev: String,
}

impl LoopGuard {
    /// Attaches `file` with direct I/O on.
    pub fn attach_direct(file: &Path) -> Self {
        let dev = run("losetup", &["--direct-io=on", "-f", "--show", file.to_str().unwrap()]).trim().to_string();
        LoopGuard { dev }
    }

    /// Whether the loop driver actually uses direct I/O for this device.
    pub fn direct_io(&self) -> bool {
        let name = Path::new(&self.dev).file_name().unwrap().to_string_lossy().into_owned();
        std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).map(|s| s.trim() == "1").unwrap_or(false)
    }
}

impl Drop for LoopGuard {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

/// A mount, unmounted on drop (lazily if still busy).
#[derive(Debug)]
pub struct MountGuard {
    /// Mount point.
    pub dir: PathBuf,
    mounted: bool,
}

impl MountGuard {
    /// Mounts `dev` on `dir`.
    pub fn mount(dev: &str, dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        run("mount", &[dev, dir.to_str().unwrap()]);
        MountGuard { dir: dir.to_path_buf(), mounted: true }
    }

    /// Unmounts now, panicking on failure.
    pub fn unmount(mut self) {
        run("umount", &[self.dir.to_str().unwrap()]);
        self.mounted = false;
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if self.mounted {
            let ok = Command::new("umount").arg(&self.dir).status().map(|s| s.success()).unwrap_or(false);
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
            }
        }
    }
}

/// A child process killed (SIGKILL) and reaped on drop if still running.
#[derive(Debug)]
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    /// Sends SIGTERM and waits; returns the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.0.take().expect("child still owned");
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        c.wait().expect("wait")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
