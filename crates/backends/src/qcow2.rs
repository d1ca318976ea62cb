//! The `qcow2` backend: a file backend whose file holds a qcow2 image, over a chain of
//! read-only backing files.
//!
//! The format is `imago`'s (built synchronous): it reads and updates the image's metadata (L1
//! and L2 tables, refcounts) through [`FdStorage`], a storage object over a descriptor the
//! supervisor opened, so nothing is opened in the domain. Data does not pass through imago:
//! for each request the backend asks imago where the range lives ([`FormatAccess::get_mapping`]
//! for reads, [`FormatAccess::prepare_data_mapping`] for writes) and moves the bytes between
//! the request's grant windows and that place with the same system calls as the `file`
//! backend. A write that allocates lands in its new cluster before the mapping that makes it
//! visible is committed, so a crash between the two leaks a cluster (`qemu-img check` reclaims
//! it) and never exposes stale data.
//!
//! imago keeps changed metadata in its caches until flushed. A domain that is killed loses its
//! memory, but bulkhead promises that no acknowledged write is lost when a domain is replaced:
//! so every batch that changed metadata writes those caches back (to the page cache, which
//! outlives the process) before its requests are answered. A flush request also syncs.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

use bulkhead_block::{Backend, BlockError, Caps, Io, Request, SliceList};
use bulkhead_image::{Format, Qcow2Header};
use imago::io_buffers::{IoVector, IoVectorMut};
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::storage::drivers::CommonStorageHelper;
use imago::{DenyImplicitOpenGate, FormatAccess, FormatDriverBuilder, Mapping, Storage};

use crate::file::FileBackend;
use crate::BackendError;

/// A storage object for imago over a descriptor handed to the domain.
#[derive(Debug)]
pub struct FdStorage {
    file: File,
    /// The file's length, grown as writes reach past it.
    size: AtomicU64,
    helper: CommonStorageHelper,
}

impl FdStorage {
    /// Over `fd`, which must stay the only user of the file's end (the image grows here).
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        let file = File::from(fd);
        let size = file.metadata()?.len();
        Ok(FdStorage { file, size: AtomicU64::new(size), helper: CommonStorageHelper::default() })
    }

    /// The descriptor, for data the caller moves itself.
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, length: u64) -> io::Result<()> {
        let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(length)) else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        loop {
            // SAFETY: a plain system call on a descriptor this object owns; no memory is passed.
            let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, len) };
            if rc == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl fmt::Display for FdStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fd:{}", self.file.as_raw_fd())
    }
}

impl Storage for FdStorage {
    fn size(&self) -> io::Result<u64> {
        Ok(self.size.load(Ordering::Relaxed))
    }

