//! LUKS1 and LUKS2 headers: what a volume is made of, and opening it with a passphrase.
//!
//! Both formats put a binary header at the start of the device. LUKS1's names the cipher, the
//! master key's digest and eight key slots; LUKS2's names a JSON area that holds the same and
//! more, under a checksum, twice (a primary and a secondary copy). A key slot holds the master
//! key split into anti-forensic stripes, encrypted with a key derived from the passphrase
//! (PBKDF2, or Argon2 in LUKS2). Every field is untrusted input: each is checked before use,
//! and an error names it.

use base64::Engine;
use serde_json::Value;
use zeroize::Zeroizing;

use crate::hash::{af_merge, Hash};
use crate::xts::SectorCipher;
use crate::CryptError;

const MAGIC_1: &[u8; 6] = b"LUKS\xba\xbe";
const MAGIC_2_SECONDARY: &[u8; 6] = b"SKUL\xba\xbe";
/// Where a LUKS2 secondary header may be: right after a primary area of these sizes.
const SECONDARY_OFFSETS: [u64; 9] = [0x4000, 0x8000, 0x10000, 0x20000, 0x40000, 0x80000, 0x100000, 0x200000, 0x400000];
/// LUKS1's header and eight key slots.
const LUKS1_HEADER: usize = 592;
/// A LUKS2 binary header; its JSON area follows it.
const LUKS2_BINARY: usize = 4096;
/// The largest Argon2 memory cost cryptsetup sets (4 GiB, in KiB).
const ARGON2_MAX_KIB: u64 = 4 << 20;
/// Most anti-forensic stripes accepted (cryptsetup writes 4000).
const MAX_STRIPES: u64 = 1 << 16;

/// Reads `buf.len()` bytes at a byte offset of the device holding the volume.
pub type ReadAt<'a> = dyn FnMut(u64, &mut [u8]) -> std::io::Result<()> + 'a;

/// A master key, zeroed when dropped.
pub struct MasterKey(Zeroizing<Vec<u8>>);

impl MasterKey {
    /// The key's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// A key of these bytes (one kept from an earlier opening).
    pub fn from_bytes(b: &[u8]) -> Self {
        MasterKey(Zeroizing::new(b.to_vec()))
    }
}

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MasterKey({} bytes)", self.0.len())
    }
}

/// How a key slot derives its key from the passphrase.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kdf {
    Pbkdf2 { hash: Hash, iterations: u32, salt: Vec<u8> },
    Argon2 { id: bool, time: u32, memory_kib: u32, lanes: u32, salt: Vec<u8> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Keyslot {
    /// Its number in the header.
    id: u32,
    /// Where its key material starts, bytes.
    offset: u64,
    /// Bytes of the key that decrypts its material.
    area_key_bytes: usize,
    kdf: Kdf,
    stripes: usize,
    af_hash: Hash,
}

/// The master key's digest: PBKDF2 of the key, to tell the right one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct KeyDigest {
    hash: Hash,
    iterations: u32,
    salt: Vec<u8>,
    value: Vec<u8>,
}

/// An encrypted volume as its header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// 1 or 2.
    pub version: u8,
    /// The volume's UUID.
    pub uuid: String,
    /// Where the encrypted data starts, bytes.
    pub payload_offset: u64,
    /// Bytes of encrypted data, if the header fixes it (otherwise up to the device's end).
    pub payload_size: Option<u64>,
    /// Bytes per encrypted sector.
    pub sector_size: u32,
    /// Added to every sector number before it becomes the IV.
    pub iv_tweak: u64,
    /// Bytes of the master key (32: AES-128-XTS, 64: AES-256-XTS).
    pub key_bytes: usize,
    keyslots: Vec<Keyslot>,
    digest: KeyDigest,
}

