//! Header layout and ring geometry.

use crate::wire::{REQ_SLOT_SIZE, RSP_SLOT_SIZE};
use crate::RingError;

/// "BKHD".
pub const MAGIC: u32 = 0x4448_4b42;
/// Protocol version.
pub const VERSION: u32 = 1;
/// Bytes reserved for the header at the start of the queue file.
pub const HEADER_SIZE: usize = 4096;

/// Byte offsets of header fields. Fields written by different sides sit on different cache
/// lines; fields polled by one side sit alone on theirs.
#[derive(Debug, Clone, Copy)]
pub struct HeaderOffsets;

impl HeaderOffsets {
    /// Constant: magic.
    pub const MAGIC: usize = 0;
    /// Constant: version.
    pub const VERSION: usize = 4;
    /// Constant: number of slots in each ring (a power of two).
    pub const NSLOTS: usize = 8;
    /// Constant: request slot size.
    pub const REQ_SLOT: usize = 12;
    /// Constant: response slot size.
    pub const RSP_SLOT: usize = 16;
    /// Generation of this channel incarnation (frontend writes it before the driver starts).
    pub const GENERATION: usize = 20;
    /// Frontend-written, driver-polled: request producer index.
    pub const REQ_PROD: usize = 64;
    /// Driver-written when it goes to sleep: "notify me when req_prod passes this".
    pub const REQ_EVENT: usize = 128;
    /// Driver-written: the driver's [`PeerState`](crate::PeerState).
    pub const BACK_STATE: usize = 132;
    /// Driver-written, frontend-polled: response producer index.
    pub const RSP_PROD: usize = 192;
    /// Frontend-written when it goes to sleep: "notify me when rsp_prod passes this".
    pub const RSP_EVENT: usize = 256;
    /// Frontend-written: the frontend's [`PeerState`](crate::PeerState).
    pub const FRONT_STATE: usize = 260;
    /// Driver-written every batch: request consumer index (informational).
    pub const REQ_CONS: usize = 320;
    /// Driver-written every batch: requests completed (u64), watched by the supervisor.
    pub const PROGRESS: usize = 328;
    /// Frontend-written every batch: response consumer index (informational).
    pub const RSP_CONS: usize = 384;
}

/// Geometry of one queue file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    /// Slots in each ring.
    pub nslots: u32,
}

impl RingLayout {
    /// A layout with `nslots` slots per ring; must be a power of two between 2 and 32768.
    pub fn new(nslots: u32) -> Result<Self, RingError> {
        if !nslots.is_power_of_two() || !(2..=32768).contains(&nslots) {
            return Err(RingError::BadHeader("slot count must be a power of two in 2..=32768"));
        }
        Ok(RingLayout { nslots })
    }

    /// Offset of the request ring.
    pub fn req_ring(&self) -> usize {
        HEADER_SIZE
    }

    /// Offset of the response ring.
    pub fn rsp_ring(&self) -> usize {
        HEADER_SIZE + self.nslots as usize * REQ_SLOT_SIZE
    }

    /// Total bytes of the queue file, rounded to pages.
    pub fn file_size(&self) -> usize {
        let end = self.rsp_ring() + self.nslots as usize * RSP_SLOT_SIZE;
        end.div_ceil(4096) * 4096
    }

    /// Offset of request slot for free-running index `idx`.
    pub fn req_slot(&self, idx: u32) -> usize {
        self.req_ring() + (idx & (self.nslots - 1)) as usize * REQ_SLOT_SIZE
    }

    /// Offset of response slot for free-running index `idx`.
    pub fn rsp_slot(&self, idx: u32) -> usize {
        self.rsp_ring() + (idx & (self.nslots - 1)) as usize * RSP_SLOT_SIZE
    }
}
