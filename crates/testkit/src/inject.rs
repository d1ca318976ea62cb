//! What faults a guarded filter is to make on purpose (the `faults` module makes them): where
//! they aim, how often, and the environment variable the test driver reads them from. Plain
//! data, so that `bench guard`'s report can name the targets in any build.

/// Where an injected fault writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InjectTarget {
    /// The descriptor ring of a queue.
    Ring,
    /// Another filter's state.
    Filter,
    /// The runtime's heap.
    Heap,
    /// A block of the filter's own heap it has just freed.
    Freed,
    /// Anywhere in the guarded memory outside the filter's own.
    Random,
    /// Seed-like: through a corrupted live pointer, a word of guarded memory that points into
    /// guarded memory with one of its bits 3 to 12 flipped.
    Pointer,
    /// Seed-like: up to 512 bytes past the end of a buffer the call was given (its scratch,
    /// its data).
    Overrun,
    /// Seed-like: a word drawn over the guarded memory outside the filter's own, weighted by
    /// size.
    Wild,
}

impl InjectTarget {
    /// Every target, as `BULKHEAD_TEST_GUARD_INJECT` spells them.
    pub const ALL: [(&'static str, InjectTarget); 8] = [
        ("ring", InjectTarget::Ring),
        ("filter", InjectTarget::Filter),
        ("heap", InjectTarget::Heap),
        ("freed", InjectTarget::Freed),
        ("random", InjectTarget::Random),
        ("pointer", InjectTarget::Pointer),
        ("overrun", InjectTarget::Overrun),
        ("wild", InjectTarget::Wild),
    ];

    /// As `BULKHEAD_TEST_GUARD_INJECT` spells it.
    pub fn as_str(self) -> &'static str {
        Self::ALL.iter().find(|(_, t)| *t == self).map_or("?", |(n, _)| n)
    }

    /// Whether this is one of the seed-like faults, modelled on bugs a fault-injection tool
    /// plants (Chariot's population): they strike before or after the filter's own work in
    /// the call, and are made only where DWC stops them. The others aim at chosen state, at
    /// the start of a call.
    pub fn seed_like(self) -> bool {
        matches!(self, InjectTarget::Pointer | InjectTarget::Overrun | InjectTarget::Wild)
    }
}

/// Faults made on purpose in a filter, to test and measure what capture isolates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectSpec {
    /// Where the faults write.
    pub target: InjectTarget,
    /// One fault every this many calls into the filter, at a random call of each span.
    pub every: u64,
    /// Of the random choices.
    pub seed: u64,
}

/// What the test driver reads faults from: `FILTER:TARGET[:EVERY[:SEED]]`, with FILTER the
/// filter's place in the chain from 1 at the frontend side, TARGET one of
/// [`InjectTarget::ALL`], EVERY at least 1 (default 1000) and SEED any number (default 1).
pub const INJECT_ENV: &str = "BULKHEAD_TEST_GUARD_INJECT";

impl InjectSpec {
    /// `FILTER:TARGET[:EVERY[:SEED]]` (see [`INJECT_ENV`]): the filter's place in the chain,
    /// from 0, and its faults.
    pub fn parse_env(s: &str) -> Result<(usize, InjectSpec), crate::KitError> {
        let bad = |why: String| crate::KitError(format!("{INJECT_ENV}={s:?}: {why} (FILTER:TARGET[:EVERY[:SEED]])"));
        let parts: Vec<&str> = s.split(':').collect();
        if !(2..=4).contains(&parts.len()) {
            return Err(bad("two to four fields".into()));
        }
        let filter = match parts[0].parse::<usize>() {
            Ok(n) if n >= 1 => n - 1,
            _ => return Err(bad(format!("filter `{}` is not a number from 1", parts[0]))),
        };
        let Some(&(_, target)) = InjectTarget::ALL.iter().find(|(n, _)| *n == parts[1]) else {
            let names: Vec<&str> = InjectTarget::ALL.iter().map(|(n, _)| *n).collect();
            return Err(bad(format!("target `{}` is not one of {}", parts[1], names.join(", "))));
        };
        let every = match parts.get(2).map(|e| e.parse::<u64>()) {
            None => 1000,
            Some(Ok(e)) if e >= 1 => e,
            Some(_) => return Err(bad(format!("every `{}` is not a number from 1", parts[2]))),
        };
        let seed = match parts.get(3).map(|e| e.parse::<u64>()) {
            None => 1,
            Some(Ok(e)) => e,
            Some(Err(_)) => return Err(bad(format!("seed `{}` is not a number", parts[3]))),
        };
        Ok((filter, InjectSpec { target, every, seed }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_names_the_filter_from_1_and_refuses_what_is_not_a_fault() {
        let ring = InjectSpec { target: InjectTarget::Ring, every: 1000, seed: 1 };
        assert_eq!(InjectSpec::parse_env("1:ring"), Ok((0, ring)));
        let random = InjectSpec { target: InjectTarget::Random, every: 3000, seed: 7 };
        assert_eq!(InjectSpec::parse_env("2:random:3000:7"), Ok((1, random)));
        for (bad, why) in [
            ("ring", "two to four"),
            ("0:ring", "filter `0`"),
            ("1:stack", "`stack` is not one of ring, filter, heap, freed, random, pointer, overrun, wild"),
            ("1:heap:0", "every `0`"),
            ("1:heap:5:x", "seed `x`"),
            ("1:heap:5:1:9", "two to four"),
        ] {
            let e = InjectSpec::parse_env(bad).unwrap_err();
            assert!(e.0.contains(why) && e.0.contains(INJECT_ENV), "{bad}: {e}");
        }
    }
}
