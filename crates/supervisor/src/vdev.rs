//! A `vdev` device's card: the memory and lines the supervisor makes for it once, and the
//! device-model domain that models it.
//!
//! The card outlives its drivers, as hardware does: its register page, DMA memory, storage,
//! interrupt and counter page are made when the device starts, and the model's domain
//! (`bulkhead vdev model`) holds them for the life of the device. Each generation of the driver
//! domain gets the register page, the DMA memory, the interrupt and a copy of the driver's end
//! of the trap line, down which it sends its trap (see [`bulkhead_vdev::domain`]); a driver
//! restarted by the watchdog resets the card and goes on with the same storage and the same
//! model. If the model's domain dies, the watcher restarts the device: the next launch starts a
//! new model over the same storage, on a new line, before the new driver.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use bulkhead_config::{VdevCard, VdevWait};
use bulkhead_doorbell::EventFd;
use bulkhead_sandbox::spawn::DomainChild;
use bulkhead_sandbox::{Layers, Policy};
use bulkhead_shmem::memfd;
use bulkhead_spec::{ModelSpec, SandboxSpec};
use bulkhead_vdev::card::PAGE;
use bulkhead_vdev::domain::{StatsPage, DMA_BYTES, STATS_BYTES};
use bulkhead_vdev::Card;

use crate::error::Error;
use crate::spawn::{discard, exec_confined, EXIT_WAIT};

/// A running device-model domain.
#[derive(Debug)]
struct ModelProc {
    child: DomainChild,
    /// The driver's end of the trap line (each driver generation gets a copy).
    driver_end: OwnedFd,
    layers: Option<Layers>,
}

pub use bulkhead_control::CardStatus;

/// A `vdev` device's card and its model's domain.
#[derive(Debug)]
pub(crate) struct CardDevice {
    device: String,
    card: Card,
    card_json: String,
    size: u64,
    regs: OwnedFd,
    dma: OwnedFd,
    media: OwnedFd,
    irq: OwnedFd,
    stats_fd: OwnedFd,
    stats: StatsPage,
    exe: PathBuf,
    policy: Policy,
    model: Mutex<(Option<ModelProc>, u64)>,
}

