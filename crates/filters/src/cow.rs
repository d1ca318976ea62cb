//! `cow`: copy-on-write over any device below, into a qcow2 overlay.
//!
//! Writes land in the overlay file, a qcow2 image the supervisor opened (and created, empty,
//! the first time) and handed over as a descriptor; reads of clusters the overlay does not hold
//! go to the device below. The device below is never written. The overlay is opened with
//! `imago` with no backing image: an unallocated cluster is one whose data is below, and the
//! filter reads it through the layers below (a [`Sub::Read`]) rather than through a file.
//!
//! A write that covers part of a cluster the overlay does not hold reads the whole cluster
//! from below into the filter's scratch memory, merges the new bytes in, and writes it as a
//! new cluster: the mapping is committed only after the data is in the file, and every request
//! that changed metadata writes imago's caches back before it is answered, so a domain killed
//! at any point loses no acknowledged write (at worst a cluster leaks). A cluster the overlay
//! holds but shares with a snapshot, or holds as explicit zeroes, is copied by imago itself.
//! Discard and write-zeroes leave whole clusters reading as zeroes without data (discard frees
//! them); the parts of clusters they cover are written as zeroes, so both read back as zeroes
//! over their whole range, as a file's punched hole does.
//!
//! Snapshots are the overlay's internal qcow2 snapshots ([`bulkhead_image::snapshot`]). The
//! supervisor asks for one by starting a generation whose spec carries the operation: the
//! filter carries it out on the closed overlay as the domain is set up, before any request,
//! and records the result in its state page under the operation's sequence number, so a
//! generation that replaces this one does not repeat it.

use std::os::fd::OwnedFd;

use bulkhead_backends::{FdStorage, FileBackend};
use bulkhead_block::{
    After, BlockError, Caps, Data, Layer, ReadBelow, Request, SharedSlice, SliceList, Sub, Tag, TagSpace, Verdict,
};
use bulkhead_block::{Outcome, SetupError};
use bulkhead_image::snapshot::{self, SnapshotError};
use bulkhead_image::Qcow2Header;
use imago::qcow2::Qcow2;
use imago::{DenyImplicitOpenGate, FormatAccess, FormatDriverBuilder, Mapping};
use serde::{Deserialize, Serialize};

use crate::state::StatePage;

/// Counters in the state page.
const OPENED: usize = 0;
const READ_BELOW: usize = 1;
const WRITTEN: usize = 2;
const ALLOCATED: usize = 3;
/// The sequence number of the last snapshot operation carried out, and its result.
const OP_SEQ: usize = 4;
const OP_RESULT: usize = 5;

/// What a snapshot operation came to, as the state page records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpResult {
    /// Done.
    Done,
    /// No snapshot has the name.
    NotFound,
    /// A snapshot has the name already.
    Exists,
    /// Failed; the domain's log says why.
    Failed,
}

impl OpResult {
    fn code(self) -> u64 {
        match self {
            OpResult::Done => 1,
            OpResult::NotFound => 2,
            OpResult::Exists => 3,
            OpResult::Failed => 4,
        }
    }

    fn from_code(c: u64) -> Option<Self> {
        Some(match c {
            1 => OpResult::Done,
            2 => OpResult::NotFound,
            3 => OpResult::Exists,
            4 => OpResult::Failed,
            _ => return None,
        })
    }
}

/// What to do to the overlay's snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotAction {
    /// Take one.
    Create,
    /// Make the device's contents a snapshot's again.
    Revert,
    /// Delete one.
    Delete,
}

impl SnapshotAction {
    /// As on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotAction::Create => "create",
            SnapshotAction::Revert => "revert",
            SnapshotAction::Delete => "delete",
        }
    }
}

/// A snapshot operation for the next generation to carry out as it opens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotOp {
    /// Increases with each operation on the device; one already recorded is not repeated.
    pub seq: u64,
    /// What.
    pub action: SnapshotAction,
    /// The snapshot's name.
    pub name: String,
    /// For `create`: when, seconds and nanoseconds since the epoch.
    pub date: (u32, u32),
}

/// The result recorded for operation `seq`, once the domain has carried it out.
pub fn op_result(page: &StatePage, seq: u64) -> Option<OpResult> {
    if page.get(OP_SEQ) != seq {
        return None;
    }
    OpResult::from_code(page.get(OP_RESULT))
}

