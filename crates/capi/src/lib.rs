//! The C API of attached applications: `include/bulkhead.h`, built as `libbulkhead.so` and
//! `libbulkhead.a`. A thin layer over [`bulkhead_client::attach_with`]: every function checks
//! its pointers, catches nothing it cannot report (a panic never crosses into C: it is turned
//! into `-EIO`), and leaves a message for [`bulkhead_last_error`].
//!
//! The unsafe code here is the FFI boundary alone: reading the C strings and buffers the
//! caller passes, and owning the device behind the opaque pointer.
#![deny(missing_docs)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use bulkhead_client::{attach_with, AttachError, AttachOptions, Attached, IoError};
use bulkhead_control::ErrorCode;

mod queued;
use queued::{Ask, QueueSlot};

/// An attached device, as C holds it (opaque).
pub struct BulkheadDevice {
    /// The asynchronous side of each queue. Declared before `dev` so that it drops first:
    /// a slot's held queue borrows the device.
    slots: Vec<QueueSlot>,
    dev: Attached,
}

/// One answer of [`bulkhead_reap`] (`struct bulkhead_completion`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BulkheadCompletion {
    /// The token the request was submitted with.
    pub token: u64,
    /// 0, or a negative errno.
    pub result: c_int,
}

/// The `BULKHEAD_FUA` write flag.
pub const BULKHEAD_FUA: c_uint = 1;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, turning a failure or a panic into a negative errno with its message.
fn guarded(f: impl FnOnce() -> Result<(), (c_int, String)>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err((errno, msg))) => {
            set_error(&msg);
            -errno
        }
        Err(_) => {
            set_error("internal error (panic) in libbulkhead");
            -libc::EIO
        }
    }
}

fn io(e: IoError) -> (c_int, String) {
    (e.errno(), e.to_string())
}

fn attach_errno(e: &AttachError) -> c_int {
    match e {
        AttachError::Io { source, .. } => match source.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => libc::ENOENT,
            std::io::ErrorKind::PermissionDenied => libc::EACCES,
            _ => libc::EIO,
        },
        AttachError::Refused(e) => match e.code {
            ErrorCode::InUse => libc::EBUSY,
            ErrorCode::NotFound => libc::ENOENT,
            ErrorCode::Denied => libc::EACCES,
            _ => libc::EIO,
        },
        AttachError::Queue(_) => libc::EIO,
    }
}

/// # Safety
/// `p`, if not null, must point at a NUL-terminated string.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, (c_int, String)> {
    if p.is_null() {
        return Err((libc::EINVAL, format!("{what} is NULL")));
    }
    // SAFETY: not null, and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| (libc::EINVAL, format!("{what} is not UTF-8")))
}

/// # Safety
/// `dev`, if not null, must come from [`bulkhead_attach`] and not be detached.
unsafe fn device<'a>(dev: *const BulkheadDevice) -> Result<&'a Attached, (c_int, String)> {
    // SAFETY: forwarded from this function's contract.
    unsafe { whole(dev) }.map(|d| &d.dev)
}

/// # Safety
/// As [`device`].
unsafe fn whole<'a>(dev: *const BulkheadDevice) -> Result<&'a BulkheadDevice, (c_int, String)> {
    // SAFETY: by the caller's contract a non-null `dev` is a live device from bulkhead_attach.
    unsafe { dev.as_ref() }.ok_or_else(|| (libc::EINVAL, "device is NULL".to_string()))
}

/// # Safety
/// As [`device`].
unsafe fn blocking_queue<'a>(dev: *const BulkheadDevice, queue: c_uint) -> Result<(&'a Attached, usize), (c_int, String)> {
    // SAFETY: forwarded from this function's contract.
    let d = unsafe { whole(dev)? };
    let q = queue_of(&d.dev, queue)?;
    if d.slots[q].busy() {
        return Err((libc::EBUSY, format!("queue {queue} has submitted requests not yet reaped")));
    }
    Ok((&d.dev, q))
}

/// # Safety
/// `buf`, if not null, must be valid for `len` bytes.
unsafe fn bytes<'a>(buf: *const c_void, len: usize) -> Result<&'a [u8], (c_int, String)> {
    if len == 0 {
        return Ok(&[]);
    }
    if buf.is_null() {
        return Err((libc::EINVAL, "buffer is NULL".to_string()));
    }
    // SAFETY: not null, and valid for `len` bytes by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) })
}

