//! Wire formats of ring slots. Little-endian, fixed size, `repr(C)` with explicit padding.

use bulkhead_block::{Op, Status};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Bytes in a request slot.
pub const REQ_SLOT_SIZE: usize = 128;
/// Bytes of a request slot's first cache line: the fixed fields and the first
/// [`HEAD_SEGMENTS`] segments. A request with no more segments than that is written and read as
/// this line alone, so a round trip moves one line of request instead of two.
pub const REQ_SLOT_HEAD: usize = 64;
/// Segments that fit in [`REQ_SLOT_HEAD`].
pub const HEAD_SEGMENTS: usize = (REQ_SLOT_HEAD - 32) / 16;
/// Bytes in a response slot.
pub const RSP_SLOT_SIZE: usize = 32;
/// Segments a request slot can name.
pub const MAX_SEGMENTS: usize = bulkhead_shmem::MAX_SLICES;
/// Largest data transfer of one request (read or write).
pub const MAX_REQUEST_BYTES: u64 = 32 << 20;
/// Arena holding data flowing to the driver (mapped read-only by it).
pub const ARENA_WRITE: u32 = 0;
/// Arena holding buffers the driver fills.
pub const ARENA_READ: u32 = 1;
/// Request flag: force unit access (the write is durable when acknowledged).
pub const FLAG_FUA: u8 = 1;

/// One grant segment: `len` bytes at `offset` of arena `arena`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Segment {
    /// Arena id ([`ARENA_WRITE`] or [`ARENA_READ`]).
    pub arena: u32,
    /// Length in bytes.
    pub len: u32,
    /// Byte offset in the arena.
    pub offset: u64,
}

/// A request slot as it sits in the ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct RequestSlot {
    /// Request id, echoed in the response.
    pub id: u64,
    /// Channel generation the request was issued in.
    pub generation: u32,
    /// Operation code ([`op_code`]).
    pub op: u8,
    /// Flags ([`FLAG_FUA`]).
    pub flags: u8,
    /// Number of valid entries in `segs`.
    pub nsegs: u16,
    /// Byte offset on the device.
    pub offset: u64,
    /// Bytes: the sum of the segments for reads and writes, the range for discard/write-zeroes.
    pub len: u64,
    /// Grant segments.
    pub segs: [Segment; MAX_SEGMENTS],
}

/// A response slot as it sits in the ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ResponseSlot {
    /// Id of the request answered.
    pub id: u64,
    /// Generation copied from the request.
    pub generation: u32,
    /// Status code ([`status_code`]).
    pub status: u32,
    /// Bytes transferred.
    pub len: u64,
    /// Reserved, zero.
    pub reserved: u64,
}

/// The operation code a request slot carries for `op`: the ring's one encoding of [`Op`].
pub const fn op_code(op: Op) -> u8 {
    match op {
        Op::Read => 1,
        Op::Write => 2,
        Op::Flush => 3,
        Op::Discard => 4,
        Op::WriteZeroes => 5,
    }
}

/// Decodes a request slot's operation code; `None` for a code no operation has.
pub const fn op_of_code(code: u8) -> Option<Op> {
    Some(match code {
        1 => Op::Read,
        2 => Op::Write,
        3 => Op::Flush,
        4 => Op::Discard,
        5 => Op::WriteZeroes,
        _ => return None,
    })
}

/// The status code a response slot carries for `status`: the ring's one encoding of
/// [`Status`].
pub const fn status_code(status: Status) -> u32 {
    match status {
        Status::Ok => 0,
        Status::IoError => 1,
        Status::Invalid => 2,
        Status::NotSupported => 3,
        Status::NoSpace => 4,
        Status::ReadOnly => 5,
    }
}

/// Decodes a response slot's status code; `None` for a code no status has.
pub const fn status_of_code(code: u32) -> Option<Status> {
    Some(match code {
        0 => Status::Ok,
        1 => Status::IoError,
        2 => Status::Invalid,
        3 => Status::NotSupported,
        4 => Status::NoSpace,
        5 => Status::ReadOnly,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_sizes_are_fixed() {
        assert_eq!(std::mem::size_of::<RequestSlot>(), REQ_SLOT_SIZE);
        assert_eq!(std::mem::size_of::<ResponseSlot>(), RSP_SLOT_SIZE);
        assert_eq!(std::mem::offset_of!(RequestSlot, segs), REQ_SLOT_HEAD - HEAD_SEGMENTS * 16);
        assert_eq!(std::mem::size_of::<Segment>(), 16);
    }

    #[test]
    fn codes_round_trip_and_unknown_codes_are_rejected() {
        for op in Op::ALL {
            assert_eq!(op_of_code(op_code(op)), Some(op));
        }
        for status in Status::ALL {
            assert_eq!(status_of_code(status_code(status)), Some(status));
        }
        assert_eq!(op_of_code(0), None);
        assert_eq!(op_of_code(6), None);
        assert_eq!(status_code(Status::ReadOnly), 5);
        assert_eq!(status_of_code(6), None);
    }
}
