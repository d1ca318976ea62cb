//! Reading a trace back: the summary `bulkhead trace FILE` prints.
//!
//! A trace file is untrusted input (it may have been cut short, or be something else): every
//! record is checked for blktrace's magic, payloads are skipped by their stated length, and a
//! record that does not parse ends the reading with an error naming its offset.

use std::collections::HashMap;
use std::io::Read;

use bulkhead_block::Op;

use crate::trace::{Record, RECORD_BYTES};

/// blktrace's "notify" category: process names and messages, not I/O.
const TC_NOTIFY: u32 = 1 << 10;

/// Figures of one operation in a trace.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct OpSummary {
    /// Operation name.
    pub op: &'static str,
    /// Requests queued.
    pub queued: u64,
    /// Requests completed.
    pub completed: u64,
    /// Of which failed.
    pub errors: u64,
    /// Bytes completed successfully.
    pub bytes: u64,
    /// Queue-to-complete latency, µs: mean, median, 99th percentile, largest.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest.
    pub max_us: f64,
}

/// What a trace holds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Records read.
    pub records: u64,
    /// From the first record to the last, seconds.
    pub span_s: f64,
    /// Per operation with at least one request, in [`Op::ALL`] order.
    pub ops: Vec<OpSummary>,
    /// Requests per queue (the records' `cpu`), by queue.
    pub per_queue: Vec<(u32, u64)>,
    /// Completions without a queue record before them (the trace began mid-request, or a
    /// domain restart lost records).
    pub unpaired_completions: u64,
    /// Queue records with no completion (in flight when the trace ended).
    pub in_flight_at_end: u64,
    /// Bytes at the end that do not make a whole record.
    pub trailing_bytes: u64,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("read: {0}")]
    Io(#[from] std::io::Error),
    /// A record without blktrace's magic.
    #[error("byte {offset}: not a blktrace record (bad magic)")]
    BadMagic {
        /// Where it starts.
        offset: u64,
    },
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1e3
}

