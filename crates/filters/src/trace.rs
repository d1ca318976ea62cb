//! `trace`: every request with its submission and completion time, in blktrace's binary
//! format, so `blkparse` and `btt` read it (`blkparse -i FILE`, `btt -i FILE`).
//!
//! Each request gives two 48-byte records: a *queue* record (`Q`) when the filter sees it on
//! its way down, a *complete* record (`C`) when its result comes back, carrying the errno of a
//! failure. The record's `cpu` field is the queue the request came in on, `pid` its tag,
//! `device` the device number the supervisor assigned, `time` the domain's monotonic clock in
//! ns. Records are buffered and written at least every 100 ms and whenever 64 KiB are pending;
//! what a killed domain had not written yet is lost (a restart is marked by the gap).
//! blktrace has no category for write-zeroes, so it is recorded as a write of its range.

use std::io::Write;

use bulkhead_block::{After, Layer, Op, Outcome, Request, SharedSlice, Tag, TagSpace, Verdict};

use crate::state::StatePage;

/// blktrace's magic, with its format version 7 in the low byte.
pub const MAGIC: u32 = 0x6561_7407;
/// Size of one record (no payload is written).
pub const RECORD_BYTES: usize = 48;

/// Action codes (`__BLK_TA_*`) and category bits (`BLK_TC_*`) used here.
mod act {
    pub const QUEUE: u32 = 1;
    pub const COMPLETE: u32 = 8;
    pub const TC_READ: u32 = 1 << 0;
    pub const TC_WRITE: u32 = 1 << 1;
    pub const TC_FLUSH: u32 = 1 << 2;
    pub const TC_SYNC: u32 = 1 << 3;
    pub const TC_QUEUE: u32 = 1 << 4;
    pub const TC_COMPLETE: u32 = 1 << 7;
    pub const TC_DISCARD: u32 = 1 << 13;
    pub const TC_FUA: u32 = 1 << 15;
    pub const TC_SHIFT: u32 = 16;
}

/// Flush the buffer once it holds this much.
const FLUSH_AT: usize = 64 << 10;

/// State page slots: records written, records lost (write errors).
const WRITTEN: usize = 1;
const LOST: usize = 2;

/// The category bits of a request.
fn category(req: &Request<'_>) -> u32 {
    match req {
        Request::Read { .. } => act::TC_READ,
        Request::Write { fua, .. } => act::TC_WRITE | if *fua { act::TC_FUA | act::TC_SYNC } else { 0 },
        Request::Flush => act::TC_WRITE | act::TC_FLUSH,
        Request::Discard { .. } => act::TC_WRITE | act::TC_DISCARD,
        // blktrace has no category of its own for write-zeroes; it is a write that moves no data.
        Request::WriteZeroes { .. } => act::TC_WRITE,
    }
}

/// One decoded record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Per-queue sequence number.
    pub sequence: u32,
    /// ns.
    pub time: u64,
    /// 512-byte sector.
    pub sector: u64,
    /// Bytes.
    pub bytes: u32,
    /// Action code and category bits.
    pub action: u32,
    /// The request's tag.
    pub pid: u32,
    /// Device number.
    pub device: u32,
    /// Queue.
    pub cpu: u32,
    /// errno of a failed completion.
    pub error: u16,
}

