//! Wire formats of ring slots. Little-endian, fixed size, `repr(C)` with explicit padding.

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
    /// Operation code ([`Op`]).
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
    /// [`Status`] code.
    pub status: u32,
    /// Bytes transferred.
    pub len: u64,
    /// Reserved, zero.
    pub reserved: u64,
}

/// Operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Read into the read arena.
    Read = 1,
    /// Write from the write arena.
    Write = 2,
    /// Make every acknowledged write durable.
    Flush = 3,
    /// Deallocate a range (contents become unspecified).
    Discard = 4,
    /// Write zeroes to a range.
    WriteZeroes = 5,
}

impl Op {
    /// Decodes an operation code.
    pub fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Read,
            2 => Op::Write,
            3 => Op::Flush,
            4 => Op::Discard,
            5 => Op::WriteZeroes,
            _ => return None,
        })
    }
}

/// Completion status on the wire: a small stable set, mapped to errnos by each export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// The backend failed (EIO).
    IoError = 1,
    /// The request was malformed or out of range (EINVAL).
    Invalid = 2,
    /// The operation is not supported by the device (EOPNOTSUPP).
    NotSupported = 3,
    /// No space left (ENOSPC).
    NoSpace = 4,
    /// The device is read-only (EROFS).
    ReadOnly = 5,
}

impl Status {
    /// Decodes a status code.
    pub fn from_u32(v: u32) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::IoError,
            2 => Status::Invalid,
            3 => Status::NotSupported,
            4 => Status::NoSpace,
            5 => Status::ReadOnly,
            _ => return None,
        })
    }

    /// The errno an export reports for this status.
    pub fn errno(self) -> i32 {
        match self {
            Status::Ok => 0,
            Status::IoError => 5,       // EIO
            Status::Invalid => 22,      // EINVAL
            Status::NotSupported => 95, // EOPNOTSUPP
            Status::NoSpace => 28,      // ENOSPC
            Status::ReadOnly => 30,     // EROFS
        }
    }
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
        for op in [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::WriteZeroes] {
            assert_eq!(Op::from_u8(op as u8), Some(op));
        }
        assert_eq!(Op::from_u8(0), None);
        assert_eq!(Op::from_u8(6), None);
        assert_eq!(Status::from_u32(5), Some(Status::ReadOnly));
        assert_eq!(Status::from_u32(6), None);
    }
}
