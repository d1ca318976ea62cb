//! The drive's parameters, and the model of its head and cache.

use serde::{Deserialize, Serialize};

use crate::cache::{CacheGeometry, CacheShadow};

/// Bytes of a sector, the model's unit of position.
pub const SECTOR: u64 = 512;

/// What the model knows of a drive. Positions are in sectors of 512 bytes; times in
/// nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drive {
    /// Sectors of the device (`D` of the seek model).
    pub sectors: u64,
    /// One revolution (`R`): an access waits half of it on average.
    pub rotation_ns: u64,
    /// A seek across the whole device (`S`).
    pub full_seek_ns: u64,
    /// Media transfer rate, bytes per second (0: transfers take no time).
    pub transfer_bps: u64,
    /// The drive's read cache, when it is modelled.
    pub cache: Option<CacheGeometry>,
}

impl Drive {
    /// The drive of the measurements in Jones' performance modeling paper, a 15,000 RPM 73.4 GB
    /// disk (R = 4 ms, full-stroke seek 7.5 ms, about 90 MB/s from the media, 64 cache segments of
    /// 221 sectors with a 64-sector prefetch), stretched or shrunk to `sectors`: a seek across the
    /// device takes the full stroke whatever its size.
    pub fn seed(sectors: u64) -> Self {
        Drive {
            sectors,
            rotation_ns: 4_000_000,
            full_seek_ns: 7_500_000,
            transfer_bps: 90_000_000,
            cache: Some(CacheGeometry::seed()),
        }
    }

    /// The drive of that paper's worked example: travel time one millisecond per unit of
    /// distance over `sectors` units, and nothing else (no rotation, transfer or cache).
    pub fn travel_only(sectors: u64) -> Self {
        Drive { sectors, rotation_ns: 0, full_seek_ns: sectors.saturating_mul(1_000_000), transfer_bps: 0, cache: None }
    }

    /// Checks the parameters, naming the one that is wrong.
    pub fn validate(&self) -> Result<(), crate::InvalidDrive> {
        if self.sectors == 0 {
            return Err(crate::InvalidDrive("the device has no sectors".into()));
        }
        if let Some(c) = &self.cache {
            c.validate()?;
        }
        Ok(())
    }

    /// Seek time over `d` sectors: `S·d/D`.
    pub fn seek_ns(&self, d: u64) -> u64 {
        let d = d.min(self.sectors);
        ((self.full_seek_ns as u128 * d as u128) / self.sectors as u128) as u64
    }

    /// Time to move `sectors` sectors to or from the media.
    pub fn transfer_ns(&self, sectors: u64) -> u64 {
        if self.transfer_bps == 0 {
            return 0;
        }
        ((sectors as u128 * SECTOR as u128 * 1_000_000_000) / self.transfer_bps as u128) as u64
    }

    /// What an access costs beside its seek: half a rotation and its transfer.
    pub fn fixed_ns(&self, sectors: u64) -> u64 {
        self.rotation_ns / 2 + self.transfer_ns(sectors)
    }

    /// The seek model: an access of `sectors` at distance `d` from the head.
    pub fn media_ns(&self, d: u64, sectors: u64) -> u64 {
        self.fixed_ns(sectors) + self.seek_ns(d)
    }
}

/// One access to the modelled drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Access {
    /// First sector.
    pub start: u64,
    /// Sectors.
    pub sectors: u64,
    /// A write (else a read).
    pub write: bool,
}

impl Access {
    /// The sector after it.
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.sectors)
    }
}

/// What an access costs on the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    /// Model time, ns.
    pub ns: u64,
    /// Served from the cache.
    pub hit: bool,
    /// Seek distance, sectors (0 for a hit).
    pub distance: u64,
}

/// The drive's state as the model sees it: where the head is, and what the cache holds.
#[derive(Debug, Clone)]
pub struct Model {
    drive: Drive,
    head: u64,
    cache: Option<CacheShadow>,
}

impl Model {
    /// A model of `drive` with the head at sector 0 and the cache empty.
    pub fn new(drive: Drive) -> Self {
        Model { drive, head: 0, cache: drive.cache.map(CacheShadow::new) }
    }

    /// The drive.
    pub fn drive(&self) -> &Drive {
        &self.drive
    }

    /// Where the head is.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Puts the head at `sector`.
    pub fn set_head(&mut self, sector: u64) {
        self.head = sector;
    }

    /// Whether a read of `a` would be served from the cache now.
    pub fn would_hit(&self, a: &Access) -> bool {
        !a.write && self.cache.as_ref().is_some_and(|c| c.holds(a.start, a.sectors))
    }

    /// What `a` would cost now, changing nothing.
    pub fn predict(&self, a: &Access) -> Service {
        if self.would_hit(a) {
            let hit_ns = self.drive.cache.map_or(0, |c| c.hit_ns);
            return Service { ns: hit_ns, hit: true, distance: 0 };
        }
        let distance = self.head.abs_diff(a.start);
        Service { ns: self.drive.media_ns(distance, a.sectors), hit: false, distance }
    }

    /// Serves `a`: what it costs, and the head and cache as they are after it.
    pub fn serve(&mut self, a: &Access) -> Service {
        let s = self.predict(a);
        if s.hit {
            return s;
        }
        self.head = a.end();
        if let Some(c) = &mut self.cache {
            if a.write {
                c.invalidate(a.start, a.sectors);
            } else {
                c.fill(a.start, a.sectors);
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seek_model_charges_half_a_rotation_a_seek_in_proportion_and_the_transfer() {
        let d = Drive { cache: None, ..Drive::seed(1_000_000) };
        // No distance: half a rotation and 8 sectors at 90 MB/s (45.5 µs).
        assert_eq!(d.media_ns(0, 8), 2_000_000 + 45_511);
        // Half the device: half the full stroke more.
        assert_eq!(d.media_ns(500_000, 8), 2_000_000 + 45_511 + 3_750_000);
        // Beyond the device counts as the full stroke.
        assert_eq!(d.seek_ns(5_000_000), 7_500_000);
    }

    #[test]
    fn the_head_follows_what_reaches_the_media_and_a_cache_hit_moves_nothing() {
        let mut m = Model::new(Drive::seed(1_000_000));
        let read = Access { start: 1000, sectors: 8, write: false };
        let first = m.serve(&read);
        assert!(!first.hit);
        assert_eq!((first.distance, m.head()), (1000, 1008));
        // The prefetch brought in what follows: a hit, and the head stays.
        let next = m.serve(&Access { start: 1008, sectors: 8, write: false });
        assert!(next.hit);
        assert_eq!(next.ns, CacheGeometry::seed().hit_ns);
        assert_eq!(m.head(), 1008);
        // A write goes to the media and drops what the cache held of its range.
        let w = m.serve(&Access { start: 1010, sectors: 2, write: true });
        assert!(!w.hit);
        assert!(!m.would_hit(&Access { start: 1008, sectors: 8, write: false }));
    }
}