/// The counters of a cow filter: times opened, bytes read from below, bytes written to the
/// overlay, clusters allocated.
pub fn read(page: &StatePage) -> (u64, u64, u64, u64) {
    (page.get(OPENED), page.get(READ_BELOW), page.get(WRITTEN), page.get(ALLOCATED))
}

/// Where a request stands: which part of it waits on the device below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Below {
    /// Nothing.
    None,
    /// A read's `n` bytes at its current position are being read from below into its windows.
    Read(u64),
    /// The whole cluster at `start` (`len` bytes) is being read into scratch, to merge the
    /// next `seg` bytes of a write into.
    Merge { start: u64, len: u64, seg: u64 },
}

/// The filter.
pub struct Cow {
    image: Option<FormatAccess<FdStorage>>,
    /// The overlay again, for writing zeroes where imago mapped data.
    data: Option<std::fs::File>,
    cluster_bits: u32,
    size: u64,
    op: Option<SnapshotOp>,
    page: StatePage,
    /// Per tag: bytes of the handed request done.
    pos: Vec<u64>,
    below: Vec<Below>,
    /// Metadata changed by the request being served, not yet written back.
    dirty: bool,
    /// Private memory for data imago must transform (compressed clusters).
    bounce: Vec<u8>,
    /// Zeroes to write from.
    zeroes: Vec<u8>,
}

impl std::fmt::Debug for Cow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cow").field("cluster_bits", &self.cluster_bits).field("size", &self.size).finish_non_exhaustive()
    }
}

fn os(op: &'static str, offset: u64) -> impl FnOnce(std::io::Error) -> BlockError {
    move |e| BlockError::Os { op, offset, errno: e.raw_os_error().unwrap_or(libc::EIO) }
}

fn part<'a>(bufs: &SliceList<'a>, at: u64, n: u64) -> Result<SliceList<'a>, BlockError> {
    bufs.range(at, n).ok_or(BlockError::Invalid("cow: a mapping outside the request"))
}

/// What to do next for a request.
enum Step {
    Send(Sub),
    Done(Result<u64, BlockError>),
}