impl CardDevice {
    /// Makes the card's memory for a device of `size` bytes and starts its model's domain, exec'd
    /// from `exe`.
    pub fn start(device: &str, card: &VdevCard, size: u64, policy: Policy, exe: &Path) -> Result<Self, Error> {
        let card = match card {
            VdevCard::Seed(seed) => Card::generate(*seed),
            VdevCard::File(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| Error::failed(format!("cannot read card {}: {e}", path.display())))?;
                Card::from_json(&text).map_err(|e| Error::invalid(format!("card {}: {e}", path.display())))?
            }
        };
        let mem = |what: &str, len: u64| -> Result<OwnedFd, Error> {
            let failed = |e| Error::failed(format!("card {what}: {e}"));
            let fd = memfd::create(&format!("bulkhead-{device}-vdev-{what}"), len).map_err(failed)?;
            memfd::seal_size(fd.as_raw_fd()).map_err(failed)?;
            Ok(fd)
        };
        let regs = mem("regs", u64::from(PAGE))?;
        let dma = mem("dma", DMA_BYTES)?;
        let media = mem("media", size)?;
        let stats_fd = mem("stats", STATS_BYTES)?;
        let irq = EventFd::new().map_err(|e| Error::failed(format!("card interrupt: {e}")))?.into_owned();
        let stats = StatsPage::map(&stats_fd, false).map_err(|e| Error::failed(format!("card counters: {e}")))?;
        let c = CardDevice {
            device: device.to_string(),
            card_json: card.to_json(),
            card,
            size,
            regs,
            dma,
            media,
            irq,
            stats_fd,
            stats,
            exe: exe.to_path_buf(),
            policy,
            model: Mutex::new((None, 0)),
        };
        c.spawn_model()?;
        Ok(c)
    }

    /// The card's name.
    pub fn name(&self) -> &str {
        &self.card.name
    }

    /// The card's spec, as its driver reads it.
    pub fn card_json(&self) -> &str {
        &self.card_json
    }

    /// The card's storage, as the model keeps it (its bytes are the device's).
    pub fn media(&self) -> &OwnedFd {
        &self.media
    }

    /// What a driver generation gets: the register page, the DMA memory, the interrupt and
    /// its end of the trap line. Starts the model's domain first if none runs.
    pub fn driver_fds(&self) -> Result<([&OwnedFd; 3], OwnedFd), Error> {
        // One that has exited and is not reaped yet is replaced too.
        let running = {
            let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
            if m.0.as_mut().is_some_and(|p| !matches!(p.child.try_wait(), Ok(None))) {
                m.0 = None;
            }
            m.0.is_some()
        };
        if !running {
            self.spawn_model()?;
        }
        let m = self.model.lock().unwrap_or_else(|e| e.into_inner());
        let model = m.0.as_ref().ok_or_else(|| Error::failed("the device model is not running"))?;
        let line = model.driver_end.try_clone().map_err(|e| Error::failed(e.to_string()))?;
        Ok(([&self.regs, &self.dma, &self.irq], line))
    }

    /// A copy of the model domain's pidfd, to watch (readable once it exits).
    pub fn model_pidfd(&self) -> Option<OwnedFd> {
        self.model.lock().unwrap_or_else(|e| e.into_inner()).0.as_ref().and_then(|m| m.child.pidfd().try_clone().ok())
    }

    /// If the model's domain has exited: reaps it and says how.
    pub fn model_exited(&self) -> Option<String> {
        let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
        let status = m.0.as_mut()?.child.try_wait().ok()??;
        let pid = m.0.take().map_or(0, |p| p.child.id());
        Some(format!("device model (pid {pid}) exited: {status}"))
    }

    /// Ends the model's domain (SIGTERM, then SIGKILL after `grace`).
    pub fn stop_model(&self, grace: std::time::Duration) {
        let Some(mut m) = self.model.lock().unwrap_or_else(|e| e.into_inner()).0.take() else { return };
        let _ = m.child.signal(libc::SIGTERM);
        if !matches!(m.child.wait_timeout(grace), Ok(Some(_))) {
            log::warn!("device {}: device model did not stop; killing it", self.device);
            discard(m.child);
        }
    }

    /// What `bulkhead status` shows.
    pub fn status(&self) -> CardStatus {
        let m = self.model.lock().unwrap_or_else(|e| e.into_inner());
        CardStatus {
            card: self.card.name.clone(),
            model_pid: m.0.as_ref().map_or(0, |p| p.child.id()),
            model_sandbox: m.0.as_ref().and_then(|p| p.layers.clone()),
            model_starts: m.1,
            stats: self.stats.read(),
        }
    }

    /// Execs a device-model domain over the card's memory, on a new trap line, and waits for
    /// its sandbox report. The model domain dies with the thread that calls this (see
    /// [`crate::spawn::exec_confined`]): one of the supervisor's workers.
    fn spawn_model(&self) -> Result<(), Error> {
        let (model_end, driver_end) = bulkhead_sys::seqpacket_pair().map_err(|e| Error::failed(format!("trap line: {e}")))?;
        let (report_r, report_w) = bulkhead_sys::pipe().map_err(|e| Error::failed(format!("report pipe: {e}")))?;
        let fds = [&self.regs, &self.dma, &self.media, &self.irq, &model_end, &self.stats_fd, &report_w].map(|f| f.as_raw_fd());
        let at = |i: usize| 3 + i as i32;
        let spec = ModelSpec {
            device: self.device.clone(),
            card: self.card_json.clone(),
            media_size: self.size,
            fds: [at(0), at(1), at(2), at(3), at(4), at(5)],
            sandbox: SandboxSpec { policy: self.policy },
            report_fd: Some(at(6)),
        };
        let json = serde_json::to_string(&spec).expect("spec serialises");
        let args: [&std::ffi::OsStr; 3] = ["vdev".as_ref(), "model".as_ref(), self.device.as_ref()];
        let (mut child, layers) = exec_confined(
            &self.exe,
            &args,
            &json,
            &fds,
            (model_end, report_w),
            &self.device,
            self.policy,
            &report_r,
            "device model",
            // A model lives as long as its device: no spare (see `crate::spares`).
            crate::spawn::From::Exec,
        )?;
        if layers.is_none() {
            // Silent: it failed before confinement (it said why on its output) or hangs.
            if let Ok(Some(status)) = child.wait_timeout(EXIT_WAIT) {
                return Err(Error::failed(format!("the device model exited before it was confined: {status}")));
            }
        }
        let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
        m.0 = Some(ModelProc { child, driver_end, layers });
        m.1 += 1;
        Ok(())
    }
}

impl Drop for CardDevice {
    fn drop(&mut self) {
        self.stop_model(std::time::Duration::from_secs(1));
    }
}

/// A `vdev` backend as `bulkhead status` describes it.
pub(crate) fn describe(card: &VdevCard, name: &str, wait: VdevWait) -> String {
    match card {
        VdevCard::Seed(seed) => format!("vdev:{name} (seed {seed}),{}", wait.as_str()),
        VdevCard::File(p) => format!("vdev:{name} ({}),{}", p.display(), wait.as_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_card_is_described_by_its_name_where_it_came_from_and_how_its_driver_waits() {
        assert_eq!(describe(&VdevCard::Seed(7), "LN-131", VdevWait::Poll), "vdev:LN-131 (seed 7),poll");
        let file = VdevCard::File(PathBuf::from("/cards/x/card.json"));
        assert_eq!(describe(&file, "X", VdevWait::Interrupt), "vdev:X (/cards/x/card.json),interrupt");
    }
}