/// Reads a whole trace and sums it up.
pub fn summarize(mut input: impl Read) -> Result<Summary, TraceError> {
    let mut s = Summary::default();
    let mut open: HashMap<(u32, u32, u32, u64), u64> = HashMap::new();
    let mut lat: [Vec<u64>; 5] = Default::default();
    let mut counts = [(0u64, 0u64, 0u64, 0u64); 5];
    let mut queues: HashMap<u32, u64> = HashMap::new();
    let (mut first, mut last) = (u64::MAX, 0u64);
    let mut offset = 0u64;
    let mut buf = [0u8; RECORD_BYTES];
    loop {
        let mut got = 0;
        while got < RECORD_BYTES {
            match input.read(&mut buf[got..])? {
                0 => break,
                n => got += n,
            }
        }
        if got == 0 {
            break;
        }
        if got < RECORD_BYTES {
            s.trailing_bytes = got as u64;
            break;
        }
        let (r, pdu) = Record::decode(&buf).ok_or(TraceError::BadMagic { offset })?;
        offset += RECORD_BYTES as u64;
        if pdu > 0 {
            std::io::copy(&mut (&mut input).take(pdu as u64), &mut std::io::sink())?;
            offset += pdu as u64;
        }
        if (r.action >> 16) & TC_NOTIFY != 0 {
            continue;
        }
        s.records += 1;
        first = first.min(r.time);
        last = last.max(r.time);
        let op = r.op().index();
        let key = (r.device, r.cpu, r.pid, r.sector);
        if r.is_queue() {
            counts[op].0 += 1;
            *queues.entry(r.cpu).or_default() += 1;
            open.insert(key, r.time);
        } else if r.is_complete() {
            counts[op].1 += 1;
            if r.error != 0 {
                counts[op].2 += 1;
            } else {
                counts[op].3 += r.bytes as u64;
            }
            match open.remove(&key) {
                Some(t) => lat[op].push(r.time.saturating_sub(t)),
                None => s.unpaired_completions += 1,
            }
        }
    }
    s.in_flight_at_end = open.len() as u64;
    if s.records > 0 {
        s.span_s = last.saturating_sub(first) as f64 / 1e9;
    }
    for k in Op::ALL {
        let (queued, completed, errors, bytes) = counts[k.index()];
        if queued == 0 && completed == 0 {
            continue;
        }
        let l = &mut lat[k.index()];
        l.sort_unstable();
        // Times come from the file: summed wide, so hostile values cannot overflow.
        let mean_us = if l.is_empty() { 0.0 } else { l.iter().map(|&x| x as u128).sum::<u128>() as f64 / l.len() as f64 / 1e3 };
        s.ops.push(OpSummary {
            op: k.as_str(),
            queued,
            completed,
            errors,
            bytes,
            mean_us,
            p50_us: percentile(l, 0.5),
            p99_us: percentile(l, 0.99),
            max_us: l.last().map_or(0.0, |&x| x as f64 / 1e3),
        });
    }
    let mut per_queue: Vec<_> = queues.into_iter().collect();
    per_queue.sort_unstable();
    s.per_queue = per_queue;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(action: u32, cpu: u32, pid: u32, sector: u64, bytes: u32, time: u64, error: u16) -> [u8; RECORD_BYTES] {
        Record { sequence: 0, time, sector, bytes, action, pid, device: 1, cpu, error }.encode()
    }

    const QW: u32 = 1 | ((2 | 16) << 16);
    const CW: u32 = 8 | ((2 | 128) << 16);
    const QR: u32 = 1 | ((1 | 16) << 16);
    const CR: u32 = 8 | ((1 | 128) << 16);

    #[test]
    fn pairs_queue_and_complete_records_into_latencies_per_operation() {
        let mut bytes = Vec::new();
        bytes.extend(rec(QW, 0, 1, 8, 4096, 1_000, 0));
        bytes.extend(rec(QR, 1, 9, 16, 8192, 2_000, 0));
        bytes.extend(rec(CR, 1, 9, 16, 8192, 12_000, 0));
        bytes.extend(rec(CW, 0, 1, 8, 4096, 31_000, 0));
        bytes.extend(rec(QW, 0, 2, 0, 512, 40_000, 0));
        bytes.extend(rec(CW, 0, 2, 0, 512, 41_000, 5));
        bytes.extend(rec(QR, 1, 3, 0, 4096, 50_000, 0));
        bytes.extend(rec(CW, 0, 7, 64, 4096, 60_000, 0));
        bytes.extend([1, 2, 3]);
        let s = summarize(&bytes[..]).unwrap();
        assert_eq!(s.records, 8);
        assert!((s.span_s - 59e-6).abs() < 1e-12);
        assert_eq!(s.ops.len(), 2);
        let read = &s.ops[0];
        assert_eq!((read.op, read.queued, read.completed, read.errors, read.bytes), ("read", 2, 1, 0, 8192));
        assert_eq!(read.mean_us, 10.0);
        let write = &s.ops[1];
        assert_eq!((write.op, write.queued, write.completed, write.errors, write.bytes), ("write", 2, 3, 1, 8192));
        assert_eq!((write.p50_us, write.max_us), (1.0, 30.0));
        assert_eq!(s.per_queue, vec![(0, 2), (1, 2)]);
        assert_eq!((s.unpaired_completions, s.in_flight_at_end, s.trailing_bytes), (1, 1, 3));
    }

    #[test]
    fn latencies_near_the_top_of_the_clock_do_not_overflow_the_mean() {
        // Found by the trace_file fuzz target: two requests a whole clock apart.
        let mut bytes = Vec::new();
        for pid in [1, 2] {
            bytes.extend(rec(QW, 0, pid, 8, 4096, 0, 0));
            bytes.extend(rec(CW, 0, pid, 8, 4096, u64::MAX - 1, 0));
        }
        let s = summarize(&bytes[..]).unwrap();
        assert_eq!(s.ops[0].completed, 2);
        assert!(s.ops[0].mean_us > 1.8e13, "{}", s.ops[0].mean_us);
    }

    #[test]
    fn garbage_is_refused_with_its_offset() {
        let mut bytes = rec(QW, 0, 1, 8, 4096, 1_000, 0).to_vec();
        bytes.extend([0xaa; RECORD_BYTES]);
        match summarize(&bytes[..]) {
            Err(TraceError::BadMagic { offset }) => assert_eq!(offset, 48),
            other => panic!("{other:?}"),
        }
    }
}