impl Cow {
    /// A filter over the overlay `file`, whose clusters are `1 << cluster_bits` bytes. It
    /// first carries out `op` unless the state page records it done, then opens the overlay.
    /// Called while the domain is set up, before it is confined: the overlay's length and
    /// header are read here, with system calls the confined domain no longer has.
    pub fn new(file: OwnedFd, cluster_bits: u32, op: Option<SnapshotOp>, page: StatePage) -> Result<Self, String> {
        let file = std::fs::File::from(file);
        let mut cow = Cow {
            image: None,
            data: None,
            cluster_bits,
            size: 0,
            op,
            page,
            pos: Vec::new(),
            below: Vec::new(),
            dirty: false,
            bounce: Vec::new(),
            zeroes: Vec::new(),
        };
        cow.run_op(&file);
        let len = file.metadata().map_err(|e| format!("overlay: {e}"))?.len();
        let mut start = vec![0u8; bulkhead_image::PROBE_BYTES.min(len as usize)];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut start, 0).map_err(|e| format!("overlay: {e}"))?;
        let h = Qcow2Header::parse(&start).map_err(|e| format!("overlay: {e}"))?;
        if h.cluster_bits != cluster_bits {
            return Err(format!("the overlay's clusters changed since the device started ({} bytes now)", h.cluster_size()));
        }
        if h.dirty {
            return Err("the overlay was not closed cleanly (dirty bit set); repair it with `qemu-img check -r all`".into());
        }
        cow.data = Some(file.try_clone().map_err(|e| format!("overlay: {e}"))?);
        let storage = FdStorage::new(OwnedFd::from(file)).map_err(|e| format!("overlay: {e}"))?;
        let image = Qcow2::<FdStorage>::builder(storage)
            .backing(None::<FormatAccess<FdStorage>>)
            .write(true)
            .open(DenyImplicitOpenGate::default())
            .map_err(|e| format!("overlay: {e}"))?;
        cow.size = h.size;
        cow.image = Some(FormatAccess::new(image));
        cow.zeroes = vec![0u8; 1 << cluster_bits];
        Ok(cow)
    }

    fn cluster(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn image(&self) -> Result<&FormatAccess<FdStorage>, BlockError> {
        self.image.as_ref().ok_or(BlockError::Invalid("cow: the overlay is not open"))
    }

    /// Carries out the pending snapshot operation on the closed overlay, once.
    fn run_op(&mut self, file: &std::fs::File) {
        let Some(op) = self.op.take() else { return };
        if self.page.get(OP_SEQ) >= op.seq {
            return;
        }
        let r = match op.action {
            SnapshotAction::Create => snapshot::create(file, &op.name, op.date).map(|_| ()),
            SnapshotAction::Revert => snapshot::revert(file, &op.name),
            SnapshotAction::Delete => snapshot::delete(file, &op.name),
        };
        let result = match r {
            Ok(()) => OpResult::Done,
            Err(SnapshotError::NotFound(_)) => OpResult::NotFound,
            Err(SnapshotError::Exists(_)) => OpResult::Exists,
            Err(e) => {
                eprintln!("cow: snapshot {} `{}`: {e}", op.action.as_str(), op.name);
                OpResult::Failed
            }
        };
        // The result first: the supervisor reads it once it sees the sequence number.
        self.page.set(OP_RESULT, result.code());
        self.page.set(OP_SEQ, op.seq);
    }

    /// Writes imago's changed metadata back to the file (the page cache outlives the domain).
    fn write_back(&mut self) -> Result<(), BlockError> {
        if self.dirty {
            self.image()?.flush().map_err(os("flush", 0))?;
            self.dirty = false;
        }
        Ok(())
    }

    fn finish(&mut self, req: &Request<'_>) -> Step {
        let fua = matches!(req, Request::Write { fua: true, .. });
        let r = self.write_back().and_then(|()| match fua {
            true => self.image()?.sync().map_err(os("write", req.range().0)),
            false => Ok(()),
        });
        Step::Done(r.map(|()| req.transfer_len()))
    }

    /// Serves a read from the current position on, until it needs the device below.
    fn read_step(&mut self, tag: Tag, offset: u64, bufs: &SliceList<'_>) -> Result<Step, BlockError> {
        let len = bufs.total_len();
        loop {
            let pos = self.pos[tag.index()];
            if pos >= len {
                return Ok(Step::Done(Ok(len)));
            }
            let at = offset + pos;
            let image = self.image.as_ref().ok_or(BlockError::Invalid("cow: the overlay is not open"))?;
            let (mapping, n) = image.get_mapping(at, len - pos).map_err(os("read", at))?;
            let n = n.min(len - pos);
            match mapping {
                Mapping::Raw { storage, offset: host, .. } if n > 0 => {
                    FileBackend::rw_list_sync(storage.raw_fd(), false, host, &part(bufs, pos, n)?, false)?;
                }
                Mapping::Zero { explicit: true, .. } if n > 0 => {
                    for s in part(bufs, pos, n)?.iter() {
                        s.zero().map_err(|_| BlockError::Invalid("cow: read into read-only memory"))?;
                    }
                }
                Mapping::Zero { explicit: false, .. } if n > 0 => {
                    self.below[tag.index()] = Below::Read(n);
                    return Ok(Step::Send(Sub::Read { offset: at, into: Data::Handed { at: pos, len: n } }));
                }
                // Data imago must transform (a compressed cluster): through private memory.
                _ => {
                    let n = if n == 0 { (len - pos).min(self.cluster() - at % self.cluster()) } else { n };
                    self.bounce.resize(n as usize, 0);
                    image.read(&mut self.bounce[..], at).map_err(os("read", at))?;
                    let mut from = 0;
                    for s in part(bufs, pos, n)?.iter() {
                        s.copy_from(&self.bounce[from..from + s.len()])
                            .map_err(|_| BlockError::Invalid("cow: read into read-only memory"))?;
                        from += s.len();
                    }
                }
            }
            self.pos[tag.index()] = pos + n;
        }
    }

    /// Writes `n` bytes of the request at its position `pos` (its data, or zeroes) to `host`.
    fn put(&self, fd: std::os::fd::RawFd, host: u64, data: Option<&SliceList<'_>>, pos: u64, n: u64) -> Result<(), BlockError> {
        match data {
            Some(bufs) => {
                FileBackend::rw_list_sync(fd, true, host, &part(bufs, pos, n)?, false)?;
            }
            None => {
                // Zeroes for part of a cluster: the overlay holds its data itself (no
                // external data file), so its own descriptor reaches `host`.
                let f = self.data.as_ref().ok_or(BlockError::Invalid("cow: the overlay is not open"))?;
                let chunk = self.zeroes.len().max(1) as u64;
                let mut done = 0;
                while done < n {
                    let k = chunk.min(n - done) as usize;
                    std::os::unix::fs::FileExt::write_all_at(f, &self.zeroes[..k], host + done)
                        .map_err(os("write", host + done))?;
                    done += k as u64;
                }
            }
        }
        self.page.add(WRITTEN, n);
        Ok(())
    }

    /// Serves a write (`data`), write-zeroes or discard (`data` is `None`) from the current
    /// position on, until it needs the device below.
    fn write_step(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>) -> Result<Step, BlockError> {
        let (offset, len) = req.range();
        let data = match req {
            Request::Write { from: bufs, .. } => Some(bufs),
            _ => None,
        };
        let cluster = self.cluster();
        loop {
            let pos = self.pos[tag.index()];
            if pos >= len {
                return Ok(self.finish(req));
            }
            let at = offset + pos;
            let left = len - pos;
            let image = self.image.as_ref().ok_or(BlockError::Invalid("cow: the overlay is not open"))?;
            let (mapping, n) = image.get_mapping(at, left).map_err(os("write", at))?;
            let n = n.min(left);
            if let Mapping::Raw { storage, offset: host, writable: true, .. } = mapping {
                if n > 0 {
                    let fd = storage.raw_fd();
                    // Zeroes over whole clusters are better recorded than written: below.
                    if data.is_some() || !at.is_multiple_of(cluster) || n < cluster {
                        let n = if data.is_some() { n } else { n.min(cluster - at % cluster) };
                        self.put(fd, host, data, pos, n)?;
                        self.pos[tag.index()] = pos + n;
                        continue;
                    }
                }
            }
            let unallocated = matches!(mapping, Mapping::Zero { explicit: false, .. });
            let start = at - at % cluster;
            let end = (start + cluster).min(self.size);
            if at == start && at + left >= end {
                // Whole clusters: nothing they held is kept.
                let whole = if at + left == self.size { left } else { left / cluster * cluster };
                match data {
                    Some(_) => {
                        let prepared = image.prepare_data_mapping(at, whole, true).map_err(os("write", at))?;
                        let m = prepared.length().min(whole);
                        let (fd, host) = (prepared.storage().raw_fd(), prepared.offset());
                        self.put(fd, host, data, pos, m)?;
                        let image = self.image.as_ref().ok_or(BlockError::Invalid("cow: the overlay is not open"))?;
                        image.commit_data_mapping(prepared).map_err(os("write", at))?;
                        self.page.add(ALLOCATED, m.div_ceil(cluster));
                        self.pos[tag.index()] = pos + m;
                    }
                    None => {
                        let image = self.image.as_mut().ok_or(BlockError::Invalid("cow: the overlay is not open"))?;
                        if matches!(req, Request::Discard { .. }) {
                            image.discard_to_zero(at, whole).map_err(os("discard", at))?;
                        } else {
                            image.write_zeroes(at, whole).map_err(os("write_zeroes", at))?;
                        }
                        self.pos[tag.index()] = pos + whole;
                    }
                }
                self.dirty = true;
                continue;
            }
            let seg = left.min(end - at);
            if unallocated {
                // Part of a cluster whose data is below: fetch the cluster, merge, write.
                self.below[tag.index()] = Below::Merge { start, len: end - start, seg };
                if (scratch.len() as u64) < end - start {
                    return Err(BlockError::Invalid("cow: scratch memory smaller than a cluster"));
                }
                return Ok(Step::Send(Sub::Read { offset: start, into: Data::Scratch { at: 0, len: end - start } }));
            }
            // Part of a cluster held as zeroes, compressed or shared with a snapshot: imago
            // copies what the cluster holds into a new one.
            let prepared = image.prepare_data_mapping(at, seg, false).map_err(os("write", at))?;
            let m = prepared.length().min(seg);
            let (fd, host) = (prepared.storage().raw_fd(), prepared.offset());
            self.put(fd, host, data, pos, m)?;
            let image = self.image.as_ref().ok_or(BlockError::Invalid("cow: the overlay is not open"))?;
            image.commit_data_mapping(prepared).map_err(os("write", at))?;
            self.page.add(ALLOCATED, 1);
            self.dirty = true;
            self.pos[tag.index()] = pos + m;
        }
    }

    /// The whole cluster at `start` has arrived in scratch: merge the request's next `seg`
    /// bytes in and write it as a new cluster, unless another request allocated the cluster
    /// meanwhile (its data is then the overlay's, and the write goes there).
    fn merge(
        &mut self,
        tag: Tag,
        req: &Request<'_>,
        scratch: SharedSlice<'_>,
        start: u64,
        len: u64,
        seg: u64,
    ) -> Result<(), BlockError> {
        let pos = self.pos[tag.index()];
        let at = req.range().0 + pos;
        let image = self.image()?;
        let (mapping, _) = image.get_mapping(start, len).map_err(os("write", start))?;
        if !matches!(mapping, Mapping::Zero { explicit: false, .. }) {
            return Ok(());
        }
        let window =
            scratch.sub(0, len as usize).map_err(|_| BlockError::Invalid("cow: scratch memory smaller than a cluster"))?;
        let into =
            window.sub((at - start) as usize, seg as usize).map_err(|_| BlockError::Invalid("cow: merge outside the cluster"))?;
        match req {
            Request::Write { from: bufs, .. } => {
                let mut to = 0usize;
                for s in part(bufs, pos, seg)?.iter() {
                    let dst = into.sub(to, s.len()).map_err(|_| BlockError::Invalid("cow: merge outside the cluster"))?;
                    s.copy_to_shared(&dst).map_err(|_| BlockError::Invalid("cow: scratch memory is read-only"))?;
                    to += s.len();
                }
            }
            _ => into.zero().map_err(|_| BlockError::Invalid("cow: scratch memory is read-only"))?,
        }
        let image = self.image()?;
        let prepared = image.prepare_data_mapping(start, len, true).map_err(os("write", start))?;
        if prepared.length() < len {
            return Err(BlockError::Invalid("cow: imago mapped less than a cluster"));
        }
        let (fd, host) = (prepared.storage().raw_fd(), prepared.offset());
        FileBackend::rw_list_sync(fd, true, host, &SliceList::one(window), false)?;
        self.image()?.commit_data_mapping(prepared).map_err(os("write", start))?;
        self.page.add(WRITTEN, len);
        self.page.add(ALLOCATED, 1);
        self.dirty = true;
        self.pos[tag.index()] = pos + seg;
        Ok(())
    }

    fn step(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>) -> Step {
        let r = match req {
            Request::Read { offset, into: bufs } => self.read_step(tag, *offset, bufs),
            Request::Write { .. } | Request::WriteZeroes { .. } | Request::Discard { .. } => self.write_step(tag, req, scratch),
            Request::Flush => {
                let r = self.write_back().and_then(|()| self.image()?.sync().map_err(os("flush", 0)));
                Ok(Step::Done(r.map(|()| 0)))
            }
        };
        // Metadata a failed request changed stays marked dirty: the next request that
        // completes writes it back before it is answered.
        r.unwrap_or_else(|e| Step::Done(Err(e)))
    }
}

