//! A device's chain as the supervisor keeps it: where the filters run, and each filter with the
//! descriptors it is handed every generation. `bulkhead device tap` and `bulkhead filter` change it on a
//! running device; the next generation runs the new chain.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use std::sync::Arc;

use bulkhead_config::{Filter, Tap};
use bulkhead_filters::cow::SnapshotOp;
use bulkhead_filters::state::{StatePage, STATE_BYTES};
use bulkhead_filters::FilterSpec;
use bulkhead_shmem::memfd;

use crate::error::Error;

/// Major device number stamped on trace records (the range Linux reserves for local use).
const TRACE_MAJOR: u32 = 240;

/// A size-sealed state page for a filter or a domain, and the supervisor's read-only view.
pub(crate) fn state_page(name: &str) -> Result<(OwnedFd, StatePage), Error> {
    shared_page(name, false)
}

/// A state page the supervisor writes too (`writable`): the domain's own, where it sets the
/// views' caps.
pub(crate) fn shared_page(name: &str, writable: bool) -> Result<(OwnedFd, StatePage), Error> {
    let fd = memfd::create(name, STATE_BYTES as u64).map_err(|e| Error::failed(format!("state page: {e}")))?;
    memfd::seal_size(fd.as_raw_fd()).map_err(|e| Error::failed(format!("state page: {e}")))?;
    let page = StatePage::map(fd.as_raw_fd(), writable).map_err(|e| Error::failed(format!("state page: {e}")))?;
    Ok((fd, page))
}

/// `key` in a sealed memory file of its own.
fn secret_file(device: &str, key: &[u8]) -> Result<OwnedFd, Error> {
    use std::os::unix::fs::FileExt;
    fn failed(e: impl std::fmt::Display) -> Error {
        Error::failed(format!("key: {e}"))
    }
    let fd = memfd::create(&format!("bulkhead-{device}-key"), key.len() as u64).map_err(failed)?;
    let f = std::fs::File::from(fd);
    f.write_all_at(key, 0).map_err(failed)?;
    let fd = OwnedFd::from(f);
    memfd::seal_size(fd.as_raw_fd()).map_err(failed)?;
    memfd::seal_future_write(fd.as_raw_fd()).map_err(failed)?;
    Ok(fd)
}

/// Opens the LUKS volume of `crypt` filter `f` (the `i`-th, from 0) on the device below it,
/// `size_below` bytes read by `read`: fills in where its data lies, opens it with the key file
/// and hands the filter the master key; returns the size of the device the filter makes.
/// Opening here, once, gives a wrong key or a damaged header a clear error when the device
/// starts, and spares every domain generation the key derivation (seconds and up to 4 GiB of
/// memory, as the volume's key slots ask).
pub(crate) fn open_volume(
    device: &str,
    i: usize,
    f: &mut FilterSetup,
    size_below: u64,
    read: &mut bulkhead_crypt::ReadAt<'_>,
) -> Result<u64, Error> {
    let bad = |m: String| Error::invalid(format!("filter {} (crypt): {m}", i + 1));
    let FilterSpec::Crypt { payload_offset, data_size, sector_size } = &mut f.spec else {
        return Err(bad("not a crypt filter".into()));
    };
    let v = bulkhead_crypt::Volume::read(read).map_err(|e| bad(e.to_string()))?;
    let d = v.data_size(size_below).map_err(|e| bad(e.to_string()))?;
    if d == 0 {
        return Err(bad("the volume holds no data".into()));
    }
    (*payload_offset, *data_size, *sector_size) = (v.payload_offset, d, v.sector_size);
    let path = f.key_file.as_ref().ok_or_else(|| bad("no key_file".into()))?;
    let passphrase = zeroize::Zeroizing::new(std::fs::read(path).map_err(|e| bad(format!("key_file {}: {e}", path.display())))?);
    if v.kdf_work() > SLOW_UNLOCK {
        log::info!(
            "device {device}: filter {} (crypt): the volume's key slots ask for {} rounds of key derivation; unlocking may take a while",
            i + 1,
            v.kdf_work()
        );
    }
    let key = v.unlock(&passphrase, read).map_err(|e| match e {
        bulkhead_crypt::CryptError::WrongKey => bad(format!("no key slot of the volume opens with key_file {}", path.display())),
        e => bad(e.to_string()),
    })?;
    f.secret = Some(secret_file(device, key.bytes()).map_err(|e| e.context(format!("filter {} (crypt)", i + 1)))?);
    Ok(d)
}

/// Key derivation rounds (PBKDF2 iterations, Argon2 passes × KiB) past which opening a
/// volume is said to take a while: about ten seconds of PBKDF2-SHA256 here.
const SLOW_UNLOCK: u64 = 20_000_000;

