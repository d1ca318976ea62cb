//! The request vocabulary every layer shares: the five operations ([`Op`]), one request shape
//! over any payload ([`Command`]), and the small stable set of outcomes ([`Status`]).
//!
//! Each wire converts to and from these in one place: the ring slot in `bulkhead_ring::wire`,
//! NBD in `bulkhead_nbd_export`, FUSE in `bulkhead_fuse_export`. What differs between layers is
//! only where a request's bytes are, so [`Command`] is generic over it: grant windows in a
//! domain ([`crate::Request`]), a layer's scratch or handed data ([`crate::Sub`]), a byte count
//! and a borrowed slice at the frontend (`bulkhead_channel::FrontRequest`).

/// The five block operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Read bytes from the device.
    Read,
    /// Write bytes to the device.
    Write,
    /// Make every acknowledged write durable.
    Flush,
    /// Deallocate a range; its contents become unspecified.
    Discard,
    /// Make a range read back as zeroes.
    WriteZeroes,
}

impl Op {
    /// Every operation, in a fixed order (its [`index`](Self::index)).
    pub const ALL: [Op; 5] = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::WriteZeroes];

    /// Position in [`ALL`](Self::ALL), for tables indexed by operation.
    pub const fn index(self) -> usize {
        match self {
            Op::Read => 0,
            Op::Write => 1,
            Op::Flush => 2,
            Op::Discard => 3,
            Op::WriteZeroes => 4,
        }
    }

    /// Lower-case name as in configuration and status (`read`, `write`, `flush`, `discard`,
    /// `write_zeroes`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write_zeroes",
        }
    }

    /// Parses [`as_str`](Self::as_str).
    pub fn parse(s: &str) -> Option<Op> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Whether it changes what the device holds (a read-only device refuses it).
    pub const fn modifies(self) -> bool {
        match self {
            Op::Write | Op::Discard | Op::WriteZeroes => true,
            Op::Read | Op::Flush => false,
        }
    }

    /// Whether it moves data (its length is that of its buffers).
    pub const fn moves_data(self) -> bool {
        match self {
            Op::Read | Op::Write => true,
            Op::Flush | Op::Discard | Op::WriteZeroes => false,
        }
    }
}

/// One block request, generic over where its bytes are: `R` receives a read's bytes, `W` holds
/// a write's. Every layer matches it in full: there is no default pass-through, because a
/// layer that forwards an operation it does not understand corrupts data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command<R, W> {
    /// Read from `offset` into `into`.
    Read {
        /// Device byte offset.
        offset: u64,
        /// Where the bytes go.
        into: R,
    },
    /// Write `from` at `offset`.
    Write {
        /// Device byte offset.
        offset: u64,
        /// The bytes.
        from: W,
        /// Durable before acknowledgement (force unit access).
        fua: bool,
    },
    /// Make every acknowledged write durable.
    Flush,
    /// Deallocate a range; its contents become unspecified.
    Discard {
        /// Device byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Make a range read back as zeroes.
    WriteZeroes {
        /// Device byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

impl<R, W> Command<R, W> {
    /// Its operation.
    pub const fn op(&self) -> Op {
        match self {
            Command::Read { .. } => Op::Read,
            Command::Write { .. } => Op::Write,
            Command::Flush => Op::Flush,
            Command::Discard { .. } => Op::Discard,
            Command::WriteZeroes { .. } => Op::WriteZeroes,
        }
    }

    /// Its device offset (0 for a flush).
    pub const fn offset(&self) -> u64 {
        match *self {
            Command::Read { offset, .. }
            | Command::Write { offset, .. }
            | Command::Discard { offset, .. }
            | Command::WriteZeroes { offset, .. } => offset,
            Command::Flush => 0,
        }
    }

    /// The same request with its payloads converted: the one place a layer changes where a
    /// request's bytes are without touching what it asks.
    pub fn map<R2, W2>(self, read: impl FnOnce(R) -> R2, write: impl FnOnce(W) -> W2) -> Command<R2, W2> {
        match self {
            Command::Read { offset, into } => Command::Read { offset, into: read(into) },
            Command::Write { offset, from, fua } => Command::Write { offset, from: write(from), fua },
            Command::Flush => Command::Flush,
            Command::Discard { offset, len } => Command::Discard { offset, len },
            Command::WriteZeroes { offset, len } => Command::WriteZeroes { offset, len },
        }
    }

    /// The same request with a moved offset (a layer with a header below, a view of a part).
    pub fn shifted(self, by: u64) -> Self {
        match self {
            Command::Read { offset, into } => Command::Read { offset: offset + by, into },
            Command::Write { offset, from, fua } => Command::Write { offset: offset + by, from, fua },
            Command::Flush => Command::Flush,
            Command::Discard { offset, len } => Command::Discard { offset: offset + by, len },
            Command::WriteZeroes { offset, len } => Command::WriteZeroes { offset: offset + by, len },
        }
    }
}

/// The outcome of a request: a small stable set that each wire encodes in its own way (a ring
/// status code, an NBD error, a FUSE errno), the message staying in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Success.
    Ok,
    /// The backend failed (EIO).
    IoError,
    /// The request was malformed or out of range (EINVAL).
    Invalid,
    /// The operation is not supported by the device (EOPNOTSUPP).
    NotSupported,
    /// No space left (ENOSPC).
    NoSpace,
    /// The device is read-only (EROFS).
    ReadOnly,
}

impl Status {
    /// Every status, in a fixed order.
    pub const ALL: [Status; 6] =
        [Status::Ok, Status::IoError, Status::Invalid, Status::NotSupported, Status::NoSpace, Status::ReadOnly];

    /// The errno an export reports for this status.
    pub const fn errno(self) -> i32 {
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
    fn ops_index_their_table_and_round_trip_their_names() {
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(op.index(), i);
            assert_eq!(Op::parse(op.as_str()), Some(op));
        }
        assert_eq!(Op::parse("trim"), None);
    }

    #[test]
    fn a_command_keeps_its_operation_through_map_and_shift() {
        let w: Command<u64, &[u8]> = Command::Write { offset: 8, from: b"abcd", fua: true };
        let m = w.map(|n| n * 2, |d| d.len());
        assert_eq!(m, Command::Write { offset: 8, from: 4, fua: true });
        assert_eq!(m.shifted(4096).offset(), 4104);
        assert_eq!(m.op(), Op::Write);
        let f: Command<(), ()> = Command::Flush;
        assert_eq!((f.shifted(7).offset(), f.op()), (0, Op::Flush));
    }

    #[test]
    fn only_the_modifying_operations_modify() {
        let modifying: Vec<Op> = Op::ALL.into_iter().filter(|o| o.modifies()).collect();
        assert_eq!(modifying, [Op::Write, Op::Discard, Op::WriteZeroes]);
        assert_eq!(Status::ReadOnly.errno(), 30);
    }
}
