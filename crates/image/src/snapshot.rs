//! Internal snapshots of a qcow2 image: list, create, revert to, delete.
//!
//! A snapshot is a copy of the image's L1 table plus an entry in the snapshot table (its name,
//! id, date and size); every cluster it reaches gains a reference, so later writes to the live
//! image copy those clusters instead of changing them (qcow2's `COPIED` flag says which
//! clusters have exactly one reference and may be written in place). These are the operations
//! `qemu-img snapshot -c/-a/-d/-l` perform, on the same on-disk structures, so either tool reads
//! what the other wrote.
//!
//! Each operation runs on a closed image (no other writer) and orders its writes so that a
//! crash at any point leaves an image whose worst fault is a leaked cluster (a refcount higher
//! than its references, which `qemu-img check -r leaks` reclaims): references are added before
//! anything points at them and removed only after nothing does, and the header's snapshot
//! count and table offset — the commit point — change in one write.
//!
//! The image is untrusted: every table offset is checked against the file and the cluster
//! size, every refcount change against underflow and the refcount width, and an operation that
//! finds a fault fails before it writes anything of the stage that found it.

use std::collections::{BTreeMap, BTreeSet};
use std::io;

use crate::{ImageError, Qcow2Header, PROBE_BYTES};

/// An L1 or L2 entry's host offset bits.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// The cluster has exactly one reference and may be written in place.
const COPIED: u64 = 1 << 63;
/// An L2 entry describing a compressed cluster.
const COMPRESSED: u64 = 1 << 62;
/// qemu's limit on snapshots per image.
const MAX_SNAPSHOTS: usize = 65536;
/// qemu's limit on a snapshot entry's extra data.
const MAX_EXTRA: u32 = 1024;
/// Longest name accepted for a new snapshot.
pub const MAX_NAME: usize = 255;

/// The file an image lives in, as the operations here use it.
pub trait ImageFile {
    /// Fills `buf` from `offset`; bytes past the end of the file read as zeroes.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// The file's length.
    fn file_len(&self) -> io::Result<u64>;
    /// Makes what was written durable.
    fn sync(&self) -> io::Result<()>;
}

impl ImageFile for std::fs::File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut done = 0;
        while done < buf.len() {
            match FileExt::read_at(self, &mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    buf[done..].fill(0);
                    return Ok(());
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, buf, offset)
    }

    fn file_len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn sync(&self) -> io::Result<()> {
        self.sync_data()
    }
}

/// Why a snapshot operation failed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The header is not one this reads.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A table is damaged.
    #[error("qcow2 {0}")]
    Corrupt(String),
    /// No snapshot has this name.
    #[error("no snapshot named `{0}`")]
    NotFound(String),
    /// A snapshot has this name already.
    #[error("a snapshot named `{0}` exists already")]
    Exists(String),
    /// The name cannot be recorded.
    #[error("snapshot name `{0}`: {1}")]
    BadName(String, &'static str),
    /// A valid image this does not handle.
    #[error("{0}")]
    Unsupported(String),
    /// The file failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> SnapshotError {
    move |source| SnapshotError::Io { what, source }
}

fn corrupt(m: impl Into<String>) -> SnapshotError {
    SnapshotError::Corrupt(m.into())
}

/// One internal snapshot, as the snapshot table records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Its unique id (qemu numbers them).
    pub id: String,
    /// Its name.
    pub name: String,
    /// When it was taken: seconds since the epoch.
    pub date_sec: u32,
    /// And nanoseconds.
    pub date_nsec: u32,
    /// The virtual disk size when it was taken, if recorded.
    pub disk_size: Option<u64>,
    /// Bytes of saved VM state (0 for a disk-only snapshot).
    pub vm_state_size: u64,
    /// Where its L1 table is.
    pub l1_offset: u64,
    /// Entries in its L1 table.
    pub l1_size: u32,
}

/// A snapshot table entry: what it says, and its bytes, rewritten unchanged when others change.
struct Entry {
    info: SnapshotInfo,
    raw: Vec<u8>,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A refcount block in memory.
struct Block {
    data: Vec<u8>,
    dirty: bool,
}

/// An open image's metadata, with the refcount blocks touched so far cached until written.
struct Image<'f> {
    f: &'f dyn ImageFile,
    version: u32,
    cluster_bits: u32,
    size: u64,
    dirty: bool,
    l1_offset: u64,
    l1_size: u32,
    rt_offset: u64,
    /// Refcount table entries (block offsets).
    rt: Vec<u64>,
    rt_dirty: BTreeSet<usize>,
    /// Bytes per refcount entry.
    rc_bytes: usize,
    nb_snapshots: u32,
    snapshots_offset: u64,
    blocks: BTreeMap<usize, Block>,
    /// The next cluster to allocate: past everything in the file.
    end: u64,
    file_len: u64,
}

