//! Writing a new, empty qcow2 image: the overlay a `cow` filter starts from.
//!
//! The layout is the one `qemu-img create -f qcow2` uses: the header in cluster 0, the refcount
//! table in cluster 1, one refcount block in cluster 2, the L1 table from cluster 3. Every
//! cluster in use has refcount 1; nothing else is allocated, so every guest cluster reads from
//! the backing device.

use crate::{extension, Backing, ImageError, QCOW2_MAGIC};

/// Bytes of the header proper (version 3, with the compression type field's 8-byte slot).
const HEADER_BYTES: usize = 112;

/// The bytes of a new qcow2 v3 image of `size` bytes with clusters of `1 << cluster_bits`
/// bytes, naming `backing` (a path and its format) if given. Refcounts are 16 bits wide.
pub fn new_image(size: u64, cluster_bits: u32, backing: Option<&Backing>) -> Result<Vec<u8>, ImageError> {
    let bad = |field: &'static str, problem: String| ImageError::Header { field, problem };
    if !(12..=21).contains(&cluster_bits) {
        return Err(bad("cluster_bits", format!("{cluster_bits} (a cluster of 4 KiB to 2 MiB expected)")));
    }
    if size == 0 || size > 1 << 50 {
        return Err(bad("size", format!("{size} bytes (1 byte to 1 PiB expected)")));
    }
    let cluster = 1u64 << cluster_bits;
    let per_l2 = (cluster / 8) << cluster_bits;
    let l1_size = size.div_ceil(per_l2);
    let l1_clusters = (l1_size * 8).div_ceil(cluster);
    let used = 3 + l1_clusters;
    // The one refcount block (16-bit entries) must cover every cluster in use.
    if used > cluster / 2 {
        return Err(bad("size", format!("{size} bytes needs more L1 table than one refcount block covers")));
    }
    if let Some(b) = backing {
        if b.name.is_empty() || b.name.len() > crate::MAX_BACKING_NAME as usize || b.name.contains('\0') {
            return Err(bad("backing file name", format!("`{}` cannot be recorded", b.name)));
        }
    }
    let mut img = vec![0u8; (used * cluster) as usize];
    let put32 = |img: &mut [u8], at: usize, v: u32| img[at..at + 4].copy_from_slice(&v.to_be_bytes());
    let put64 = |img: &mut [u8], at: usize, v: u64| img[at..at + 8].copy_from_slice(&v.to_be_bytes());
    img[..4].copy_from_slice(&QCOW2_MAGIC);
    put32(&mut img, 4, 3);
    put32(&mut img, 20, cluster_bits);
    put64(&mut img, 24, size);
    put32(&mut img, 36, l1_size as u32);
    put64(&mut img, 40, 3 * cluster);
    put64(&mut img, 48, cluster);
    put32(&mut img, 56, 1);
    put32(&mut img, 96, 4);
    put32(&mut img, 100, HEADER_BYTES as u32);
    let mut at = HEADER_BYTES;
    if let Some(b) = backing {
        let fmt = b.format.as_str().as_bytes();
        put32(&mut img, at, extension::BACKING_FORMAT);
        put32(&mut img, at + 4, fmt.len() as u32);
        img[at + 8..at + 8 + fmt.len()].copy_from_slice(fmt);
        at = (at + 8 + fmt.len()).next_multiple_of(8);
    }
    // The end marker (zeroes) is already there.
    at += 8;
    if let Some(b) = backing {
        if at + b.name.len() > cluster as usize {
            return Err(bad("backing file name", "does not fit the first cluster".into()));
        }
        put64(&mut img, 8, at as u64);
        put32(&mut img, 16, b.name.len() as u32);
        img[at..at + b.name.len()].copy_from_slice(b.name.as_bytes());
    }
    // The refcount table names the block in cluster 2; the block counts clusters 0..used.
    put64(&mut img, cluster as usize, 2 * cluster);
    for c in 0..used as usize {
        let e = 2 * cluster as usize + 2 * c;
        img[e..e + 2].copy_from_slice(&1u16.to_be_bytes());
    }
    Ok(img)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Format, Qcow2Header};

    #[test]
    fn a_new_image_reads_back_as_what_was_asked() {
        let b = Backing { name: "/srv/base.raw".into(), format: Format::Raw };
        let img = new_image(3 << 30, 16, Some(&b)).unwrap();
        let h = Qcow2Header::parse(&img).unwrap();
        assert_eq!((h.version, h.cluster_size(), h.size, h.backing, h.snapshots), (3, 65536, 3 << 30, Some(b), 0));
        assert_eq!(img.len(), 4 * 65536, "header, refcount table, refcount block, one L1 cluster");
        let h = Qcow2Header::parse(&new_image(4096, 12, None).unwrap()).unwrap();
        assert_eq!((h.size, h.cluster_size(), h.backing), (4096, 4096, None));
        assert!(matches!(new_image(0, 16, None), Err(ImageError::Header { field: "size", .. })));
        assert!(matches!(new_image(1 << 20, 9, None), Err(ImageError::Header { field: "cluster_bits", .. })));
    }
}
