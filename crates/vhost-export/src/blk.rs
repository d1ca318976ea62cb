//! virtio-blk: the features and configuration space a device offers, and a descriptor chain
//! parsed into a typed request (the one vocabulary of `bulkhead_block`) before anything acts on
//! it. The wire framing is the spec's: a 16-byte header in the readable buffers, data, and a
//! status byte at the very end of the writable ones, split across descriptors any way the
//! driver likes.

use bulkhead_block::Command;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use vm_memory::{Address, Bytes, GuestAddress};

use crate::memory::GuestMem;
use crate::virtq::{Chain, Seg};

/// Bytes of a virtio-blk sector.
pub const SECTOR: u64 = 512;
/// Bytes of the request header.
const HEADER: u64 = 16;
/// Bytes of one discard or write-zeroes segment.
const RANGE: u64 = 16;
/// Segments the driver may put in one request (`seg_max`).
pub const SEG_MAX: u32 = 128;

/// Status byte: done.
pub const S_OK: u8 = VIRTIO_BLK_S_OK as u8;
/// Status byte: failed.
pub const S_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
/// Status byte: not a request this device knows.
pub const S_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

/// What the configuration space says of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes.
    pub size: u64,
    /// The logical block: offsets and lengths are multiples of it.
    pub block: u32,
    /// Request queues.
    pub queues: u16,
    /// Largest request's data, bytes.
    pub max_request: u64,
    /// Writes refused.
    pub read_only: bool,
    /// What GET_ID answers (at most 20 bytes are sent).
    pub id: String,
}

impl Geometry {
    /// Largest buffer of one segment: requests of `SEG_MAX` of them fit `max_request`.
    pub fn size_max(&self) -> u32 {
        let per = (self.max_request / u64::from(SEG_MAX)) & !4095;
        per.clamp(4096, u64::from(u32::MAX)) as u32
    }

    /// Largest discard or write-zeroes, sectors.
    pub fn max_range_sectors(&self) -> u32 {
        (u64::from(u32::MAX) & !(u64::from(self.block) / SECTOR - 1)) as u32
    }
}

/// The virtio features a device offers.
pub fn features(read_only: bool) -> u64 {
    let mut f = 1 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | 1 << VIRTIO_RING_F_INDIRECT_DESC
        | 1 << VIRTIO_BLK_F_SIZE_MAX
        | 1 << VIRTIO_BLK_F_SEG_MAX
        | 1 << VIRTIO_BLK_F_BLK_SIZE
        | 1 << VIRTIO_BLK_F_FLUSH
        | 1 << VIRTIO_BLK_F_TOPOLOGY
        | 1 << VIRTIO_BLK_F_MQ;
    if read_only {
        f |= 1 << VIRTIO_BLK_F_RO;
    } else {
        f |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
    }
    f
}

/// The configuration space (`struct virtio_blk_config`, little-endian), laid out by the
/// field offsets of `virtio-bindings`' struct.
pub fn config_space(g: &Geometry) -> Vec<u8> {
    use std::mem::{offset_of, size_of};
    let mut c = vec![0u8; size_of::<virtio_blk_config>()];
    let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
    put(offset_of!(virtio_blk_config, capacity), &(g.size / SECTOR).to_le_bytes());
    put(offset_of!(virtio_blk_config, size_max), &g.size_max().to_le_bytes());
    put(offset_of!(virtio_blk_config, seg_max), &SEG_MAX.to_le_bytes());
    put(offset_of!(virtio_blk_config, blk_size), &g.block.to_le_bytes());
    put(offset_of!(virtio_blk_config, min_io_size), &((g.block as u64 / SECTOR) as u16).to_le_bytes());
    put(offset_of!(virtio_blk_config, num_queues), &g.queues.to_le_bytes());
    let range = g.max_range_sectors().to_le_bytes();
    put(offset_of!(virtio_blk_config, max_discard_sectors), &range);
    put(offset_of!(virtio_blk_config, max_discard_seg), &1u32.to_le_bytes());
    put(offset_of!(virtio_blk_config, discard_sector_alignment), &((u64::from(g.block) / SECTOR) as u32).to_le_bytes());
    put(offset_of!(virtio_blk_config, max_write_zeroes_sectors), &range);
    put(offset_of!(virtio_blk_config, max_write_zeroes_seg), &1u32.to_le_bytes());
    c
}

