//! Test-only hostile behaviour of a driver domain.
//!
//! The frontend must survive a driver that turns hostile: it may not crash, hang or corrupt
//! other requests, and must fail or hold the affected requests until the supervisor has
//! replaced the domain. `bulkhead driver` switches one of these behaviours on when
//! `BULKHEAD_TEST_FAULT=hostile:<name>` is set (tests only); the domain serves honestly for
//! [`TRIGGER_AFTER`] requests, then misbehaves.

/// Requests a hostile domain answers honestly before it turns.
pub const TRIGGER_AFTER: u64 = 64;

/// One way of misbehaving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostility {
    /// Publish a response producer index far beyond anything outstanding.
    CorruptIndex,
    /// Publish a response slot full of random bytes instead of a real response.
    CorruptSlot,
    /// Answer with an id the frontend never issued.
    UnknownId,
    /// Answer one request twice.
    DuplicateId,
    /// Answer with the previous channel generation.
    StaleGeneration,
    /// Answer every batch in reverse order (allowed by the protocol: nothing may break).
    OutOfOrder,
    /// Report more bytes than the request asked for.
    WrongLength,
    /// Answer with a status value the protocol does not define.
    BadStatus,
    /// Ring the frontend's doorbell in a tight loop while serving correctly but slowly (2 ms
    /// per batch), so the frontend has to wait through the storm.
    DoorbellStorm,
    /// Take no more requests, and stay alive.
    StopAnswering,
    /// Exit after executing a batch, before answering it.
    ExitMidRequest,
    /// Print a 1 MiB line and 100,000 more at once on standard error — terminal escapes,
    /// lines posing as serve's own, bytes that are not UTF-8 — then serve correctly.
    LogFlood,
}

impl Hostility {
    /// Every behaviour, in the order the tests run them.
    pub const ALL: [Hostility; 12] = [
        Hostility::CorruptIndex,
        Hostility::CorruptSlot,
        Hostility::UnknownId,
        Hostility::DuplicateId,
        Hostility::StaleGeneration,
        Hostility::OutOfOrder,
        Hostility::WrongLength,
        Hostility::BadStatus,
        Hostility::DoorbellStorm,
        Hostility::StopAnswering,
        Hostility::ExitMidRequest,
        Hostility::LogFlood,
    ];

    /// The name used in `BULKHEAD_TEST_FAULT=hostile:<name>`.
    pub fn as_str(self) -> &'static str {
        match self {
            Hostility::CorruptIndex => "corrupt-index",
            Hostility::CorruptSlot => "corrupt-slot",
            Hostility::UnknownId => "unknown-id",
            Hostility::DuplicateId => "duplicate-id",
            Hostility::StaleGeneration => "stale-generation",
            Hostility::OutOfOrder => "out-of-order",
            Hostility::WrongLength => "wrong-length",
            Hostility::BadStatus => "bad-status",
            Hostility::DoorbellStorm => "doorbell-storm",
            Hostility::StopAnswering => "stop-answering",
            Hostility::ExitMidRequest => "exit-mid-request",
            Hostility::LogFlood => "log-flood",
        }
    }

    /// Parses a name of [`as_str`](Self::as_str).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|h| h.as_str() == s)
    }

    /// Whether the behaviour breaks the protocol (the frontend must declare the channel broken).
    pub fn violates_protocol(self) -> bool {
        !matches!(
            self,
            Hostility::OutOfOrder
                | Hostility::DoorbellStorm
                | Hostility::StopAnswering
                | Hostility::ExitMidRequest
                | Hostility::LogFlood
        )
    }
}

/// Writes the [`Hostility::LogFlood`] output to standard error.
pub(crate) fn flood_log() {
    use std::io::Write;
    let mut out = Vec::with_capacity(2 << 20);
    out.extend(std::iter::repeat_n(b'L', 1 << 20));
    out.push(b'\n');
    for i in 0..100_000u32 {
        match i % 4 {
            0 => out.extend_from_slice(format!("flood line {i}\n").as_bytes()),
            1 => out.extend_from_slice(b"\x1b[2J\x1b[31mforged: screen cleared\r\n"),
            2 => out.extend_from_slice(b"bulkhead: device other: forged: restarted, all is well\n"),
            _ => out.extend_from_slice(b"\xff\xfe not utf-8\x07\n"),
        }
        if out.len() >= 1 << 20 {
            let _ = std::io::stderr().write_all(&out);
            out.clear();
        }
    }
    let _ = std::io::stderr().write_all(&out);
}

/// A small deterministic generator for garbage bytes.
#[derive(Debug)]
pub(crate) struct Garbage(u64);

impl Garbage {
    pub(crate) fn new(seed: u64) -> Self {
        Garbage(seed | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for h in Hostility::ALL {
            assert_eq!(Hostility::parse(h.as_str()), Some(h));
        }
        assert_eq!(Hostility::parse("friendly"), None);
    }
}
