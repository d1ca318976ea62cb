//! What a device's start reads through its own storage before the first generation: the
//! filters' setup from the bottom of the chain up (a `cow` filter's overlay, a `crypt` filter's
//! LUKS header, read through a domain of its own where the bytes below are not plain), an
//! `rbd` image's size, and whether the backend may end an `intercept` chain.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_client::Device;
use bulkhead_config::{BackendConfig, ImageFormat, Tap};
use bulkhead_filters::FilterSpec;

use super::{Launched, Launcher, PROBE_STOP, PROBE_TIMEOUT_MS};
use crate::chain::FilterSetup;
use crate::error::Error;
use crate::spawn::discard;

impl Launcher {
    /// Opens what the filters need before their first generation, from the bottom of the
    /// chain up, each over the device the filters below it make: a `cow` filter's overlay is
    /// made the size of that device, and a `crypt` filter's LUKS header is read from it. Where
    /// that device is the backend's own bytes (memory, a raw file, through filters that move
    /// no data) the header is read from the storage directly; otherwise (a qcow2 image, a
    /// remote server, a `cow` below) the filters below run in a domain of their own for the
    /// read, so the header is read exactly as the filter will see it. Sets the chain to
    /// `filters` under `tap`; returns the size of the device they make.
    pub(super) fn prepare_filters(&mut self, mut filters: Vec<FilterSetup>, tap: Tap) -> Result<u64, Error> {
        let mut size = self.backend_size;
        let (mut crypt, mut cow) = (false, false);
        while let Some(mut f) = filters.pop() {
            let i = filters.len();
            let below = &self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).filters;
            let direct = below.iter().all(|b| !b.spec.transforms());
            let no_filter_below = below.is_empty();
            match f.spec {
                FilterSpec::Crypt { .. } => {
                    if std::mem::replace(&mut crypt, true) {
                        return Err(Error::invalid(format!("filter {} (crypt): one crypt filter per device", i + 1)));
                    }
                    size = if direct && self.reads_storage_directly() {
                        let file = match self.header_fd() {
                            Some(fd) => Some(std::fs::File::from(
                                fd.map_err(|e| Error::failed(format!("filter {} (crypt): {e}", i + 1)))?,
                            )),
                            None => None,
                        };
                        let mut read = |at: u64, buf: &mut [u8]| -> std::io::Result<()> {
                            use std::os::unix::fs::FileExt;
                            match &file {
                                Some(f) => f.read_exact_at(buf, at),
                                None => {
                                    buf.fill(0);
                                    Ok(())
                                }
                            }
                        };
                        crate::chain::open_volume(&self.name, i, &mut f, size, &mut read)?
                    } else {
                        self.size = size;
                        let name = self.name.clone();
                        self.read_through(|read| crate::chain::open_volume(&name, i, &mut f, size, read))
                            .map_err(|e| e.context(format!("filter {} (crypt)", i + 1)))?
                    };
                }
                FilterSpec::Cow { .. } => {
                    if std::mem::replace(&mut cow, true) {
                        return Err(Error::invalid(format!("filter {} (cow): one cow filter per device", i + 1)));
                    }
                    let backing = match &self.backend {
                        BackendConfig::File { format, path, .. } if no_filter_below => Some((
                            path.clone(),
                            match format {
                                ImageFormat::Raw => bulkhead_image::Format::Raw,
                                ImageFormat::Qcow2 => bulkhead_image::Format::Qcow2,
                            },
                        )),
                        _ => None,
                    };
                    crate::chain::open_cow_overlay(i, &mut f, size, backing.as_ref().map(|(p, f)| (p.as_path(), *f)))?;
                }
                _ => {}
            }
            self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).filters.insert(0, Arc::new(f));
        }
        self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).tap = tap;
        self.size = size;
        Ok(size)
    }

    /// Whether the backend's bytes are in storage the supervisor holds (memory, a raw file).
    fn reads_storage_directly(&self) -> bool {
        matches!(
            self.backend,
            BackendConfig::Ram
                | BackendConfig::Null
                | BackendConfig::Vdev { .. }
                | BackendConfig::File { format: ImageFormat::Raw, .. }
        )
    }

    /// The descriptor to read the backend's storage through: a direct file's buffered one (no
    /// alignment rules for a header read); `None` for the null backend (it reads as zeroes).
    fn header_fd(&self) -> Option<std::io::Result<OwnedFd>> {
        let held = self.held();
        let fd = match &self.backend {
            BackendConfig::File { direct, .. } => held.fds.get(usize::from(*direct)),
            BackendConfig::Ram => held.fds.first(),
            // The card keeps the device's bytes as they are, in storage the supervisor made.
            BackendConfig::Vdev { .. } => self.card.as_ref().map(|c| c.media()),
            BackendConfig::Null | BackendConfig::Nbd { .. } | BackendConfig::Rbd { .. } => None,
        };
        fd.map(OwnedFd::try_clone)
    }

    /// Runs `f` with a reader of the device the current chain makes (`self.size` bytes): a
    /// domain of its own serves it, in passthrough, and is ended afterwards.
    fn read_through<T>(&self, f: impl FnOnce(&mut bulkhead_crypt::ReadAt<'_>) -> Result<T, Error>) -> Result<T, Error> {
        let Launched { fronts, domains, .. } =
            self.launch(1).map_err(|e| e.context("cannot start a domain to read the device below"))?;
        let timeout = self.io_timeout_ms.max(PROBE_TIMEOUT_MS);
        let (dev, _control) = Device::new(&self.name, self.size, fronts, Some(timeout));
        let size = self.size;
        let mut read = |at: u64, buf: &mut [u8]| -> std::io::Result<()> {
            // The device takes whole sectors.
            let start = at / 512 * 512;
            let end = (at + buf.len() as u64).div_ceil(512) * 512;
            if end > size {
                let past = format!("{} bytes at {at} run past the end of the device below ({size} bytes)", buf.len());
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, past));
            }
            let mut whole = vec![0u8; (end - start) as usize];
            dev.read_into(0, start, &mut whole).map_err(|e| std::io::Error::other(format!("reading the device below: {e}")))?;
            let from = (at - start) as usize;
            buf.copy_from_slice(&whole[from..from + buf.len()]);
            Ok(())
        };
        let out = f(&mut read);
        let (domains, _) = { domains }.take_all();
        for d in domains {
            discard(d.child);
        }
        out
    }

    /// An `rbd` device's size when the configuration gives none: its image's, in whole
    /// sectors, as a domain started for the purpose finds it once it has opened the image (it
    /// tells its broker, [`crate::rbd::Opened::image_bytes`], and is ended). Waits up to the
    /// backend's connect and op timeouts.
    pub(super) fn learn_image_size(&mut self) -> Result<u64, Error> {
        let BackendConfig::Rbd { pool, image, connect_timeout_ms, op_timeout_ms, .. } = &self.backend else {
            return Err(Error::failed("only an rbd device learns its size from its backend"));
        };
        let what = format!("image `{pool}/{image}`");
        let wait = Duration::from_millis(connect_timeout_ms + op_timeout_ms);
        let opened = self.rbd()?.1.clone();
        // Any image of at least a sector opens at this size.
        (self.size, self.backend_size) = (512, 512);
        let Launched { domains, .. } =
            self.launch(1).map_err(|e| e.context(format!("{what}: cannot start a domain to learn its size")))?;
        let (mut domains, _) = { domains }.take_all();
        let deadline = Instant::now() + wait;
        let told = loop {
            if let Some(n) = opened.image_bytes() {
                break Ok(n);
            }
            if domains.iter_mut().any(|d| matches!(d.child.try_wait(), Ok(Some(_)))) {
                // What it said before it ended may still be on its way.
                std::thread::sleep(Duration::from_millis(100));
                break opened.image_bytes().ok_or_else(|| {
                    Error::unreachable(format!(
                        "{what}: its domain ended before it opened the image, so its size is unknown (its log lines say why)"
                    ))
                });
            }
            if Instant::now() >= deadline {
                break Err(Error::unreachable(format!(
                    "{what}: its domain did not open the image within {} ms, so its size is unknown",
                    wait.as_millis()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // Asked to stop, so that it closes the image: a client killed instead leaves its watch
        // on the image for the cluster to time out, and the next domain's flush and close wait
        // for it (more than 5 s).
        for d in &domains {
            let _ = d.child.signal(libc::SIGTERM);
        }
        for mut d in domains {
            let _ = d.child.wait_timeout(PROBE_STOP);
            discard(d.child);
        }
        let bytes = told? / 512 * 512;
        if bytes == 0 {
            return Err(Error::invalid(format!("{what} holds less than one 512-byte sector")));
        }
        log::info!("{}: size {bytes} bytes, the whole of {what}", self.name);
        Ok(bytes)
    }

    /// Refuses a terminal that is not a soft device: `intercept` ends the chain in memory, a
    /// file on a mounted file system or a remote server, never in a device node (that is what
    /// a driver domain is for).
    pub(crate) fn soft_terminal(&self) -> Result<(), Error> {
        use std::os::unix::fs::FileTypeExt;
        let BackendConfig::File { path, .. } = &self.backend else { return Ok(()) };
        let dup = self.held().fds[0].try_clone().map_err(|e| Error::failed(format!("{}: {e}", path.display())))?;
        let kind =
            std::fs::File::from(dup).metadata().map_err(|e| Error::failed(format!("{}: {e}", path.display())))?.file_type();
        if kind.is_block_device() || kind.is_char_device() {
            return Err(Error::invalid(format!(
                "tap = \"intercept\" terminates in a soft device (memory, a file on a mounted file system, a remote \
                 server), and {} is a device node: use \"passthrough\" or \"interpose\"",
                path.display()
            )));
        }
        Ok(())
    }
}
