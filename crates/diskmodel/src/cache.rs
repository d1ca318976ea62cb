//! A shadow of the drive's segmented read cache.
//!
//! As Jones' performance modeling paper models it: a fixed number of segments, each holding one run
//! of consecutive sectors; fully associative (a run may land in any segment); first-in-first-out
//! replacement; and wrap-around within a segment (a run longer than a segment keeps only its last
//! sectors, as a ring buffer that went round overwrites its start). A read that reaches the media
//! fills a segment with what it read plus the prefetch after it; a read that lies wholly within one
//! segment is a hit. A write drops every segment it overlaps.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// The shape of the drive's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheGeometry {
    /// Segments.
    pub segments: u32,
    /// Sectors a segment holds.
    pub segment_sectors: u32,
    /// Sectors read ahead after each read that reaches the media.
    pub prefetch_sectors: u32,
    /// Service time of a hit, ns.
    pub hit_ns: u64,
}

impl CacheGeometry {
    /// That paper's drive: 64 segments of 221 sectors, a 64-sector prefetch; a hit costs
    /// 0.1 ms (the command and the transfer over the bus).
    pub fn seed() -> Self {
        CacheGeometry { segments: 64, segment_sectors: 221, prefetch_sectors: 64, hit_ns: 100_000 }
    }

    /// Checks the shape, naming what is wrong.
    pub fn validate(&self) -> Result<(), crate::InvalidDrive> {
        if self.segments == 0 || self.segments > 65_536 {
            return Err(crate::InvalidDrive(format!("{} cache segments: from 1 to 65536", self.segments)));
        }
        if self.segment_sectors == 0 {
            return Err(crate::InvalidDrive("cache segments of 0 sectors".into()));
        }
        Ok(())
    }
}

/// What the cache holds now: runs `[start, end)` of sectors, oldest first.
#[derive(Debug, Clone)]
pub struct CacheShadow {
    geometry: CacheGeometry,
    segments: VecDeque<(u64, u64)>,
}

impl CacheShadow {
    /// An empty cache of this shape.
    pub fn new(geometry: CacheGeometry) -> Self {
        CacheShadow { geometry, segments: VecDeque::with_capacity(geometry.segments as usize) }
    }

    /// Whether `sectors` from `start` lie wholly in one segment.
    pub fn holds(&self, start: u64, sectors: u64) -> bool {
        let end = start.saturating_add(sectors);
        self.segments.iter().any(|&(s, e)| s <= start && end <= e)
    }

    /// A read of `sectors` from `start` reached the media: the run it read and the prefetch
    /// after it take the oldest segment (its last `segment_sectors` sectors, if longer).
    pub fn fill(&mut self, start: u64, sectors: u64) {
        let end = start.saturating_add(sectors).saturating_add(self.geometry.prefetch_sectors as u64);
        let begin = start.max(end.saturating_sub(self.geometry.segment_sectors as u64));
        if self.segments.len() == self.geometry.segments as usize {
            self.segments.pop_front();
        }
        self.segments.push_back((begin, end));
    }

    /// A write of `sectors` from `start`: segments it overlaps no longer hold the disk's data.
    pub fn invalidate(&mut self, start: u64, sectors: u64) {
        let end = start.saturating_add(sectors);
        self.segments.retain(|&(s, e)| e <= start || end <= s);
    }

    /// Segments in use.
    pub fn used(&self) -> usize {
        self.segments.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> CacheShadow {
        CacheShadow::new(CacheGeometry { segments: 2, segment_sectors: 16, prefetch_sectors: 4, hit_ns: 1 })
    }

    #[test]
    fn a_read_fills_a_segment_with_its_run_and_the_prefetch() {
        let mut c = small();
        c.fill(100, 8);
        assert!(c.holds(100, 12));
        assert!(c.holds(104, 8));
        assert!(!c.holds(100, 13), "beyond the prefetch");
        assert!(!c.holds(99, 2), "before the run");
    }

    #[test]
    fn a_run_longer_than_a_segment_keeps_its_last_sectors() {
        let mut c = small();
        c.fill(0, 30); // 34 sectors with the prefetch; the segment keeps 18..34.
        assert!(c.holds(18, 16));
        assert!(!c.holds(17, 1));
    }

    #[test]
    fn replacement_is_first_in_first_out() {
        let mut c = small();
        c.fill(0, 4);
        c.fill(100, 4);
        assert!(c.holds(0, 4));
        // A hit does not refresh a segment: the oldest goes first all the same.
        c.fill(200, 4);
        assert!(!c.holds(0, 4));
        assert!(c.holds(100, 4) && c.holds(200, 4));
        assert_eq!(c.used(), 2);
    }

    #[test]
    fn a_write_drops_the_segments_it_overlaps_only() {
        let mut c = small();
        c.fill(0, 4);
        c.fill(100, 4);
        c.invalidate(7, 1);
        assert!(!c.holds(0, 1));
        assert!(c.holds(100, 4));
        c.invalidate(96, 4); // ends where the segment starts
        assert!(c.holds(100, 4));
    }
}
