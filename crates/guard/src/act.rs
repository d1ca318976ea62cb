//! The access control table: the memory guarded code may write during one call.

/// Most ranges one table holds.
pub const MAX_RANGES: usize = 64;

/// Address ranges guarded code may write: its own state, its scratch, the buffers of the
/// requests it was handed. Fixed capacity, so the fault handler reads it without allocating.
#[derive(Debug, Clone, Copy)]
pub struct Act {
    ranges: [(u64, u64); MAX_RANGES],
    len: usize,
}

impl Default for Act {
    fn default() -> Self {
        Self::new()
    }
}

impl Act {
    /// An empty table: nothing may be written.
    pub const fn new() -> Self {
        Act { ranges: [(0, 0); MAX_RANGES], len: 0 }
    }

    /// Allows `[start, start + len)`. Fails when the table is full.
    pub fn allow(&mut self, start: u64, len: u64) -> Result<(), ActFull> {
        if len == 0 {
            return Ok(());
        }
        if self.len == MAX_RANGES {
            return Err(ActFull);
        }
        self.ranges[self.len] = (start, start.saturating_add(len));
        self.len += 1;
        Ok(())
    }

    /// Allows the bytes of `buf`.
    pub fn allow_slice<T>(&mut self, buf: &[T]) -> Result<(), ActFull> {
        self.allow(buf.as_ptr() as u64, std::mem::size_of_val(buf) as u64)
    }

    /// Whether a write at `addr` is allowed.
    pub fn allows(&self, addr: u64) -> bool {
        self.ranges[..self.len].iter().any(|&(s, e)| addr >= s && addr < e)
    }

    /// Whether the table allows any byte of `[start, end)`.
    pub fn reaches(&self, start: u64, end: u64) -> bool {
        self.ranges().iter().any(|&(s, e)| s < end && start < e)
    }

    /// The allowed ranges, as (start, end).
    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges[..self.len]
    }

    /// Empties the table.
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

/// The table holds [`MAX_RANGES`] ranges already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActFull;

impl std::fmt::Display for ActFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the access control table holds {MAX_RANGES} ranges already")
    }
}

impl std::error::Error for ActFull {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_exactly_its_ranges() {
        let mut a = Act::new();
        a.allow(0x1000, 0x10).unwrap();
        a.allow(0x5000, 0).unwrap();
        assert!(a.allows(0x1000) && a.allows(0x100f));
        assert!(!a.allows(0xfff) && !a.allows(0x1010) && !a.allows(0x5000));
        assert_eq!(a.ranges().len(), 1);
    }

    #[test]
    fn a_full_table_says_so() {
        let mut a = Act::new();
        for i in 0..MAX_RANGES as u64 {
            a.allow(i * 0x1000, 8).unwrap();
        }
        assert_eq!(a.allow(0xfff_0000, 8), Err(ActFull));
    }
}