fn field(field: impl Into<String>, problem: impl Into<String>) -> CryptError {
    CryptError::Header { field: field.into(), problem: problem.into() }
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A NUL-padded text field.
fn text(b: &[u8], at: usize, len: usize, name: &str) -> Result<String, CryptError> {
    let raw = &b[at..at + len];
    let end = raw.iter().position(|&c| c == 0).unwrap_or(len);
    std::str::from_utf8(&raw[..end]).map(str::to_string).map_err(|_| field(name, "is not text"))
}

impl Volume {
    /// Reads and checks the header at the start of the device `read` reads.
    pub fn read(read: &mut ReadAt<'_>) -> Result<Volume, CryptError> {
        let mut head = vec![0u8; LUKS2_BINARY];
        read(0, &mut head).map_err(|e| CryptError::Read(e.to_string()))?;
        if &head[..6] == MAGIC_1 {
            return match u16::from_be_bytes([head[6], head[7]]) {
                1 => Self::luks1(&head[..LUKS1_HEADER]),
                2 => Self::luks2_any(head, read),
                v => Err(CryptError::Unsupported(format!("LUKS version {v}"))),
            };
        }
        // A damaged primary LUKS2 header: the secondary may still be whole.
        for at in SECONDARY_OFFSETS {
            let mut h = vec![0u8; LUKS2_BINARY];
            if read(at, &mut h).is_ok() && &h[..6] == MAGIC_2_SECONDARY {
                return Self::luks2_at(at, h, read);
            }
        }
        Err(CryptError::NotLuks)
    }

    fn luks1(h: &[u8]) -> Result<Volume, CryptError> {
        let cipher = text(h, 8, 32, "cipher-name")?;
        let mode = text(h, 40, 32, "cipher-mode")?;
        if cipher != "aes" || mode != "xts-plain64" {
            return Err(CryptError::Unsupported(format!("cipher `{cipher}-{mode}` (aes-xts-plain64 is)")));
        }
        let hash = Hash::parse(&text(h, 72, 32, "hash-spec")?, "hash-spec")?;
        let payload_offset = u64::from(be32(h, 104)) * 512;
        let key_bytes = be32(h, 108) as usize;
        if key_bytes != 32 && key_bytes != 64 {
            return Err(field("key-bytes", format!("{key_bytes} (32 or 64 for aes-xts)")));
        }
        let iterations = be32(h, 164);
        if iterations == 0 {
            return Err(field("mk-digest-iter", "is 0"));
        }
        let digest = KeyDigest { hash, iterations, salt: h[132..164].to_vec(), value: h[112..132].to_vec() };
        let uuid = text(h, 168, 40, "uuid")?;
        let mut keyslots = Vec::new();
        for i in 0..8 {
            let k = 208 + 48 * i;
            let name = |f: &str| format!("key-slot {i} {f}");
            match be32(h, k) {
                0x00AC_71F3 => {}
                0x0000_DEAD => continue,
                other => return Err(field(name("active"), format!("{other:#x} (neither enabled nor disabled)"))),
            }
            let iterations = be32(h, k + 4);
            if iterations == 0 {
                return Err(field(name("iterations"), "is 0"));
            }
            let stripes = u64::from(be32(h, k + 44));
            if stripes == 0 || stripes > MAX_STRIPES {
                return Err(field(name("stripes"), format!("{stripes} (1 to {MAX_STRIPES})")));
            }
            let offset = u64::from(be32(h, k + 40)) * 512;
            let end = offset + key_bytes as u64 * stripes;
            if offset < LUKS1_HEADER as u64 || end > payload_offset {
                return Err(field(
                    name("key-material-offset"),
                    format!("{offset}: its material would overlap the header or the data"),
                ));
            }
            keyslots.push(Keyslot {
                id: i as u32,
                offset,
                area_key_bytes: key_bytes,
                kdf: Kdf::Pbkdf2 { hash, iterations, salt: h[k + 8..k + 40].to_vec() },
                stripes: stripes as usize,
                af_hash: hash,
            });
        }
        Ok(Volume {
            version: 1,
            uuid,
            payload_offset,
            payload_size: None,
            sector_size: 512,
            iv_tweak: 0,
            key_bytes,
            keyslots,
            digest,
        })
    }

    /// The primary LUKS2 header, or the secondary if the primary's checksum is wrong.
    fn luks2_any(head: Vec<u8>, read: &mut ReadAt<'_>) -> Result<Volume, CryptError> {
        match Self::luks2_at(0, head, read) {
            Ok(v) => Ok(v),
            Err(primary) => {
                for at in SECONDARY_OFFSETS {
                    let mut h = vec![0u8; LUKS2_BINARY];
                    if read(at, &mut h).is_ok() && &h[..6] == MAGIC_2_SECONDARY {
                        if let Ok(v) = Self::luks2_at(at, h, read) {
                            return Ok(v);
                        }
                    }
                }
                Err(primary)
            }
        }
    }

    fn luks2_at(at: u64, head: Vec<u8>, read: &mut ReadAt<'_>) -> Result<Volume, CryptError> {
        let version = u16::from_be_bytes([head[6], head[7]]);
        if version != 2 {
            return Err(CryptError::Unsupported(format!("LUKS version {version}")));
        }
        let hdr_size = be64(&head, 8);
        if !(0x4000..=0x40_0000).contains(&hdr_size) || !hdr_size.is_multiple_of(4096) {
            return Err(field("hdr_size", format!("{hdr_size} (16 KiB to 4 MiB, in 4 KiB)")));
        }
        if be64(&head, 256) != at {
            return Err(field("hdr_offset", format!("{} where the header is at {at}", be64(&head, 256))));
        }
        let csum_hash = Hash::parse(&text(&head, 72, 32, "checksum_alg")?, "checksum_alg")?;
        let mut all = vec![0u8; hdr_size as usize];
        all[..LUKS2_BINARY].copy_from_slice(&head);
        read(at + LUKS2_BINARY as u64, &mut all[LUKS2_BINARY..]).map_err(|e| CryptError::Read(e.to_string()))?;
        let stored = head[448..448 + csum_hash.output_len()].to_vec();
        all[448..512].fill(0);
        if csum_hash.digest(&[&all]) != stored {
            return Err(field("csum", "does not match the header (damaged or changed)"));
        }
        let json_area = &all[LUKS2_BINARY..];
        let end = json_area.iter().position(|&c| c == 0).unwrap_or(json_area.len());
        let json: Value = serde_json::from_slice(&json_area[..end]).map_err(|e| field("JSON area", e.to_string()))?;
        let uuid = text(&head, 168, 40, "uuid")?;
        Self::luks2_json(&J { v: &json, path: String::new() }, uuid)
    }

    fn luks2_json(json: &J<'_>, uuid: String) -> Result<Volume, CryptError> {
        let segments = json.get("segments")?;
        let ids = segments.keys()?;
        if ids.len() != 1 {
            return Err(CryptError::Unsupported(format!("{} segments (one is; a volume in re-encryption has more)", ids.len())));
        }
        let seg_id = ids[0].clone();
        let seg = segments.get(&seg_id)?;
        if seg.get("type")?.str()? != "crypt" {
            return Err(field(seg.at("type"), "is not `crypt`"));
        }
        let enc = seg.get("encryption")?.str()?;
        if enc != "aes-xts-plain64" {
            return Err(CryptError::Unsupported(format!("{} `{enc}` (aes-xts-plain64 is)", seg.at("encryption"))));
        }
        let payload_offset = seg.get("offset")?.u64_text()?;
        let payload_size = match seg.get("size")?.str()? {
            "dynamic" => None,
            _ => Some(seg.get("size")?.u64_text()?),
        };
        let iv_tweak = seg.get("iv_tweak")?.u64_text()?;
        let sector_size = seg.get("sector_size")?.num()?;
        if !matches!(sector_size, 512 | 1024 | 2048 | 4096) {
            return Err(field(seg.at("sector_size"), format!("{sector_size} (512 to 4096, a power of two)")));
        }
        let digests = json.get("digests")?;
        let mut found = None;
        for id in digests.keys()? {
            let d = digests.get(&id)?;
            let segs = d.get("segments")?.strings()?;
            if segs.contains(&seg_id) {
                found = Some(d);
                break;
            }
        }
        let d = found.ok_or_else(|| field("digests", format!("none is for segment {seg_id}")))?;
        if d.get("type")?.str()? != "pbkdf2" {
            return Err(CryptError::Unsupported(format!("{} `{}` (pbkdf2 is)", d.at("type"), d.get("type")?.str()?)));
        }
        let digest = KeyDigest {
            hash: Hash::parse(d.get("hash")?.str()?, &d.at("hash"))?,
            iterations: d.get("iterations")?.u32()?,
            salt: d.get("salt")?.base64()?,
            value: d.get("digest")?.base64()?,
        };
        if digest.iterations == 0 || digest.value.is_empty() {
            return Err(field(d.at("digest"), "is empty or never iterated"));
        }
        let all_slots = json.get("keyslots")?;
        let mut keyslots = Vec::new();
        let mut key_bytes = None;
        for id in d.get("keyslots")?.strings()? {
            let k = all_slots.get(&id)?;
            let num: u32 = id.parse().map_err(|_| field(k.path.clone(), "is not a number"))?;
            if k.get("type")?.str()? != "luks2" {
                continue;
            }
            let kb = k.get("key_size")?.num()? as usize;
            if kb != 32 && kb != 64 {
                return Err(field(k.at("key_size"), format!("{kb} (32 or 64 for aes-xts)")));
            }
            key_bytes.get_or_insert(kb);
            let area = k.get("area")?;
            if area.get("type")?.str()? != "raw" || area.get("encryption")?.str()? != "aes-xts-plain64" {
                return Err(CryptError::Unsupported(format!("{}: a raw aes-xts-plain64 area is", area.path)));
            }
            let af = k.get("af")?;
            if af.get("type")?.str()? != "luks1" {
                return Err(CryptError::Unsupported(format!("{} (luks1 is)", af.at("type"))));
            }
            let stripes = af.get("stripes")?.num()?;
            if stripes == 0 || stripes > MAX_STRIPES {
                return Err(field(af.at("stripes"), format!("{stripes} (1 to {MAX_STRIPES})")));
            }
            let offset = area.get("offset")?.u64_text()?;
            let size = area.get("size")?.u64_text()?;
            if size < kb as u64 * stripes || offset.checked_add(size).is_none() {
                return Err(field(area.at("size"), format!("{size}: too small for {stripes} stripes of {kb} bytes")));
            }
            let kdf = k.get("kdf")?;
            let kdf = match kdf.get("type")?.str()? {
                "pbkdf2" => Kdf::Pbkdf2 {
                    hash: Hash::parse(kdf.get("hash")?.str()?, &kdf.at("hash"))?,
                    iterations: kdf.get("iterations")?.u32()?,
                    salt: kdf.get("salt")?.base64()?,
                },
                t @ ("argon2i" | "argon2id") => {
                    let memory = kdf.get("memory")?.num()?;
                    if memory > ARGON2_MAX_KIB {
                        return Err(field(kdf.at("memory"), format!("{memory} KiB (at most {ARGON2_MAX_KIB})")));
                    }
                    Kdf::Argon2 {
                        id: t == "argon2id",
                        time: kdf.get("time")?.u32()?,
                        memory_kib: memory as u32,
                        lanes: kdf.get("cpus")?.u32()?,
                        salt: kdf.get("salt")?.base64()?,
                    }
                }
                other => return Err(CryptError::Unsupported(format!("{} `{other}`", kdf.at("type")))),
            };
            keyslots.push(Keyslot {
                id: num,
                offset,
                area_key_bytes: area.get("key_size")?.num()? as usize,
                kdf,
                stripes: stripes as usize,
                af_hash: Hash::parse(af.get("hash")?.str()?, &af.at("hash"))?,
            });
        }
        let key_bytes = key_bytes.ok_or_else(|| field(d.at("keyslots"), "names no LUKS2 key slot"))?;
        Ok(Volume {
            version: 2,
            uuid,
            payload_offset,
            payload_size,
            sector_size: sector_size as u32,
            iv_tweak,
            key_bytes,
            keyslots,
            digest,
        })
    }

    /// Bytes of encrypted data on a device of `device_size` bytes (whole sectors), or why the
    /// header does not fit it.
    pub fn data_size(&self, device_size: u64) -> Result<u64, CryptError> {
        let room = device_size.checked_sub(self.payload_offset).ok_or_else(|| {
            field("payload offset", format!("{} lies past the device's {device_size} bytes", self.payload_offset))
        })?;
        let size = match self.payload_size {
            Some(s) if s > room => {
                return Err(field("segment size", format!("{s} bytes do not fit the {room} after the header")))
            }
            Some(s) => s,
            None => room,
        };
        Ok(size / u64::from(self.sector_size) * u64::from(self.sector_size))
    }

    /// The work unlocking asks for at most, summed over the key slots and the digest check:
    /// PBKDF2 iterations, Argon2 passes × KiB. A header is the device's to write; what it
    /// asks for is said before it is spent.
    pub fn kdf_work(&self) -> u64 {
        let slots = self.keyslots.iter().map(|s| match &s.kdf {
            Kdf::Pbkdf2 { iterations, .. } => u64::from(*iterations),
            Kdf::Argon2 { time, memory_kib, .. } => u64::from(*time) * u64::from(*memory_kib),
        });
        slots.fold(u64::from(self.digest.iterations), u64::saturating_add)
    }

    /// Opens the volume with `passphrase`, trying each key slot in turn; `read` reads the
    /// key material.
    pub fn unlock(&self, passphrase: &[u8], read: &mut ReadAt<'_>) -> Result<MasterKey, CryptError> {
        let mut first_error = None;
        for slot in &self.keyslots {
            match self.try_slot(slot, passphrase, read) {
                Ok(Some(key)) => return Ok(key),
                Ok(None) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        Err(first_error.unwrap_or(CryptError::WrongKey))
    }

    fn try_slot(&self, slot: &Keyslot, passphrase: &[u8], read: &mut ReadAt<'_>) -> Result<Option<MasterKey>, CryptError> {
        let mut derived = Zeroizing::new(vec![0u8; slot.area_key_bytes]);
        match &slot.kdf {
            Kdf::Pbkdf2 { hash, iterations, salt } => hash.pbkdf2(passphrase, salt, *iterations, &mut derived),
            Kdf::Argon2 { id, time, memory_kib, lanes, salt } => {
                let algorithm = if *id { argon2::Algorithm::Argon2id } else { argon2::Algorithm::Argon2i };
                let params = argon2::Params::new(*memory_kib, *time, *lanes, Some(derived.len()))
                    .map_err(|e| field(format!("keyslots.{}.kdf", slot.id), e.to_string()))?;
                argon2::Argon2::new(algorithm, argon2::Version::V0x13, params)
                    .hash_password_into(passphrase, salt, &mut derived)
                    .map_err(|e| field(format!("keyslots.{}.kdf", slot.id), e.to_string()))?;
            }
        }
        let len = self.key_bytes * slot.stripes;
        let mut material = Zeroizing::new(vec![0u8; len.div_ceil(512) * 512]);
        read(slot.offset, &mut material).map_err(|e| CryptError::Read(e.to_string()))?;
        SectorCipher::new(&derived, 512)?.decrypt(&mut material, 0);
        let key = Zeroizing::new(af_merge(&material[..len], self.key_bytes, slot.stripes, slot.af_hash));
        Ok(self.check(&key).then(|| MasterKey(key)))
    }

    /// Whether `key` is this volume's master key (its digest matches).
    pub fn check(&self, key: &[u8]) -> bool {
        let mut d = Zeroizing::new(vec![0u8; self.digest.value.len()]);
        self.digest.hash.pbkdf2(key, &self.digest.salt, self.digest.iterations, &mut d);
        // Not secret-dependent timing that matters: the digest is on the device for all to see.
        *d == self.digest.value
    }

    /// The data cipher for `key`.
    pub fn cipher(&self, key: &MasterKey) -> Result<SectorCipher, CryptError> {
        SectorCipher::new(key.bytes(), self.sector_size as usize)
    }
}

/// A JSON value with its path, so errors name the field.
struct J<'a> {
    v: &'a Value,
    path: String,
}

impl<'a> J<'a> {
    fn at(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    fn get(&self, key: &str) -> Result<J<'a>, CryptError> {
        let v = self.v.get(key).ok_or_else(|| field(self.at(key), "is missing"))?;
        Ok(J { v, path: self.at(key) })
    }

    fn keys(&self) -> Result<Vec<String>, CryptError> {
        let o = self.v.as_object().ok_or_else(|| field(self.path.clone(), "is not an object"))?;
        Ok(o.keys().cloned().collect())
    }

    fn str(&self) -> Result<&'a str, CryptError> {
        self.v.as_str().ok_or_else(|| field(self.path.clone(), "is not a string"))
    }

    fn strings(&self) -> Result<Vec<String>, CryptError> {
        let a = self.v.as_array().ok_or_else(|| field(self.path.clone(), "is not a list"))?;
        a.iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| field(self.path.clone(), "holds something not a string")))
            .collect()
    }

    fn u64_text(&self) -> Result<u64, CryptError> {
        self.str()?.parse().map_err(|_| field(self.path.clone(), "is not a number"))
    }

    fn num(&self) -> Result<u64, CryptError> {
        self.v.as_u64().ok_or_else(|| field(self.path.clone(), "is not a whole number"))
    }

    fn u32(&self) -> Result<u32, CryptError> {
        let n = self.num()?;
        u32::try_from(n).ok().filter(|&n| n > 0).ok_or_else(|| field(self.path.clone(), format!("{n} (1 to {})", u32::MAX)))
    }

    fn base64(&self) -> Result<Vec<u8>, CryptError> {
        base64::engine::general_purpose::STANDARD.decode(self.str()?).map_err(|_| field(self.path.clone(), "is not base64"))
    }
}
