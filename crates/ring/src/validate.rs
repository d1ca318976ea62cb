//! Validation of a request slot copied out of the ring by the driver domain.

use bulkhead_block::{Command, Op};

use crate::wire::{op_of_code, RequestSlot, Segment, ARENA_READ, ARENA_WRITE, FLAG_FUA, MAX_REQUEST_BYTES, MAX_SEGMENTS};

/// Sizes of the two grant arenas of a queue.
#[derive(Debug, Clone, Copy)]
pub struct ArenaSizes {
    /// Bytes in the write arena (driver read-only).
    pub write: u64,
    /// Bytes in the read arena (driver read-write).
    pub read: u64,
}

/// A request that passed every check: known op and flags, segments inside the right arena and
/// summing to the length, range inside the device. Only [`validate_request`] makes one, so
/// holding one proves the checks were made; its fields are read through accessors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidRequest {
    id: u64,
    generation: u32,
    op: Op,
    fua: bool,
    offset: u64,
    len: u64,
    segs: [Segment; MAX_SEGMENTS],
    nsegs: usize,
}

impl ValidRequest {
    /// Request id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Generation, echoed in the response.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Operation.
    pub fn op(&self) -> Op {
        self.op
    }

    /// Force unit access.
    pub fn fua(&self) -> bool {
        self.fua
    }

    /// Device byte offset.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it moves no bytes (a flush).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The valid segments.
    pub fn segments(&self) -> &[Segment] {
        &self.segs[..self.nsegs]
    }

    /// The request it stands for: the ring's one decoding of a slot into a [`Command`], its
    /// data in what `bufs` makes of [`segments`](Self::segments) (asked only for a read or a
    /// write).
    pub fn command<B>(&self, bufs: impl FnOnce() -> B) -> Command<B, B> {
        match self.op {
            Op::Read => Command::Read { offset: self.offset, into: bufs() },
            Op::Write => Command::Write { offset: self.offset, from: bufs(), fua: self.fua },
            Op::Flush => Command::Flush,
            Op::Discard => Command::Discard { offset: self.offset, len: self.len },
            Op::WriteZeroes => Command::WriteZeroes { offset: self.offset, len: self.len },
        }
    }
}

/// Why a request was refused. The driver answers it with `Status::Invalid`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Unknown operation code.
    #[error("unknown op {0}")]
    UnknownOp(u8),
    /// Unknown flag bits, or FUA on something other than a write.
    #[error("bad flags {0:#x}")]
    BadFlags(u8),
    /// Generation is not the channel's.
    #[error("stale generation {got} (channel is at {want})")]
    StaleGeneration {
        /// In the slot.
        got: u32,
        /// Expected.
        want: u32,
    },
    /// Segment count beyond the slot, or segments on an op that takes none.
    #[error("bad segment count {0}")]
    BadSegmentCount(u16),
    /// A segment names the wrong arena for the op.
    #[error("segment {index} names arena {arena}")]
    WrongArena {
        /// Segment index.
        index: usize,
        /// Arena named.
        arena: u32,
    },
    /// A segment lies outside its arena.
    #[error("segment {index} ({offset}+{len}) outside its arena of {size} bytes")]
    SegmentOutOfArena {
        /// Segment index.
        index: usize,
        /// Offset.
        offset: u64,
        /// Length.
        len: u32,
        /// Arena size.
        size: u64,
    },
    /// Segments do not add up to the request length, or the length is zero or too large.
    #[error("length {len} does not match segments ({segs} bytes) or limits")]
    BadLength {
        /// Request length.
        len: u64,
        /// Sum of segments.
        segs: u64,
    },
    /// The range goes past the end of the device.
    #[error("range {offset}+{len} beyond device size {size}")]
    BeyondDevice {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Device size.
        size: u64,
    },
}

