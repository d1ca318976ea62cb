//! The bookkeeping of opened pages, as Chariot's Algorithm 2: which page to protect again
//! when one is opened, and which pages the next call into guarded code must protect. Plain
//! data in fixed arrays, so the fault handler can use it without allocating; tested here
//! without any fault.

/// Most pages a shadow page cache may hold.
pub const MAX_CACHE: usize = 256;
/// Most pages the pool records before the next call protects everything instead.
pub const MAX_POOL: usize = 4096;

/// How captured writes are let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Dynamic write capture: a page opened for an allowed write is protected again right
    /// after that write (one instruction later), and every call protects every page.
    Dwc,
    /// Shadow-cache dynamic write capture: the `cache` most recently opened pages stay open;
    /// the oldest is protected again when a newer one pushes it out while guarded code runs,
    /// or moved to the pool when it does not, and the next call protects only the pool.
    Scdwc {
        /// Pages kept open (C), at most [`MAX_CACHE`].
        cache: usize,
    },
}

/// What becomes of a page pushed out of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evicted {
    /// Protect it now (guarded code is running).
    Protect(u64),
    /// Nothing now: it is in the pool, protected at the next call.
    Pooled,
}

/// What a call into guarded code must protect first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prepare<'a> {
    /// Every guarded page.
    All,
    /// These pages only (the pool).
    Pages(&'a [u64]),
}

/// Opened pages: the cache (a ring of the most recent) and the pool.
#[derive(Debug)]
pub struct Shadow {
    mode: Mode,
    cache: [u64; MAX_CACHE],
    /// Next slot of the ring to fill.
    next: usize,
    /// Slots in use.
    held: usize,
    pool: [u64; MAX_POOL],
    pooled: usize,
    /// Everything must be protected at the next call (the first one, or the pool overflowed).
    all: bool,
}

impl Shadow {
    /// Bookkeeping for `mode`; the cache size is cut to [`MAX_CACHE`].
    pub const fn new(mode: Mode) -> Self {
        let mode = match mode {
            Mode::Scdwc { cache } if cache > MAX_CACHE => Mode::Scdwc { cache: MAX_CACHE },
            m => m,
        };
        Shadow { mode, cache: [0; MAX_CACHE], next: 0, held: 0, pool: [0; MAX_POOL], pooled: 0, all: true }
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    fn capacity(&self) -> usize {
        match self.mode {
            Mode::Dwc => 0,
            Mode::Scdwc { cache } => cache,
        }
    }

    /// Pages open in the cache now.
    pub fn cached(&self) -> usize {
        self.held
    }

    /// The pages the cache holds open, newest first.
    pub fn cached_pages(&self) -> impl Iterator<Item = u64> + '_ {
        let cap = self.capacity();
        (0..self.held).map(move |i| self.cache[(self.next + cap - 1 - i) % cap])
    }

    /// Whether `page` is held open by the cache.
    pub fn is_cached(&self, page: u64) -> bool {
        let cap = self.capacity();
        (0..self.held).any(|i| self.cache[(self.next + cap - 1 - i) % cap] == page)
    }

    /// A page was opened. While guarded code runs (`running`), under DWC the caller protects
    /// it again after the write itself and this returns `None`; under SCDWC the page enters
    /// the cache and the page it pushes out, if any, is returned to protect. While the code
    /// does not run the page is recorded for the next call: in the cache, its eviction going
    /// to the pool (SCDWC), or straight in the pool (DWC, whose calls protect everything
    /// anyway).
    pub fn opened(&mut self, page: u64, running: bool) -> Option<Evicted> {
        let cap = self.capacity();
        if cap == 0 {
            if !running {
                self.pool_push(page);
            }
            return None;
        }
        let out = if self.held == cap {
            let old = self.cache[self.next];
            Some(if running {
                Evicted::Protect(old)
            } else {
                self.pool_push(old);
                Evicted::Pooled
            })
        } else {
            self.held += 1;
            None
        };
        self.cache[self.next] = page;
        self.next = (self.next + 1) % cap;
        out
    }

    fn pool_push(&mut self, page: u64) {
        if self.all {
            return;
        }
        if self.pooled == MAX_POOL {
            self.all = true;
            self.pooled = 0;
            return;
        }
        self.pool[self.pooled] = page;
        self.pooled += 1;
    }

