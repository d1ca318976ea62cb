//! What each FUSE request means, whichever transport brought it: metadata is answered here,
//! I/O comes back as an [`Io`] for the transport to run (synchronously on `/dev/fuse`,
//! several in flight on a ring).

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use bulkhead_client::{Command, Device, FrontRequest, IoError};
use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::abi::*;

/// Largest write the kernel may send (and read it may ask for).
pub(crate) const MAX_WRITE: usize = 1 << 20;
const MAX_PAGES: u16 = (MAX_WRITE / 4096) as u16;
const ATTR_VALID_S: u64 = 3600;

/// A device's file.
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) dev: Arc<Device>,
    /// Opens not yet released: a loop device, a mount on one, a program.
    pub(crate) opens: AtomicUsize,
}

/// The files, by node id less 2. A removed device's slot stays empty: node ids are never
/// given twice, so the kernel's cached entry for a removed file finds nothing.
pub(crate) type Table = Arc<Vec<Option<Arc<Node>>>>;

/// What the export serves, shared by every worker of either transport.
pub(crate) struct Shared {
    /// Replaced whole when a device comes or goes; workers keep the one they started with
    /// until `version` moves.
    table: RwLock<Table>,
    /// Bumped at every change of `table`.
    pub(crate) version: AtomicU64,
    pub(crate) stop: AtomicBool,
    pub(crate) initialized: AtomicBool,
    /// Whether to offer FUSE over io_uring at INIT.
    pub(crate) offer_uring: bool,
    /// Whether the kernel took the offer.
    pub(crate) uring_granted: AtomicBool,
    pub(crate) start_time: u64,
    errors_logged: AtomicUsize,
    /// Given the files' state (see [`Shared::kept_state`]) whenever it changes, to keep for a
    /// `serve` that takes the session over.
    pub(crate) keep: OnceLock<Box<dyn Fn(String) + Send + Sync>>,
    /// One state handed over at a time, so the last one given is the newest.
    keep_order: Mutex<()>,
}

/// A keeper's state of the files: read back by [`Shared::adopt`].
pub(crate) const KEPT_STATE_VERSION: u64 = 1;

/// A kept FUSE state that cannot be taken over.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct KeptStateError(String);

impl Shared {
    pub(crate) fn new(devices: Vec<Arc<Device>>, offer_uring: bool) -> Self {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let table = devices.into_iter().map(|dev| Some(Arc::new(Node { dev, opens: AtomicUsize::new(0) }))).collect();
        Shared {
            table: RwLock::new(Arc::new(table)),
            version: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            initialized: AtomicBool::new(false),
            offer_uring,
            uring_granted: AtomicBool::new(false),
            start_time: now,
            errors_logged: AtomicUsize::new(0),
            keep: OnceLock::new(),
            keep_order: Mutex::new(()),
        }
    }

    /// The files and their open counts, as JSON: `{"version":1,"files":[{"name":"disk0",
    /// "opens":1},null,…]}`, by node id less 2 (a removed file's slot is `null`).
    pub(crate) fn kept_state(&self) -> String {
        let files: Vec<serde_json::Value> = self
            .table()
            .iter()
            .map(|n| match n {
                Some(n) => serde_json::json!({"name": n.dev.name(), "opens": n.opens.load(Ordering::Acquire)}),
                None => serde_json::Value::Null,
            })
            .collect();
        serde_json::json!({"version": KEPT_STATE_VERSION, "files": files}).to_string()
    }

    /// Hands the files' state to the keeper, if there is one.
    pub(crate) fn save(&self) {
        if let Some(keep) = self.keep.get() {
            let _one = self.keep_order.lock().unwrap_or_else(|e| e.into_inner());
            keep(self.kept_state());
        }
    }