/// Opens the overlay of `cow` filter `f` (the `i`-th, from 0), creating an empty one (a qcow2
/// image the size of the device below it) if the file does not exist, and checks that it
/// fits: qcow2, not damaged, `size_below` bytes. The overlay is locked for this serve alone.
/// A new overlay names `backing_file` (the backend's file or image right below, if any, and its
/// format) as its backing file, so `qemu-img` reads the overlay as the device it stands for.
pub(crate) fn open_cow_overlay(
    i: usize,
    f: &mut FilterSetup,
    size_below: u64,
    backing_file: Option<(&Path, bulkhead_image::Format)>,
) -> Result<(), Error> {
    let bad = |m: String| Error::invalid(format!("filter {} (cow): {m}", i + 1));
    let FilterSpec::Cow { cluster_bits, .. } = &mut f.spec else {
        return Err(bad("not a cow filter".into()));
    };
    let path = f.overlay.clone().ok_or_else(|| bad("no overlay".into()))?;
    let backing = backing_file.and_then(|(p, format)| {
        let name = p.canonicalize().ok()?.to_str()?.to_string();
        Some(bulkhead_image::Backing { name, format })
    });
    let (fd, bits) = open_overlay(&path, size_below, *cluster_bits, backing.as_ref())
        .map_err(|e| e.context(format!("filter {} (cow): overlay {}", i + 1, path.display())))?;
    *cluster_bits = bits;
    f.output = Some(fd);
    Ok(())
}

/// Opens (or creates) one overlay; returns it and its cluster size's log2.
fn open_overlay(
    path: &Path,
    size: u64,
    cluster_bits: u32,
    backing: Option<&bulkhead_image::Backing>,
) -> Result<(OwnedFd, u32), Error> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let failed = |e: std::io::Error| Error::failed(e.to_string());
    if !path.exists() {
        let image = bulkhead_image::new_image(size, cluster_bits, backing).map_err(|e| Error::invalid(e.to_string()))?;
        // Written whole under another name, then renamed: never a half-made overlay.
        let tmp = path.with_extension(format!("new-{}", std::process::id()));
        let made = (|| -> std::io::Result<()> {
            let f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
            f.write_all_at(&image, 0)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = made {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::failed(format!("cannot create it: {e}")));
        }
    }
    let f = std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(path).map_err(failed)?;
    if f.try_lock().is_err() {
        return Err(Error::in_use("in use by another process (it is locked)"));
    }
    let len = f.metadata().map_err(failed)?.len();
    let mut start = vec![0u8; bulkhead_image::PROBE_BYTES.min(len as usize)];
    f.read_exact_at(&mut start, 0).map_err(failed)?;
    let h = bulkhead_image::Qcow2Header::parse(&start).map_err(|e| Error::invalid(e.to_string()))?;
    if h.size != size {
        return Err(Error::invalid(format!("holds a device of {} bytes; the device below has {size}", h.size)));
    }
    if h.dirty {
        return Err(Error::invalid("was not closed cleanly (dirty bit set); repair it with `qemu-img check -r all`"));
    }
    Ok((OwnedFd::from(f), h.cluster_bits))
}

/// Opens a trace file for a domain to append to: created, or emptied if it exists.
fn open_trace(path: &Path) -> std::io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_CLOEXEC | libc::O_APPEND)
        .open(path)?;
    Ok(OwnedFd::from(f))
}

/// One filter of a device: what it is, its state page and its output, the same for every
/// generation so counters and traces carry on across restarts.
#[derive(Debug)]
pub(crate) struct FilterSetup {
    pub spec: FilterSpec,
    pub state_fd: OwnedFd,
    pub output: Option<OwnedFd>,
    /// Its secret (a `crypt` filter's master key, once the supervisor has opened the volume
    /// with the key file) in a sealed memory file: each generation gets the descriptor; the
    /// key never appears in a spec, a command line or a log.
    pub secret: Option<OwnedFd>,
    /// The key file it is opened with (`crypt`).
    pub key_file: Option<std::path::PathBuf>,
    /// Its overlay file (`cow`), opened by [`open_cow_overlay`] into `output`.
    pub overlay: Option<std::path::PathBuf>,
    /// The state page as `status` reads it.
    pub page: StatePage,
    /// Write capture for it.
    pub guard: bulkhead_filters::GuardSpec,
}

