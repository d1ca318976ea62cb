//! Virtual devices (the virtual PCI half of Jones, "Virtual Device Driver Development &
//! Virtual Device-Based Performance Modeling"): a storage controller that exists only as a
//! model in another process, and a driver for it written exactly as for hardware.
//!
//! - [`card`]: a card's spec (register map, bits, codes, descriptor layout, interrupt
//!   behaviour), different for every seed, and checked when read.
//! - [`datasheet`]: the card's datasheet in Markdown and HTML, from which a person can write
//!   a driver.
//! - [`model`]: what the card does when its registers change, over DMA memory granted to it
//!   and the storage behind it; it checks everything the driver writes.
//! - [`trap`]: the driver's register page, write-protected so each register write is caught
//!   and handed to the model (a userfaultfd the driver arms and the model serves).
//! - [`driver`]: the reference driver, a bulkhead backend at register level.
//! - [`Server`]: the model's loop around a trap: serve the trapped writes, then let the model
//!   look.
//! - [`domain`]: the card across two domains: the driver's side sends its trap to the
//!   device-model domain over a line the supervisor made, and the model's domain serves it.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod card;
pub mod datasheet;
pub mod domain;
pub mod driver;
pub mod model;
pub mod regs;
pub mod trap;

use std::io;
use std::os::fd::BorrowedFd;

pub use card::Card;

/// What went wrong with a virtual device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VdevError {
    /// A card's spec that is not valid: the field and why.
    #[error("{0}")]
    Card(String),
    /// The card, its model or the trap line between them did not do what was asked: a
    /// timeout, a bad status, a message out of turn.
    #[error("{0}")]
    Device(String),
}
pub use driver::{Driver, Wait};
pub use model::{Model, ModelStats};
pub use trap::Trapped;

/// The model's side of a card: the model and the trap of the driver it serves now.
#[derive(Debug)]
pub struct Server {
    model: Model,
    trapped: Option<Trapped>,
    before: Box<[u8; card::PAGE as usize]>,
}

impl Server {
    /// Serves `model`; no driver yet.
    pub fn new(model: Model) -> Self {
        let mut before = Box::new([0u8; card::PAGE as usize]);
        model.registers().snapshot(&mut before);
        Server { model, trapped: None, before }
    }

    /// A driver's trap: from now on its register writes reach the model (a driver that
    /// replaces another, after a restart, brings its own). The model looks at the registers
    /// first: whatever the last driver left there unseen is dealt with (read-only registers
    /// put back) before the new one is served.
    pub fn attach(&mut self, trapped: Trapped) {
        self.look();
        self.trapped = Some(trapped);
    }

    /// Lets the model act on the registers as they are now.
    fn look(&mut self) {
        self.model.step();
        self.model.registers().snapshot(&mut self.before);
    }

    /// Readable when the driver's register write waits; `None` with no driver.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.trapped.as_ref().map(Trapped::fd)
    }

    /// Serves the trapped writes waiting, then lets the model act on the registers. A trap
    /// that fails (its driver is gone, or it never was one) is dropped, and the error
    /// returned; the model goes on serving the next driver.
    pub fn serve(&mut self) -> io::Result<u32> {
        let Some(t) = self.trapped.as_mut() else { return Ok(0) };
        let served = match t.serve(self.model.registers(), &self.before) {
            Ok(n) => n,
            Err(e) => {
                // The driver went (exited, or unmapped its page) with its last writes perhaps
                // landed and not looked at: the model looks now.
                self.trapped = None;
                self.look();
                return Err(e);
            }
        };
        if served > 0 {
            self.look();
        }
        Ok(served)
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Trapped writes served for the current driver.
    pub fn faults(&self) -> u64 {
        self.trapped.as_ref().map_or(0, Trapped::faults)
    }
}