impl<'f> Image<'f> {
    fn open(f: &'f dyn ImageFile) -> Result<Self, SnapshotError> {
        let file_len = f.file_len().map_err(io_err("reading the image's length"))?;
        let mut start = vec![0u8; PROBE_BYTES.min(file_len as usize)];
        f.read_at(&mut start, 0).map_err(io_err("reading the header"))?;
        let h = Qcow2Header::parse(&start)?;
        let cluster = h.cluster_size();
        let rc_order = if h.version >= 3 { be32(&start, 96) } else { 4 };
        if !(3..=6).contains(&rc_order) {
            return Err(SnapshotError::Unsupported(format!(
                "refcounts of {} bits (8, 16, 32 or 64 are handled)",
                1u32 << rc_order
            )));
        }
        let rt_offset = be64(&start, 48);
        let rt_clusters = u64::from(be32(&start, 56));
        let rt_bytes = rt_clusters * cluster;
        if rt_offset + rt_bytes > file_len {
            return Err(corrupt("refcount table: reaches past the end of the file"));
        }
        let mut raw = vec![0u8; rt_bytes as usize];
        f.read_at(&mut raw, rt_offset).map_err(io_err("reading the refcount table"))?;
        let mut rt = Vec::with_capacity(raw.len() / 8);
        for (i, e) in raw.chunks_exact(8).enumerate() {
            let off = u64::from_be_bytes(e.try_into().expect("8 bytes"));
            if off & 0x1ff != 0 || !(off & !0x1ff).is_multiple_of(cluster) {
                return Err(corrupt(format!("refcount table entry {i}: {off:#x} is not a cluster offset")));
            }
            rt.push(off);
        }
        Ok(Image {
            f,
            version: h.version,
            cluster_bits: h.cluster_bits,
            size: h.size,
            dirty: h.dirty,
            l1_offset: be64(&start, 40),
            l1_size: be32(&start, 36),
            rt_offset,
            rt,
            rt_dirty: BTreeSet::new(),
            rc_bytes: 1 << (rc_order - 3),
            nb_snapshots: be32(&start, 60),
            snapshots_offset: be64(&start, 64),
            blocks: BTreeMap::new(),
            end: file_len.div_ceil(cluster),
            file_len,
        })
    }