impl FilterSetup {
    /// Makes the state page and opens the output of a configured filter of device `device`
    /// (the `index`-th in the configuration, for the trace's device number).
    pub fn new(device: &str, index: u32, f: Filter) -> Result<Self, Error> {
        let mut spec = f.spec;
        if let FilterSpec::Trace { device_number } = &mut spec {
            *device_number = (TRACE_MAJOR << 20) | index;
        }
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let (state_fd, page) = state_page(&format!("bulkhead-{device}-{}-{nanos:x}", spec.type_name()))?;
        let (output, overlay) = match (&spec, &f.path) {
            (FilterSpec::Cow { .. }, p) => (None, p.clone()),
            (_, Some(p)) => {
                let cannot = |e| Error::failed(format!("{}: cannot open {}: {e}", spec.type_name(), p.display()));
                (Some(open_trace(p).map_err(cannot)?), None)
            }
            (_, None) => (None, None),
        };
        Ok(FilterSetup { spec, state_fd, output, secret: None, key_file: f.key_file, overlay, page, guard: f.guard })
    }

    /// Cuts a trace file back to whole records: a domain killed in the middle of a write may
    /// have left part of one, which would misalign every record after it.
    pub fn trim_output(&self) {
        let (FilterSpec::Trace { .. }, Some(o)) = (&self.spec, &self.output) else { return };
        let Ok(dup) = o.try_clone() else { return };
        let f = std::fs::File::from(dup);
        let record = bulkhead_filters::trace::RECORD_BYTES as u64;
        if let Ok(m) = f.metadata() {
            if m.len() % record != 0 {
                let _ = f.set_len(m.len() / record * record);
            }
        }
    }
}

/// Where a device's filters run, and the filters, frontend side first: a copy is cheap, so
/// each launch takes one and nothing waits on the device's while a domain starts.
#[derive(Debug, Clone)]
pub(crate) struct ChainSetup {
    pub tap: Tap,
    pub filters: Vec<Arc<FilterSetup>>,
    /// The last snapshot operation asked of the `cow` filter: every generation from the next
    /// on is told of it, and carries it out once (its sequence number says whether it has).
    pub snapshot: Option<SnapshotOp>,
}

impl ChainSetup {
    /// What filter `f` of this chain is told: its spec, with the snapshot operation for a
    /// `cow` filter.
    pub fn spec_of(&self, f: &FilterSetup) -> FilterSpec {
        let mut spec = f.spec.clone();
        if let (FilterSpec::Cow { op, .. }, Some(s)) = (&mut spec, &self.snapshot) {
            *op = Some(s.clone());
        }
        spec
    }

    /// The `cow` filter, if the chain has one.
    pub fn cow(&self) -> Option<&FilterSetup> {
        self.filters.iter().map(|f| &**f).find(|f| matches!(f.spec, FilterSpec::Cow { .. }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_filters::cow::{SnapshotAction, SnapshotOp};

    fn filter(spec: FilterSpec, path: Option<std::path::PathBuf>) -> Filter {
        Filter { spec, path, key_file: None, guard: Default::default() }
    }

    #[test]
    fn only_the_cow_filter_is_told_of_the_pending_snapshot() {
        let stats = FilterSetup::new("d", 0, filter(FilterSpec::Stats {}, None)).unwrap();
        let cow = FilterSetup::new("d", 0, filter(FilterSpec::Cow { cluster_bits: 16, op: None }, None)).unwrap();
        let op = SnapshotOp { seq: 3, action: SnapshotAction::Create, name: "s1".into(), date: (1, 2) };
        let chain =
            ChainSetup { tap: Tap::Passthrough, filters: vec![Arc::new(stats), Arc::new(cow)], snapshot: Some(op.clone()) };
        assert_eq!(chain.spec_of(&chain.filters[0]), FilterSpec::Stats {});
        assert_eq!(chain.spec_of(&chain.filters[1]), FilterSpec::Cow { cluster_bits: 16, op: Some(op) });
        assert!(chain.cow().is_some());
        // A copy shares the filters' files: the next generation gets the same state pages.
        let copy = chain.clone();
        assert!(Arc::ptr_eq(&copy.filters[1], &chain.filters[1]));
    }

    #[test]
    fn a_trace_is_stamped_with_the_device_number_and_cut_back_to_whole_records() {
        let dir = std::env::temp_dir().join(format!("bulkhead-chain-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.blktrace");
        let f = FilterSetup::new("d", 7, filter(FilterSpec::Trace { device_number: 0 }, Some(path.clone()))).unwrap();
        assert_eq!(f.spec, FilterSpec::Trace { device_number: (TRACE_MAJOR << 20) | 7 });
        // A domain killed in the middle of a record left part of one.
        let record = bulkhead_filters::trace::RECORD_BYTES;
        std::fs::write(&path, vec![1u8; 3 * record + 17]).unwrap();
        f.trim_output();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 3 * record as u64);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