/// A request the device serves: a block command (lengths in bytes; the data buffers are the
/// request's segments), or the device's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlkOp {
    /// A read, write, flush, discard or write-zeroes.
    Io(Command<u32, u32>),
    /// `VIRTIO_BLK_T_GET_ID`.
    GetId,
}

/// A chain parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// No writable byte for the status: the chain goes back with nothing written.
    NoStatus,
    /// Refused without reaching the device: `code` goes to the status byte at `status`.
    Refused {
        /// The status byte's address.
        status: GuestAddress,
        /// `S_IOERR` or `S_UNSUPP`.
        code: u8,
        /// Why, for the log.
        why: &'static str,
    },
    /// To serve; its data buffers were left in the caller's list.
    Request {
        /// The status byte's address.
        status: GuestAddress,
        /// What to do.
        op: BlkOp,
    },
}

/// Copies `out.len()` bytes starting `skip` bytes into `segs`; false if they hold fewer.
fn gather(mem: &GuestMem, segs: &[Seg], mut skip: u64, out: &mut [u8]) -> bool {
    let mut done = 0;
    for s in segs {
        if done == out.len() {
            break;
        }
        let len = u64::from(s.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let take = ((len - skip) as usize).min(out.len() - done);
        if mem.memory().read_slice(&mut out[done..done + take], s.addr.unchecked_add(skip)).is_err() {
            return false;
        }
        done += take;
        skip = 0;
    }
    done == out.len()
}

/// Puts into `data` the part of `segs` after the first `skip` bytes and before the last
/// `trim`; returns its length.
fn window(segs: &[Seg], skip: u64, trim: u64, data: &mut Vec<Seg>) -> u64 {
    data.clear();
    let total: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
    let end = total.saturating_sub(trim);
    let mut at = 0u64;
    for s in segs {
        let (from, to) = (at, at + u64::from(s.len));
        at = to;
        let (lo, hi) = (from.max(skip), to.min(end));
        if lo < hi {
            data.push(Seg { addr: s.addr.unchecked_add(lo - from), len: (hi - lo) as u32 });
        }
    }
    end.saturating_sub(skip)
}

/// Parses `chain` for a device of geometry `g`, leaving the data buffers of a read or write
/// (or of GET_ID's answer) in `data`.
pub fn parse(mem: &GuestMem, chain: &Chain, g: &Geometry, data: &mut Vec<Seg>) -> Parsed {
    data.clear();
    // The status byte is the last writable byte.
    let Some(last) = chain.writable.iter().rev().find(|s| s.len > 0) else {
        return Parsed::NoStatus;
    };
    let status = last.addr.unchecked_add(u64::from(last.len) - 1);
    let refuse = |code, why| Parsed::Refused { status, code, why };
    let mut hdr = [0u8; HEADER as usize];
    if !gather(mem, &chain.readable, 0, &mut hdr) {
        return refuse(S_IOERR, "header shorter than 16 bytes");
    }
    let kind = u32::from_le_bytes(hdr[0..4].try_into().expect("four bytes"));
    let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("eight bytes"));
    let in_range = |offset: u64, len: u64| offset.checked_add(len).is_some_and(|end| end <= g.size);
    let aligned = |offset: u64, len: u64| offset.is_multiple_of(u64::from(g.block)) && len.is_multiple_of(u64::from(g.block));
    match kind {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
            let Some(offset) = sector.checked_mul(SECTOR) else { return refuse(S_IOERR, "sector out of range") };
            let len = if kind == VIRTIO_BLK_T_IN {
                if chain.readable.iter().map(|s| u64::from(s.len)).sum::<u64>() != HEADER {
                    return refuse(S_IOERR, "a read with data in readable buffers");
                }
                window(&chain.writable, 0, 1, data)
            } else {
                if chain.writable.iter().map(|s| u64::from(s.len)).sum::<u64>() != 1 {
                    return refuse(S_IOERR, "a write with data in writable buffers");
                }
                window(&chain.readable, HEADER, 0, data)
            };
            if len > g.max_request {
                return refuse(S_IOERR, "larger than seg_max × size_max");
            }
            if !len.is_multiple_of(SECTOR) || !aligned(offset, len) {
                return refuse(S_IOERR, "not a whole number of blocks");
            }
            if !in_range(offset, len) {
                return refuse(S_IOERR, "beyond the end of the device");
            }
            if kind == VIRTIO_BLK_T_OUT && g.read_only {
                return refuse(S_IOERR, "a write to a read-only device");
            }
            let len = len as u32;
            let cmd = if kind == VIRTIO_BLK_T_IN {
                Command::Read { offset, into: len }
            } else {
                Command::Write { offset, from: len, fua: false }
            };
            Parsed::Request { status, op: BlkOp::Io(cmd) }
        }
        VIRTIO_BLK_T_FLUSH => Parsed::Request { status, op: BlkOp::Io(Command::Flush) },
        VIRTIO_BLK_T_GET_ID => {
            window(&chain.writable, 0, 1, data);
            Parsed::Request { status, op: BlkOp::GetId }
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            if g.read_only {
                return refuse(S_IOERR, "a discard or write-zeroes on a read-only device");
            }
            let mut range = [0u8; RANGE as usize];
            let body: u64 = chain.readable.iter().map(|s| u64::from(s.len)).sum::<u64>() - HEADER;
            if body != RANGE || !gather(mem, &chain.readable, HEADER, &mut range) {
                return refuse(S_IOERR, "a discard or write-zeroes of other than one range");
            }
            let start = u64::from_le_bytes(range[0..8].try_into().expect("eight bytes"));
            let sectors = u64::from(u32::from_le_bytes(range[8..12].try_into().expect("four bytes")));
            let flags = u32::from_le_bytes(range[12..16].try_into().expect("four bytes"));
            let allowed = if kind == VIRTIO_BLK_T_WRITE_ZEROES { VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP } else { 0 };
            if flags & !allowed != 0 {
                return refuse(S_UNSUPP, "unknown range flags");
            }
            let (Some(offset), len) = (start.checked_mul(SECTOR), sectors * SECTOR) else {
                return refuse(S_IOERR, "sector out of range");
            };
            if !aligned(offset, len) {
                return refuse(S_IOERR, "not a whole number of blocks");
            }
            if !in_range(offset, len) {
                return refuse(S_IOERR, "beyond the end of the device");
            }
            let cmd = if kind == VIRTIO_BLK_T_DISCARD {
                Command::Discard { offset, len }
            } else {
                Command::WriteZeroes { offset, len }
            };
            Parsed::Request { status, op: BlkOp::Io(cmd) }
        }
        _ => refuse(S_UNSUPP, "unknown request type"),
    }
}

