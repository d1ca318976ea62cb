//! What a disk image file says about itself, read strictly.
//!
//! An image file is untrusted input: a qcow2 header names its backing file, and the supervisor
//! opens that file on the image's word. So the header is read here, before anything acts on it,
//! with every field checked against the qcow2 specification (docs/interop/qcow2.txt in qemu)
//! and every failure naming the field. The rest of the format (L1, L2 and refcount tables, the
//! data) is read inside the driver domain, by the `imago` crate, never by the supervisor.
//!
//! [`Qcow2Header::parse`] takes the start of the file ([`PROBE_BYTES`], or the whole file if it
//! is shorter): the header, its extensions and the backing file name must all lie in the first
//! cluster, as qemu writes them.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::fmt;

mod create;
pub mod snapshot;

pub use create::new_image;

/// Bytes of the file start that [`Qcow2Header::parse`] needs at most: the largest cluster.
pub const PROBE_BYTES: usize = 2 << 20;

/// The qcow2 magic, `QFI\xfb`.
pub const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";

/// Longest backing file name qemu accepts.
const MAX_BACKING_NAME: u32 = 1023;

/// Incompatible feature bits (header offset 72).
mod incompatible {
    pub const DIRTY: u64 = 1 << 0;
    pub const CORRUPT: u64 = 1 << 1;
    pub const EXTERNAL_DATA: u64 = 1 << 2;
    pub const COMPRESSION_TYPE: u64 = 1 << 3;
    pub const EXTENDED_L2: u64 = 1 << 4;
    pub const KNOWN: u64 = DIRTY | CORRUPT | EXTERNAL_DATA | COMPRESSION_TYPE | EXTENDED_L2;
}

/// Header extension types.
mod extension {
    pub const END: u32 = 0;
    pub const BACKING_FORMAT: u32 = 0xe279_2aca;
    pub const EXTERNAL_DATA_FILE: u32 = 0x4441_5441;
}

/// The format of an image file (or of a backing file, as its image records it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Plain bytes.
    Raw,
    /// qcow2.
    Qcow2,
}

impl Format {
    /// The name qemu uses (`raw`, `qcow2`).
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        }
    }

    /// Parses [`as_str`](Self::as_str).
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "raw" => Some(Format::Raw),
            "qcow2" => Some(Format::Qcow2),
            _ => None,
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The backing file a qcow2 image names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backing {
    /// The name as recorded: a path, relative to the image's directory unless absolute.
    pub name: String,
    /// Its format, from the backing-format extension.
    pub format: Format,
}

/// What a qcow2 header says, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qcow2Header {
    /// 2 or 3.
    pub version: u32,
    /// log2 of the cluster size (9..=21).
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// The backing file, if any.
    pub backing: Option<Backing>,
    /// The image was not closed cleanly with lazy refcounts on: its refcounts must be rebuilt
    /// before it is written (`qemu-img check -r all`).
    pub dirty: bool,
    /// Internal snapshots recorded in the image.
    pub snapshots: u32,
    /// Where the L1 table and the refcount table end, whichever ends later: a whole image
    /// holds both, so a file shorter than this is truncated or crafted.
    pub tables_end: u64,
}

impl Qcow2Header {
    /// Bytes per cluster.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }
}

/// Why an image header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    /// Not a qcow2 file at all.
    #[error("not a qcow2 image (no QFI\\xfb magic)")]
    NotQcow2,
    /// A field holds a value the specification does not allow.
    #[error("qcow2 header field `{field}`: {problem}")]
    Header {
        /// The field, as the specification names it.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A valid image using something this implementation does not serve.
    #[error("qcow2 image uses {0}, which is not supported")]
    Unsupported(String),
}