impl Layer for Cow {
    fn name(&self) -> &'static str {
        "cow"
    }

    fn caps(&self, _lower: Caps) -> Caps {
        // Everything is served by the overlay; the device below is only read.
        Caps { flush: true, fua: true, discard: true, write_zeroes: true, read_only: false }
    }

    fn scratch_bytes(&self) -> usize {
        1 << self.cluster_bits
    }

    fn open(&mut self, below: &mut dyn ReadBelow) -> Result<(), SetupError> {
        if self.size != below.size() {
            return Err(SetupError::new(format!(
                "the overlay holds a device of {} bytes; the device below has {}",
                self.size,
                below.size()
            )));
        }
        self.page.add(OPENED, 1);
        Ok(())
    }

    fn attach(&mut self, tags: TagSpace) {
        self.pos = vec![0; tags.capacity()];
        self.below = vec![Below::None; tags.capacity()];
    }

    fn submit(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, _: u64) -> Verdict {
        self.pos[tag.index()] = 0;
        self.below[tag.index()] = Below::None;
        let (offset, len) = req.range();
        if !matches!(req, Request::Flush) && offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Verdict::Complete(Err(BlockError::Invalid("cow: range beyond the end of the device")));
        }
        match self.step(tag, req, scratch) {
            Step::Send(sub) => Verdict::Send(sub),
            Step::Done(r) => Verdict::Complete(r),
        }
    }

    fn complete(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, result: &mut Outcome, _: u64) -> After {
        let waited = std::mem::replace(&mut self.below[tag.index()], Below::None);
        let want = match waited {
            Below::Read(n) => n,
            Below::Merge { len, .. } => len,
            Below::None => {
                *result = Err(BlockError::Invalid("cow: a completion it did not ask for"));
                return After::Up;
            }
        };
        match *result {
            Ok(n) if n == want => {}
            Ok(n) => {
                *result = Err(BlockError::Short { op: "read", offset: req.range().0, done: n, want });
                return After::Up;
            }
            Err(_) => return After::Up,
        }
        self.page.add(READ_BELOW, want);
        let r = match waited {
            Below::Read(n) => {
                self.pos[tag.index()] += n;
                Ok(())
            }
            Below::Merge { start, len, seg } => self.merge(tag, req, scratch, start, len, seg),
            Below::None => Ok(()),
        };
        let step = match r {
            Ok(()) => self.step(tag, req, scratch),
            Err(e) => Step::Done(Err(e)),
        };
        match step {
            Step::Send(sub) => After::Send(sub),
            Step::Done(r) => {
                *result = r;
                After::Up
            }
        }
    }

    fn poll(&mut self, _: u64, _: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_backends::RamBackend;
    use bulkhead_block::Chain;
    use bulkhead_shmem::{memfd, Mapping as ShMapping, Protection};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    use std::path::PathBuf;

    const SIZE: u64 = 4 << 20;
    const CLUSTER_BITS: u32 = 16;

    struct Files {
        dir: PathBuf,
    }
    impl Drop for Files {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    use bulkhead_rng::Rng;

    fn lower_pattern() -> Vec<u8> {
        (0..SIZE).map(|i| (i % 251) as u8 ^ (i >> 16) as u8).collect()
    }

    /// A cow over a ram backend holding `lower`, on the overlay at `path`.
    fn chain(ram: &std::fs::File, path: &std::path::Path, op: Option<SnapshotOp>, page_fd: &OwnedFd) -> Chain {
        let overlay = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
        let page = StatePage::map(page_fd.as_raw_fd(), true).unwrap();
        let cow = Cow::new(overlay.into(), CLUSTER_BITS, op, page).unwrap();
        let backend = RamBackend::new(ram.try_clone().unwrap().into(), SIZE).unwrap();
        let mut c = Chain::new(vec![Box::new(cow)], Box::new(backend));
        c.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
        c.start(&|| 1).unwrap();
        c
    }

    fn run<'q>(c: &mut Chain, tags: &[Tag], req: &dyn Fn(Tag) -> Request<'q>) -> Vec<Result<u64, BlockError>> {
        let mut out = vec![None; 4];
        c.run(tags, &|| 1, req, &mut |t, r| out[t.index()] = Some(r));
        for _ in 0..100 {
            if tags.iter().all(|t| out[t.index()].is_some()) {
                break;
            }
            c.run(&[], &|| 1, req, &mut |t, r| out[t.index()] = Some(r));
        }
        tags.iter().map(|t| out[t.index()].clone().expect("completed")).collect()
    }

    fn setup(tag: &str) -> (Files, std::fs::File, PathBuf, OwnedFd, Vec<u8>) {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("bulkhead-cow-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("overlay.qcow2");
        std::fs::write(&path, bulkhead_image::new_image(SIZE, CLUSTER_BITS, None).unwrap()).unwrap();
        let lower = lower_pattern();
        let ram = std::fs::File::from(memfd::create("lower", SIZE).unwrap());
        ram.write_all_at(&lower, 0).unwrap();
        let page = memfd::create("state", crate::state::STATE_BYTES as u64).unwrap();
        (Files { dir }, ram, path, page, lower)
    }

    fn qemu_check(path: &std::path::Path) {
        let Ok(out) = std::process::Command::new("qemu-img").args(["check", "-f", "qcow2"]).arg(path).output() else {
            eprintln!("qemu-img not installed: image check skipped");
            return;
        };
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "qemu-img check: {text}");
    }

    /// Random reads, writes, write-zeroes, discards and flushes of any alignment to 512 bytes,
    /// checked against a byte model at every read, across domain generations that take,
    /// revert to and delete snapshots; the device below is never written, and qemu finds the
    /// overlay consistent.
    #[test]
    fn a_cow_matches_a_byte_model_through_generations_and_snapshots_and_never_writes_below() {
        let (_files, ram, path, page_fd, lower) = setup("model");
        let mut model = lower.clone();
        let mut snaps: Vec<(String, Vec<u8>)> = Vec::new();
        let app = ShMapping::new(memfd::create("app", 1 << 20).unwrap().as_raw_fd(), 1 << 20, Protection::ReadWrite).unwrap();
        let mut rng = Rng::new(0x1234_5678_9abc_def1);
        let mut seq = 0;
        let mut op = None;
        for generation in 0..8 {
            let mut c = chain(&ram, &path, op.take(), &page_fd);
            let page = StatePage::map(page_fd.as_raw_fd(), false).unwrap();
            if seq > 0 {
                assert_eq!(op_result(&page, seq), Some(OpResult::Done), "generation {generation}");
            }
            for _ in 0..400 {
                let kind = rng.next_u64() % 10;
                let offset = rng.next_u64() % (SIZE / 512) * 512;
                let len = ((1 + rng.next_u64() % 512) * 512).min(SIZE - offset);
                let len = if rng.next_u64().is_multiple_of(4) { len.min(4096) } else { len };
                let w = app.slice(0, len as usize).unwrap();
                let req = |_: Tag| match kind {
                    0..=3 => Request::Read { offset, into: SliceList::one(w) },
                    4..=6 => Request::Write { offset, from: SliceList::one(w), fua: kind == 6 },
                    7 => Request::WriteZeroes { offset, len },
                    8 => Request::Discard { offset, len },
                    _ => Request::Flush,
                };
                if (4..=6).contains(&kind) {
                    let data: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
                    w.copy_from(&data).unwrap();
                    model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                }
                if kind == 7 || kind == 8 {
                    model[offset as usize..(offset + len) as usize].fill(0);
                }
                let r = run(&mut c, &[Tag::new(0)], &req);
                let want = if (0..=6).contains(&kind) { len } else { 0 };
                assert_eq!(r, vec![Ok(want)], "kind {kind} at {offset} len {len}");
                if kind <= 3 {
                    let mut got = vec![0u8; len as usize];
                    w.copy_to(&mut got);
                    assert!(got == model[offset as usize..(offset + len) as usize], "read at {offset} len {len} differs");
                }
            }
            drop(c);
            // The next generation takes, reverts to or deletes a snapshot as it opens.
            seq += 1;
            let (action, name) = match generation % 4 {
                0 | 1 => (SnapshotAction::Create, format!("s{generation}")),
                2 => (SnapshotAction::Revert, snaps[0].0.clone()),
                _ => (SnapshotAction::Delete, snaps[0].0.clone()),
            };
            match action {
                SnapshotAction::Create => snaps.push((name.clone(), model.clone())),
                SnapshotAction::Revert => model = snaps[0].1.clone(),
                SnapshotAction::Delete => {
                    snaps.remove(0);
                }
            }
            op = Some(SnapshotOp { seq, action, name, date: (1_700_000_000 + generation, 0) });
        }
        let mut below = vec![0u8; SIZE as usize];
        ram.read_exact_at(&mut below, 0).unwrap();
        assert!(below == lower, "the device below was written");
        qemu_check(&path);
        // A repeated operation (a replaced generation handed the same spec) is not redone.
        let page = StatePage::map(page_fd.as_raw_fd(), false).unwrap();
        let last = SnapshotOp { seq, action: SnapshotAction::Create, name: "again".into(), date: (0, 0) };
        let _ = chain(&ram, &path, Some(last.clone()), &page_fd);
        let _ = chain(&ram, &path, Some(last), &page_fd);
        assert_eq!(op_result(&page, seq), Some(OpResult::Done));
        let names: Vec<String> =
            snapshot::list(&std::fs::File::open(&path).unwrap()).unwrap().into_iter().map(|s| s.name).collect();
        assert_eq!(names.iter().filter(|n| *n == "again").count(), 1, "{names:?}");
    }

    /// A partial write waiting for its cluster from below while another request allocates the
    /// cluster lands on top of that request's data, not on stale data from below.
    #[test]
    fn a_merge_that_loses_the_race_for_its_cluster_writes_into_the_winner() {
        let (_files, ram, path, page_fd, lower) = setup("race");
        let page = memfd::create("state", crate::state::STATE_BYTES as u64).unwrap();
        let mut c = chain(&ram, &path, None, &page);
        drop(page_fd);
        let app = ShMapping::new(memfd::create("app", 1 << 20).unwrap().as_raw_fd(), 1 << 20, Protection::ReadWrite).unwrap();
        let (a, b, rd) = (app.slice(0, 4096).unwrap(), app.slice(65536, 65536).unwrap(), app.slice(131072, 65536).unwrap());
        a.copy_from(&[0xaa; 4096]).unwrap();
        b.copy_from(&[0xbb; 65536]).unwrap();
        let req = |t: Tag| match t.index() {
            0 => Request::Write { offset: 65536 + 8192, from: SliceList::one(a), fua: false },
            1 => Request::Write { offset: 65536, from: SliceList::one(b), fua: false },
            _ => Request::Read { offset: 65536, into: SliceList::one(rd) },
        };
        assert_eq!(run(&mut c, &[Tag::new(0), Tag::new(1)], &req), vec![Ok(4096), Ok(65536)]);
        assert_eq!(run(&mut c, &[Tag::new(2)], &req), vec![Ok(65536)]);
        let mut got = vec![0u8; 65536];
        rd.copy_to(&mut got);
        let mut want = vec![0xbbu8; 65536];
        want[8192..12288].fill(0xaa);
        assert!(got == want, "the later write's bytes over the earlier one's cluster");
        // A partial write alone keeps the rest of its cluster from below.
        let req = |t: Tag| match t.index() {
            0 => Request::Write { offset: 3 * 65536 + 512, from: SliceList::one(a), fua: true },
            _ => Request::Read { offset: 3 * 65536, into: SliceList::one(rd) },
        };
        assert_eq!(run(&mut c, &[Tag::new(0)], &req), vec![Ok(4096)]);
        assert_eq!(run(&mut c, &[Tag::new(2)], &req), vec![Ok(65536)]);
        rd.copy_to(&mut got);
        let mut want = lower[3 * 65536..4 * 65536].to_vec();
        want[512..4608].fill(0xaa);
        assert!(got == want);
        drop(c);
        qemu_check(&path);
    }

    /// An overlay for another size, or damaged, stops the domain with a message that says so.
    #[test]
    fn an_overlay_that_does_not_fit_is_refused_when_the_domain_opens() {
        let (_files, ram, path, page_fd, _) = setup("refuse");
        std::fs::write(&path, bulkhead_image::new_image(SIZE * 2, CLUSTER_BITS, None).unwrap()).unwrap();
        let open = |path: &std::path::Path| {
            let overlay = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
            let page = StatePage::map(page_fd.as_raw_fd(), true).unwrap();
            let cow = Cow::new(overlay.into(), CLUSTER_BITS, None, page).map_err(|e| format!("filter cow: {e}"))?;
            let backend = RamBackend::new(ram.try_clone().unwrap().into(), SIZE).unwrap();
            let mut c = Chain::new(vec![Box::new(cow)], Box::new(backend));
            c.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
            c.start(&|| 1).map(|_| ()).map_err(|e| e.to_string())
        };
        let e = open(&path).unwrap_err();
        assert!(e.contains("cow") && e.contains("8388608 bytes") && e.contains("4194304"), "{e}");
        std::fs::write(&path, b"not an image at all").unwrap();
        let e = open(&path).unwrap_err();
        assert!(e.contains("not a qcow2 image"), "{e}");
    }
}
