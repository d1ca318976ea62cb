//! Storage on this host: a ramdisk (a sealed memfd, kept across a restart of `serve` when a
//! keeper holds it), and a raw file or block device, opened with `O_DIRECT` when asked.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use bulkhead_config::Engine;
use bulkhead_shmem::memfd;
use bulkhead_sys::uring;

use super::Storage;
use crate::error::Error;
use crate::kept::Keep;

/// A ramdisk of `size` bytes: the one a keeper held for the `serve` before this one, or a new
/// sparse, size-sealed memfd.
pub(super) fn ram(name: &str, size: u64, keep: &Keep) -> Result<Storage, Error> {
    let kept_as = crate::kept::ram_name(name);
    let fd = match keep.take(&kept_as) {
        // The contents a `serve` before this one left, kept across its end.
        Some(fd) => {
            let have = memfd::size_of(fd.as_raw_fd()).map_err(|e| Error::failed(format!("kept ramdisk: {e}")))?;
            if have != size {
                return Err(Error::invalid(format!("the kept ramdisk holds {have} bytes, and size is {size}")));
            }
            log::info!("{name}: the ramdisk's contents were kept across the restart of serve");
            fd
        }
        None => {
            let fd = memfd::create(&format!("bulkhead-{name}-ram"), size).map_err(|e| Error::failed(format!("ramdisk: {e}")))?;
            memfd::seal_size(fd.as_raw_fd()).map_err(|e| Error::failed(format!("ramdisk: {e}")))?;
            fd
        }
    };
    keep.keep(&kept_as, fd.as_fd());
    Ok(Storage::held(size, "ram".into(), vec![fd]))
}

/// A raw file or block device at `path`: its descriptor, and a buffered one beside it when
/// `direct` (for reads with no alignment rules, such as a LUKS header's); opened to write if
/// the device is `active` and not `read_only`.
pub(super) fn file(
    path: &Path,
    direct: bool,
    engine: Engine,
    read_only: bool,
    active: bool,
    size: Option<u64>,
) -> Result<Storage, Error> {
    let open = |direct| {
        open_backing(path, read_only || !active, direct)
            .map_err(|e| Error::failed(format!("cannot open backing file {}: {e}", path.display())))
    };
    let main = open(direct)?;
    let have = bulkhead_sys::storage_size(main.as_fd()).map_err(|e| Error::failed(format!("{}: {e}", path.display())))?.0;
    let size = super::fit(size, have, &path.display().to_string())?;
    let mut fds = vec![main];
    if direct {
        fds.push(open(false)?);
    }
    let desc = format!(
        "file:{}{}{}{}",
        path.display(),
        if direct { ",direct" } else { "" },
        if engine == Engine::IoUring { ",io_uring" } else { "" },
        if read_only { ",ro" } else { "" }
    );
    Ok(Storage::held(size, desc, fds))
}

fn open_backing(path: &Path, read_only: bool, direct: bool) -> Result<OwnedFd, std::io::Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC | if direct { libc::O_DIRECT } else { 0 })
        .open(path)?;
    Ok(OwnedFd::from(f))
}

/// The engine `engine = "auto"` (the default) picks for a raw file, and says why when it is
/// not io_uring: sync for a regular file on a file system held in memory; else io_uring if
/// the supervisor can make a ring to lend (the kernel may have io_uring switched off:
/// `kernel.io_uring_disabled`, or a seccomp policy around `serve`), else sync. On a disk,
/// io_uring is faster at every point measured (docs/bench/file-engines.md).
pub(crate) fn auto_engine(device: &str, path: &Path) -> Engine {
    // A regular file in memory never waits for a device, and the kernel (6.18 here)
    // completes none of its requests from a ring on the spot: each goes to an io-wq worker
    // thread and back, a hop the sync engine's plain copy does not take.
    let regular = std::fs::metadata(path).is_ok_and(|m| m.is_file());
    if let (true, Ok(Some(fs))) = (regular, bulkhead_sys::in_memory_fs(path)) {
        log::info!("device {device}: {} is on {fs}; the file backend uses the sync engine", path.display());
        return Engine::Sync;
    }
    match uring::lend(uring::FILE_ENGINE) {
        Ok(_) => Engine::IoUring,
        Err(e) => {
            log::info!("device {device}: io_uring is unavailable ({e}); the file backend uses the sync engine");
            Engine::Sync
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_sync_engine_for_a_file_in_memory_and_io_uring_for_one_on_a_disk() {
        let uring = if uring::lend(uring::FILE_ENGINE).is_ok() { Engine::IoUring } else { Engine::Sync };
        let shm = Path::new("/dev/shm");
        if bulkhead_sys::in_memory_fs(shm).is_ok_and(|fs| fs.is_some()) {
            let f = shm.join(format!("bulkhead-auto-engine-{}", std::process::id()));
            std::fs::write(&f, [0u8; 4096]).unwrap();
            let picked = auto_engine("t", &f);
            std::fs::remove_file(&f).unwrap();
            assert_eq!(picked, Engine::Sync, "a file on {}", shm.display());
        }
        // The build's own directory: on a disk, unless this machine keeps it in memory too.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let f = dir.join("Cargo.toml");
        let expect = if bulkhead_sys::in_memory_fs(dir).unwrap().is_some() { Engine::Sync } else { uring };
        assert_eq!(auto_engine("t", &f), expect, "{}", f.display());
        // A device is not judged by the file system its node is on (devtmpfs).
        assert_eq!(auto_engine("t", Path::new("/dev/null")), uring, "a device node");
    }
}