impl Record {
    /// The record's bytes, in this machine's byte order (blkparse reads either).
    pub fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_ne_bytes());
        b[4..8].copy_from_slice(&self.sequence.to_ne_bytes());
        b[8..16].copy_from_slice(&self.time.to_ne_bytes());
        b[16..24].copy_from_slice(&self.sector.to_ne_bytes());
        b[24..28].copy_from_slice(&self.bytes.to_ne_bytes());
        b[28..32].copy_from_slice(&self.action.to_ne_bytes());
        b[32..36].copy_from_slice(&self.pid.to_ne_bytes());
        b[36..40].copy_from_slice(&self.device.to_ne_bytes());
        b[40..44].copy_from_slice(&self.cpu.to_ne_bytes());
        b[44..46].copy_from_slice(&self.error.to_ne_bytes());
        // pdu_len (46..48) stays 0: no payload follows.
        b
    }

    /// Decodes one record and the length of the payload that follows it; `None` if the magic
    /// is wrong in both byte orders.
    pub fn decode(b: &[u8; RECORD_BYTES]) -> Option<(Record, usize)> {
        let le = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let swap = if le & 0xffff_ff00 == MAGIC & 0xffff_ff00 {
            false
        } else if le.swap_bytes() & 0xffff_ff00 == MAGIC & 0xffff_ff00 {
            true
        } else {
            return None;
        };
        let u16_at = |i: usize| {
            let v = u16::from_le_bytes([b[i], b[i + 1]]);
            if swap {
                v.swap_bytes()
            } else {
                v
            }
        };
        let u32_at = |i: usize| {
            let v = u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
            if swap {
                v.swap_bytes()
            } else {
                v
            }
        };
        let u64_at = |i: usize| {
            let v = u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
            if swap {
                v.swap_bytes()
            } else {
                v
            }
        };
        let r = Record {
            sequence: u32_at(4),
            time: u64_at(8),
            sector: u64_at(16),
            bytes: u32_at(24),
            action: u32_at(28),
            pid: u32_at(32),
            device: u32_at(36),
            cpu: u32_at(40),
            error: u16_at(44),
        };
        Some((r, u16_at(46) as usize))
    }

    /// Whether this is a completion record.
    pub fn is_complete(&self) -> bool {
        self.action & 0xffff == act::COMPLETE
    }

    /// Whether this is a queue record.
    pub fn is_queue(&self) -> bool {
        self.action & 0xffff == act::QUEUE
    }

    /// The operation a record's categories stand for. blktrace has no category for
    /// write-zeroes: it reads back as a write of its range.
    pub fn op(&self) -> Op {
        let cat = self.action >> act::TC_SHIFT;
        if cat & act::TC_DISCARD != 0 {
            Op::Discard
        } else if cat & act::TC_FLUSH != 0 {
            Op::Flush
        } else if cat & act::TC_WRITE != 0 {
            Op::Write
        } else {
            Op::Read
        }
    }
}

/// The `trace` filter.
pub struct Trace {
    out: std::fs::File,
    page: StatePage,
    device: u32,
    tags: TagSpace,
    /// Next sequence number per queue.
    sequence: Vec<u32>,
    buf: Vec<u8>,
    /// Write errors logged so far (rate limit).
    complained: u64,
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trace").field("device", &self.device).field("pending", &self.buf.len()).finish()
    }
}

impl Trace {
    /// A filter appending to `out` (opened by the supervisor), counting into `page`, stamping
    /// records with `device`.
    pub fn new(out: std::fs::File, page: StatePage, device: u32) -> Self {
        Trace {
            out,
            page,
            device,
            tags: TagSpace { queues: 1, per_queue: 1 },
            sequence: Vec::new(),
            buf: Vec::with_capacity(FLUSH_AT + 2 * RECORD_BYTES),
            complained: 0,
        }
    }

    fn record(&mut self, tag: Tag, req: &Request<'_>, action: u32, error: u16, now_ns: u64) {
        let q = self.tags.queue_of(tag);
        let seq = &mut self.sequence[q as usize];
        let (offset, bytes) = req.range();
        let r = Record {
            sequence: *seq,
            time: now_ns,
            sector: offset / 512,
            bytes: bytes.min(u32::MAX as u64) as u32,
            action,
            pid: tag.index() as u32,
            device: self.device,
            cpu: q,
            error,
        };
        *seq = seq.wrapping_add(1);
        self.buf.extend_from_slice(&r.encode());
        if self.buf.len() >= FLUSH_AT {
            self.write_out();
        }
    }

    fn write_out(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let n = (self.buf.len() / RECORD_BYTES) as u64;
        match self.out.write_all(&self.buf) {
            Ok(()) => self.page.add(WRITTEN, n),
            Err(e) => {
                self.page.add(LOST, n);
                self.complained += 1;
                if self.complained.is_power_of_two() {
                    eprintln!("bulkhead driver: trace: {n} records lost: {e} ({} write errors so far)", self.complained);
                }
            }
        }
        self.buf.clear();
    }
}

/// Records written and records lost, as read back from a trace filter's state page.
pub fn read(page: &StatePage) -> (u64, u64) {
    (page.get(WRITTEN), page.get(LOST))
}