    /// The export of a session taken over: `devices` placed at the node ids that `state` (what
    /// [`kept_state`](Self::kept_state) gave) says the kernel knows them by, with their open
    /// counts. A device the state names that is not in `devices` leaves its slot empty; a
    /// device it does not name is added after the others.
    pub(crate) fn adopt(devices: Vec<Arc<Device>>, state: &str) -> Result<Self, KeptStateError> {
        let v: serde_json::Value =
            serde_json::from_str(state).map_err(|e| KeptStateError(format!("the kept FUSE state: {e}")))?;
        if v["version"].as_u64() != Some(KEPT_STATE_VERSION) {
            let was = v["version"].to_string();
            return Err(KeptStateError(format!("the kept FUSE state is of version {was}, not {KEPT_STATE_VERSION}")));
        }
        let files = v["files"].as_array().ok_or_else(|| KeptStateError("the kept FUSE state has no list of files".into()))?;
        let mut left: Vec<Option<Arc<Device>>> = devices.into_iter().map(Some).collect();
        let mut table: Vec<Option<Arc<Node>>> = Vec::with_capacity(files.len());
        for f in files {
            let Some(name) = f["name"].as_str() else {
                table.push(None);
                continue;
            };
            let dev = left.iter_mut().find(|d| d.as_ref().is_some_and(|d| d.name() == name)).and_then(Option::take);
            if dev.is_none() {
                log::warn!("the FUSE file `{name}` is served no more: its users get ENOENT");
            }
            let opens = f["opens"].as_u64().unwrap_or(0) as usize;
            table.push(dev.map(|dev| Arc::new(Node { dev, opens: AtomicUsize::new(opens) })));
        }
        table.extend(left.into_iter().flatten().map(|dev| Some(Arc::new(Node { dev, opens: AtomicUsize::new(0) }))));
        let sh = Shared::new(Vec::new(), false);
        *sh.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        sh.initialized.store(true, Ordering::Release);
        Ok(sh)
    }

    /// The files as they are now.
    pub(crate) fn table(&self) -> Table {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Changes the files; returns what `change` returns.
    pub(crate) fn change<R>(&self, change: impl FnOnce(&mut Vec<Option<Arc<Node>>>) -> R) -> R {
        let mut t = self.table.write().unwrap_or_else(|e| e.into_inner());
        let mut next = (**t).clone();
        let r = change(&mut next);
        *t = Arc::new(next);
        self.version.fetch_add(1, Ordering::AcqRel);
        r
    }

    pub(crate) fn node(&self, nodeid: u64) -> Option<Arc<Node>> {
        let t = self.table.read().unwrap_or_else(|e| e.into_inner());
        nodeid.checked_sub(2).and_then(|i| t.get(i as usize)).and_then(Clone::clone)
    }

    /// The node id of the file named `name`.
    pub(crate) fn lookup(&self, name: &[u8]) -> Option<u64> {
        let t = self.table.read().unwrap_or_else(|e| e.into_inner());
        t.iter().position(|n| n.as_ref().is_some_and(|n| n.dev.name().as_bytes() == name)).map(|i| i as u64 + 2)
    }

    /// Node `nodeid`, looked up in `files` (a worker's copy of the table), or in the table
    /// itself if it was added since the copy was taken: no lock and no reference count is
    /// taken for the files the copy has.
    pub(crate) fn node_in<'t>(&self, files: &'t [Option<Arc<Node>>], nodeid: u64) -> Option<Cow<'t, Arc<Node>>> {
        let i = usize::try_from(nodeid.checked_sub(2)?).ok()?;
        match files.get(i) {
            Some(n) => n.as_ref().map(Cow::Borrowed),
            None => self.node(nodeid).map(Cow::Owned),
        }
    }

    fn attr(&self, files: &[Option<Arc<Node>>], nodeid: u64) -> Option<Attr> {
        let t = self.start_time;
        let base = Attr { ino: nodeid, atime: t, mtime: t, ctime: t, uid: 0, gid: 0, blksize: 4096, ..Default::default() };
        if nodeid == FUSE_ROOT_ID {
            return Some(Attr { mode: libc::S_IFDIR | 0o755, nlink: 2, ..base });
        }
        let n = self.node_in(files, nodeid)?;
        let d = &n.dev;
        let perm = if d.read_only() { 0o400 } else { 0o600 };
        Some(Attr { mode: libc::S_IFREG | perm, nlink: 1, size: d.size(), blocks: d.size() / 512, ..base })
    }

    pub(crate) fn log_error(&self, what: &str, e: &IoError) {
        // Rate-limited: the first 10, then every 1000th.
        let n = self.errors_logged.fetch_add(1, Ordering::Relaxed);
        if n < 10 || n.is_multiple_of(1000) {
            log::warn!("fuse {what}: {e} ({} errors so far)", n + 1);
        }
    }
}

