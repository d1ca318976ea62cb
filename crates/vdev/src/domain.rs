//! A card across two domains: the model in a device-model domain of its own, the driver in a
//! driver domain, and the memory and lines between them, all made by the supervisor.
//!
//! The supervisor makes the card's memory once, for the life of the device: its register page,
//! its DMA memory, its storage (all memory files), its interrupt (an eventfd) and a page of the
//! model's counters. The model's domain holds all of them. Each generation of the driver domain
//! gets the register page, the DMA memory and the interrupt, and the driver's end of the
//! *trap line*, a sequenced-packet socket to the model's domain: before it is confined, the
//! driver arms a trap over its mapping of the register page ([`crate::trap::arm`]) and sends it
//! down the line with the page's address ([`connect_driver`]). The model's domain takes each
//! trap that arrives as the driver's from then on ([`ModelDomain::run`]): a restarted driver
//! brings a new one, and resets the card before it uses it.
//!
//! The line carries nothing but traps, and the model trusts none of it: a message of the wrong
//! size, a descriptor that is no trap or a trap over another address is refused, and the model
//! goes on with the trap it had.

use crate::VdevError;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use bulkhead_doorbell::EventFd;
use bulkhead_shmem::{Mapping, Protection};
use bulkhead_sys::uffd::WriteTrap;

use crate::card::{Card, PAGE};
use crate::regs::RegisterPage;
use crate::{trap, Driver, Model, ModelStats, Server, Trapped, Wait};

/// Bytes of DMA memory a card gets: the reference driver's ring and 32 buffers of up to
/// 512 KiB each. A memory file this size costs only the pages used.
pub const DMA_BYTES: u64 = 16 << 20;

/// Bytes of a trap message: the register page's address and length in the driver, each a
/// little-endian u64.
const MESSAGE: usize = 16;

/// The driver domain's side, before it is confined: maps the card's register page and DMA
/// memory, arms a trap over the page and sends it to the model's domain on `line`, and
/// returns the reference driver over them (it resets the card when its backend starts).
pub fn connect_driver(
    card: Card,
    wait: Wait,
    regs: OwnedFd,
    dma: OwnedFd,
    irq: EventFd,
    line: OwnedFd,
) -> Result<Driver, VdevError> {
    let page = Mapping::new(regs.as_raw_fd(), PAGE as usize, Protection::ReadWrite)
        .map_err(|e| VdevError::Device(format!("register page: {e}")))?;
    let page = RegisterPage::new(page).map_err(|e| VdevError::Device(format!("register page: {e}")))?;
    let dma = Mapping::new(dma.as_raw_fd(), DMA_BYTES as usize, Protection::ReadWrite)
        .map_err(|e| VdevError::Device(format!("DMA memory ({DMA_BYTES} bytes): {e}")))?;
    send_trap(&line, &page)?;
    drop(line);
    Driver::new(card, page, dma, irq, wait)
}

/// Arms a trap over `page` (the driver's mapping of the register page) and sends it to the
/// model's domain on `line`, with the page's address: from then on the model is told of each
/// write to the page. The driver keeps no copy of the trap.
pub fn send_trap(line: &OwnedFd, page: &RegisterPage) -> Result<(), VdevError> {
    let armed = trap::arm(page).map_err(|e| VdevError::Device(format!("cannot trap the register page (userfaultfd): {e}")))?;
    let mut msg = [0u8; MESSAGE];
    msg[..8].copy_from_slice(&(page.mapping().base_ptr() as u64).to_le_bytes());
    msg[8..].copy_from_slice(&u64::from(PAGE).to_le_bytes());
    bulkhead_sys::send_with_fd(line.as_fd(), &msg, armed.fd())
        .map_err(|e| VdevError::Device(format!("cannot send the trap to the device model: {e}")))
}