    fn cluster(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Refuses what the writing operations do not handle.
    fn writable(&self) -> Result<(), SnapshotError> {
        if self.version < 3 {
            return Err(SnapshotError::Unsupported(
                "snapshots of a version 2 image (upgrade with `qemu-img amend -o compat=v3`)".into(),
            ));
        }
        if self.dirty {
            return Err(SnapshotError::Unsupported(
                "an image not closed cleanly (dirty bit set); repair it with `qemu-img check -r all`".into(),
            ));
        }
        Ok(())
    }

    fn per_block(&self) -> u64 {
        self.cluster() / self.rc_bytes as u64
    }

    fn load_block(&mut self, bi: usize) -> Result<(), SnapshotError> {
        if self.blocks.contains_key(&bi) {
            return Ok(());
        }
        let off = self.rt[bi];
        if off + self.cluster() > self.file_len.max(self.end * self.cluster()) {
            return Err(corrupt(format!("refcount block {bi} at {off:#x}: past the end of the file")));
        }
        let mut data = vec![0u8; self.cluster() as usize];
        self.f.read_at(&mut data, off).map_err(io_err("reading a refcount block"))?;
        self.blocks.insert(bi, Block { data, dirty: false });
        Ok(())
    }

    fn refcount(&mut self, c: u64) -> Result<u64, SnapshotError> {
        let bi = (c / self.per_block()) as usize;
        if bi >= self.rt.len() || self.rt[bi] == 0 {
            return Ok(0);
        }
        self.load_block(bi)?;
        let at = (c % self.per_block()) as usize * self.rc_bytes;
        let b = &self.blocks[&bi].data[at..at + self.rc_bytes];
        Ok(b.iter().fold(0u64, |v, &x| (v << 8) | u64::from(x)))
    }

    fn set_refcount(&mut self, c: u64, v: u64) -> Result<(), SnapshotError> {
        if self.rc_bytes < 8 && v >> (8 * self.rc_bytes) != 0 {
            return Err(SnapshotError::Unsupported(format!(
                "cluster {c} would have {v} references, more than {}-bit refcounts hold",
                8 * self.rc_bytes
            )));
        }
        let bi = (c / self.per_block()) as usize;
        if bi >= self.rt.len() {
            return Err(SnapshotError::Unsupported("the image's refcount table is full (it grows only through qemu-img)".into()));
        }
        if self.rt[bi] == 0 {
            // A new refcount block, in the next free cluster; it counts itself if it covers
            // itself, else its own block counts it.
            let at = self.end;
            self.end += 1;
            self.rt[bi] = at * self.cluster();
            self.rt_dirty.insert(bi);
            self.blocks.insert(bi, Block { data: vec![0u8; self.cluster() as usize], dirty: true });
            self.set_refcount(at, 1)?;
        }
        self.load_block(bi)?;
        let at = (c % self.per_block()) as usize * self.rc_bytes;
        let n = self.rc_bytes;
        let block = self.blocks.get_mut(&bi).expect("loaded");
        block.data[at..at + n].copy_from_slice(&v.to_be_bytes()[8 - n..]);
        block.dirty = true;
        Ok(())
    }

    fn add_ref(&mut self, c: u64, addend: i64) -> Result<(), SnapshotError> {
        let now = self.refcount(c)?;
        let new = match now.checked_add_signed(addend) {
            Some(n) => n,
            None => {
                return Err(corrupt(format!(
                    "refcounts: cluster {:#x} has refcount {now} but more references than that",
                    c * self.cluster()
                )))
            }
        };
        self.set_refcount(c, new)
    }

    /// `n` new clusters past everything else, each with refcount 1; their first offset.
    fn alloc(&mut self, n: u64) -> Result<u64, SnapshotError> {
        let first = self.end;
        self.end += n;
        for c in first..first + n {
            self.set_refcount(c, 1)?;
        }
        Ok(first * self.cluster())
    }

    /// Writes changed refcount blocks, then the table entries that point at new ones.
    fn write_refcounts(&mut self) -> Result<(), SnapshotError> {
        for (&bi, b) in self.blocks.iter_mut().filter(|(_, b)| b.dirty) {
            self.f.write_at(&b.data, self.rt[bi]).map_err(io_err("writing a refcount block"))?;
            b.dirty = false;
        }
        for &bi in &self.rt_dirty {
            self.f
                .write_at(&self.rt[bi].to_be_bytes(), self.rt_offset + 8 * bi as u64)
                .map_err(io_err("writing the refcount table"))?;
        }
        self.rt_dirty.clear();
        self.file_len = self.file_len.max(self.end * self.cluster());
        Ok(())
    }

    fn sync(&self) -> Result<(), SnapshotError> {
        self.f.sync().map_err(io_err("syncing the image"))
    }

    fn read_l1(&self, offset: u64, size: u32, what: &str) -> Result<Vec<u64>, SnapshotError> {
        let bytes = u64::from(size) * 8;
        if size > 32 << 20 || !offset.is_multiple_of(self.cluster()) || offset + bytes > self.file_len {
            return Err(corrupt(format!("{what} L1 table: {size} entries at {offset:#x} do not lie in the file")));
        }
        let mut raw = vec![0u8; bytes as usize];
        self.f.read_at(&mut raw, offset).map_err(io_err("reading an L1 table"))?;
        Ok(raw.chunks_exact(8).map(|e| u64::from_be_bytes(e.try_into().expect("8 bytes"))).collect())
    }

    fn write_table(&self, entries: &[u64], offset: u64, what: &'static str) -> Result<(), SnapshotError> {
        let raw: Vec<u8> = entries.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.f.write_at(&raw, offset).map_err(io_err(what))
    }

    fn read_l2(&self, offset: u64) -> Result<Vec<u64>, SnapshotError> {
        if !offset.is_multiple_of(self.cluster()) || offset + self.cluster() > self.file_len {
            return Err(corrupt(format!("L2 table at {offset:#x}: not a cluster of the file")));
        }
        let mut raw = vec![0u8; self.cluster() as usize];
        self.f.read_at(&mut raw, offset).map_err(io_err("reading an L2 table"))?;
        Ok(raw.chunks_exact(8).map(|e| u64::from_be_bytes(e.try_into().expect("8 bytes"))).collect())
    }

    /// The host clusters an L2 entry references.
    fn data_clusters(&self, e: u64) -> Result<std::ops::Range<u64>, SnapshotError> {
        let cb = self.cluster_bits;
        if e & COMPRESSED != 0 {
            let shift = 62 - (cb - 8);
            let offset = e & ((1 << shift) - 1);
            let sectors = ((e >> shift) & ((1 << (cb - 8)) - 1)) + 1;
            let len = sectors * 512 - (offset & 511);
            return Ok((offset >> cb)..((offset + len - 1) >> cb) + 1);
        }
        let off = e & OFFSET_MASK;
        if !off.is_multiple_of(self.cluster()) {
            return Err(corrupt(format!("L2 entry {e:#x}: data offset is not cluster aligned")));
        }
        Ok(if off == 0 { 0..0 } else { (off >> cb)..(off >> cb) + 1 })
    }

    /// Adds `addend` to the refcount of every cluster the tree under `l1` references: its L2
    /// tables and their data clusters. Nothing is written until [`write_refcounts`].
    fn update_tree(&mut self, l1: &[u64], addend: i64) -> Result<(), SnapshotError> {
        for &e in l1 {
            let l2 = e & OFFSET_MASK;
            if l2 == 0 {
                continue;
            }
            let table = self.read_l2(l2)?;
            for x in table {
                for c in self.data_clusters(x)? {
                    self.add_ref(c, addend)?;
                }
            }
            self.add_ref(l2 >> self.cluster_bits, addend)?;
        }
        Ok(())
    }

    /// Sets the `COPIED` flag of each active L1 and L2 entry to whether its cluster has exactly
    /// one reference, as the specification requires of the active tables.
    fn fix_copied(&mut self) -> Result<(), SnapshotError> {
        let mut l1 = self.read_l1(self.l1_offset, self.l1_size, "active")?;
        let mut l1_changed = false;
        let mut seen = BTreeSet::new();
        for e in l1.iter_mut() {
            let l2 = *e & OFFSET_MASK;
            let want = l2 != 0 && self.refcount(l2 >> self.cluster_bits)? == 1;
            let new = if want { *e | COPIED } else { *e & !COPIED };
            l1_changed |= new != *e;
            *e = new;
            if l2 == 0 || !seen.insert(l2) {
                continue;
            }
            let mut table = self.read_l2(l2)?;
            let mut changed = false;
            for x in table.iter_mut() {
                let off = *x & OFFSET_MASK;
                let want = *x & COMPRESSED == 0 && off != 0 && self.refcount(off >> self.cluster_bits)? == 1;
                let new = if want { *x | COPIED } else { *x & !COPIED };
                changed |= new != *x;
                *x = new;
            }
            if changed {
                self.write_table(&table, l2, "writing an L2 table")?;
            }
        }
        if l1_changed {
            self.write_table(&l1, self.l1_offset, "writing the L1 table")?;
        }
        Ok(())
    }

    fn read_snapshots(&self) -> Result<Vec<Entry>, SnapshotError> {
        let n = self.nb_snapshots as usize;
        if n == 0 {
            return Ok(Vec::new());
        }
        if n > MAX_SNAPSHOTS {
            return Err(corrupt(format!("snapshot table: {n} snapshots, more than qemu's limit of {MAX_SNAPSHOTS}")));
        }
        if !self.snapshots_offset.is_multiple_of(self.cluster()) {
            return Err(corrupt(format!("snapshot table: offset {:#x} is not cluster aligned", self.snapshots_offset)));
        }
        let mut at = self.snapshots_offset;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let bad = |m: String| corrupt(format!("snapshot table entry {i}: {m}"));
            if at + 40 > self.file_len {
                return Err(bad("past the end of the file".into()));
            }
            let mut fixed = [0u8; 40];
            self.f.read_at(&mut fixed, at).map_err(io_err("reading the snapshot table"))?;
            let extra = be32(&fixed, 36);
            if extra > MAX_EXTRA {
                return Err(bad(format!("{extra} bytes of extra data (at most {MAX_EXTRA})")));
            }
            let (id_len, name_len) = (be16(&fixed, 12) as usize, be16(&fixed, 14) as usize);
            let len = (40 + extra as usize + id_len + name_len).next_multiple_of(8);
            if at + len as u64 > self.file_len {
                return Err(bad("past the end of the file".into()));
            }
            let mut raw = vec![0u8; len];
            self.f.read_at(&mut raw, at).map_err(io_err("reading the snapshot table"))?;
            let e = 40 + extra as usize;
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            let vm_state_size = if extra >= 8 { be64(&raw, 40) } else { u64::from(be32(&raw, 32)) };
            let info = SnapshotInfo {
                id: text(&raw[e..e + id_len]),
                name: text(&raw[e + id_len..e + id_len + name_len]),
                date_sec: be32(&raw, 16),
                date_nsec: be32(&raw, 20),
                disk_size: (extra >= 16).then(|| be64(&raw, 48)),
                vm_state_size,
                l1_offset: be64(&raw, 0),
                l1_size: be32(&raw, 8),
            };
            if !info.l1_offset.is_multiple_of(self.cluster())
                || info.l1_size > 32 << 20
                || info.l1_offset + u64::from(info.l1_size) * 8 > self.file_len
            {
                return Err(bad(format!(
                    "its L1 table ({} entries at {:#x}) does not lie in the file",
                    info.l1_size, info.l1_offset
                )));
            }
            out.push(Entry { info, raw });
            at += len as u64;
        }
        Ok(out)
    }