/// Where a transport sends replies.
pub(crate) trait Sink {
    /// Answers request `unique`: `errno` (0 for success) and the reply's parts, in order.
    fn reply(&mut self, unique: u64, errno: i32, parts: &[&[u8]]);

    fn error(&mut self, unique: u64, errno: i32) {
        self.reply(unique, errno, &[]);
    }

    fn value<T: IntoBytes + Immutable>(&mut self, unique: u64, v: &T) {
        self.reply(unique, 0, &[v.as_bytes()]);
    }
}

/// One request as it arrived: the header, the operation's own header, and the payload
/// after it (a write's data, a lookup's name).
pub(crate) struct Incoming<'a> {
    pub(crate) h: InHeader,
    pub(crate) op: &'a [u8],
    pub(crate) payload: &'a [u8],
}

impl<'a> Incoming<'a> {
    /// Splits a request read from `/dev/fuse`, where the parts follow each other.
    pub(crate) fn from_dev(req: &'a [u8]) -> Option<Self> {
        let h = parse::<InHeader>(req)?;
        let body = &req[std::mem::size_of::<InHeader>()..];
        let op_len = match h.opcode {
            LOOKUP => 0,
            WRITE => std::mem::size_of::<WriteIn>().min(body.len()),
            _ => body.len(),
        };
        let (op, payload) = body.split_at(op_len);
        Some(Incoming { h, op, payload })
    }
}

/// A device request a transport runs, then answers with [`Io::reply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Io {
    pub(crate) unique: u64,
    /// Index into the export's devices.
    pub(crate) dev: usize,
    pub(crate) kind: IoKind,
}

/// A FUSE request's device command: a read names its length, a write the length of the data
/// in the request's payload.
pub(crate) type IoKind = Command<u64, u32>;

impl Io {
    /// The device request; `payload` is the write's data.
    pub(crate) fn request<'p>(&self, payload: &'p [u8]) -> FrontRequest<'p> {
        self.kind.map(|len| len, |len| &payload[..len as usize])
    }

    /// Answers everything but a successful read, whose data the transport sends itself. The
    /// transport counts the bytes moved (the synchronous device calls count their own).
    pub(crate) fn reply(&self, sh: &Shared, sink: &mut impl Sink, result: Result<(), IoError>) {
        match result {
            Ok(()) => match self.kind {
                IoKind::Write { from: len, .. } => sink.value(self.unique, &WriteOut { size: len, padding: 0 }),
                IoKind::Read { .. } => unreachable!("a read's reply carries its data"),
                _ => sink.error(self.unique, 0),
            },
            Err(e) => {
                let what = match self.kind {
                    IoKind::Read { .. } => "read",
                    IoKind::Write { .. } => "write",
                    IoKind::Flush => "fsync",
                    IoKind::Discard { .. } | IoKind::WriteZeroes { .. } => "fallocate",
                };
                sh.log_error(what, &e);
                sink.error(self.unique, e.errno());
            }
        }
    }
}

/// What became of a request.
pub(crate) enum Step {
    /// Answered (or needs no answer).
    Done,
    /// Device I/O to run and then answer.
    Io(Io),
    /// The session ends.
    Stop,
}

pub(crate) fn parse<T: FromBytes>(body: &[u8]) -> Option<T> {
    T::read_from_prefix(body).ok().map(|(v, _)| v)
}