    /// A call into guarded code begins: what to protect. DWC protects everything on every
    /// call; SCDWC everything on the first call (or after the pool overflowed), otherwise the
    /// pool, which it then empties. The cache stays open across calls.
    pub fn prepare(&mut self) -> Prepare<'_> {
        if self.mode == Mode::Dwc || self.all {
            self.all = self.mode == Mode::Dwc;
            self.pooled = 0;
            if self.mode != Mode::Dwc {
                // Everything protected: the cache holds nothing open any more.
                self.held = 0;
            }
            return Prepare::All;
        }
        let n = std::mem::take(&mut self.pooled);
        Prepare::Pages(&self.pool[..n])
    }

    /// Moves the pages the cache holds open to the pool, so the next call protects them: a
    /// different filter is about to run, and what the last one kept open is not its to write.
    pub fn flush(&mut self) {
        let cap = self.capacity();
        for i in 0..self.held {
            let page = self.cache[(self.next + cap - 1 - i) % cap];
            self.pool_push(page);
        }
        self.held = 0;
    }

    /// Records `page`, opened for the kernel to fill, for the next call to protect, without
    /// it entering the cache (whose evictions might protect it again while the kernel writes).
    pub fn pool(&mut self, page: u64) {
        self.pool_push(page);
    }

    /// Drops from the cache the pages `shut` says the caller has protected again, keeping the
    /// others open in their order: a page dropped so is neither open nor owed to the pool.
    pub fn drop_shut(&mut self, shut: impl Fn(u64) -> bool) {
        let cap = self.capacity();
        if cap == 0 {
            return;
        }
        // Oldest first, packed to the front of the ring.
        let mut kept = [0u64; MAX_CACHE];
        let mut n = 0;
        for i in 0..self.held {
            let page = self.cache[(self.next + cap - self.held + i) % cap];
            if !shut(page) {
                kept[n] = page;
                n += 1;
            }
        }
        self.cache[..n].copy_from_slice(&kept[..n]);
        self.held = n;
        self.next = n % cap;
    }

    /// Forgets every opened page: the next call protects everything.
    pub fn reset(&mut self) {
        self.held = 0;
        self.pooled = 0;
        self.all = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dwc_protects_everything_on_every_call_and_caches_nothing() {
        let mut s = Shadow::new(Mode::Dwc);
        assert_eq!(s.prepare(), Prepare::All);
        assert_eq!(s.opened(0x1000, true), None);
        assert_eq!(s.cached(), 0);
        assert_eq!(s.opened(0x2000, false), None);
        assert_eq!(s.prepare(), Prepare::All);
    }

    #[test]
    fn scdwc_keeps_the_last_c_pages_open_and_protects_the_oldest_while_running() {
        let mut s = Shadow::new(Mode::Scdwc { cache: 2 });
        assert_eq!(s.prepare(), Prepare::All);
        assert_eq!(s.opened(0x1000, true), None);
        assert_eq!(s.opened(0x2000, true), None);
        assert!(s.is_cached(0x1000) && s.is_cached(0x2000));
        assert_eq!(s.opened(0x3000, true), Some(Evicted::Protect(0x1000)));
        assert!(!s.is_cached(0x1000) && s.is_cached(0x3000));
        // Nothing pooled while running: the next call protects nothing more.
        assert_eq!(s.prepare(), Prepare::Pages(&[]));
    }

    #[test]
    fn scdwc_pools_what_is_pushed_out_while_not_running_and_protects_only_the_pool_next() {
        let mut s = Shadow::new(Mode::Scdwc { cache: 1 });
        assert_eq!(s.prepare(), Prepare::All);
        assert_eq!(s.opened(0x1000, false), None);
        assert_eq!(s.opened(0x2000, false), Some(Evicted::Pooled));
        assert_eq!(s.opened(0x3000, false), Some(Evicted::Pooled));
        assert_eq!(s.prepare(), Prepare::Pages(&[0x1000, 0x2000]));
        assert!(s.is_cached(0x3000));
        assert_eq!(s.prepare(), Prepare::Pages(&[]));
    }

    #[test]
    fn a_pool_that_overflows_makes_the_next_call_protect_everything() {
        let mut s = Shadow::new(Mode::Scdwc { cache: 1 });
        assert_eq!(s.prepare(), Prepare::All);
        for p in 0..=MAX_POOL as u64 + 1 {
            s.opened(p << 12, false);
        }
        assert_eq!(s.prepare(), Prepare::All);
        assert_eq!(s.cached(), 0);
        assert_eq!(s.prepare(), Prepare::Pages(&[]));
    }

    #[test]
    fn a_flush_sends_the_open_pages_to_the_pool() {
        let mut s = Shadow::new(Mode::Scdwc { cache: 2 });
        assert_eq!(s.prepare(), Prepare::All);
        s.opened(0x1000, true);
        s.opened(0x2000, true);
        s.flush();
        assert_eq!(s.cached(), 0);
        let Prepare::Pages(p) = s.prepare() else { panic!("expected the pool") };
        let mut p = p.to_vec();
        p.sort();
        assert_eq!(p, [0x1000, 0x2000]);
    }

    #[test]
    fn the_cached_pages_are_listed_newest_first() {
        let mut s = Shadow::new(Mode::Scdwc { cache: 2 });
        assert_eq!(s.prepare(), Prepare::All);
        assert_eq!(s.cached_pages().count(), 0);
        s.opened(0x1000, true);
        s.opened(0x2000, false);
        s.opened(0x3000, true);
        assert_eq!(s.cached_pages().collect::<Vec<_>>(), [0x3000, 0x2000]);
    }

    #[test]
    fn pages_dropped_as_shut_leave_the_cache_and_the_rest_keep_their_order() {
        const PAGE: u64 = 0x1000;
        let mut s = Shadow::new(Mode::Scdwc { cache: 4 });
        assert_eq!(s.prepare(), Prepare::All);
        for p in [1, 2, 3, 4, 5] {
            s.opened(p * PAGE, false);
        }
        // The cache holds 2..=5, and 1 went to the pool.
        s.drop_shut(|p| p == 3 * PAGE || p == 5 * PAGE);
        assert_eq!(s.cached_pages().collect::<Vec<_>>(), [4 * PAGE, 2 * PAGE]);
        assert_eq!(s.prepare(), Prepare::Pages(&[PAGE]));
        // The room made is filled before anything is pushed out again.
        assert_eq!(s.opened(6 * PAGE, true), None);
        assert_eq!(s.opened(7 * PAGE, true), None);
        assert_eq!(s.opened(8 * PAGE, true), Some(Evicted::Protect(2 * PAGE)));
        assert_eq!(s.cached_pages().collect::<Vec<_>>(), [8 * PAGE, 7 * PAGE, 6 * PAGE, 4 * PAGE]);
    }

    #[test]
    fn the_cache_is_cut_to_its_most() {
        assert_eq!(Shadow::new(Mode::Scdwc { cache: 10_000 }).mode(), Mode::Scdwc { cache: MAX_CACHE });
    }
}
