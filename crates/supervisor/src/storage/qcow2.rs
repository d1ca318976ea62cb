//! A qcow2 image and the backing files it names.
//!
//! The domain opens nothing, so the supervisor follows a qcow2 image's chain: it reads each
//! header (strictly, [`bulkhead_image::Qcow2Header::parse`]; the tables behind it are read in
//! the domain), resolves the backing file name as qemu does (relative to the directory of the
//! image that names it), and opens every backing file read-only. A chain that loops or runs
//! deeper than [`MAX_DEPTH`] is refused.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use bulkhead_image::{Format, Qcow2Header, PROBE_BYTES};

use super::Storage;
use crate::error::Error;

/// Images in one chain, the top one included, at most (qemu has no limit; real chains are short).
pub const MAX_DEPTH: usize = 16;

/// An opened chain: the image first, then each backing file after the image naming it.
#[derive(Debug)]
pub struct ImageChain {
    /// Descriptors: the image read-write unless read-only, every backing file read-only.
    pub fds: Vec<OwnedFd>,
    /// Their formats.
    pub formats: Vec<Format>,
    /// Their paths, as resolved.
    pub paths: Vec<PathBuf>,
    /// The virtual size of the top image.
    pub size: u64,
}

fn open_one(path: &Path, write: bool) -> Result<OwnedFd, Error> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map(OwnedFd::from)
        .map_err(|e| Error::failed(format!("cannot open {}: {e}", path.display())))
}

/// Opens the qcow2 image at `path` and its backing chain.
pub fn open_chain(path: &Path, read_only: bool) -> Result<ImageChain, Error> {
    let mut chain = ImageChain { fds: Vec::new(), formats: Vec::new(), paths: Vec::new(), size: 0 };
    let mut seen = HashSet::new();
    let mut next = Some((path.to_path_buf(), Format::Qcow2));
    while let Some((path, format)) = next.take() {
        let top = chain.fds.is_empty();
        if chain.fds.len() == MAX_DEPTH {
            return Err(Error::invalid(format!("the backing chain is deeper than {MAX_DEPTH} images at {}", path.display())));
        }
        let fd = open_one(&path, top && !read_only)?;
        let file = std::fs::File::from(fd);
        let meta = file.metadata().map_err(|e| Error::failed(format!("{}: {e}", path.display())))?;
        if !seen.insert((meta.dev(), meta.ino())) {
            return Err(Error::invalid(format!("the backing chain loops: {} is already in it", path.display())));
        }
        if format == Format::Qcow2 {
            let mut start = vec![0u8; (meta.len() as usize).min(PROBE_BYTES)];
            file.read_exact_at(&mut start, 0).map_err(|e| Error::failed(format!("{}: {e}", path.display())))?;
            let header = Qcow2Header::parse(&start).map_err(|e| Error::invalid(format!("image {}: {e}", path.display())))?;
            if top {
                if header.dirty && !read_only {
                    return Err(Error::invalid(format!(
                        "image {} was not closed cleanly (dirty bit, lazy refcounts): repair it with `qemu-img check -r all`",
                        path.display()
                    )));
                }
                chain.size = header.size / 512 * 512;
                if chain.size == 0 {
                    return Err(Error::invalid(format!("image {} has a virtual size of {} bytes", path.display(), header.size)));
                }
            }
            if let Some(b) = header.backing {
                let named = PathBuf::from(&b.name);
                let resolved = if named.is_absolute() { named } else { path.parent().unwrap_or(Path::new(".")).join(named) };
                next = Some((resolved, b.format));
            }
        }
        chain.fds.push(file.into());
        chain.formats.push(format);
        chain.paths.push(path);
    }
    Ok(chain)
}

/// The storage of a qcow2 image: the image and its backing chain, the image opened to write
/// if the device is `active` and not `read_only`.
pub(super) fn open(path: &Path, read_only: bool, active: bool) -> Result<Storage, Error> {
    let chain = open_chain(path, read_only || !active)?;
    let desc = format!(
        "qcow2:{}{}{}",
        path.display(),
        match chain.paths.len() - 1 {
            0 => String::new(),
            1 => format!(" over {}", chain.paths[1].display()),
            n => format!(" over {} and {} more", chain.paths[1].display(), n - 1),
        },
        if read_only { ",ro" } else { "" }
    );
    Ok(Storage { size: chain.size, desc, fds: chain.fds, formats: chain.formats, card: None, rbd: None })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn qemu_img(args: &[&str]) -> bool {
        match Command::new("qemu-img").args(args).output() {
            Ok(o) => {
                assert!(o.status.success(), "qemu-img {args:?}: {}", String::from_utf8_lossy(&o.stderr));
                true
            }
            Err(_) => false,
        }
    }

    #[test]
    fn a_chain_is_followed_relative_to_each_image_and_loops_and_depth_are_refused() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let d = std::env::temp_dir().join(format!("bulkhead-chain-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(d.join("sub")).unwrap();
        let p = |n: &str| d.join(n).to_str().unwrap().to_string();
        std::fs::write(d.join("sub/base.raw"), vec![0u8; 1 << 20]).unwrap();
        if !qemu_img(&["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", &p("sub/mid.qcow2")]) {
            eprintln!("skipped: qemu-img is not installed");
            let _ = std::fs::remove_dir_all(&d);
            return;
        }
        assert!(qemu_img(&["create", "-q", "-f", "qcow2", "-b", "sub/mid.qcow2", "-F", "qcow2", &p("top.qcow2")]));
        let c = open_chain(&d.join("top.qcow2"), false).unwrap();
        assert_eq!(c.formats, [Format::Qcow2, Format::Qcow2, Format::Raw]);
        assert_eq!(c.paths[2], d.join("sub/base.raw"));
        assert_eq!(c.size, 1 << 20);

        // mid → top → mid: rebase mid onto top without checking (-u), making a loop.
        assert!(qemu_img(&["rebase", "-u", "-f", "qcow2", "-b", "../top.qcow2", "-F", "qcow2", &p("sub/mid.qcow2")]));
        let e = open_chain(&d.join("top.qcow2"), false).unwrap_err().to_string();
        assert!(e.contains("loops"), "{e}");

        // A chain of MAX_DEPTH + 1 images.
        std::fs::write(d.join("l0"), vec![0u8; 65536]).unwrap();
        assert!(qemu_img(&["create", "-q", "-f", "qcow2", "-b", "l0", "-F", "raw", &p("l1")]));
        for i in 2..=MAX_DEPTH {
            let (below, this) = (format!("l{}", i - 1), p(&format!("l{i}")));
            assert!(qemu_img(&["create", "-q", "-f", "qcow2", "-b", &below, "-F", "qcow2", &this]));
        }
        let e = open_chain(&d.join(format!("l{MAX_DEPTH}")), true).unwrap_err().to_string();
        assert!(e.contains("deeper than 16"), "{e}");
        assert!(open_chain(&d.join(format!("l{}", MAX_DEPTH - 1)), true).is_ok());

        // A missing backing file and a corrupt header are named.
        std::fs::remove_file(d.join("l0")).unwrap();
        let e = open_chain(&d.join("l1"), true).unwrap_err().to_string();
        assert!(e.contains("cannot open") && e.contains("l0"), "{e}");
        let mut bytes = std::fs::read(d.join("l2")).unwrap();
        bytes[20..24].copy_from_slice(&40u32.to_be_bytes());
        std::fs::write(d.join("l2"), bytes).unwrap();
        let e = open_chain(&d.join("l2"), true).unwrap_err().to_string();
        assert!(e.contains("cluster_bits") && e.contains("l2"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
