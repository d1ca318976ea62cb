//! AES-XTS over sectors with the plain64 IV: the sector number, little-endian, is the tweak
//! (IEEE 1619, as dm-crypt, cryptsetup and qemu use it for `aes-xts-plain64`).

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
use aes::{Aes128, Aes256};

use crate::CryptError;

/// Blocks encrypted in one call, so that AES-NI pipelines them.
const BATCH: usize = 32;

/// One of the two AES keys of XTS.
enum Aes {
    A128(Box<Aes128>),
    A256(Box<Aes256>),
}

impl Aes {
    fn new(key: &[u8]) -> Self {
        match key.len() {
            16 => Aes::A128(Box::new(Aes128::new(GenericArray::from_slice(key)))),
            _ => Aes::A256(Box::new(Aes256::new(GenericArray::from_slice(key)))),
        }
    }

    fn encrypt(&self, blocks: &mut [aes::Block]) {
        match self {
            Aes::A128(c) => c.encrypt_blocks(blocks),
            Aes::A256(c) => c.encrypt_blocks(blocks),
        }
    }

    fn decrypt(&self, blocks: &mut [aes::Block]) {
        match self {
            Aes::A128(c) => c.decrypt_blocks(blocks),
            Aes::A256(c) => c.decrypt_blocks(blocks),
        }
    }
}

/// `aes-xts-plain64` with one key, over sectors of one size. The AES key schedules are
/// zeroed when it is dropped.
pub struct SectorCipher {
    data: Aes,
    tweak: Aes,
    sector: usize,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SectorCipher").field("sector", &self.sector).finish_non_exhaustive()
    }
}

impl SectorCipher {
    /// A cipher with the XTS key `key` (32 bytes: AES-128, 64: AES-256; the first half
    /// encrypts data, the second the tweak) over sectors of `sector` bytes (a power of two,
    /// 512 to 4096).
    pub fn new(key: &[u8], sector: usize) -> Result<Self, CryptError> {
        if key.len() != 32 && key.len() != 64 {
            return Err(CryptError::Unsupported(format!("an aes-xts key of {} bits (256 and 512 are)", key.len() * 8)));
        }
        if !sector.is_power_of_two() || !(512..=4096).contains(&sector) {
            return Err(CryptError::Unsupported(format!("sectors of {sector} bytes (512 to 4096, a power of two)")));
        }
        let (a, b) = key.split_at(key.len() / 2);
        Ok(SectorCipher { data: Aes::new(a), tweak: Aes::new(b), sector })
    }

    /// Bytes per sector.
    pub fn sector_size(&self) -> usize {
        self.sector
    }

    /// Encrypts `buf`, whole sectors, the first being number `first`.
    pub fn encrypt(&self, buf: &mut [u8], first: u64) {
        self.each_sector(buf, first, |c, blocks| c.data.encrypt(blocks));
    }

    /// Decrypts `buf`, whole sectors, the first being number `first`.
    pub fn decrypt(&self, buf: &mut [u8], first: u64) {
        self.each_sector(buf, first, |c, blocks| c.data.decrypt(blocks));
    }

    fn each_sector(&self, buf: &mut [u8], first: u64, op: impl Fn(&Self, &mut [aes::Block])) {
        assert!(buf.len().is_multiple_of(self.sector), "whole sectors only");
        let mut blocks = [aes::Block::default(); BATCH];
        let mut tweaks = [0u128; BATCH];
        for (i, sector) in buf.chunks_exact_mut(self.sector).enumerate() {
            let mut t = [GenericArray::clone_from_slice(&u128::from(first + i as u64).to_le_bytes())];
            self.tweak.encrypt(&mut t);
            let mut tweak = u128::from_le_bytes(t[0].into());
            for batch in sector.chunks_exact_mut(16 * BATCH) {
                for (j, (block, plain)) in blocks.iter_mut().zip(batch.chunks_exact(16)).enumerate() {
                    tweaks[j] = tweak;
                    let x = u128::from_le_bytes(plain.try_into().expect("16 bytes")) ^ tweak;
                    *block = GenericArray::from(x.to_le_bytes());
                    tweak = times_alpha(tweak);
                }
                op(self, &mut blocks);
                for ((block, out), t) in blocks.iter().zip(batch.chunks_exact_mut(16)).zip(&tweaks) {
                    let x = u128::from_le_bytes((*block).into()) ^ t;
                    out.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        blocks.iter_mut().for_each(|b| *b = aes::Block::default());
    }
}

/// Multiplication by the primitive element of GF(2^128), XTS's little-endian convention.
fn times_alpha(t: u128) -> u128 {
    let carry = t >> 127;
    (t << 1) ^ (carry * 0x87)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// IEEE 1619-2007 vectors 1 to 3 are one 32-byte data unit each; XTS over them as a
    /// 32-byte "sector" is the same computation as over the first 32 bytes of a sector.
    fn first_32(key: &[u8], seq: u64, plain: &[u8]) -> Vec<u8> {
        // A 512-byte sector whose first 32 bytes are the vector's: XTS encrypts blocks in order
        // with the tweak advancing, so its first two blocks are the vector's data unit.
        let c = SectorCipher::new(key, 512).unwrap();
        let mut s = vec![0u8; 512];
        s[..32].copy_from_slice(plain);
        c.encrypt(&mut s, seq);
        s[..32].to_vec()
    }

    #[test]
    fn ieee_1619_vectors_1_to_3() {
        assert_eq!(first_32(&[0; 32], 0, &[0; 32]), hex("917cf69ebd68b2ec9b9fe9a3eadda692cd43d2f59598ed858c02c2652fbf922e"));
        let mut k = vec![0x11; 16];
        k.extend([0x22; 16]);
        assert_eq!(
            first_32(&k, 0x33_3333_3333, &[0x44; 32]),
            hex("c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0")
        );
        let mut k = hex("fffefdfcfbfaf9f8f7f6f5f4f3f2f1f0");
        k.extend([0x22; 16]);
        assert_eq!(
            first_32(&k, 0x33_3333_3333, &[0x44; 32]),
            hex("af85336b597afc1a900b2eb21ec949d292df4c047e0b21532186a5971a227a89")
        );
    }

    #[test]
    fn ieee_1619_vector_10_a_512_byte_unit_with_256_bit_keys() {
        let mut key = hex("2718281828459045235360287471352662497757247093699959574966967627");
        key.extend(hex("3141592653589793238462643383279502884197169399375105820974944592"));
        let c = SectorCipher::new(&key, 512).unwrap();
        let plain: Vec<u8> = (0..512).map(|i| i as u8).collect();
        let mut s = plain.clone();
        c.encrypt(&mut s, 0xff);
        assert_eq!(s[..32], hex("1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b")[..]);
        assert_eq!(s[480..], hex("773dad38014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151")[..]);
        c.decrypt(&mut s, 0xff);
        assert_eq!(s, plain);
    }

    #[test]
    fn sectors_are_numbered_from_the_first_and_each_decrypts_alone() {
        let c = SectorCipher::new(&[7; 64], 4096).unwrap();
        let plain: Vec<u8> = (0..3 * 4096).map(|i| (i * 13) as u8).collect();
        let mut all = plain.clone();
        c.encrypt(&mut all, 10);
        let mut second = all[4096..8192].to_vec();
        c.decrypt(&mut second, 11);
        assert_eq!(second, plain[4096..8192]);
        assert!(SectorCipher::new(&[0; 48], 512).is_err());
        assert!(SectorCipher::new(&[0; 64], 1000).is_err());
    }
}