fn bad(field: &'static str, problem: impl Into<String>) -> ImageError {
    ImageError::Header { field, problem: problem.into() }
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Whether `start` begins with the qcow2 magic.
pub fn is_qcow2(start: &[u8]) -> bool {
    start.len() >= 4 && start[..4] == QCOW2_MAGIC
}

impl Qcow2Header {
    /// Reads the header at the start of an image file. `start` is the file's first
    /// [`PROBE_BYTES`] bytes, or all of it if the file is shorter.
    pub fn parse(start: &[u8]) -> Result<Qcow2Header, ImageError> {
        if !is_qcow2(start) {
            return Err(ImageError::NotQcow2);
        }
        if start.len() < 72 {
            return Err(bad("header_length", format!("the file ends after {} bytes, inside the header", start.len())));
        }
        let version = be32(start, 4);
        if version != 2 && version != 3 {
            return Err(bad("version", format!("{version} (2 or 3 expected)")));
        }
        let cluster_bits = be32(start, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(bad("cluster_bits", format!("{cluster_bits} (9..=21 expected)")));
        }
        let cluster = 1usize << cluster_bits;
        // Everything below lives in the first cluster; what the file holds of it is `first`.
        let first = &start[..start.len().min(cluster)];
        let size = be64(start, 24);
        // qemu's limit: 2^61 bytes (L1 entries address at most that much).
        if size > 1 << 61 {
            return Err(bad("size", format!("{size} bytes exceeds 2^61")));
        }
        let crypt_method = be32(start, 32);
        if crypt_method != 0 {
            return Err(ImageError::Unsupported(format!(
                "qcow2's own encryption (crypt_method {crypt_method}); put a crypt filter over a plain image instead"
            )));
        }
        let l1_size = be32(start, 36);
        let l1_offset = be64(start, 40);
        // One L1 entry maps one L2 table: cluster / 8 entries of one cluster each.
        let per_l1 = (cluster as u64 / 8) << cluster_bits;
        let l1_needed = size.div_ceil(per_l1);
        if u64::from(l1_size) < l1_needed {
            return Err(bad("l1_size", format!("{l1_size} entries cannot map {size} bytes ({l1_needed} needed)")));
        }
        if l1_size > 32 << 20 {
            return Err(bad("l1_size", format!("{l1_size} entries exceeds qemu's limit of 32 Mi")));
        }
        if !l1_offset.is_multiple_of(cluster as u64) || l1_offset == 0 && l1_size != 0 {
            return Err(bad("l1_table_offset", format!("{l1_offset:#x} is not a cluster-aligned offset past the header")));
        }
        let rt_offset = be64(start, 48);
        if rt_offset == 0 || !rt_offset.is_multiple_of(cluster as u64) {
            return Err(bad("refcount_table_offset", format!("{rt_offset:#x} is not a cluster-aligned offset past the header")));
        }
        let rt_clusters = be32(start, 56);
        if rt_clusters == 0 || rt_clusters > (8u32 << 20) >> cluster_bits {
            return Err(bad("refcount_table_clusters", format!("{rt_clusters} is out of range")));
        }
        let snapshots = be32(start, 60);
        let header_length = if version == 2 {
            72u32
        } else {
            if start.len() < 104 {
                return Err(bad("header_length", format!("the file ends after {} bytes, inside the header", start.len())));
            }
            let incompat = be64(start, 72);
            if incompat & incompatible::CORRUPT != 0 {
                return Err(ImageError::Unsupported(
                    "an image marked corrupt (incompatible feature bit 1); repair it with `qemu-img check -r all`".into(),
                ));
            }
            if incompat & incompatible::EXTERNAL_DATA != 0 {
                return Err(ImageError::Unsupported("an external data file (incompatible feature bit 2)".into()));
            }
            if incompat & incompatible::EXTENDED_L2 != 0 {
                return Err(ImageError::Unsupported("extended L2 entries (incompatible feature bit 4)".into()));
            }
            let unknown = incompat & !incompatible::KNOWN;
            if unknown != 0 {
                return Err(ImageError::Unsupported(format!("unknown incompatible features {unknown:#x}")));
            }
            let refcount_order = be32(start, 96);
            if refcount_order > 6 {
                return Err(bad("refcount_order", format!("{refcount_order} (0..=6 expected)")));
            }
            let header_length = be32(start, 100);
            if header_length < 104 || !header_length.is_multiple_of(8) {
                return Err(bad("header_length", format!("{header_length} (a multiple of 8, at least 104, expected)")));
            }
            if header_length as usize > first.len() {
                return Err(bad("header_length", format!("{header_length} reaches past the first cluster or the file")));
            }
            if incompat & incompatible::COMPRESSION_TYPE != 0 {
                if header_length < 105 {
                    return Err(bad("compression_type", "the feature bit is set but the header has no such field"));
                }
                let kind = start[104];
                if kind != 0 {
                    return Err(ImageError::Unsupported(format!("compression type {kind} (only zlib, 0)")));
                }
            }
            header_length
        };
        let dirty = version == 3 && be64(start, 72) & incompatible::DIRTY != 0;

        // Header extensions, up to the end marker, all within the first cluster.
        let mut at = header_length as usize;
        let mut backing_format = None;
        loop {
            if at + 8 > first.len() {
                return Err(bad("header extensions", "no end marker within the first cluster"));
            }
            let kind = be32(first, at);
            let len = be32(first, at + 4) as usize;
            if kind == extension::END {
                break;
            }
            let data_end = at + 8 + len;
            if data_end > first.len() {
                return Err(bad(
                    "header extensions",
                    format!("extension {kind:#x} of {len} bytes reaches past the first cluster"),
                ));
            }
            let data = &first[at + 8..data_end];
            match kind {
                extension::BACKING_FORMAT => {
                    let name =
                        std::str::from_utf8(data).map_err(|_| bad("backing file format", "not UTF-8"))?.trim_end_matches('\0');
                    backing_format =
                        Some(Format::parse(name).ok_or_else(|| {
                            ImageError::Unsupported(format!("a backing file of format `{name}` (raw or qcow2)"))
                        })?);
                }
                extension::EXTERNAL_DATA_FILE => {
                    return Err(ImageError::Unsupported("an external data file".into()));
                }
                _ => {}
            }
            at = data_end.next_multiple_of(8);
        }

        let backing_offset = be64(start, 8);
        let backing_len = be32(start, 16);
        let backing = if backing_offset == 0 {
            if backing_len != 0 {
                return Err(bad("backing_file_size", format!("{backing_len} with no backing_file_offset")));
            }
            None
        } else {
            if backing_len == 0 || backing_len > MAX_BACKING_NAME {
                return Err(bad("backing_file_size", format!("{backing_len} (1..={MAX_BACKING_NAME} expected)")));
            }
            let end = backing_offset.checked_add(u64::from(backing_len)).filter(|&e| e <= first.len() as u64);
            let Some(end) = end else {
                return Err(bad("backing_file_offset", format!("{backing_offset:#x} puts the name past the first cluster")));
            };
            if backing_offset < u64::from(header_length) {
                return Err(bad("backing_file_offset", format!("{backing_offset:#x} lies inside the header")));
            }
            let raw = &first[backing_offset as usize..end as usize];
            let name = std::str::from_utf8(raw).map_err(|_| bad("backing file name", "not UTF-8"))?;
            if name.contains('\0') {
                return Err(bad("backing file name", "contains a NUL byte"));
            }
            if name.starts_with("json:") || name.contains("://") {
                return Err(ImageError::Unsupported(format!(
                    "a backing file given as a protocol or json: specification (`{name}`); only paths are opened"
                )));
            }
            let Some(format) = backing_format else {
                return Err(ImageError::Unsupported(format!(
                    "a backing file (`{name}`) with no recorded format; record it with `qemu-img rebase -u -b {name} -F raw|qcow2`"
                )));
            };
            Some(Backing { name: name.to_string(), format })
        };
        let tables_end = (l1_offset.saturating_add(u64::from(l1_size) * 8))
            .max(rt_offset.saturating_add(u64::from(rt_clusters) << cluster_bits));
        Ok(Qcow2Header { version, cluster_bits, size, backing, dirty, snapshots, tables_end })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v3 header as `qemu-img create -f qcow2 -o cluster_size=64k` writes it for a 1 GiB
    /// image, with a backing file and its format when `backing` is given.
    fn header(backing: Option<(&str, &str)>) -> Vec<u8> {
        let mut h = vec![0u8; 65536];
        h[..4].copy_from_slice(&QCOW2_MAGIC);
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
        h[36..40].copy_from_slice(&2u32.to_be_bytes());
        h[40..48].copy_from_slice(&0x30000u64.to_be_bytes());
        h[48..56].copy_from_slice(&0x10000u64.to_be_bytes());
        h[56..60].copy_from_slice(&1u32.to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h[100..104].copy_from_slice(&112u32.to_be_bytes());
        let mut at = 112;
        if let Some((_, fmt)) = backing {
            h[at..at + 4].copy_from_slice(&extension::BACKING_FORMAT.to_be_bytes());
            h[at + 4..at + 8].copy_from_slice(&(fmt.len() as u32).to_be_bytes());
            h[at + 8..at + 8 + fmt.len()].copy_from_slice(fmt.as_bytes());
            at = (at + 8 + fmt.len()).next_multiple_of(8);
        }
        at += 8; // end marker
        if let Some((name, _)) = backing {
            h[8..16].copy_from_slice(&(at as u64).to_be_bytes());
            h[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
            h[at..at + name.len()].copy_from_slice(name.as_bytes());
        }
        h
    }

    #[test]
    fn a_plain_header_and_one_with_a_backing_file_parse() {
        let h = Qcow2Header::parse(&header(None)).unwrap();
        assert_eq!((h.version, h.cluster_size(), h.size, h.backing.clone(), h.dirty), (3, 65536, 1 << 30, None, false));
        let h = Qcow2Header::parse(&header(Some(("base.raw", "raw")))).unwrap();
        assert_eq!(h.backing, Some(Backing { name: "base.raw".into(), format: Format::Raw }));
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: [(usize, &[u8], &str); 8] = [
            (4, &7u32.to_be_bytes(), "version"),
            (20, &30u32.to_be_bytes(), "cluster_bits"),
            (24, &u64::MAX.to_be_bytes(), "size"),
            (36, &0u32.to_be_bytes(), "l1_size"),
            (40, &0x30001u64.to_be_bytes(), "l1_table_offset"),
            (48, &0u64.to_be_bytes(), "refcount_table_offset"),
            (96, &9u32.to_be_bytes(), "refcount_order"),
            (100, &0x20000u32.to_be_bytes(), "header_length"),
        ];
        for (at, bytes, field) in cases {
            let mut h = header(None);
            h[at..at + bytes.len()].copy_from_slice(bytes);
            match Qcow2Header::parse(&h) {
                Err(ImageError::Header { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn what_is_not_served_says_what_it_is() {
        let mut h = header(None);
        h[32..36].copy_from_slice(&1u32.to_be_bytes());
        assert!(matches!(Qcow2Header::parse(&h), Err(ImageError::Unsupported(m)) if m.contains("crypt_method 1")));
        let mut h = header(None);
        h[79] = 2;
        assert!(matches!(Qcow2Header::parse(&h), Err(ImageError::Unsupported(m)) if m.contains("corrupt")));
        // A backing file with no format would be probed: refused, with the command that fixes it.
        let mut h = header(Some(("base", "raw")));
        h[112..116].copy_from_slice(&0x1234u32.to_be_bytes());
        assert!(matches!(Qcow2Header::parse(&h), Err(ImageError::Unsupported(m)) if m.contains("rebase")));
        let h = header(Some(("json:{\"driver\":\"nbd\"}", "raw")));
        assert!(matches!(Qcow2Header::parse(&h), Err(ImageError::Unsupported(m)) if m.contains("json:")));
        assert_eq!(Qcow2Header::parse(b"\0\0\0\0rest"), Err(ImageError::NotQcow2));
    }

    #[test]
    fn a_backing_name_past_the_first_cluster_or_inside_the_header_is_refused() {
        let mut h = header(Some(("base", "qcow2")));
        h[8..16].copy_from_slice(&65534u64.to_be_bytes());
        assert!(matches!(Qcow2Header::parse(&h), Err(ImageError::Header { field: "backing_file_offset", .. })));
        let mut h = header(Some(("base", "qcow2")));
        h[8..16].copy_from_slice(&8u64.to_be_bytes());
        assert!(matches!(Qcow2Header::parse(&h), Err(ImageError::Header { field: "backing_file_offset", .. })));
        // Truncated files end inside the header.
        let h = header(None);
        for len in [0, 3, 4, 50, 71, 100] {
            assert!(Qcow2Header::parse(&h[..len]).is_err(), "{len}");
        }
    }

    use bulkhead_rng::Rng;

    #[test]
    fn mutated_headers_never_panic_and_every_accepted_one_is_consistent() {
        let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
        let base = header(Some(("base.qcow2", "qcow2")));
        let mut accepted = 0;
        for round in 0..20_000 {
            let mut h = base[..4096].to_vec();
            let flips = 1 + rng.next_u64() % 4;
            for _ in 0..flips {
                // Mostly the header and its extensions, sometimes anywhere.
                let at = if round % 4 == 0 { rng.next_u64() as usize % h.len() } else { rng.next_u64() as usize % 160 };
                h[at] = rng.next_u64() as u8;
            }
            let cut = if round % 7 == 0 { rng.next_u64() as usize % h.len() } else { h.len() };
            if let Ok(p) = Qcow2Header::parse(&h[..cut]) {
                accepted += 1;
                assert!((9..=21).contains(&p.cluster_bits) && p.size <= 1 << 61, "{p:?}");
                if let Some(b) = &p.backing {
                    assert!(!b.name.is_empty() && b.name.len() <= 1023 && !b.name.contains('\0'));
                }
            }
        }
        assert!(accepted > 100, "the mutations should leave some headers valid: {accepted}");
    }
}