/// Answers `req` or says what I/O it needs.
pub(crate) fn dispatch(sh: &Shared, files: &[Option<Arc<Node>>], req: &Incoming<'_>, sink: &mut impl Sink) -> Step {
    let h = &req.h;
    let (u, op) = (h.unique, req.op);
    match h.opcode {
        INIT => return init(sh, u, op, sink),
        DESTROY => {
            sink.error(u, 0);
            return Step::Stop;
        }
        FORGET | BATCH_FORGET | INTERRUPT => {} // no reply
        LOOKUP => {
            let name = req.payload.split(|&b| b == 0).next().unwrap_or(&[]);
            let found = (h.nodeid == FUSE_ROOT_ID).then(|| sh.lookup(name)).flatten();
            match found.and_then(|nodeid| sh.attr(files, nodeid).map(|a| (nodeid, a))) {
                Some((nodeid, attr)) => {
                    let out = EntryOut {
                        nodeid,
                        generation: 1,
                        entry_valid: ATTR_VALID_S,
                        attr_valid: ATTR_VALID_S,
                        attr,
                        ..Default::default()
                    };
                    sink.value(u, &out);
                }
                None => sink.error(u, libc::ENOENT),
            }
        }
        GETATTR => match sh.attr(files, h.nodeid) {
            Some(attr) => sink.value(u, &AttrOut { attr_valid: ATTR_VALID_S, attr, ..Default::default() }),
            None => sink.error(u, libc::ENOENT),
        },
        SETATTR => match (parse::<SetattrIn>(op), sh.attr(files, h.nodeid)) {
            // A device has a fixed size.
            (Some(s), Some(attr)) if s.valid & FATTR_SIZE != 0 && s.size != attr.size => sink.error(u, libc::EPERM),
            (Some(_), Some(attr)) => sink.value(u, &AttrOut { attr_valid: ATTR_VALID_S, attr, ..Default::default() }),
            _ => sink.error(u, libc::ENOENT),
        },
        OPEN => match (sh.node_in(files, h.nodeid), parse::<OpenIn>(op)) {
            // A read-only view opens for reading only (`losetup -r`, `mount -o ro`).
            (Some(n), Some(o)) if n.dev.read_only() && o.flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 => {
                sink.error(u, libc::EROFS)
            }
            (Some(n), Some(_)) => {
                n.opens.fetch_add(1, Ordering::AcqRel);
                // Kept before the answer: a crash in between counts an open too many, which
                // refuses a removal without --force, rather than one too few.
                sh.save();
                // The handle names the file: its release finds it even if the node id is
                // looked up no more.
                sink.value(u, &OpenOut { fh: h.nodeid, ..Default::default() })
            }
            (None, _) if h.nodeid == FUSE_ROOT_ID => sink.error(u, libc::EISDIR),
            _ => sink.error(u, libc::ENOENT),
        },
        OPENDIR if h.nodeid == FUSE_ROOT_ID => sink.value(u, &OpenOut::default()),
        OPENDIR => sink.error(u, libc::ENOTDIR),
        READDIR => readdir(sh, u, h.nodeid, op, sink),
        READ => return read(sh, files, u, h.nodeid, op, sink),
        WRITE => return write(sh, files, u, h.nodeid, op, req.payload, sink),
        FSYNC => match sh.node_in(files, h.nodeid) {
            Some(_) => return io(h, IoKind::Flush),
            None => sink.error(u, 0),
        },
        FALLOCATE => return fallocate(sh, files, u, h.nodeid, op, sink),
        STATFS => sink.value(
            u,
            &StatfsOut {
                bsize: 4096,
                frsize: 4096,
                namelen: 255,
                files: sh.table().iter().flatten().count() as u64,
                ..Default::default()
            },
        ),
        RELEASE => {
            if let Some(n) = sh.node_in(files, h.nodeid) {
                let _ = n.opens.fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| o.checked_sub(1));
                sh.save();
            }
            sink.error(u, 0)
        }
        FLUSH | RELEASEDIR | FSYNCDIR | ACCESS => sink.error(u, 0),
        _ => sink.error(u, libc::ENOSYS),
    }
    Step::Done
}

fn io(h: &InHeader, kind: IoKind) -> Step {
    Step::Io(Io { unique: h.unique, dev: (h.nodeid - 2) as usize, kind })
}

