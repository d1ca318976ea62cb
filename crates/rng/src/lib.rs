//! The one pseudo-random generator of bulkhead: workloads and the disk simulator draw from it,
//! the `error` filter picks the requests it fails with it, benchmarks and tests choose offsets,
//! kill times and garbage with it. SplitMix64: a few instructions a number, good enough for
//! all of these, and the same seed gives the same numbers on every machine, so a run and a
//! failure reproduce. Not for anything secret.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

/// A SplitMix64 generator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`; every seed, 0 too, gives a sequence of its own.
    pub const fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// Where the generator stands, to carry it somewhere and [`new`](Self::new) it back.
    pub const fn state(&self) -> u64 {
        self.0
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (0 if `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift: no modulo bias worth speaking of, no division.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let x = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&x[..chunk.len()]);
        }
    }
}

/// `len` bytes drawn from `seed`: the same seed and length, the same bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng::new(seed).fill(&mut v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_numbers_and_another_seed_others() {
        let a: Vec<u64> = (0..4).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let b: Vec<u64> = (0..4).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let c: Vec<u64> = (0..4).scan(Rng::new(8), |r, _| Some(r.next_u64())).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        // SplitMix64's published first output for seed 0.
        assert_eq!(Rng::new(0).next_u64(), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn below_and_unit_stay_in_range_and_spread() {
        let mut r = Rng::new(1);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            let x = r.below(10);
            seen[x as usize] += 1;
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
        }
        assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
        assert_eq!(r.below(0), 0);
    }

    #[test]
    fn a_carried_state_goes_on_where_it_stood() {
        let mut r = Rng::new(42);
        r.next_u64();
        let mut again = Rng::new(r.state());
        assert_eq!(r.next_u64(), again.next_u64());
        assert_eq!(pattern(3, 13), pattern(3, 13));
        assert_eq!(pattern(3, 13).len(), 13);
    }
}