    /// Writes `entries` as a new snapshot table and makes the header point at it; then frees
    /// the old table.
    fn replace_table(&mut self, entries: &[Entry], old: &[Entry]) -> Result<(), SnapshotError> {
        let bytes: Vec<u8> = entries.iter().flat_map(|e| e.raw.iter().copied()).collect();
        let offset = if bytes.is_empty() {
            0
        } else {
            let at = self.alloc((bytes.len() as u64).div_ceil(self.cluster()))?;
            self.f.write_at(&bytes, at).map_err(io_err("writing the snapshot table"))?;
            at
        };
        self.write_refcounts()?;
        self.sync()?;
        // The commit point: count and offset in one write.
        let mut h = [0u8; 12];
        h[..4].copy_from_slice(&(entries.len() as u32).to_be_bytes());
        h[4..].copy_from_slice(&offset.to_be_bytes());
        self.f.write_at(&h, 60).map_err(io_err("writing the header"))?;
        self.sync()?;
        let old_bytes: u64 = old.iter().map(|e| e.raw.len() as u64).sum();
        if old_bytes > 0 {
            let first = self.snapshots_offset >> self.cluster_bits;
            for c in first..first + old_bytes.div_ceil(self.cluster()) {
                self.add_ref(c, -1)?;
            }
        }
        self.nb_snapshots = entries.len() as u32;
        self.snapshots_offset = offset;
        Ok(())
    }
}

