//! Requests in flight from C: `bulkhead_submit_*` place a request on a queue and return at
//! once; `bulkhead_reap` hands back the answers, under the caller's tokens, in any order. This
//! is what an asynchronous engine (fio's, an event loop's) needs to keep a queue deep from one
//! thread.
//!
//! A queue with requests in flight is held (its [`QueueHandle`]) by the thread that submitted
//! them until every one is reaped; only that thread may submit on or reap from it meanwhile
//! (others get `-EBUSY`). A request longer than the queue carries at once goes as several
//! pieces and is answered once, when the last piece is.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard};
use std::thread::ThreadId;

use bulkhead_client::{Device, FrontRequest, IoError, QueueHandle, SharedSlice};

/// What a request asks, as [`QueueSlot::submit`] takes it.
pub(crate) enum Ask<'a> {
    /// Read into the caller's buffer (valid until the request is reaped).
    Read {
        buf: *mut u8,
        len: u64,
        offset: u64,
    },
    /// Write the caller's bytes (copied into the channel before submit returns).
    Write {
        data: &'a [u8],
        offset: u64,
        fua: bool,
    },
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
    },
}

/// One request of the caller's with pieces still in flight.
struct Pending {
    token: u64,
    /// Where a read's data goes (null for other requests).
    buf: *mut u8,
    pieces_left: u32,
    /// The first failure of a piece (0: none).
    errno: c_int,
}

/// Pieces' tokens: the pending request's index in the high half, the piece in the low.
fn piece_token(req: usize, piece: u32) -> u64 {
    ((req as u64) << 32) | u64::from(piece)
}

/// The asynchronous side of one queue of an attached device.
#[derive(Default)]
pub(crate) struct QueueSlot {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Held while requests are in flight; `'static` stands for the device's life (see
    /// [`QueueSlot::submit`]).
    handle: Option<Held>,
    /// Requests with pieces in flight, indexed by the high half of a piece's token.
    pending: Vec<Option<Pending>>,
    free: Vec<usize>,
    /// Answered requests not yet reaped: (token, 0 or a negative errno).
    done: VecDeque<(u64, c_int)>,
    /// Bytes a piece carries at most (the device's largest request).
    chunk: u64,
}

/// The held queue, with the thread that holds it.
struct Held {
    handle: QueueHandle<'static>,
    owner: ThreadId,
}

// SAFETY: the handle (a lock guard and a turn on the queue) is only used, and only dropped by
// `reap` or `submit`, on the thread recorded in `owner`, which every call checks first; the
// one exception is `QueueSlot::drop` at detach, which the C contract orders after every call
// on the device, when no other thread can touch it.
unsafe impl Send for Held {}

// SAFETY: `buf` is the caller's read buffer, which the C contract keeps valid and untouched
// until the request is reaped; it is written only under the slot's lock.
unsafe impl Send for Pending {}

fn errno_of(e: &IoError) -> c_int {
    e.errno()
}