fn init(sh: &Shared, u: u64, op: &[u8], sink: &mut impl Sink) -> Step {
    // Kernels before protocol 7.36 send 16 bytes, without `flags2`.
    let mut raw = [0u8; std::mem::size_of::<InitIn>()];
    let n = op.len().min(raw.len());
    raw[..n].copy_from_slice(&op[..n]);
    let Some(i) = parse::<InitIn>(&raw).filter(|_| n >= 16) else {
        sink.error(u, libc::EINVAL);
        return Step::Done;
    };
    if i.major != FUSE_KERNEL_VERSION {
        sink.error(u, libc::EPROTO);
        return Step::Stop;
    }
    let want = FUSE_ASYNC_READ | FUSE_ASYNC_DIO | FUSE_ATOMIC_O_TRUNC | FUSE_BIG_WRITES | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES;
    let mut flags = i.flags & want;
    let mut flags2 = 0;
    let uring = sh.offer_uring && i.flags & FUSE_INIT_EXT != 0 && i.flags2 & FUSE_OVER_IO_URING_FLAGS2 != 0;
    if uring {
        flags |= FUSE_INIT_EXT;
        flags2 |= FUSE_OVER_IO_URING_FLAGS2;
    }
    let out = InitOut {
        major: FUSE_KERNEL_VERSION,
        minor: FUSE_KERNEL_MINOR_VERSION.min(i.minor),
        max_readahead: i.max_readahead,
        flags,
        max_background: 64,
        congestion_threshold: 48,
        max_write: MAX_WRITE as u32,
        time_gran: 1,
        max_pages: MAX_PAGES,
        flags2,
        ..Default::default()
    };
    sink.value(u, &out);
    sh.uring_granted.store(uring, Ordering::Release);
    sh.initialized.store(true, Ordering::Release);
    Step::Done
}