    // imago's contract for the `unsafe fn`s below is about alignment and concurrent access;
    // this storage has no alignment rules (a buffered descriptor) and is used by one thread,
    // so each is an ordinary positioned transfer on memory imago lends.
    // SAFETY: reads into the slices imago lends, through safe `read_at`.
    unsafe fn pure_readv(&self, bufv: IoVectorMut<'_>, offset: u64) -> io::Result<()> {
        let mut at = offset;
        for mut b in bufv.into_inner() {
            let buf: &mut [u8] = &mut b;
            // Under write capture the buffer may lie in protected pages, which the kernel's
            // writes would fail on: open them first.
            bulkhead_guard::kernel_fills(buf);
            let mut done = 0;
            while done < buf.len() {
                match self.file.read_at(&mut buf[done..], at + done as u64) {
                    // Past the end of the file reads as zeroes, as imago expects.
                    Ok(0) => {
                        buf[done..].fill(0);
                        done = buf.len();
                    }
                    Ok(n) => done += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            at += buf.len() as u64;
        }
        Ok(())
    }

    // SAFETY: writes from the slices imago lends, through safe `write_all_at`.
    unsafe fn pure_writev(&self, bufv: IoVector<'_>, offset: u64) -> io::Result<()> {
        let mut at = offset;
        for b in bufv.into_inner() {
            self.file.write_all_at(&b, at)?;
            at += b.len() as u64;
        }
        self.size.fetch_max(at, Ordering::Relaxed);
        Ok(())
    }

    // SAFETY: `fallocate` on our descriptor, or safe writes of zeroes.
    unsafe fn pure_write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        match self.fallocate(libc::FALLOC_FL_ZERO_RANGE, offset, length) {
            Ok(()) => {
                self.size.fetch_max(offset + length, Ordering::Relaxed);
                Ok(())
            }
            Err(_) => {
                let zeroes = vec![0u8; length.min(1 << 20) as usize];
                let mut at = offset;
                while at < offset + length {
                    let n = (offset + length - at).min(zeroes.len() as u64) as usize;
                    self.file.write_all_at(&zeroes[..n], at)?;
                    at += n as u64;
                }
                self.size.fetch_max(at, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    // SAFETY: the same as `pure_write_zeroes`.
    unsafe fn pure_write_allocated_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: same contract, passed on.
        unsafe { self.pure_write_zeroes(offset, length) }
    }

    // SAFETY: `fallocate` on our descriptor; no memory involved.
    unsafe fn pure_discard(&self, offset: u64, length: u64) -> io::Result<()> {
        // Discarded contents are unspecified: a file system without hole punching keeps them.
        match self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, length) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            r => r,
        }
    }

    fn flush(&self) -> io::Result<()> {
        // Writes go straight to the kernel: nothing is buffered here.
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    // SAFETY: nothing is cached here.
    unsafe fn invalidate_cache(&self) -> io::Result<()> {
        Ok(())
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        &self.helper
    }
}

/// One image of a chain as the supervisor hands it over: its descriptor and format.
#[derive(Debug)]
pub struct ImageLayer {
    /// The descriptor (read-write for the top image unless the device is read-only; read-only
    /// for every backing file).
    pub fd: OwnedFd,
    /// Its format.
    pub format: Format,
}

/// A qcow2 image over its backing chain.
pub struct Qcow2Backend {
    top: FormatAccess<FdStorage>,
    size: u64,
    read_only: bool,
    /// Bytes per cluster of the top image.
    cluster: u64,
    /// Private memory for the data imago must transform (compressed clusters).
    bounce: Vec<u8>,
    /// Metadata changed in this batch and not yet written back.
    dirty: bool,
}

impl fmt::Debug for Qcow2Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qcow2Backend").field("size", &self.size).field("read_only", &self.read_only).finish()
    }
}

fn open_error(what: String) -> impl FnOnce(io::Error) -> BackendError {
    move |e| BackendError::Image(format!("{what}: {e}"))
}

impl Qcow2Backend {
    /// Opens `layers`, the top image first and each backing file after the image that names it.
    /// The top image must be qcow2; backing files are qcow2 or raw.
    pub fn open(layers: Vec<ImageLayer>, read_only: bool) -> Result<Self, BackendError> {
        let depth = layers.len();
        let layer_formats: Vec<Format> = layers.iter().map(|l| l.format).collect();
        if layers.first().map(|l| l.format) != Some(Format::Qcow2) {
            return Err(BackendError::Image("the top image of a qcow2 backend must be qcow2".into()));
        }
        let mut below: Option<FormatAccess<FdStorage>> = None;
        let mut cluster = 0;
        for (i, layer) in layers.into_iter().enumerate().rev() {
            let what = if i == 0 { "image".to_string() } else { format!("backing file {i} of {}", depth - 1) };
            let storage = FdStorage::new(layer.fd).map_err(open_error(what.clone()))?;
            if layer.format == Format::Qcow2 {
                // The header again, read here as the supervisor read it: the file may have
                // changed since, and the chain handed over must be the one it names.
                let mut start = vec![0u8; bulkhead_image::PROBE_BYTES.min(storage.size.load(Ordering::Relaxed) as usize)];
                storage.file.read_exact_at(&mut start, 0).map_err(open_error(what.clone()))?;
                let header = Qcow2Header::parse(&start).map_err(|e| BackendError::Image(format!("{what}: {e}")))?;
                // Tables past the end read as zeroes, and a write to such an image sends the
                // allocator down one refcount block per table entry (found by the
                // `qcow2_image` fuzz target: a stack overflow).
                let len = storage.size.load(Ordering::Relaxed);
                if header.tables_end > len {
                    return Err(BackendError::Image(format!(
                        "{what}: its L1 or refcount table ends at byte {:#x}, past the end of the file ({len} bytes): the image is truncated or damaged",
                        header.tables_end
                    )));
                }
                let names_backing = header.backing.as_ref().map(|b| b.format);
                let handed = below.as_ref().map(|_| layer_formats[i + 1]);
                if names_backing != handed {
                    return Err(BackendError::Image(format!(
                        "{what} names backing {names_backing:?} but was handed {handed:?}: the image changed since it was opened"
                    )));
                }
                cluster = header.cluster_size();
            }
            let writable = i == 0 && !read_only;
            let opened = match layer.format {
                Format::Raw => Raw::builder(storage).write(writable).open(DenyImplicitOpenGate::default()).map(FormatAccess::new),
                // Each backing file is the one the supervisor found named in the header above
                // it: passed explicitly, so imago opens nothing by name.
                Format::Qcow2 => Qcow2::<FdStorage>::builder(storage)
                    .backing(below.take())
                    .write(writable)
                    .open(DenyImplicitOpenGate::default())
                    .map(FormatAccess::new),
            };
            below = Some(opened.map_err(open_error(what))?);
        }
        let top = below.expect("at least the top image");
        let size = top.size();
        Ok(Qcow2Backend { top, size, read_only, cluster, bounce: Vec::new(), dirty: false })
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(BlockError::Invalid("range beyond the end of the device")),
        }
    }