/// The image's snapshots, in table order.
pub fn list(f: &dyn ImageFile) -> Result<Vec<SnapshotInfo>, SnapshotError> {
    let img = Image::open(f)?;
    Ok(img.read_snapshots()?.into_iter().map(|e| e.info).collect())
}

/// Checks a name for a new snapshot.
pub fn check_name(name: &str) -> Result<(), SnapshotError> {
    let bad = |why| Err(SnapshotError::BadName(name.to_string(), why));
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_NAME {
        return bad("longer than 255 bytes");
    }
    if name.chars().any(|c| c.is_control()) {
        return bad("contains a control character");
    }
    Ok(())
}

/// Takes a snapshot named `name` of the image as it is now, dated `date` (seconds and
/// nanoseconds since the epoch).
pub fn create(f: &dyn ImageFile, name: &str, date: (u32, u32)) -> Result<SnapshotInfo, SnapshotError> {
    check_name(name)?;
    let mut img = Image::open(f)?;
    img.writable()?;
    let old = img.read_snapshots()?;
    if old.iter().any(|e| e.info.name == name) {
        return Err(SnapshotError::Exists(name.to_string()));
    }
    if old.len() >= MAX_SNAPSHOTS {
        return Err(SnapshotError::Unsupported(format!("more than {MAX_SNAPSHOTS} snapshots")));
    }
    let id = old.iter().filter_map(|e| e.info.id.parse::<u64>().ok()).max().unwrap_or(0) + 1;
    let l1 = img.read_l1(img.l1_offset, img.l1_size, "active")?;
    // References first: a crash after this leaks, never frees what the live image uses.
    img.update_tree(&l1, 1)?;
    let l1_bytes = (u64::from(img.l1_size) * 8).max(8);
    let copy_at = img.alloc(l1_bytes.div_ceil(img.cluster()))?;
    let copy: Vec<u64> = l1.iter().map(|e| e & !COPIED).collect();
    img.write_table(&copy, copy_at, "writing the snapshot's L1 table")?;
    img.write_refcounts()?;
    img.fix_copied()?;
    let info = SnapshotInfo {
        id: id.to_string(),
        name: name.to_string(),
        date_sec: date.0,
        date_nsec: date.1,
        disk_size: Some(img.size),
        vm_state_size: 0,
        l1_offset: copy_at,
        l1_size: img.l1_size,
    };
    let mut raw = Vec::new();
    raw.extend_from_slice(&copy_at.to_be_bytes());
    raw.extend_from_slice(&img.l1_size.to_be_bytes());
    raw.extend_from_slice(&(info.id.len() as u16).to_be_bytes());
    raw.extend_from_slice(&(name.len() as u16).to_be_bytes());
    raw.extend_from_slice(&date.0.to_be_bytes());
    raw.extend_from_slice(&date.1.to_be_bytes());
    raw.extend_from_slice(&0u64.to_be_bytes()); // guest run time: no guest
    raw.extend_from_slice(&0u32.to_be_bytes()); // VM state: none
    raw.extend_from_slice(&16u32.to_be_bytes()); // extra data: 64-bit VM state size, disk size
    raw.extend_from_slice(&0u64.to_be_bytes());
    raw.extend_from_slice(&img.size.to_be_bytes());
    raw.extend_from_slice(info.id.as_bytes());
    raw.extend_from_slice(name.as_bytes());
    raw.resize(raw.len().next_multiple_of(8), 0);
    let mut entries = Vec::with_capacity(old.len() + 1);
    entries.extend(old.iter().map(|e| Entry { info: e.info.clone(), raw: e.raw.clone() }));
    entries.push(Entry { info: info.clone(), raw });
    img.replace_table(&entries, &old)?;
    img.write_refcounts()?;
    img.sync()?;
    Ok(info)
}