/// Attaches to `name` of the serve at `run_dir` with `queues` queues (see `bulkhead.h`).
///
/// # Safety
/// `run_dir` and `name` must be NUL-terminated strings; `err` null or writable.
#[no_mangle]
pub unsafe extern "C" fn bulkhead_attach(
    run_dir: *const c_char,
    name: *const c_char,
    queues: c_uint,
    err: *mut c_int,
) -> *mut BulkheadDevice {
    let mut out = std::ptr::null_mut();
    let rc = guarded(|| {
        // SAFETY: forwarded from this function's contract.
        let (run_dir, name) = unsafe { (text(run_dir, "run_dir")?, text(name, "name")?) };
        let opts = AttachOptions { queues: queues.max(1) };
        let dev = attach_with(Path::new(run_dir), name, opts).map_err(|e| (attach_errno(&e), e.to_string()))?;
        let slots = (0..dev.queue_count()).map(|_| QueueSlot::default()).collect();
        out = Box::into_raw(Box::new(BulkheadDevice { slots, dev }));
        Ok(())
    });
    if !err.is_null() {
        // SAFETY: not null, and writable by the caller's contract.
        unsafe { *err = rc };
    }
    out
}

/// Detaches and frees `dev`.
///
/// # Safety
/// `dev` must be null or come from [`bulkhead_attach`], and be used by no call during or
/// after this one.
#[no_mangle]
pub unsafe extern "C" fn bulkhead_detach(dev: *mut BulkheadDevice) {
    if dev.is_null() {
        return;
    }
    // SAFETY: by the contract, `dev` came from Box::into_raw in bulkhead_attach and is
    // released once, here.
    let d = unsafe { Box::from_raw(dev) };
    let _ = catch_unwind(AssertUnwindSafe(move || drop(d)));
}

/// Size in bytes (0 for a null device).
///
/// # Safety
/// `dev` must be null or a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_size(dev: *const BulkheadDevice) -> u64 {
    // SAFETY: forwarded from this function's contract.
    unsafe { device(dev) }.map_or(0, |d| d.size())
}

/// Queues the device was attached with (0 for a null device).
///
/// # Safety
/// `dev` must be null or a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_queue_count(dev: *const BulkheadDevice) -> c_uint {
    // SAFETY: forwarded from this function's contract.
    unsafe { device(dev) }.map_or(0, |d| d.queue_count() as c_uint)
}

/// 1 if the device refuses writes, else 0.
///
/// # Safety
/// `dev` must be null or a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_read_only(dev: *const BulkheadDevice) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe { device(dev) }.map_or(0, |d| c_int::from(d.read_only()))
}

fn queue_of(d: &Attached, queue: c_uint) -> Result<usize, (c_int, String)> {
    if (queue as usize) < d.queue_count() {
        Ok(queue as usize)
    } else {
        Err((libc::EINVAL, format!("queue {queue}: the device has {}", d.queue_count())))
    }
}

/// Reads `len` bytes at `offset` into `buf`.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`]; `buf` writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn bulkhead_read(
    dev: *mut BulkheadDevice,
    queue: c_uint,
    buf: *mut c_void,
    len: usize,
    offset: u64,
) -> c_int {
    guarded(|| {
        // SAFETY: forwarded from this function's contract.
        let (d, q) = unsafe { blocking_queue(dev, queue)? };
        if len == 0 {
            return Ok(());
        }
        if buf.is_null() {
            return Err((libc::EINVAL, "buffer is NULL".to_string()));
        }
        // SAFETY: not null, and writable for `len` bytes by the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) };
        d.read_into(q, offset, out).map_err(io)
    })
}

/// Writes `len` bytes from `buf` at `offset`.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`]; `buf` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn bulkhead_write(
    dev: *mut BulkheadDevice,
    queue: c_uint,
    buf: *const c_void,
    len: usize,
    offset: u64,
    flags: c_uint,
) -> c_int {
    guarded(|| {
        // SAFETY: forwarded from this function's contract.
        let ((d, q), data) = unsafe { (blocking_queue(dev, queue)?, bytes(buf, len)?) };
        if flags & !BULKHEAD_FUA != 0 {
            return Err((libc::EINVAL, format!("unknown flags {flags:#x}")));
        }
        d.write(q, offset, data, flags & BULKHEAD_FUA != 0).map_err(io)
    })
}

/// Makes every acknowledged write durable.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_flush(dev: *mut BulkheadDevice, queue: c_uint) -> c_int {
    guarded(|| {
        // SAFETY: forwarded from this function's contract.
        let (d, q) = unsafe { blocking_queue(dev, queue)? };
        d.flush(q).map_err(io)
    })
}

/// Discards `len` bytes at `offset`.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_discard(dev: *mut BulkheadDevice, queue: c_uint, offset: u64, len: u64) -> c_int {
    guarded(|| {
        // SAFETY: forwarded from this function's contract.
        let (d, q) = unsafe { blocking_queue(dev, queue)? };
        d.discard(q, offset, len).map_err(io)
    })
}