/// Writes `id` (at most `VIRTIO_BLK_ID_BYTES`, unterminated if that long) into `data`;
/// returns the bytes written.
pub fn write_id(mem: &GuestMem, data: &[Seg], id: &str) -> u32 {
    let mut bytes = [0u8; VIRTIO_BLK_ID_BYTES as usize];
    let n = id.len().min(bytes.len());
    bytes[..n].copy_from_slice(&id.as_bytes()[..n]);
    let mut done = 0usize;
    for s in data {
        if done == bytes.len() {
            break;
        }
        let take = (s.len as usize).min(bytes.len() - done);
        if mem.memory().write_slice(&bytes[done..done + take], s.addr).is_err() {
            break;
        }
        done += take;
    }
    done as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtq::tests::guest;

    fn geo() -> Geometry {
        Geometry { size: 1 << 20, block: 512, queues: 2, max_request: 1 << 20, read_only: false, id: "disk0".into() }
    }

    fn header(mem: &GuestMem, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.memory().write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn seg(addr: u64, len: u32) -> Seg {
        Seg { addr: GuestAddress(addr), len }
    }

    #[test]
    fn a_read_is_its_header_its_buffers_and_a_status_byte() {
        let mem = guest(1 << 20);
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 8);
        let c = Chain { head: 0, readable: vec![seg(0x1000, 16)], writable: vec![seg(0x2000, 4096), seg(0x4000, 1)] };
        let mut data = Vec::new();
        let p = parse(&mem, &c, &geo(), &mut data);
        assert_eq!(
            p,
            Parsed::Request { status: GuestAddress(0x4000), op: BlkOp::Io(Command::Read { offset: 4096, into: 4096 }) }
        );
        assert_eq!(data, vec![seg(0x2000, 4096)]);
    }

    #[test]
    fn framing_is_free_header_split_and_status_sharing_a_buffer() {
        let mem = guest(1 << 20);
        header(&mem, 0x1000, VIRTIO_BLK_T_OUT, 1);
        // Header in two pieces, data following the header in the same buffer.
        let c = Chain { head: 0, readable: vec![seg(0x1000, 8), seg(0x1008, 8 + 1024)], writable: vec![seg(0x3000, 1)] };
        let mut data = Vec::new();
        let p = parse(&mem, &c, &geo(), &mut data);
        assert_eq!(
            p,
            Parsed::Request {
                status: GuestAddress(0x3000),
                op: BlkOp::Io(Command::Write { offset: 512, from: 1024, fua: false })
            }
        );
        assert_eq!(data, vec![seg(0x1010, 1024)]);
        // A read whose status byte ends its data buffer.
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 0);
        let c = Chain { head: 0, readable: vec![seg(0x1000, 16)], writable: vec![seg(0x2000, 513)] };
        let p = parse(&mem, &c, &geo(), &mut data);
        assert_eq!(p, Parsed::Request { status: GuestAddress(0x2200), op: BlkOp::Io(Command::Read { offset: 0, into: 512 }) });
    }

    #[test]
    fn refuses_what_a_hostile_driver_might_send() {
        let mem = guest(1 << 20);
        let g = geo();
        let mut data = Vec::new();
        let st = GuestAddress(0x4000);
        let io = |why| Parsed::Refused { status: st, code: S_IOERR, why };
        let w = vec![seg(0x4000, 1)];
        // No status byte at all.
        let c = Chain { head: 0, readable: vec![seg(0x1000, 16)], writable: vec![] };
        assert_eq!(parse(&mem, &c, &g, &mut data), Parsed::NoStatus);
        // A short header.
        let c = Chain { head: 0, readable: vec![seg(0x1000, 8)], writable: w.clone() };
        assert_eq!(parse(&mem, &c, &g, &mut data), io("header shorter than 16 bytes"));
        // Past the end, at a sector that overflows, and a ragged length.
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, (1 << 20) / 512);
        let c = Chain { head: 0, readable: vec![seg(0x1000, 16)], writable: vec![seg(0x2000, 512), seg(0x4000, 1)] };
        assert_eq!(parse(&mem, &c, &g, &mut data), io("beyond the end of the device"));
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, u64::MAX / 256);
        assert_eq!(parse(&mem, &c, &g, &mut data), io("sector out of range"));
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 0);
        let c = Chain { head: 0, readable: vec![seg(0x1000, 16)], writable: vec![seg(0x2000, 100), seg(0x4000, 1)] };
        assert_eq!(parse(&mem, &c, &g, &mut data), io("not a whole number of blocks"));
        // Writes to a read-only device, and an unknown type.
        header(&mem, 0x1000, VIRTIO_BLK_T_OUT, 0);
        let c = Chain { head: 0, readable: vec![seg(0x1000, 16), seg(0x2000, 512)], writable: w.clone() };
        let ro = Geometry { read_only: true, ..geo() };
        assert_eq!(parse(&mem, &c, &ro, &mut data), io("a write to a read-only device"));
        header(&mem, 0x1000, 77, 0);
        assert_eq!(parse(&mem, &c, &g, &mut data), Parsed::Refused { status: st, code: S_UNSUPP, why: "unknown request type" });
        // Larger than the request limit.
        let small = Geometry { max_request: 4096, ..geo() };
        header(&mem, 0x1000, VIRTIO_BLK_T_OUT, 0);
        let c = Chain { head: 0, readable: vec![seg(0x1000, 16), seg(0x2000, 8192)], writable: w.clone() };
        assert_eq!(parse(&mem, &c, &small, &mut data), io("larger than seg_max × size_max"));
    }

    #[test]
    fn discard_and_write_zeroes_take_one_range() {
        let mem = guest(1 << 20);
        let mut data = Vec::new();
        header(&mem, 0x1000, VIRTIO_BLK_T_DISCARD, 0);
        let mut r = [0u8; 16];
        r[0..8].copy_from_slice(&8u64.to_le_bytes());
        r[8..12].copy_from_slice(&16u32.to_le_bytes());
        mem.memory().write_slice(&r, GuestAddress(0x1010)).unwrap();
        let c = Chain { head: 0, readable: vec![seg(0x1000, 32)], writable: vec![seg(0x4000, 1)] };
        assert_eq!(
            parse(&mem, &c, &geo(), &mut data),
            Parsed::Request { status: GuestAddress(0x4000), op: BlkOp::Io(Command::Discard { offset: 4096, len: 8192 }) }
        );
        // The unmap flag is for write-zeroes only.
        r[12..16].copy_from_slice(&VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP.to_le_bytes());
        mem.memory().write_slice(&r, GuestAddress(0x1010)).unwrap();
        assert!(matches!(parse(&mem, &c, &geo(), &mut data), Parsed::Refused { code: S_UNSUPP, .. }));
        header(&mem, 0x1000, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        assert_eq!(
            parse(&mem, &c, &geo(), &mut data),
            Parsed::Request { status: GuestAddress(0x4000), op: BlkOp::Io(Command::WriteZeroes { offset: 4096, len: 8192 }) }
        );
        // Two ranges.
        let c = Chain { head: 0, readable: vec![seg(0x1000, 48)], writable: vec![seg(0x4000, 1)] };
        assert!(matches!(parse(&mem, &c, &geo(), &mut data), Parsed::Refused { code: S_IOERR, .. }));
    }

    #[test]
    fn get_id_writes_at_most_twenty_bytes() {
        let mem = guest(1 << 20);
        let mut data = Vec::new();
        header(&mem, 0x1000, VIRTIO_BLK_T_GET_ID, 0);
        let c = Chain { head: 0, readable: vec![seg(0x1000, 16)], writable: vec![seg(0x2000, 20), seg(0x4000, 1)] };
        assert_eq!(parse(&mem, &c, &geo(), &mut data), Parsed::Request { status: GuestAddress(0x4000), op: BlkOp::GetId });
        assert_eq!(write_id(&mem, &data, "a-rather-long-device-name"), 20);
        let mut back = [0u8; 20];
        mem.memory().read_slice(&mut back, GuestAddress(0x2000)).unwrap();
        assert_eq!(&back, b"a-rather-long-device");
    }

    #[test]
    fn config_space_fields_sit_where_the_spec_puts_them() {
        let c = config_space(&geo());
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048, "capacity in sectors");
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), SEG_MAX);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512, "blk_size");
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2, "num_queues");
        assert_eq!(u32::from_le_bytes(c[40..44].try_into().unwrap()), 1, "max_discard_seg");
        assert!(geo().size_max() as u64 * SEG_MAX as u64 <= geo().max_request);
        assert_eq!(features(true) & (1 << VIRTIO_BLK_F_RO), 1 << VIRTIO_BLK_F_RO);
        assert_eq!(features(true) & (1 << VIRTIO_BLK_F_DISCARD), 0);
    }
}