impl Layer for Trace {
    fn name(&self) -> &'static str {
        "trace"
    }
    fn attach(&mut self, tags: TagSpace) {
        self.tags = tags;
        self.sequence = vec![0; tags.queues as usize];
    }
    fn submit(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, now_ns: u64) -> Verdict {
        match req.op() {
            Op::Read | Op::Write | Op::Flush | Op::Discard | Op::WriteZeroes => {
                let action = act::QUEUE | ((category(req) | act::TC_QUEUE) << act::TC_SHIFT);
                self.record(tag, req, action, 0, now_ns);
                Verdict::Forward
            }
        }
    }
    fn complete(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, result: &mut Outcome, now_ns: u64) -> After {
        let action = act::COMPLETE | ((category(req) | act::TC_COMPLETE) << act::TC_SHIFT);
        let error = match result {
            Ok(_) => 0,
            Err(e) => e.status().errno() as u16,
        };
        self.record(tag, req, action, error, now_ns);
        After::Up
    }
    fn poll(&mut self, _: u64, _: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        None
    }
    fn idle(&mut self) {
        self.write_out();
    }
    fn idle_wanted(&self) -> bool {
        !self.buf.is_empty()
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        self.write_out();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_page;
    use bulkhead_block::BlockError;
    use std::io::{Read, Seek};

    #[test]
    fn record_round_trips_in_both_byte_orders() {
        let r = Record {
            sequence: 7,
            time: 123_456_789,
            sector: 2048,
            bytes: 4096,
            action: act::QUEUE | ((act::TC_WRITE | act::TC_QUEUE) << act::TC_SHIFT),
            pid: 3,
            device: (254 << 20) | 1,
            cpu: 1,
            error: 0,
        };
        let b = r.encode();
        assert_eq!(Record::decode(&b), Some((r, 0)));
        let mut swapped = [0u8; RECORD_BYTES];
        for (range, width) in [
            (0..4, 4),
            (4..8, 4),
            (8..16, 8),
            (16..24, 8),
            (24..28, 4),
            (28..32, 4),
            (32..36, 4),
            (36..40, 4),
            (40..44, 4),
            (44..46, 2),
            (46..48, 2),
        ] {
            let mut f = b[range.clone()].to_vec();
            f.reverse();
            assert_eq!(f.len(), width);
            swapped[range].copy_from_slice(&f);
        }
        assert_eq!(Record::decode(&swapped), Some((r, 0)));
        assert_eq!(Record::decode(&[0u8; RECORD_BYTES]), None);
    }

    #[test]
    fn each_request_gives_a_queue_and_a_complete_record_with_its_errno() {
        let (_fd, page) = test_page();
        let file = tempfile();
        let mut t = Trace::new(file.try_clone().unwrap(), page, 9);
        t.attach(TagSpace { queues: 2, per_queue: 4 });
        let reqs = [Request::Flush, Request::Discard { offset: 4096, len: 8192 }, Request::WriteZeroes { offset: 0, len: 512 }];
        for (i, r) in reqs.iter().enumerate() {
            assert_eq!(t.submit(Tag::new(i as u32 * 3), r, SharedSlice::empty(), 100 + i as u64), Verdict::Forward);
        }
        let mut failed = Err(BlockError::Os { op: "discard", offset: 4096, errno: 28 });
        t.complete(Tag::new(3), &reqs[1], SharedSlice::empty(), &mut failed, 500);
        t.complete(Tag::new(0), &reqs[0], SharedSlice::empty(), &mut Ok(0), 600);
        t.complete(Tag::new(6), &reqs[2], SharedSlice::empty(), &mut Ok(0), 700);
        t.idle();
        let recs = read_all(file);
        assert_eq!(recs.len(), 6);
        let ops: Vec<_> = recs.iter().map(|r| (r.is_queue(), r.op(), r.cpu, r.pid)).collect();
        assert_eq!(
            ops,
            [
                (true, Op::Flush, 0, 0),
                (true, Op::Discard, 0, 3),
                (true, Op::Write, 1, 6),
                (false, Op::Discard, 0, 3),
                (false, Op::Flush, 0, 0),
                (false, Op::Write, 1, 6),
            ]
        );
        assert_eq!((recs[1].sector, recs[1].bytes), (8, 8192));
        assert_eq!(recs[3].error, 28);
        assert_eq!(recs[3].time, 500);
        // Sequence numbers run per queue.
        assert_eq!([recs[0].sequence, recs[1].sequence, recs[3].sequence, recs[4].sequence], [0, 1, 2, 3]);
        assert_eq!([recs[2].sequence, recs[5].sequence], [0, 1]);
        assert_eq!(read(&t.page), (6, 0));
    }

    fn tempfile() -> std::fs::File {
        let path =
            std::env::temp_dir().join(format!("bulkhead-trace-test-{}-{:?}", std::process::id(), std::thread::current().id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    fn read_all(mut f: std::fs::File) -> Vec<Record> {
        f.rewind().unwrap();
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).unwrap();
        bytes.chunks_exact(RECORD_BYTES).map(|c| Record::decode(c.try_into().unwrap()).unwrap().0).collect()
    }
}
