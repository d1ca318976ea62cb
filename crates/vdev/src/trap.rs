//! The trapped register page, as the virtual PCI bus of Jones' "Virtual Device Driver Development &
//! Virtual Device-Based Performance Modeling" did it with a page fault handler: the driver's
//! mapping of the register page is write-protected, and each write to it stops the writing thread
//! and tells the model's side, which opens the page so the write lands, protects it again, and lets
//! the model look at what changed.
//!
//! Here the trap is a userfaultfd the driver arms over its own mapping and sends to the model;
//! the kernel stops the driver's thread, not the driver's own code. Between opening and
//! protecting again the driver may write more registers without a fault; the model's look
//! after protecting sees those too. A write that lands after the page is protected faults
//! again. So no write is missed, which is why every register a driver writes is a level (a
//! value, a counter) and none is a strobe.

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bulkhead_sys::uffd::WriteTrap;

use crate::card::PAGE;
use crate::regs::RegisterPage;

/// The driver's side: write-protects `page` (the driver's own mapping) and returns the trap
/// to send to the model. Until the model serves it, the driver's first register write waits.
pub fn arm(page: &RegisterPage) -> io::Result<WriteTrap> {
    let m = page.mapping();
    let (start, len) = (m.base_ptr() as u64, u64::from(PAGE));
    // A page never touched has nothing to protect: touch it with a write that changes nothing.
    m.atomic_u32(0).map_err(|e| io::Error::other(e.to_string()))?.fetch_add(0, Ordering::AcqRel);
    let trap = WriteTrap::new()?;
    trap.register(start, len)?;
    trap.protect(start, len)?;
    Ok(trap)
}

/// The shortest and longest wait for a trapped write to land once its page is open.
const LAND_MIN: Duration = Duration::from_micros(50);
const LAND_MAX: Duration = Duration::from_millis(2);

/// The model's side of one driver's trap.
#[derive(Debug)]
pub struct Trapped {
    trap: WriteTrap,
    /// The register page's address in the driver.
    start: u64,
    /// How long to wait for a write to land before protecting again: doubles while writes
    /// are not seen to land (a write of the value already there, or a driver thread slow to
    /// run), back to the least once one is.
    land: Duration,
    faults: u64,
}

impl Trapped {
    /// A driver's trap over its register page at `start` (in the driver's address space).
    pub fn new(trap: WriteTrap, start: u64) -> Self {
        Trapped { trap, start, land: LAND_MIN, faults: 0 }
    }

    /// Readable when a trapped write waits.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.trap.fd()
    }

    /// Trapped writes served so far.
    pub fn faults(&self) -> u64 {
        self.faults
    }

    /// Serves every trapped write waiting: opens the page, waits until the write has landed
    /// (the page no longer matches `before`, the model's copy after its last look) or a short
    /// while, and protects the page again. Returns how many were served; when any were, the
    /// model looks at the registers next. A fault outside the register page (the driver
    /// armed other memory of its own) is not served: that thread waits for good.
    pub fn serve(&mut self, regs: &RegisterPage, before: &[u8; PAGE as usize]) -> io::Result<u32> {
        let len = u64::from(PAGE);
        let mut served = 0;
        let mut now = [0u8; PAGE as usize];
        while let Some(fault) = self.trap.next_fault()? {
            if fault.address & !(len - 1) != self.start {
                continue;
            }
            self.trap.open(self.start, len)?;
            let t0 = Instant::now();
            let landed = loop {
                regs.snapshot(&mut now);
                if now != *before {
                    break true;
                }
                if t0.elapsed() >= self.land {
                    break false;
                }
                // The writer may be waiting for this CPU.
                std::thread::yield_now();
            };
            self.land = if landed { LAND_MIN } else { (self.land * 2).min(LAND_MAX) };
            self.trap.protect(self.start, len)?;
            served += 1;
            self.faults += 1;
        }
        Ok(served)
    }
}
