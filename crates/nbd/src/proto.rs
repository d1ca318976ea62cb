//! NBD wire constants and encoding (the protocol of the NetworkBlockDevice project's
//! `doc/proto.md`): fixed newstyle negotiation, simple and structured replies. All integers
//! are big-endian.

use bulkhead_block::{Command, Op};

/// Largest read or write payload bulkhead sends or accepts, and the maximum block size its
/// export advertises.
pub const MAX_PAYLOAD: u32 = 32 << 20;

/// "NBDMAGIC", first thing the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle negotiation; also the magic of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of an option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Server will not send the 124 zero bytes after NBD_OPT_EXPORT_NAME if the client agrees.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client agrees to no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
/// Abort negotiation.
pub const OPT_ABORT: u32 = 2;
/// List exports.
pub const OPT_LIST: u32 = 3;
/// Upgrade to TLS.
pub const OPT_STARTTLS: u32 = 5;
/// Information about an export.
pub const OPT_INFO: u32 = 6;
/// Information, then transmission.
pub const OPT_GO: u32 = 7;
/// Structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// List metadata contexts.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Select metadata contexts.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// 64-bit extended headers.
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// Option reply types.
pub const REP_ACK: u32 = 1;
/// An export in a LIST reply.
pub const REP_SERVER: u32 = 2;
/// An information item in an INFO or GO reply.
pub const REP_INFO: u32 = 3;
/// Error replies have bit 31 set.
pub const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
/// Refused by policy.
pub const REP_ERR_POLICY: u32 = (1 << 31) | 2;
/// Malformed option.
pub const REP_ERR_INVALID: u32 = (1 << 31) | 3;
/// No such export.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;
/// The server requires TLS first.
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) | 5;
/// Option too large.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) | 9;

/// Information types.
pub const INFO_EXPORT: u16 = 0;
/// Export name.
pub const INFO_NAME: u16 = 1;
/// Export description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Read-only export.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Flush supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// FUA supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Trim supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Write-zeroes supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Don't-fragment flag on reads accepted.
pub const TFLAG_SEND_DF: u16 = 1 << 7;
/// A flush on any connection covers writes completed on every connection.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Commands.
pub const CMD_READ: u16 = 0;
/// Write.
pub const CMD_WRITE: u16 = 1;
/// Disconnect.
pub const CMD_DISC: u16 = 2;
/// Flush.
pub const CMD_FLUSH: u16 = 3;
/// Trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Cache (prefetch).
pub const CMD_CACHE: u16 = 5;
/// Write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Block status.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Write-zeroes must not punch holes.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Read must come back in one chunk.
pub const CMD_FLAG_DF: u16 = 1 << 2;

/// Structured reply flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// No payload.
pub const REPLY_TYPE_NONE: u16 = 0;
/// Data at an offset.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// An error.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

/// Error values (the protocol's own numbering, which follows Linux errno).
pub const EPERM: u32 = 1;
/// I/O error.
pub const EIO: u32 = 5;
/// Out of memory.
pub const ENOMEM: u32 = 12;
/// Invalid request.
pub const EINVAL: u32 = 22;
/// No space (write past the end).
pub const ENOSPC: u32 = 28;
/// Value too large.
pub const EOVERFLOW: u32 = 75;
/// Not supported.
pub const ENOTSUP: u32 = 95;
/// Server shutting down.
pub const ESHUTDOWN: u32 = 108;

/// The protocol's error for an errno.
pub fn error_of_errno(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES => EPERM,
        libc::ENOMEM => ENOMEM,
        libc::EINVAL => EINVAL,
        libc::ENOSPC | libc::EFBIG => ENOSPC,
        libc::EOVERFLOW => EOVERFLOW,
        libc::EOPNOTSUPP => ENOTSUP,
        libc::ESHUTDOWN => ESHUTDOWN,
        _ => EIO,
    }
}

/// The errno for a protocol error (client side).
pub fn errno_of_error(e: u32) -> i32 {
    match e {
        EPERM => libc::EPERM,
        ENOMEM => libc::ENOMEM,
        EINVAL => libc::EINVAL,
        ENOSPC => libc::ENOSPC,
        EOVERFLOW => libc::EOVERFLOW,
        ENOTSUP => libc::EOPNOTSUPP,
        ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EIO,
    }
}

/// A transmission request header (28 bytes on the wire), as it arrived: nothing acts on one
/// before [`parse`](Self::parse) has made a [`Transmission`] of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags.
    pub flags: u16,
    /// Command.
    pub typ: u16,
    /// Opaque cookie echoed in the reply.
    pub cookie: u64,
    /// Offset.
    pub offset: u64,
    /// Length.
    pub len: u32,
}