/// Slots of the model's counter page, each a u64 the model's domain writes and the supervisor
/// reads.
mod slot {
    pub const COMMANDS: usize = 0;
    pub const REFUSED: usize = 1;
    pub const STOPS: usize = 2;
    pub const INTERRUPTS: usize = 3;
    pub const IGNORED_WRITES: usize = 4;
    pub const RESETS: usize = 5;
    pub const STEPS: usize = 6;
    pub const TRAPPED_WRITES: usize = 7;
    pub const DRIVERS: usize = 8;
    pub const REFUSED_TRAPS: usize = 9;
    pub const COUNT: usize = 10;
}

/// Bytes of the model's counter page.
pub const STATS_BYTES: u64 = PAGE as u64;

/// What a card's model has done since its domain started, as its counter page shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CardStats {
    /// The model's own counters.
    #[serde(flatten)]
    pub model: ModelStats,
    /// Register writes trapped and handed to the model, over every driver.
    pub trapped_writes: u64,
    /// Drivers whose trap the model took (one per driver generation).
    pub drivers: u64,
    /// Trap messages refused (malformed, or not a trap over the page they named).
    pub refused_traps: u64,
}

/// The model's counter page: written by the model's domain, read by the supervisor.
#[derive(Debug)]
pub struct StatsPage {
    map: Mapping,
}

impl StatsPage {
    /// Maps the counter page `fd`: writable in the model's domain, read-only elsewhere.
    pub fn map(fd: &OwnedFd, writable: bool) -> io::Result<Self> {
        let prot = if writable { Protection::ReadWrite } else { Protection::ReadOnly };
        let map = Mapping::new(fd.as_raw_fd(), STATS_BYTES as usize, prot).map_err(|e| io::Error::other(e.to_string()))?;
        Ok(StatsPage { map })
    }

    fn slot(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        debug_assert!(i < slot::COUNT);
        self.map.atomic_u64(i * 8).expect("counter slots lie inside the page")
    }

    /// Writes `s` (one writer: the model's domain).
    pub fn publish(&self, s: &CardStats) {
        let m = &s.model;
        for (i, v) in [
            (slot::COMMANDS, m.commands),
            (slot::REFUSED, m.refused),
            (slot::STOPS, m.stops),
            (slot::INTERRUPTS, m.interrupts),
            (slot::IGNORED_WRITES, m.ignored_writes),
            (slot::RESETS, m.resets),
            (slot::STEPS, m.steps),
            (slot::TRAPPED_WRITES, s.trapped_writes),
            (slot::DRIVERS, s.drivers),
            (slot::REFUSED_TRAPS, s.refused_traps),
        ] {
            self.slot(i).store(v, Ordering::Relaxed);
        }
    }

    /// Reads the counters.
    pub fn read(&self) -> CardStats {
        let g = |i| self.slot(i).load(Ordering::Relaxed);
        CardStats {
            model: ModelStats {
                commands: g(slot::COMMANDS),
                refused: g(slot::REFUSED),
                stops: g(slot::STOPS),
                interrupts: g(slot::INTERRUPTS),
                ignored_writes: g(slot::IGNORED_WRITES),
                resets: g(slot::RESETS),
                steps: g(slot::STEPS),
            },
            trapped_writes: g(slot::TRAPPED_WRITES),
            drivers: g(slot::DRIVERS),
            refused_traps: g(slot::REFUSED_TRAPS),
        }
    }
}

/// How long the model's domain sleeps at most between looks at a stop request.
const IDLE_WAIT_MS: i32 = 100;

/// The device-model domain: a card's model, the trap line from the driver domains, and the
/// counter page.
#[derive(Debug)]
pub struct ModelDomain {
    server: Server,
    line: OwnedFd,
    stats: StatsPage,
    /// Trapped writes of drivers before the current one.
    earlier_faults: u64,
    drivers: u64,
    refused_traps: u64,
}