/// Makes the image's contents those of snapshot `name` again; the snapshot stays.
pub fn revert(f: &dyn ImageFile, name: &str) -> Result<(), SnapshotError> {
    let mut img = Image::open(f)?;
    img.writable()?;
    let entries = img.read_snapshots()?;
    let s = entries.iter().find(|e| e.info.name == name).ok_or_else(|| SnapshotError::NotFound(name.to_string()))?;
    if s.info.disk_size.is_some_and(|d| d != img.size) {
        return Err(SnapshotError::Unsupported(format!(
            "snapshot `{name}` was taken at a disk size of {} bytes; the image is {} bytes now",
            s.info.disk_size.unwrap_or(0),
            img.size
        )));
    }
    if s.info.l1_size > img.l1_size {
        return Err(SnapshotError::Unsupported(format!(
            "snapshot `{name}` has a larger L1 table ({} entries) than the image ({})",
            s.info.l1_size, img.l1_size
        )));
    }
    let snap = img.read_l1(s.info.l1_offset, s.info.l1_size, "the snapshot's")?;
    let live = img.read_l1(img.l1_offset, img.l1_size, "active")?;
    img.update_tree(&snap, 1)?;
    img.write_refcounts()?;
    img.sync()?;
    let mut new: Vec<u64> = snap.iter().map(|e| e & !COPIED).collect();
    new.resize(img.l1_size as usize, 0);
    img.write_table(&new, img.l1_offset, "writing the L1 table")?;
    img.sync()?;
    img.update_tree(&live, -1)?;
    img.write_refcounts()?;
    img.fix_copied()?;
    img.sync()
}

/// Deletes snapshot `name`, freeing what only it referenced.
pub fn delete(f: &dyn ImageFile, name: &str) -> Result<(), SnapshotError> {
    let mut img = Image::open(f)?;
    img.writable()?;
    let old = img.read_snapshots()?;
    let Some(pos) = old.iter().position(|e| e.info.name == name) else {
        return Err(SnapshotError::NotFound(name.to_string()));
    };
    let gone = old[pos].info.clone();
    let snap = img.read_l1(gone.l1_offset, gone.l1_size, "the snapshot's")?;
    let keep: Vec<Entry> = old
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != pos)
        .map(|(_, e)| Entry { info: e.info.clone(), raw: e.raw.clone() })
        .collect();
    img.replace_table(&keep, &old)?;
    img.update_tree(&snap, -1)?;
    let first = gone.l1_offset >> img.cluster_bits;
    for c in first..first + (u64::from(gone.l1_size) * 8).max(8).div_ceil(img.cluster()) {
        img.add_ref(c, -1)?;
    }
    img.write_refcounts()?;
    img.fix_copied()?;
    img.sync()
}