impl RequestHeader {
    /// Wire size.
    pub const SIZE: usize = 28;

    /// Decodes a header; `None` if the magic is wrong.
    pub fn decode(b: &[u8; Self::SIZE]) -> Option<RequestHeader> {
        if be32(&b[0..4]) != REQUEST_MAGIC {
            return None;
        }
        Some(RequestHeader {
            flags: be16(&b[4..6]),
            typ: be16(&b[6..8]),
            cookie: be64(&b[8..16]),
            offset: be64(&b[16..24]),
            len: be32(&b[24..28]),
        })
    }

    /// Encodes a header.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.typ.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// A transmission request as a server acts on it: the NBD wire's one decoding into the shared
/// vocabulary. A read's and a write's payload is their length in bytes (a write's data
/// follows the header on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transmission {
    /// A block request.
    Io {
        /// Echoed in the reply.
        cookie: u64,
        /// What it asks.
        cmd: Command<u32, u32>,
        /// A trim or write-zeroes with FUA: durable before the reply, so a flush follows it.
        flush_after: bool,
    },
    /// `NBD_CMD_DISC`: the client is done.
    Disconnect,
}

/// Why a request header was refused: the protocol error to reply with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// The protocol error ([`EINVAL`], [`ENOSPC`], [`EOVERFLOW`]).
    pub error: u32,
    /// Whether a write's payload follows the header on the wire (the server must read past
    /// it, or, past [`MAX_PAYLOAD`], close).
    pub payload: Option<u32>,
}

impl RequestHeader {
    /// Parses and checks the header of a request to an export of `size` bytes (`structured`:
    /// structured replies were negotiated, which allows `DF` on reads). Unknown commands and
    /// flags, ranges past the end and payloads past [`MAX_PAYLOAD`] are refused.
    pub fn parse(&self, size: u64, structured: bool) -> Result<Transmission, Refused> {
        let payload = (self.typ == CMD_WRITE).then_some(self.len);
        let refuse = |error| Err(Refused { error, payload });
        let fua = self.flags & CMD_FLAG_FUA != 0;
        let (offset, len) = (self.offset, self.len);
        let (cmd, allowed) = match self.typ {
            CMD_READ => (Command::Read { offset, into: len }, if structured { CMD_FLAG_DF } else { 0 }),
            CMD_WRITE => (Command::Write { offset, from: len, fua }, CMD_FLAG_FUA),
            CMD_FLUSH => (Command::Flush, 0),
            CMD_TRIM => (Command::Discard { offset, len: len.into() }, CMD_FLAG_FUA),
            CMD_WRITE_ZEROES => (Command::WriteZeroes { offset, len: len.into() }, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE),
            CMD_DISC => return Ok(Transmission::Disconnect),
            _ => return refuse(EINVAL),
        };
        if self.flags & !allowed != 0 {
            return refuse(EINVAL);
        }
        let flush_after = fua && matches!(cmd.op(), Op::Discard | Op::WriteZeroes);
        let ok = Ok(Transmission::Io { cookie: self.cookie, cmd, flush_after });
        match cmd {
            Command::Read { .. } | Command::Write { .. } if len > MAX_PAYLOAD => refuse(EOVERFLOW),
            Command::Flush if offset == 0 && len == 0 => ok,
            Command::Flush => refuse(EINVAL),
            Command::Read { .. } | Command::Write { .. } | Command::Discard { .. } | Command::WriteZeroes { .. } => {
                match offset.checked_add(len.into()) {
                    Some(end) if end <= size => ok,
                    // Writing past the end is "no space"; anything else past the end is invalid.
                    _ if cmd.op().modifies() && cmd.op() != Op::Discard => refuse(ENOSPC),
                    _ => refuse(EINVAL),
                }
            }
        }
    }
}