fn readdir(sh: &Shared, u: u64, nodeid: u64, op: &[u8], sink: &mut impl Sink) {
    let Some(r) = parse::<ReadIn>(op) else {
        return sink.error(u, libc::EINVAL);
    };
    if nodeid != FUSE_ROOT_ID {
        return sink.error(u, libc::ENOTDIR);
    }
    // The size is the caller's to name: the buffer grows with the entries, not with it.
    let mut out = Vec::with_capacity((r.size as usize).min(4096));
    let table = sh.table();
    let entries = [(".", FUSE_ROOT_ID, 4u32), ("..", FUSE_ROOT_ID, 4)]
        .into_iter()
        .map(|(n, i, t)| (n.to_string(), i, t))
        .chain(table.iter().enumerate().filter_map(|(i, n)| n.as_ref().map(|n| (n.dev.name().to_string(), i as u64 + 2, 8))));
    for (idx, (name, ino, typ)) in entries.enumerate().skip(r.offset as usize) {
        let head = DirentHead { ino, off: idx as u64 + 1, namelen: name.len() as u32, typ };
        let rec = (24 + name.len()).div_ceil(8) * 8;
        if out.len() + rec > r.size as usize {
            break;
        }
        out.extend_from_slice(head.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.resize(out.len().div_ceil(8) * 8, 0);
    }
    sink.reply(u, 0, &[&out]);
}

/// The arguments of an I/O operation on a device file, and the device's size; `None`, with the
/// error replied, when the arguments are short or the node is not a device file.
fn io_args<T: FromBytes>(
    sh: &Shared,
    files: &[Option<Arc<Node>>],
    u: u64,
    nodeid: u64,
    op: &[u8],
    sink: &mut impl Sink,
) -> Option<(T, u64)> {
    let Some(args) = parse::<T>(op) else {
        sink.error(u, libc::EINVAL);
        return None;
    };
    let Some(n) = sh.node_in(files, nodeid) else {
        sink.error(u, libc::EISDIR);
        return None;
    };
    Some((args, n.dev.size()))
}

fn read(sh: &Shared, files: &[Option<Arc<Node>>], u: u64, nodeid: u64, op: &[u8], sink: &mut impl Sink) -> Step {
    let Some((r, size)) = io_args::<ReadIn>(sh, files, u, nodeid, op, sink) else {
        return Step::Done;
    };
    let len = (r.size as u64).min(size.saturating_sub(r.offset));
    if len == 0 {
        sink.reply(u, 0, &[]);
        return Step::Done;
    }
    Step::Io(Io { unique: u, dev: (nodeid - 2) as usize, kind: IoKind::Read { offset: r.offset, into: len } })
}

fn write(sh: &Shared, files: &[Option<Arc<Node>>], u: u64, nodeid: u64, op: &[u8], data: &[u8], sink: &mut impl Sink) -> Step {
    let Some((w, size)) = io_args::<WriteIn>(sh, files, u, nodeid, op, sink) else {
        return Step::Done;
    };
    if data.len() != w.size as usize {
        sink.error(u, libc::EINVAL);
        return Step::Done;
    }
    if w.offset.checked_add(data.len() as u64).is_none_or(|end| end > size) {
        sink.error(u, libc::ENOSPC);
        return Step::Done;
    }
    let fua = w.flags as i32 & libc::O_DSYNC != 0;
    Step::Io(Io { unique: u, dev: (nodeid - 2) as usize, kind: IoKind::Write { offset: w.offset, from: w.size, fua } })
}

fn fallocate(sh: &Shared, files: &[Option<Arc<Node>>], u: u64, nodeid: u64, op: &[u8], sink: &mut impl Sink) -> Step {
    let Some((f, size)) = io_args::<FallocateIn>(sh, files, u, nodeid, op, sink) else {
        return Step::Done;
    };
    if f.offset.checked_add(f.length).is_none_or(|end| end > size) {
        sink.error(u, if f.mode & FALLOC_FL_KEEP_SIZE != 0 { libc::EINVAL } else { libc::ENOSPC });
        return Step::Done;
    }
    let kind = if f.mode == 0 || f.mode == FALLOC_FL_KEEP_SIZE {
        // Allocation within a fixed-size device: nothing to do.
        sink.error(u, 0);
        return Step::Done;
    } else if f.mode & FALLOC_FL_PUNCH_HOLE != 0 && f.mode & FALLOC_FL_KEEP_SIZE != 0 {
        IoKind::Discard { offset: f.offset, len: f.length }
    } else if f.mode & FALLOC_FL_ZERO_RANGE != 0 {
        IoKind::WriteZeroes { offset: f.offset, len: f.length }
    } else {
        sink.error(u, libc::EOPNOTSUPP);
        return Step::Done;
    };
    Step::Io(Io { unique: u, dev: (nodeid - 2) as usize, kind })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Collect(Vec<(u64, i32, Vec<u8>)>);

    impl Sink for Collect {
        fn reply(&mut self, unique: u64, errno: i32, parts: &[&[u8]]) {
            self.0.push((unique, errno, parts.concat()));
        }
    }

    #[test]
    fn a_kept_state_is_read_back_strictly_and_keeps_the_node_ids_of_files_gone() {
        let sh = Shared::new(Vec::new(), false);
        assert_eq!(sh.kept_state(), r#"{"files":[],"version":1}"#);
        // Files whose devices are gone keep their slots empty: node ids are never reused.
        let state = r#"{"version":1,"files":[{"name":"gone","opens":2},null]}"#;
        let sh = Shared::adopt(Vec::new(), state).unwrap();
        assert_eq!(sh.table().len(), 2);
        assert!(sh.table().iter().all(Option::is_none));
        assert!(sh.initialized.load(Ordering::Acquire), "a session taken over is past INIT");
        let refused = |state: &str| Shared::adopt(Vec::new(), state).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused(r#"{"version":2,"files":[]}"#).contains("version 2"));
        assert!(refused(r#"{"version":1}"#).contains("no list of files"));
        assert!(Shared::adopt(Vec::new(), "not json").is_err());
    }

    /// Found by the `fuse_request` fuzz target (fuzz/seeds/fuse_request/oom-readdir-size): a
    /// READDIR naming a size of gigabytes allocated that much before answering.
    #[test]
    fn oom_readdir_size_is_answered_from_a_buffer_the_entries_need() {
        let sh = Shared::new(Vec::new(), false);
        let mut out = Collect(Vec::new());
        let op = ReadIn { size: u32::MAX, ..Default::default() };
        let h = InHeader { opcode: READDIR, unique: 9, nodeid: FUSE_ROOT_ID, ..Default::default() };
        dispatch(&sh, &[], &Incoming { h, op: op.as_bytes(), payload: &[] }, &mut out);
        let (u, errno, reply) = &out.0[0];
        assert_eq!((*u, *errno), (9, 0));
        // `.` and `..`, 32 bytes each.
        assert_eq!(reply.len(), 64);
    }

    fn init_request(flags: u32, flags2: u32, len: usize) -> Vec<u8> {
        let body = InitIn { major: 7, minor: 45, max_readahead: 1 << 17, flags, flags2 };
        body.as_bytes()[..len].to_vec()
    }

    #[test]
    fn init_offers_io_uring_only_when_asked_and_offered() {
        for (offer, kernel_flags2, expect) in
            [(true, FUSE_OVER_IO_URING_FLAGS2, true), (false, FUSE_OVER_IO_URING_FLAGS2, false), (true, 0, false)]
        {
            let sh = Shared::new(Vec::new(), offer);
            let mut out = Collect(Vec::new());
            let op = init_request(FUSE_INIT_EXT | FUSE_ASYNC_READ, kernel_flags2, 20);
            let h = InHeader { opcode: INIT, unique: 7, ..Default::default() };
            assert!(matches!(dispatch(&sh, &[], &Incoming { h, op: &op, payload: &[] }, &mut out), Step::Done));
            let (u, errno, reply) = &out.0[0];
            assert_eq!((*u, *errno), (7, 0));
            let reply = parse::<InitOut>(reply).unwrap();
            assert_eq!(reply.flags2 & FUSE_OVER_IO_URING_FLAGS2 != 0, expect, "offer {offer}");
            assert_eq!(reply.flags & FUSE_INIT_EXT != 0, expect);
            assert_eq!(sh.uring_granted.load(Ordering::Relaxed), expect);
            assert!(sh.initialized.load(Ordering::Relaxed));
        }
    }

    #[test]
    fn init_from_an_old_kernel_without_flags2_is_understood() {
        let sh = Shared::new(Vec::new(), true);
        let mut out = Collect(Vec::new());
        let op = init_request(FUSE_ASYNC_READ, 0, 16);
        let h = InHeader { opcode: INIT, unique: 1, ..Default::default() };
        dispatch(&sh, &[], &Incoming { h, op: &op, payload: &[] }, &mut out);
        let reply = parse::<InitOut>(&out.0[0].2).unwrap();
        assert_eq!(reply.flags & FUSE_ASYNC_READ, FUSE_ASYNC_READ);
        assert!(!sh.uring_granted.load(Ordering::Relaxed));
        // A truncated INIT is refused, not misread.
        let mut out = Collect(Vec::new());
        dispatch(&sh, &[], &Incoming { h, op: &op[..12], payload: &[] }, &mut out);
        assert_eq!(out.0[0].1, libc::EINVAL);
    }

    #[test]
    fn a_dev_request_splits_into_op_header_and_payload() {
        let h = InHeader { opcode: WRITE, unique: 3, nodeid: 2, ..Default::default() };
        let w = WriteIn { offset: 4096, size: 5, ..Default::default() };
        let mut req = h.as_bytes().to_vec();
        req.extend_from_slice(w.as_bytes());
        req.extend_from_slice(b"hello");
        let inc = Incoming::from_dev(&req).unwrap();
        assert_eq!(inc.op.len(), std::mem::size_of::<WriteIn>());
        assert_eq!(inc.payload, b"hello");
        let h = InHeader { opcode: LOOKUP, nodeid: 1, ..Default::default() };
        let mut req = h.as_bytes().to_vec();
        req.extend_from_slice(b"disk0\0");
        let inc = Incoming::from_dev(&req).unwrap();
        assert!(inc.op.is_empty());
        assert_eq!(inc.payload, b"disk0\0");
    }
}