impl ModelDomain {
    /// A model domain for `card` over its register page, DMA memory and storage (`media`, a
    /// backend the domain opened), raising `irq`, taking traps from `line` and counting on
    /// `stats`. Maps everything here: call it before the domain is confined.
    pub fn new(
        card: Card,
        regs: &OwnedFd,
        dma: &OwnedFd,
        media: Box<dyn bulkhead_block::Backend>,
        irq: EventFd,
        line: OwnedFd,
        stats: StatsPage,
    ) -> Result<Self, VdevError> {
        let page = Mapping::new(regs.as_raw_fd(), PAGE as usize, Protection::ReadWrite)
            .map_err(|e| VdevError::Device(format!("register page: {e}")))?;
        let page = RegisterPage::new(page).map_err(|e| VdevError::Device(format!("register page: {e}")))?;
        let dma = Mapping::new(dma.as_raw_fd(), DMA_BYTES as usize, Protection::ReadWrite)
            .map_err(|e| VdevError::Device(format!("DMA memory ({DMA_BYTES} bytes): {e}")))?;
        let server = Server::new(Model::new(card, page, dma, media, irq));
        let d = ModelDomain { server, line, stats, earlier_faults: 0, drivers: 0, refused_traps: 0 };
        d.publish();
        Ok(d)
    }

    /// What the model has done.
    pub fn stats(&self) -> CardStats {
        CardStats {
            model: self.server.model().stats(),
            trapped_writes: self.earlier_faults + self.server.faults(),
            drivers: self.drivers,
            refused_traps: self.refused_traps,
        }
    }

    fn publish(&self) {
        self.stats.publish(&self.stats());
    }

    /// Serves until `stop` is set or the line closes (the supervisor is gone): takes each trap
    /// that arrives, serves the current driver's trapped writes, and keeps the counter page.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), VdevError> {
        while !stop.load(Ordering::Relaxed) {
            let mut fds = [
                libc::pollfd { fd: self.line.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.server.fd().map_or(-1, |f| f.as_raw_fd()), events: libc::POLLIN, revents: 0 },
            ];
            bulkhead_sys::poll(&mut fds, IDLE_WAIT_MS).map_err(|e| VdevError::Device(format!("poll: {e}")))?;
            if fds[0].revents != 0 && !self.take_traps()? {
                return Ok(());
            }
            if fds[1].revents != 0 {
                let served = self.server.faults();
                if let Err(e) = self.server.serve() {
                    // The driver is gone (its domain exited) or its trap was never one: the
                    // model waits for the next driver.
                    self.earlier_faults += served;
                    eprintln!("bulkhead vdev model: dropped the driver's trap: {e}");
                }
            }
            self.publish();
        }
        Ok(())
    }

    /// Takes every trap message waiting on the line; `false` once the line has closed.
    fn take_traps(&mut self) -> Result<bool, VdevError> {
        let mut buf = [0u8; MESSAGE];
        loop {
            let (n, fd) = match bulkhead_sys::recv_with_fd(self.line.as_fd(), &mut buf) {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    self.refuse(&format!("{e}"));
                    continue;
                }
                Err(e) => return Err(VdevError::Device(format!("trap line: {e}"))),
            };
            if n == 0 && fd.is_none() {
                return Ok(false);
            }
            let Some(fd) = fd.filter(|_| n == MESSAGE) else {
                self.refuse(&format!("a message of {n} bytes{}", if n == MESSAGE { " with no descriptor" } else { "" }));
                continue;
            };
            let start = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
            let len = u64::from_le_bytes(buf[8..].try_into().expect("8 bytes"));
            if len != u64::from(PAGE) || start % u64::from(PAGE) != 0 {
                self.refuse(&format!("a trap over {len} bytes at {start:#x}, not one page"));
                continue;
            }
            // Only a trap with the page registered can protect it: anything else is refused
            // here, before the model relies on it.
            let t = WriteTrap::from_fd(fd);
            if let Err(e) = t.protect(start, len) {
                self.refuse(&format!("not a trap over the page at {start:#x}: {e}"));
                continue;
            }
            self.earlier_faults += self.server.faults();
            self.server.attach(Trapped::new(t, start));
            self.drivers += 1;
        }
    }

    fn refuse(&mut self, what: &str) {
        self.refused_traps += 1;
        if self.refused_traps.is_power_of_two() {
            eprintln!("bulkhead vdev model: refused {what} on the trap line ({} so far)", self.refused_traps);
        }
    }
}