    fn os(op: &'static str, offset: u64) -> impl FnOnce(io::Error) -> BlockError {
        move |e| BlockError::Os { op, offset, errno: e.raw_os_error().unwrap_or(libc::EIO) }
    }

    fn part<'a>(bufs: &SliceList<'a>, pos: u64, n: u64) -> Result<SliceList<'a>, BlockError> {
        bufs.range(pos, n).ok_or(BlockError::Invalid("mapping outside the request"))
    }

    fn read(&mut self, offset: u64, bufs: SliceList<'_>) -> Result<u64, BlockError> {
        let len = bufs.total_len();
        self.check_range(offset, len)?;
        let mut pos = 0;
        while pos < len {
            let at = offset + pos;
            let (mapping, n) = self.top.get_mapping(at, len - pos).map_err(Self::os("read", at))?;
            let n = n.min(len - pos);
            match mapping {
                Mapping::Raw { storage, offset: host, .. } if n > 0 => {
                    let part = Self::part(&bufs, pos, n)?;
                    FileBackend::rw_list_sync(storage.raw_fd(), false, host, &part, false)?;
                }
                Mapping::Zero { .. } if n > 0 => zero(&Self::part(&bufs, pos, n)?)?,
                // Data imago must transform (a compressed cluster), or the end of the image
                // (never inside the checked range): read through imago into private memory.
                _ => {
                    let n = if n == 0 { len - pos } else { n };
                    self.bounce.resize(n as usize, 0);
                    self.top.read(&mut self.bounce[..], at).map_err(Self::os("read", at))?;
                    copy_in(&Self::part(&bufs, pos, n)?, &self.bounce)?;
                    pos += n;
                    continue;
                }
            }
            pos += n;
        }
        Ok(len)
    }

    fn write(&mut self, offset: u64, bufs: SliceList<'_>, fua: bool) -> Result<u64, BlockError> {
        let len = bufs.total_len();
        self.check_range(offset, len)?;
        let cluster = self.cluster;
        let mut pos = 0;
        let mut allocated = false;
        while pos < len {
            let at = offset + pos;
            let left = len - pos;
            let (mapping, n) = self.top.get_mapping(at, left).map_err(Self::os("write", at))?;
            if let Mapping::Raw { storage, offset: host, writable: true, .. } = mapping {
                let n = n.min(left);
                FileBackend::rw_list_sync(storage.raw_fd(), true, host, &Self::part(&bufs, pos, n)?, fua)?;
                pos += n;
                continue;
            }
            // A new cluster. Clusters the write covers whole need not keep what they held; a
            // partly written one does (imago copies the rest from below as it allocates).
            let (want, overwrite) = if at.is_multiple_of(cluster) && left >= cluster {
                (left - left % cluster, true)
            } else {
                (left.min(cluster - at % cluster), false)
            };
            let prepared = self.top.prepare_data_mapping(at, want, overwrite).map_err(Self::os("write", at))?;
            let n = prepared.length().min(want);
            let part = Self::part(&bufs, pos, n)?;
            FileBackend::rw_list_sync(prepared.storage().raw_fd(), true, prepared.offset(), &part, false)?;
            self.top.commit_data_mapping(prepared).map_err(Self::os("write", at))?;
            allocated = true;
            pos += n;
        }
        if allocated {
            self.dirty = true;
            if fua {
                self.write_back()?;
                self.top.sync().map_err(Self::os("write", offset))?;
            }
        }
        Ok(len)
    }

    /// Writes imago's changed metadata back to the file.
    fn write_back(&mut self) -> Result<(), BlockError> {
        if self.dirty {
            self.top.flush().map_err(Self::os("flush", 0))?;
            self.dirty = false;
        }
        Ok(())
    }

    fn one(&mut self, req: &Request<'_>) -> Result<u64, BlockError> {
        if self.read_only && !matches!(req, Request::Read { .. } | Request::Flush) {
            return Err(BlockError::ReadOnly);
        }
        match *req {
            Request::Read { offset, into: bufs } => self.read(offset, bufs),
            Request::Write { offset, from: bufs, fua } => self.write(offset, bufs, fua),
            Request::Flush => {
                self.write_back()?;
                self.top.sync().map_err(Self::os("flush", 0))?;
                Ok(0)
            }
            Request::Discard { offset, len } => {
                self.check_range(offset, len)?;
                self.dirty = true;
                self.top.discard_to_zero(offset, len).map_err(Self::os("discard", offset))?;
                Ok(0)
            }
            Request::WriteZeroes { offset, len } => {
                self.check_range(offset, len)?;
                self.dirty = true;
                self.top.write_zeroes(offset, len).map_err(Self::os("write_zeroes", offset))?;
                Ok(0)
            }
        }
    }
}