impl QueueSlot {
    /// Whether requests submitted here are in flight (the queue is held for them).
    pub(crate) fn busy(&self) -> bool {
        self.lock().handle.is_some()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Places `ask` under `token` on queue `idx` of `dev`. If the queue is full, waits for
    /// answers (kept for `reap`) until there is room.
    ///
    /// # Safety
    /// `dev` must outlive this slot (the handle borrows it for as long as requests are in
    /// flight), and a read's buffer must stay valid until its answer is reaped.
    pub(crate) unsafe fn submit(&self, dev: &Device, idx: usize, ask: Ask<'_>, token: u64) -> Result<(), (c_int, String)> {
        let mut g = self.lock();
        let inner = &mut *g;
        let me = std::thread::current().id();
        if inner.handle.as_ref().is_some_and(|h| h.owner != me) {
            return Err((libc::EBUSY, format!("queue {idx} has requests in flight from another thread")));
        }
        let chunk = dev.max_request().max(1);
        inner.chunk = chunk;
        let (start, len) = match ask {
            Ask::Read { len, offset, .. } | Ask::Discard { offset, len } | Ask::WriteZeroes { offset, len } => (offset, len),
            Ask::Write { data, offset, .. } => (offset, data.len() as u64),
            Ask::Flush => (0, 0),
        };
        let pieces = split(start, len, chunk);
        let count = u32::try_from(len.div_ceil(chunk).max(1)).map_err(|_| (libc::EINVAL, "request too long".to_string()))?;
        if inner.handle.is_none() {
            // SAFETY: the caller keeps `dev` alive for as long as this slot, which drops the
            // handle (waiting out its requests) before the device goes.
            let dev: &'static Device = unsafe { &*std::ptr::from_ref(dev) };
            inner.handle = Some(Held { handle: dev.queue(idx), owner: me });
        }
        let buf = match ask {
            Ask::Read { buf, .. } => buf,
            _ => std::ptr::null_mut(),
        };
        let req = match inner.free.pop() {
            Some(i) => i,
            None => {
                inner.pending.push(None);
                inner.pending.len() - 1
            }
        };
        inner.pending[req] = Some(Pending { token, buf, pieces_left: count, errno: 0 });
        for (n, (offset, len)) in pieces.enumerate() {
            let piece = match ask {
                Ask::Read { .. } => FrontRequest::Read { offset, into: len },
                Ask::Write { data, fua, .. } => {
                    let at = (offset - start) as usize;
                    FrontRequest::Write { offset, from: &data[at..at + len as usize], fua }
                }
                Ask::Flush => FrontRequest::Flush,
                Ask::Discard { .. } => FrontRequest::Discard { offset, len },
                Ask::WriteZeroes { .. } => FrontRequest::WriteZeroes { offset, len },
            };
            let t = piece_token(req, n as u32);
            loop {
                let held = inner.handle.as_mut().expect("held above");
                match held.handle.submit(piece, t) {
                    Ok(()) => break,
                    Err(IoError::QueueFull) => {
                        let Inner { handle, pending, free, done, .. } = &mut *inner;
                        let h = &mut handle.as_mut().expect("held above").handle;
                        h.wait(|tok, result, data| answer(pending, free, done, tok, result, data, chunk));
                    }
                    Err(e) => {
                        // Pieces already placed still answer; this one and the rest never will.
                        let p = inner.pending[req].as_mut().expect("placed above");
                        let unplaced = count - n as u32;
                        p.pieces_left -= unplaced;
                        if p.errno == 0 {
                            p.errno = -errno_of(&e);
                        }
                        if p.pieces_left == 0 {
                            inner.pending[req] = None;
                            inner.free.push(req);
                            inner.release_if_idle();
                            return Err((errno_of(&e), e.to_string()));
                        }
                        // The failure is reported when the placed pieces are reaped.
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    /// Hands up to `max` answers to `put(token, result)`, first waiting until at least `min`
    /// are there (or nothing is in flight). Returns how many.
    pub(crate) fn reap(
        &self,
        idx: usize,
        max: usize,
        min: usize,
        mut put: impl FnMut(usize, u64, c_int),
    ) -> Result<usize, (c_int, String)> {
        let mut g = self.lock();
        let inner = &mut *g;
        if inner.handle.as_ref().is_some_and(|h| h.owner != std::thread::current().id()) {
            return Err((libc::EBUSY, format!("queue {idx} has requests in flight from another thread")));
        }
        let min = min.min(max);
        {
            let Inner { handle, pending, free, done, chunk } = inner;
            let chunk = *chunk;
            if let Some(held) = handle.as_mut() {
                let h = &mut held.handle;
                h.poll(|tok, result, data| answer(pending, free, done, tok, result, data, chunk));
                while done.len() < min && h.in_flight() > 0 {
                    h.wait(|tok, result, data| answer(pending, free, done, tok, result, data, chunk));
                }
            }
        }
        let n = max.min(inner.done.len());
        for (i, (token, result)) in inner.done.drain(..n).enumerate() {
            put(i, token, result);
        }
        inner.release_if_idle();
        Ok(n)
    }
}

impl Inner {
    /// Lets the queue go once nothing of this user's is in flight, so other threads (and the
    /// blocking calls) can use it.
    fn release_if_idle(&mut self) {
        if self.handle.as_ref().is_some_and(|h| h.handle.in_flight() == 0) && self.pending.iter().all(Option::is_none) {
            self.handle = None;
        }
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        // Waits out whatever is still in flight (QueueHandle's own drop) before the device
        // the handle borrows goes.
        self.lock().handle = None;
    }
}

/// `(offset, len)` pieces of at most `chunk` bytes covering `len` bytes at `offset` (one
/// empty piece for an empty range, which the device then judges).
fn split(offset: u64, len: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(chunk).max(1)).map(move |i| (offset + i * chunk, (len - i * chunk).min(chunk)))
}

/// One piece answered: a read's data goes to its place in the caller's buffer; the request is
/// done when its last piece is.
fn answer(
    pending: &mut [Option<Pending>],
    free: &mut Vec<usize>,
    done: &mut VecDeque<(u64, c_int)>,
    tok: u64,
    result: Result<u64, IoError>,
    data: Option<SharedSlice<'_>>,
    chunk_of: u64,
) {
    let (req, piece) = ((tok >> 32) as usize, (tok & 0xffff_ffff) as u32);
    let Some(Some(p)) = pending.get_mut(req) else { return };
    match (result, data) {
        (Ok(_), Some(d)) if !p.buf.is_null() => {
            let at = u64::from(piece) * chunk_of;
            // SAFETY: the caller's buffer holds the whole request (checked at submit), of
            // which this piece is `d.len()` bytes at `at`, and stays valid until reaped.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.buf.add(at as usize), d.len()) };
            d.copy_to(dst);
        }
        (Ok(_), _) => {}
        (Err(e), _) => {
            if p.errno == 0 {
                p.errno = -errno_of(&e);
            }
        }
    }
    p.pieces_left -= 1;
    if p.pieces_left == 0 {
        done.push_back((p.token, p.errno));
        pending[req] = None;
        free.push(req);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range_in_chunks() {
        let pieces = |o, l, c| split(o, l, c).collect::<Vec<_>>();
        assert_eq!(pieces(4096, 0, 1024), vec![(4096, 0)]);
        assert_eq!(pieces(0, 3000, 1024), vec![(0, 1024), (1024, 1024), (2048, 952)]);
        assert_eq!(pieces(8192, 2048, 1024), vec![(8192, 1024), (9216, 1024)]);
        assert_eq!(piece_token(3, 2), (3 << 32) | 2);
    }
}