/// Writes zeroes over `len` bytes at `offset`.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_write_zeroes(dev: *mut BulkheadDevice, queue: c_uint, offset: u64, len: u64) -> c_int {
    guarded(|| {
        // SAFETY: forwarded from this function's contract.
        let (d, q) = unsafe { blocking_queue(dev, queue)? };
        d.write_zeroes(q, offset, len).map_err(io)
    })
}

/// Places `ask` on `queue` under `token`.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`]; a read's buffer valid until reaped.
unsafe fn submit(dev: *mut BulkheadDevice, queue: c_uint, ask: Ask<'_>, token: u64) -> c_int {
    guarded(|| {
        // SAFETY: forwarded from this function's contract.
        let d = unsafe { whole(dev)? };
        let q = queue_of(&d.dev, queue)?;
        // SAFETY: the slot belongs to `d`, and drops before `d.dev` (field order); the read
        // buffer's life is the caller's contract.
        unsafe { d.slots[q].submit(&d.dev, q, ask, token) }
    })
}

/// Submits a read of `len` bytes at `offset` into `buf`, without waiting.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`]; `buf` writable for `len` bytes and
/// left alone until the answer is reaped.
#[no_mangle]
pub unsafe extern "C" fn bulkhead_submit_read(
    dev: *mut BulkheadDevice,
    queue: c_uint,
    buf: *mut c_void,
    len: usize,
    offset: u64,
    token: u64,
) -> c_int {
    if buf.is_null() && len > 0 {
        return guarded(|| Err((libc::EINVAL, "buffer is NULL".to_string())));
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { submit(dev, queue, Ask::Read { buf: buf.cast(), len: len as u64, offset }, token) }
}

/// Submits a write of `len` bytes from `buf` at `offset`, without waiting (the data is copied
/// before the call returns).
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`]; `buf` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn bulkhead_submit_write(
    dev: *mut BulkheadDevice,
    queue: c_uint,
    buf: *const c_void,
    len: usize,
    offset: u64,
    flags: c_uint,
    token: u64,
) -> c_int {
    if flags & !BULKHEAD_FUA != 0 {
        return guarded(|| Err((libc::EINVAL, format!("unknown flags {flags:#x}"))));
    }
    // SAFETY: forwarded from this function's contract.
    let data = match unsafe { bytes(buf, len) } {
        Ok(d) => d,
        Err(e) => return guarded(|| Err(e)),
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { submit(dev, queue, Ask::Write { data, offset, fua: flags & BULKHEAD_FUA != 0 }, token) }
}

/// Submits a flush, without waiting.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_submit_flush(dev: *mut BulkheadDevice, queue: c_uint, token: u64) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe { submit(dev, queue, Ask::Flush, token) }
}

/// Submits a discard of `len` bytes at `offset`, without waiting.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_submit_discard(
    dev: *mut BulkheadDevice,
    queue: c_uint,
    offset: u64,
    len: u64,
    token: u64,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe { submit(dev, queue, Ask::Discard { offset, len }, token) }
}

/// Submits a write of zeroes over `len` bytes at `offset`, without waiting.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`].
#[no_mangle]
pub unsafe extern "C" fn bulkhead_submit_write_zeroes(
    dev: *mut BulkheadDevice,
    queue: c_uint,
    offset: u64,
    len: u64,
    token: u64,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe { submit(dev, queue, Ask::WriteZeroes { offset, len }, token) }
}

/// Moves up to `max` answers of `queue` into `out`, waiting first until `min` are there (or
/// nothing is in flight). Returns how many, or a negative errno.
///
/// # Safety
/// `dev` must be a live device from [`bulkhead_attach`]; `out` writable for `max` entries.
#[no_mangle]
pub unsafe extern "C" fn bulkhead_reap(
    dev: *mut BulkheadDevice,
    queue: c_uint,
    out: *mut BulkheadCompletion,
    max: c_uint,
    min: c_uint,
) -> c_int {
    let mut got = 0usize;
    let rc = guarded(|| {
        // SAFETY: forwarded from this function's contract.
        let d = unsafe { whole(dev)? };
        let q = queue_of(&d.dev, queue)?;
        if max == 0 {
            return Ok(());
        }
        if out.is_null() {
            return Err((libc::EINVAL, "completion array is NULL".to_string()));
        }
        // SAFETY: not null, and writable for `max` entries by the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(out, max as usize) };
        got = d.slots[q].reap(q, out.len(), min as usize, |i, token, result| out[i] = BulkheadCompletion { token, result })?;
        Ok(())
    });
    if rc < 0 {
        rc
    } else {
        got as c_int
    }
}

/// The calling thread's last failure message ("" if none), valid until its next call.
#[no_mangle]
pub extern "C" fn bulkhead_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