/// Big-endian u16 from the first two bytes.
pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// Big-endian u32 from the first four bytes.
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Big-endian u64 from the first eight bytes.
pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// An option reply header followed by `data`.
pub fn option_reply(opt: u32, typ: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + data.len());
    v.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&opt.to_be_bytes());
    v.extend_from_slice(&typ.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// A simple reply header (16 bytes).
pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk header (20 bytes) announcing `len` bytes of payload.
pub fn chunk_header(flags: u16, typ: u16, cookie: u64, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&typ.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_bad_magic_is_refused() {
        let r = RequestHeader { flags: CMD_FLAG_FUA, typ: CMD_WRITE, cookie: 0x1122_3344_5566_7788, offset: 1 << 40, len: 4096 };
        let mut b = r.encode();
        assert_eq!(RequestHeader::decode(&b), Some(r));
        b[0] ^= 1;
        assert_eq!(RequestHeader::decode(&b), None);
    }

    fn hdr(typ: u16, flags: u16, offset: u64, len: u32) -> RequestHeader {
        RequestHeader { flags, typ, cookie: 7, offset, len }
    }

    fn refused(h: RequestHeader, size: u64, structured: bool) -> u32 {
        h.parse(size, structured).expect_err("refused").error
    }

    #[test]
    fn headers_parse_into_commands_and_bad_ones_are_refused_with_their_error() {
        let size = 1 << 20;
        let io = |cmd, flush_after| Ok(Transmission::Io { cookie: 7, cmd, flush_after });
        assert_eq!(hdr(CMD_READ, 0, 0, 4096).parse(size, false), io(Command::Read { offset: 0, into: 4096 }, false));
        assert_eq!(
            hdr(CMD_WRITE, CMD_FLAG_FUA, 512, 512).parse(size, false),
            io(Command::Write { offset: 512, from: 512, fua: true }, false)
        );
        assert_eq!(hdr(CMD_TRIM, CMD_FLAG_FUA, 0, 4096).parse(size, false), io(Command::Discard { offset: 0, len: 4096 }, true));
        assert_eq!(
            hdr(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 4096).parse(size, false),
            io(Command::WriteZeroes { offset: 0, len: 4096 }, false)
        );
        assert_eq!(hdr(CMD_FLUSH, 0, 0, 0).parse(size, false), io(Command::Flush, false));
        assert_eq!(hdr(CMD_DISC, 0, 0, 0).parse(size, false), Ok(Transmission::Disconnect));
        assert_eq!(refused(hdr(CMD_READ, 0, size - 1, 2), size, false), EINVAL);
        assert_eq!(refused(hdr(CMD_WRITE, 0, size, 1), size, false), ENOSPC);
        assert_eq!(refused(hdr(CMD_WRITE_ZEROES, 0, size - 4096, 8192), size, false), ENOSPC);
        assert_eq!(refused(hdr(CMD_TRIM, 0, size - 4096, 8192), size, false), EINVAL);
        assert_eq!(refused(hdr(CMD_READ, 0, u64::MAX - 10, 4096), size, false), EINVAL);
        assert_eq!(refused(hdr(CMD_WRITE, 0, u64::MAX - 10, 4096), size, false), ENOSPC);
        assert_eq!(refused(hdr(CMD_READ, 0, 0, MAX_PAYLOAD + 1), u64::MAX, false), EOVERFLOW);
        assert_eq!(refused(hdr(CMD_READ, CMD_FLAG_FUA, 0, 512), size, false), EINVAL);
        assert_eq!(refused(hdr(CMD_READ, CMD_FLAG_DF, 0, 512), size, false), EINVAL);
        assert!(hdr(CMD_READ, CMD_FLAG_DF, 0, 512).parse(size, true).is_ok());
        assert_eq!(refused(hdr(CMD_WRITE, 1 << 9, 0, 512), size, false), EINVAL);
        assert_eq!(refused(hdr(CMD_FLUSH, 0, 0, 1), size, false), EINVAL);
        assert_eq!(refused(hdr(CMD_CACHE, 0, 0, 512), size, false), EINVAL);
        assert_eq!(refused(hdr(CMD_BLOCK_STATUS, 0, 0, 512), size, false), EINVAL);
        assert_eq!(refused(hdr(99, 0, 0, 512), size, false), EINVAL);
        // A refused write says how much payload follows it; nothing else has one.
        assert_eq!(hdr(CMD_WRITE, 1 << 9, 0, 512).parse(size, false).unwrap_err().payload, Some(512));
        assert_eq!(hdr(CMD_READ, 0, size, 512).parse(size, false).unwrap_err().payload, None);
    }

    #[test]
    fn magics_spell_what_the_protocol_says() {
        assert_eq!(&NBDMAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
    }

    #[test]
    fn errors_map_both_ways() {
        for e in [EPERM, EIO, ENOMEM, EINVAL, ENOSPC, EOVERFLOW, ENOTSUP, ESHUTDOWN] {
            assert_eq!(error_of_errno(errno_of_error(e)), e);
        }
        assert_eq!(error_of_errno(libc::EROFS), EPERM);
        assert_eq!(error_of_errno(libc::EBADMSG), EIO);
    }
}