/// Checks a request slot once, producing the only type the runtime acts on.
pub fn validate_request(
    slot: &RequestSlot,
    arenas: ArenaSizes,
    device_size: u64,
    generation: u32,
) -> Result<ValidRequest, RequestError> {
    let op = op_of_code(slot.op).ok_or(RequestError::UnknownOp(slot.op))?;
    if slot.flags & !FLAG_FUA != 0 || (slot.flags & FLAG_FUA != 0 && op != Op::Write) {
        return Err(RequestError::BadFlags(slot.flags));
    }
    if slot.generation != generation {
        return Err(RequestError::StaleGeneration { got: slot.generation, want: generation });
    }
    let nsegs = slot.nsegs as usize;
    let data = matches!(op, Op::Read | Op::Write);
    if nsegs > MAX_SEGMENTS || (data && nsegs == 0) || (!data && nsegs != 0) {
        return Err(RequestError::BadSegmentCount(slot.nsegs));
    }
    let (want_arena, arena_size) = match op {
        Op::Write => (ARENA_WRITE, arenas.write),
        _ => (ARENA_READ, arenas.read),
    };
    let mut sum = 0u64;
    for (index, seg) in slot.segs[..nsegs].iter().enumerate() {
        if seg.arena != want_arena {
            return Err(RequestError::WrongArena { index, arena: seg.arena });
        }
        let end = seg.offset.checked_add(seg.len as u64);
        if seg.len == 0 || end.is_none_or(|e| e > arena_size) {
            return Err(RequestError::SegmentOutOfArena { index, offset: seg.offset, len: seg.len, size: arena_size });
        }
        sum += seg.len as u64;
    }
    match op {
        Op::Read | Op::Write if sum != slot.len || slot.len > MAX_REQUEST_BYTES => {
            return Err(RequestError::BadLength { len: slot.len, segs: sum })
        }
        Op::Flush if slot.len != 0 || slot.offset != 0 => return Err(RequestError::BadLength { len: slot.len, segs: 0 }),
        Op::Discard | Op::WriteZeroes if slot.len == 0 => return Err(RequestError::BadLength { len: 0, segs: 0 }),
        _ => {}
    }
    if slot.offset.checked_add(slot.len).is_none_or(|end| end > device_size) {
        return Err(RequestError::BeyondDevice { offset: slot.offset, len: slot.len, size: device_size });
    }
    Ok(ValidRequest {
        id: slot.id,
        generation: slot.generation,
        op,
        fua: slot.flags & FLAG_FUA != 0,
        offset: slot.offset,
        len: slot.len,
        segs: slot.segs,
        nsegs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::op_code;

    const ARENAS: ArenaSizes = ArenaSizes { write: 1 << 20, read: 1 << 20 };

    fn write(offset: u64, len: u32) -> RequestSlot {
        let mut s =
            RequestSlot { id: 7, generation: 3, op: op_code(Op::Write), nsegs: 1, offset, len: len as u64, ..Default::default() };
        s.segs[0] = Segment { arena: ARENA_WRITE, len, offset: 0 };
        s
    }

    #[test]
    fn good_write_is_accepted() {
        let v = validate_request(&write(4096, 4096), ARENAS, 1 << 30, 3).unwrap();
        assert_eq!((v.op, v.offset, v.len, v.nsegs), (Op::Write, 4096, 4096, 1));
    }

    #[test]
    fn segment_outside_arena_is_rejected() {
        let mut s = write(0, 4096);
        s.segs[0].offset = (1 << 20) - 100;
        assert!(matches!(validate_request(&s, ARENAS, 1 << 30, 3), Err(RequestError::SegmentOutOfArena { .. })));
        s.segs[0].offset = u64::MAX - 10;
        assert!(matches!(validate_request(&s, ARENAS, 1 << 30, 3), Err(RequestError::SegmentOutOfArena { .. })));
    }

    #[test]
    fn segments_must_sum_to_length() {
        let mut s = write(0, 4096);
        s.len = 8192;
        assert!(matches!(validate_request(&s, ARENAS, 1 << 30, 3), Err(RequestError::BadLength { .. })));
    }

    #[test]
    fn write_naming_read_arena_is_rejected() {
        let mut s = write(0, 4096);
        s.segs[0].arena = ARENA_READ;
        assert!(matches!(validate_request(&s, ARENAS, 1 << 30, 3), Err(RequestError::WrongArena { .. })));
    }

    #[test]
    fn range_beyond_device_is_rejected() {
        assert!(matches!(validate_request(&write(1 << 30, 4096), ARENAS, 1 << 30, 3), Err(RequestError::BeyondDevice { .. })));
        assert!(matches!(
            validate_request(&write(u64::MAX - 1, 4096), ARENAS, u64::MAX, 3),
            Err(RequestError::BeyondDevice { .. })
        ));
    }

    #[test]
    fn unknown_op_flags_generation_and_counts_are_rejected() {
        let mut s = write(0, 4096);
        s.op = 9;
        assert_eq!(validate_request(&s, ARENAS, 1 << 30, 3), Err(RequestError::UnknownOp(9)));
        let mut s = write(0, 4096);
        s.flags = 0x80;
        assert_eq!(validate_request(&s, ARENAS, 1 << 30, 3), Err(RequestError::BadFlags(0x80)));
        let s = write(0, 4096);
        assert!(matches!(validate_request(&s, ARENAS, 1 << 30, 4), Err(RequestError::StaleGeneration { .. })));
        let mut s = write(0, 4096);
        s.nsegs = 7;
        assert_eq!(validate_request(&s, ARENAS, 1 << 30, 3), Err(RequestError::BadSegmentCount(7)));
        let s = RequestSlot { op: op_code(Op::Flush), generation: 3, nsegs: 1, ..Default::default() };
        assert_eq!(validate_request(&s, ARENAS, 1 << 30, 3), Err(RequestError::BadSegmentCount(1)));
    }

    #[test]
    fn four_mib_request_in_several_segments_is_accepted() {
        let arenas = ArenaSizes { write: 8 << 20, read: 8 << 20 };
        let mut s =
            RequestSlot { id: 1, generation: 0, op: op_code(Op::Read), nsegs: 4, offset: 0, len: 4 << 20, ..Default::default() };
        for i in 0..4 {
            s.segs[i] = Segment { arena: ARENA_READ, len: 1 << 20, offset: (i as u64) << 21 };
        }
        assert!(validate_request(&s, arenas, 1 << 30, 0).is_ok());
    }
}