fn zero(bufs: &SliceList<'_>) -> Result<(), BlockError> {
    for s in bufs.iter() {
        s.zero().map_err(|_| BlockError::Invalid("read into a read-only window"))?;
    }
    Ok(())
}

fn copy_in(bufs: &SliceList<'_>, mut src: &[u8]) -> Result<(), BlockError> {
    for s in bufs.iter() {
        let (now, rest) = src.split_at(s.len());
        s.copy_from(now).map_err(|_| BlockError::Invalid("read into a read-only window"))?;
        src = rest;
    }
    Ok(())
}

impl Backend for Qcow2Backend {
    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        Caps { flush: true, fua: true, discard: !self.read_only, write_zeroes: !self.read_only, read_only: self.read_only }
    }

    fn execute(&mut self, ios: &mut [Io<'_>]) {
        for io in ios.iter_mut() {
            io.result = self.one(&io.req);
        }
        // Answered requests must survive this domain: metadata they changed leaves its memory.
        if let Err(e) = self.write_back() {
            for io in ios.iter_mut() {
                if !matches!(io.req, Request::Read { .. }) {
                    io.result = Err(e.clone());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_shmem::{memfd, Mapping as ShMapping, Protection};
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// Found by the `qcow2_image` fuzz target (fuzz/seeds/qcow2_image/stack-overflow-tables-past-
    /// the-end): an 82-byte image whose L1 and refcount tables lie petabytes past its end. Opened,
    /// a write sent imago's allocator down one new refcount block per table entry until the
    /// stack overflowed. It is refused at open.
    #[test]
    fn stack_overflow_tables_past_the_end_are_refused_at_open() {
        let image: &[u8] = &[
            0x51, 0x46, 0x49, 0xfb, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x7c, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0xc0, 0x08, 0x00, 0x25, 0x00, 0x00, 0x32, 0x00, 0x00, 0x00, 0x00, 0x99, 0x00, 0x00, 0xfa, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x40, 0x00, 0x46, 0x49, 0xfb, 0x00, 0x00, 0x00, 0x02, 0xc8, 0x00, 0x31, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x23, 0x51, 0x46, 0x49, 0x95,
        ];
        let file = std::fs::File::from(memfd::create("image", 0).unwrap());
        std::os::unix::fs::FileExt::write_all_at(&file, image, 0).unwrap();
        let layers = vec![ImageLayer { fd: file.into(), format: Format::Qcow2 }];
        match Qcow2Backend::open(layers, false) {
            Err(BackendError::Image(m)) => assert!(m.contains("past the end of the file (82 bytes)"), "{m}"),
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("an image whose tables lie past its end was opened"),
        }
    }

    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir() -> Dir {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let d = std::env::temp_dir().join(format!("bulkhead-qcow2-test-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn qemu_img(args: &[&str]) -> Option<String> {
        let out = Command::new("qemu-img").args(args).output().ok()?;
        assert!(out.status.success(), "qemu-img {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        Some(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn open_fd(p: &Path, write: bool) -> OwnedFd {
        std::fs::OpenOptions::new().read(true).write(write).open(p).unwrap().into()
    }

    use bulkhead_rng::Rng;

    /// Random reads, writes (whole and partial clusters, across cluster ends), write-zeroes,
    /// discards and flushes on a qcow2 image over a raw backing file full of a pattern, checked
    /// against a byte model at every read; then qemu checks the image and compares it with the
    /// model written raw.
    #[test]
    fn a_qcow2_over_a_raw_backing_file_matches_a_byte_model_and_qemu_agrees() {
        const SIZE: u64 = 8 << 20;
        let d = dir();
        let base = d.0.join("base.raw");
        let top = d.0.join("top.qcow2");
        let mut model: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&base, &model).unwrap();
        let b = base.to_str().unwrap();
        if qemu_img(&["create", "-q", "-f", "qcow2", "-o", "cluster_size=64k", "-b", b, "-F", "raw", top.to_str().unwrap()])
            .is_none()
        {
            eprintln!("skipped: qemu-img is not installed");
            return;
        }
        let layers = vec![
            ImageLayer { fd: open_fd(&top, true), format: Format::Qcow2 },
            ImageLayer { fd: open_fd(&base, false), format: Format::Raw },
        ];
        let mut q = Qcow2Backend::open(layers, false).unwrap();
        assert_eq!(q.size(), SIZE);
        let mfd = memfd::create("buf", 4 << 20).unwrap();
        let m = ShMapping::new(mfd.as_raw_fd(), 4 << 20, Protection::ReadWrite).unwrap();
        let mut rng = Rng::new(0x2545_f491_4f6c_dd1d);
        for round in 0..3000 {
            let len = match rng.next_u64() % 4 {
                0 => 512 * (1 + rng.next_u64() % 8),
                1 => 4096 * (1 + rng.next_u64() % 32),
                2 => 65536 * (1 + rng.next_u64() % 8),
                _ => 512 * (1 + rng.next_u64() % 4096),
            };
            let offset = (rng.next_u64() % ((SIZE - len) / 512 + 1)) * 512;
            // Two windows, so a request spans slices as the channel hands them over.
            let split = (len / 2) & !511;
            let w1 = m.slice(0, split as usize).unwrap();
            let w2 = m.slice(2 << 20, (len - split) as usize).unwrap();
            let mut bufs = SliceList::new();
            if split > 0 {
                bufs.push(w1);
            }
            bufs.push(w2);
            let (o, l) = (offset as usize, len as usize);
            let req = match rng.next_u64() % 10 {
                0..=3 => Request::Read { offset, into: bufs },
                4..=6 => {
                    let data: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
                    if split > 0 {
                        w1.copy_from(&data[..split as usize]).unwrap();
                    }
                    w2.copy_from(&data[split as usize..]).unwrap();
                    model[o..o + l].copy_from_slice(&data);
                    Request::Write { offset, from: bufs, fua: round % 50 == 0 }
                }
                7 => {
                    model[o..o + l].fill(0);
                    Request::WriteZeroes { offset, len }
                }
                8 => {
                    model[o..o + l].fill(0);
                    Request::Discard { offset, len }
                }
                _ => Request::Flush,
            };
            let mut ios = [Io::new(req)];
            q.execute(&mut ios);
            assert_eq!(ios[0].result, Ok(req.transfer_len()), "round {round}: {req:?}");
            if let Request::Read { .. } = req {
                let mut got = vec![0u8; l];
                if split > 0 {
                    w1.copy_to(&mut got[..split as usize]);
                }
                w2.copy_to(&mut got[split as usize..]);
                assert!(got == model[o..o + l], "round {round}: read {len} at {offset} differs from the model");
            }
        }
        let mut ios = [Io::new(Request::Flush)];
        q.execute(&mut ios);
        assert_eq!(ios[0].result, Ok(0));
        drop(q);
        // The backing file is never written.
        let base_now = std::fs::read(&base).unwrap();
        assert!(base_now.iter().enumerate().all(|(i, &x)| x == (i as u64 * 7 % 251) as u8));
        let check = qemu_img(&["check", top.to_str().unwrap()]).unwrap();
        assert!(check.contains("No errors were found"), "{check}");
        let want = d.0.join("want.raw");
        std::fs::write(&want, &model).unwrap();
        let cmp = Command::new("qemu-img").args(["compare", "-f", "qcow2", "-F", "raw"]).arg(&top).arg(&want).output().unwrap();
        assert!(cmp.status.success(), "{}", String::from_utf8_lossy(&cmp.stdout));
    }

    #[test]
    fn a_read_only_image_refuses_writes_and_a_raw_top_is_refused() {
        let d = dir();
        let top = d.0.join("t.qcow2");
        if qemu_img(&["create", "-q", "-f", "qcow2", top.to_str().unwrap(), "1M"]).is_none() {
            eprintln!("skipped: qemu-img is not installed");
            return;
        }
        let mut q = Qcow2Backend::open(vec![ImageLayer { fd: open_fd(&top, false), format: Format::Qcow2 }], true).unwrap();
        assert!(q.caps().read_only);
        let mut ios = [Io::new(Request::WriteZeroes { offset: 0, len: 4096 })];
        q.execute(&mut ios);
        assert_eq!(ios[0].result, Err(BlockError::ReadOnly));
        let e = Qcow2Backend::open(vec![ImageLayer { fd: open_fd(&top, false), format: Format::Raw }], true).unwrap_err();
        assert!(e.to_string().contains("must be qcow2"), "{e}");
        // The chain handed over must be the one the header names.
        let e = Qcow2Backend::open(
            vec![
                ImageLayer { fd: open_fd(&top, false), format: Format::Qcow2 },
                ImageLayer { fd: open_fd(&top, false), format: Format::Raw },
            ],
            true,
        )
        .unwrap_err();
        assert!(e.to_string().contains("changed since"), "{e}");
    }

    /// An image is untrusted input: metadata clusters (header, L1, L2, refcount table and
    /// blocks) with random bytes changed must open with an error or serve reads and writes
    /// that fail cleanly, never panic or hang the domain.
    #[test]
    fn images_with_damaged_metadata_fail_cleanly_and_never_panic() {
        const SIZE: u64 = 4 << 20;
        let d = dir();
        let good = d.0.join("good.qcow2");
        if qemu_img(&["create", "-q", "-f", "qcow2", "-o", "cluster_size=4k", good.to_str().unwrap(), "4M"]).is_none() {
            eprintln!("skipped: qemu-img is not installed");
            return;
        }
        // Some data, so there are L2 tables and refcount blocks to damage.
        {
            let mut q = Qcow2Backend::open(vec![ImageLayer { fd: open_fd(&good, true), format: Format::Qcow2 }], false).unwrap();
            let mfd = memfd::create("buf", 1 << 16).unwrap();
            let m = ShMapping::new(mfd.as_raw_fd(), 1 << 16, Protection::ReadWrite).unwrap();
            let w = m.slice(0, 1 << 16).unwrap();
            w.copy_from(&[0xa5; 1 << 16]).unwrap();
            for i in 0..16u64 {
                let mut ios = [Io::new(Request::Write {
                    offset: i * 257 * 1024 % (SIZE - (1 << 16)),
                    from: SliceList::one(w),
                    fua: false,
                })];
                q.execute(&mut ios);
                assert!(ios[0].result.is_ok());
            }
        }
        let pristine = std::fs::read(&good).unwrap();
        // Metadata lives in the clusters before the first data cluster qemu-img and these
        // writes allocated, in a fresh image: damage there.
        let meta_end = pristine.len().min(64 << 10);
        let mfd = memfd::create("buf", 1 << 20).unwrap();
        let m = ShMapping::new(mfd.as_raw_fd(), 1 << 20, Protection::ReadWrite).unwrap();
        let w = m.slice(0, 1 << 20).unwrap();
        let mut rng = Rng::new(0x1234_5678_9abc_def1);
        let (mut refused, mut served) = (0, 0);
        for round in 0..1000 {
            let mut bytes = pristine.clone();
            for _ in 0..1 + rng.next_u64() % 6 {
                let at = rng.next_u64() as usize % meta_end;
                bytes[at] =
                    if rng.next_u64().is_multiple_of(2) { rng.next_u64() as u8 } else { bytes[at] ^ (1 << (rng.next_u64() % 8)) };
            }
            let path = d.0.join(format!("bad{round}.qcow2"));
            std::fs::write(&path, &bytes).unwrap();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let Ok(mut q) = Qcow2Backend::open(vec![ImageLayer { fd: open_fd(&path, true), format: Format::Qcow2 }], false)
                else {
                    return false;
                };
                let size = q.size();
                let mut at = 0;
                while at + (1 << 20) <= size.min(SIZE) {
                    let mut ios = [Io::new(Request::Read { offset: at, into: SliceList::one(w) })];
                    q.execute(&mut ios);
                    at += 1 << 20;
                }
                if size >= 1 << 20 {
                    let mut ios = [
                        Io::new(Request::Write { offset: 0, from: SliceList::one(w), fua: false }),
                        Io::new(Request::Discard { offset: 1 << 19, len: 1 << 16 }),
                        Io::new(Request::Flush),
                    ];
                    q.execute(&mut ios);
                }
                true
            }));
            match outcome {
                Ok(true) => served += 1,
                Ok(false) => refused += 1,
                Err(_) => panic!("round {round}: a damaged image made the backend panic (kept at {})", path.display()),
            }
            std::fs::remove_file(&path).unwrap();
        }
        assert!(refused > 0 && served > 0, "refused {refused}, served {served}");
    }
}
