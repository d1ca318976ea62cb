//! Register and descriptor access over shared memory, as a card's spec lays them out.

use crate::VdevError;
use std::sync::atomic::Ordering;

use bulkhead_shmem::Mapping;

use crate::card::{Reg, PAGE};

/// The register page, one side's mapping of it.
#[derive(Debug)]
pub struct RegisterPage {
    map: Mapping,
}

impl RegisterPage {
    /// Over `map`, which must be at least a page.
    pub fn new(map: Mapping) -> Result<Self, VdevError> {
        if map.len() < PAGE as usize {
            return Err(VdevError::Device(format!("register page mapping of {} bytes (a page is {PAGE})", map.len())));
        }
        Ok(RegisterPage { map })
    }

    /// The mapping.
    pub fn mapping(&self) -> &Mapping {
        &self.map
    }

    /// Reads a register (an aligned load, as from device memory).
    pub fn read(&self, r: Reg) -> u64 {
        // A validated card's registers are aligned and inside the page, so these never fail;
        // a register that somehow is not reads as 0.
        match r.width {
            8 => self.map.atomic_u64(r.offset as usize).map(|a| a.load(Ordering::Acquire)).unwrap_or(0),
            _ => self.map.atomic_u32(r.offset as usize).map(|a| u64::from(a.load(Ordering::Acquire))).unwrap_or(0),
        }
    }

    /// Writes a register (an aligned store; on the driver's trapped mapping this is what the
    /// card's model is told of). Bits beyond the register's width are dropped.
    pub fn write(&self, r: Reg, v: u64) {
        match r.width {
            8 => {
                if let Ok(a) = self.map.atomic_u64(r.offset as usize) {
                    a.store(v, Ordering::Release);
                }
            }
            _ => {
                if let Ok(a) = self.map.atomic_u32(r.offset as usize) {
                    a.store(v as u32, Ordering::Release);
                }
            }
        }
    }

    /// A copy of the whole page.
    pub fn snapshot(&self, out: &mut [u8; PAGE as usize]) {
        // The page is at least PAGE bytes (checked in `new`).
        let _ = self.map.read_into(0, out);
    }
}

/// The mask of a register's width.
pub fn mask(r: Reg) -> u64 {
    crate::card::width_max(r.width)
}
