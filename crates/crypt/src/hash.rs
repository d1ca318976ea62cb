//! The hashes LUKS headers name, PBKDF2 over them, and the anti-forensic merge of a key slot.

use sha1::Sha1;
use sha2::{Digest, Sha256, Sha512};

use crate::CryptError;

/// A hash a LUKS header may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hash {
    /// SHA-1 (old LUKS1 volumes).
    Sha1,
    /// SHA-256 (the default of cryptsetup and qemu).
    Sha256,
    /// SHA-512.
    Sha512,
}

impl Hash {
    /// The hash a header names (`sha256`), or why it cannot be used.
    pub fn parse(name: &str, field: &str) -> Result<Self, CryptError> {
        match name.to_ascii_lowercase().as_str() {
            "sha1" => Ok(Hash::Sha1),
            "sha256" => Ok(Hash::Sha256),
            "sha512" => Ok(Hash::Sha512),
            other => Err(CryptError::Unsupported(format!("{field} `{other}` (sha1, sha256 and sha512 are)"))),
        }
    }

    /// Bytes of output.
    pub fn output_len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }

    /// The hash of the concatenation of `parts`.
    pub fn digest(self, parts: &[&[u8]]) -> Vec<u8> {
        fn run<D: Digest>(parts: &[&[u8]]) -> Vec<u8> {
            let mut d = D::new();
            parts.iter().for_each(|p| d.update(p));
            d.finalize().to_vec()
        }
        match self {
            Hash::Sha1 => run::<Sha1>(parts),
            Hash::Sha256 => run::<Sha256>(parts),
            Hash::Sha512 => run::<Sha512>(parts),
        }
    }

    /// PBKDF2 with HMAC over this hash (RFC 8018) into `out`.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
        match self {
            Hash::Sha1 => pbkdf2::pbkdf2_hmac::<Sha1>(password, salt, iterations, out),
            Hash::Sha256 => pbkdf2::pbkdf2_hmac::<Sha256>(password, salt, iterations, out),
            Hash::Sha512 => pbkdf2::pbkdf2_hmac::<Sha512>(password, salt, iterations, out),
        }
    }
}

/// LUKS's anti-forensic merge: the key of `key_len` bytes from `material`, `stripes` blocks of
/// that size, each but the last folded in with XOR and diffused with `hash` (the LUKS1
/// on-disk format specification, section 2.4).
pub fn af_merge(material: &[u8], key_len: usize, stripes: usize, hash: Hash) -> Vec<u8> {
    assert_eq!(material.len(), key_len * stripes, "material is the stripes");
    let mut d = vec![0u8; key_len];
    let mut stripes = material.chunks_exact(key_len);
    let last = stripes.next_back().expect("at least one stripe");
    for s in stripes {
        d.iter_mut().zip(s).for_each(|(a, b)| *a ^= b);
        d = diffuse(&d, hash);
    }
    d.iter_mut().zip(last).for_each(|(a, b)| *a ^= b);
    d
}

/// Hashes each digest-sized piece of `d` with its index in front.
fn diffuse(d: &[u8], hash: Hash) -> Vec<u8> {
    let mut out = Vec::with_capacity(d.len());
    for (i, piece) in d.chunks(hash.output_len()).enumerate() {
        let h = hash.digest(&[&(i as u32).to_be_bytes(), piece]);
        out.extend_from_slice(&h[..piece.len()]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbkdf2_matches_rfc_6070() {
        let mut out = [0u8; 20];
        Hash::Sha1.pbkdf2(b"password", b"salt", 4096, &mut out);
        let want = [
            0x4b, 0x00, 0x79, 0x01, 0xb7, 0x65, 0x48, 0x9a, 0xbe, 0xad, 0x49, 0xd9, 0x26, 0xf7, 0x21, 0xd0, 0x65, 0xa4, 0x29,
            0xc1,
        ];
        assert_eq!(out, want);
    }

    #[test]
    fn one_stripe_is_the_key_and_merging_undoes_a_split() {
        assert_eq!(af_merge(&[1, 2, 3, 4], 4, 1, Hash::Sha256), vec![1, 2, 3, 4]);
        // Split by the specification's steps with chosen "random" stripes, then merge.
        let key: Vec<u8> = (0..64).collect();
        let stripes = 5;
        let mut material = Vec::new();
        let mut d = vec![0u8; 64];
        for s in 0..stripes - 1 {
            let r: Vec<u8> = (0..64).map(|i| (i * 31 + s * 7) as u8).collect();
            d.iter_mut().zip(&r).for_each(|(a, b)| *a ^= b);
            d = diffuse(&d, Hash::Sha1);
            material.extend(r);
        }
        material.extend(d.iter().zip(&key).map(|(a, b)| a ^ b));
        assert_eq!(af_merge(&material, 64, stripes, Hash::Sha1), key);
    }
}
