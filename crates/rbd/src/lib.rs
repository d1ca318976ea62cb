//! librados and librbd, as the `rbd` backend uses them.
//!
//! A small binding of bulkhead's own over librbd's C API rather than a crate from the registry:
//! the Rust bindings there (`ceph-rbd`, `librbd-sys`) date from 2016–2018 and have no
//! write-zeroes, or need Ceph 17 and later. The C API is stable across releases, and the
//! backend needs about 25 of its functions.
//!
//! The libraries are loaded at run time ([`Api::load`]) and not linked: `bulkhead` runs on a
//! host without Ceph, and only a domain that serves an `rbd` device loads them, before it is
//! confined (after that it can open no file).
//!
//! Completions are not taken through librbd's callbacks, which would run on librbd's own
//! threads: the image notifies an eventfd ([`Image::notify_on`]) and the domain's loop collects
//! what completed with [`Image::poll_completions`], on its own thread.
#![deny(missing_docs)]

mod ffi;

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::Arc;

pub use ffi::Api;

/// A librados or librbd call failed.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    /// The libraries could not be loaded.
    #[error("cannot load {lib}: {why} (install librbd1)")]
    Load {
        /// Which library or symbol.
        lib: String,
        /// What the loader said.
        why: String,
    },
    /// A call returned an error.
    #[error("{call}: {}", std::io::Error::from_raw_os_error(*.errno))]
    Call {
        /// What was called, with its argument where it helps.
        call: String,
        /// The positive errno.
        errno: i32,
    },
    /// An argument had a NUL byte in it.
    #[error("{0} contains a NUL byte")]
    Nul(&'static str),
}

impl RbdError {
    /// The errno of a failed call, if it was one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            RbdError::Call { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

fn check(call: impl FnOnce() -> String, r: i32) -> Result<i32, RbdError> {
    if r < 0 {
        Err(RbdError::Call { call: call(), errno: -r })
    } else {
        Ok(r)
    }
}

fn cstr(what: &'static str, s: &str) -> Result<CString, RbdError> {
    CString::new(s).map_err(|_| RbdError::Nul(what))
}

/// A connection to a cluster, and an I/O context in one pool (and namespace).
pub struct Cluster {
    api: Arc<Api>,
    rados: *mut c_void,
    ioctx: *mut c_void,
    connected: bool,
}

// SAFETY: librados handles may be used from any thread; the domain uses them from one.
unsafe impl Send for Cluster {}

impl Cluster {
    /// A cluster handle for client `user` (without the `client.` prefix), not yet connected.
    pub fn create(api: Arc<Api>, user: &str) -> Result<Cluster, RbdError> {
        let id = cstr("user", user)?;
        let mut rados = std::ptr::null_mut();
        // SAFETY: a valid out pointer and a NUL-terminated id.
        check(|| "rados_create".into(), unsafe { (api.rados_create)(&mut rados, id.as_ptr()) })?;
        Ok(Cluster { api, rados, ioctx: std::ptr::null_mut(), connected: false })
    }

    /// Sets one configuration option (`mon_host`, `key`, `rbd_cache`, …) before connecting.
    pub fn set(&mut self, option: &str, value: &str) -> Result<(), RbdError> {
        let (o, v) = (cstr("option", option)?, cstr("value", value)?);
        // SAFETY: a live handle and NUL-terminated strings.
        check(|| format!("rados_conf_set({option})"), unsafe { (self.api.rados_conf_set)(self.rados, o.as_ptr(), v.as_ptr()) })?;
        Ok(())
    }

    /// Connects, and opens an I/O context on `pool` (and `namespace`, if not empty).
    pub fn connect(&mut self, pool: &str, namespace: &str) -> Result<(), RbdError> {
        // SAFETY: a live handle.
        check(|| "rados_connect".into(), unsafe { (self.api.rados_connect)(self.rados) })?;
        self.connected = true;
        let p = cstr("pool", pool)?;
        // SAFETY: a connected handle, a NUL-terminated pool name and a valid out pointer.
        check(|| format!("pool `{pool}`"), unsafe { (self.api.rados_ioctx_create)(self.rados, p.as_ptr(), &mut self.ioctx) })?;
        if !namespace.is_empty() {
            let ns = cstr("namespace", namespace)?;
            // SAFETY: a live I/O context and a NUL-terminated name (copied by librados).
            unsafe { (self.api.rados_ioctx_set_namespace)(self.ioctx, ns.as_ptr()) };
        }
        Ok(())
    }

    /// This client's address (`[v2:ip:0/nonce,…]`): what a lock it holds is named after.
    pub fn addrs(&self) -> Result<String, RbdError> {
        let mut p: *mut c_char = std::ptr::null_mut();
        // SAFETY: a connected handle and a valid out pointer.
        check(|| "rados_getaddrs".into(), unsafe { (self.api.rados_getaddrs)(self.rados, &mut p) })?;
        // SAFETY: librados returned a NUL-terminated string it allocated.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        // SAFETY: handing it back once.
        unsafe { (self.api.rados_buffer_free)(p) };
        Ok(s)
    }

    /// Evicts the client at `addr` from the cluster for `seconds` (`ceph osd blocklist add`):
    /// its watches and its locks go at once, and it can do nothing more. For a client known to
    /// be dead.
    pub fn blocklist(&self, addr: &str, seconds: u32) -> Result<(), RbdError> {
        let a = cstr("client address", addr)?;
        // SAFETY: a connected handle and a NUL-terminated address, which librados only reads
        // (its prototype lacks the `const`).
        check(|| format!("rados_blocklist_add({addr})"), unsafe {
            (self.api.rados_blocklist_add)(self.rados, a.as_ptr().cast_mut(), seconds)
        })?;
        Ok(())
    }

    /// Opens image `name` in the pool; `read_only`, it never takes the image's exclusive lock
    /// nor asks its owner for it, and every write fails.
    pub fn open(&self, name: &str, read_only: bool) -> Result<Image, RbdError> {
        let n = cstr("image", name)?;
        let mut image = std::ptr::null_mut();
        let open = if read_only { self.api.rbd_open_read_only } else { self.api.rbd_open };
        // SAFETY: a live I/O context, a NUL-terminated name, no snapshot, a valid out pointer.
        check(|| format!("image `{name}`"), unsafe { open(self.ioctx, n.as_ptr(), &mut image, std::ptr::null()) })?;
        Ok(Image { api: self.api.clone(), image })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: each handle is live, destroyed once, and no image of it is open (an `Image`
        // is dropped before its cluster by the backend that holds both).
        unsafe {
            if !self.ioctx.is_null() {
                (self.api.rados_ioctx_destroy)(self.ioctx);
            }
            if !self.rados.is_null() {
                (self.api.rados_shutdown)(self.rados);
            }
        }
    }
}

/// Image geometry.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    /// Bytes.
    pub size: u64,
    /// Object size: the unit of allocation and of striping.
    pub object_size: u64,
}

/// One completed request: the argument it was started with and its result (bytes or a
/// negative errno).
#[derive(Debug, Clone, Copy)]
pub struct Completed {
    /// What [`Image::start`] was given.
    pub arg: u64,
    /// librbd's return value.
    pub result: isize,
}

/// An operation to start, in the project's one request vocabulary, its buffers as iovecs
/// (FUA is the caller's: librbd has no per-write flag for it).
pub type Aio<'a> = bulkhead_block::Command<&'a [libc::iovec], &'a [libc::iovec]>;

/// An open image.
pub struct Image {
    api: Arc<Api>,
    image: *mut c_void,
}

// SAFETY: librbd images may be used from any thread; the domain uses one from one thread.
unsafe impl Send for Image {}

/// `EVENT_TYPE_EVENTFD` in librbd.h.
const EVENT_TYPE_EVENTFD: i32 = 2;
/// `RBD_LOCK_MODE_EXCLUSIVE` in librbd.h.
const LOCK_MODE_EXCLUSIVE: i32 = 0;

/// librbd's `rbd_image_watcher_t`.
#[repr(C)]
struct Watcher {
    addr: *mut c_char,
    id: i64,
    cookie: u64,
}

/// librbd's `rbd_image_info_t`.
#[repr(C)]
struct ImageInfo {
    size: u64,
    obj_size: u64,
    num_objs: u64,
    order: i32,
    block_name_prefix: [c_char; 24],
    parent_pool: i64,
    parent_name: [c_char; 96],
}

impl Image {
    /// Size and object size.
    pub fn stat(&self) -> Result<Stat, RbdError> {
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut info: ImageInfo = unsafe { std::mem::zeroed() };
        // SAFETY: a live image and a buffer of the size given.
        check(|| "rbd_stat".into(), unsafe {
            (self.api.rbd_stat)(self.image, (&mut info as *mut ImageInfo).cast(), std::mem::size_of::<ImageInfo>())
        })?;
        Ok(Stat { size: info.size, object_size: info.obj_size })
    }

    /// Completions are announced on eventfd `fd` (which must outlive the image).
    pub fn notify_on(&self, fd: i32) -> Result<(), RbdError> {
        // SAFETY: a live image; librbd writes to `fd`, which the caller keeps open.
        check(|| "rbd_set_image_notification".into(), unsafe {
            (self.api.rbd_set_image_notification)(self.image, fd, EVENT_TYPE_EVENTFD)
        })?;
        Ok(())
    }

    /// The clients holding the image's exclusive lock.
    pub fn lock_owners(&self) -> Result<Vec<String>, RbdError> {
        let mut owners: [*mut c_char; 8] = [std::ptr::null_mut(); 8];
        let mut n: usize = owners.len();
        let mut mode = 0i32;
        // SAFETY: a live image; an array of `n` pointers for librbd to fill.
        let r = unsafe { (self.api.rbd_lock_get_owners)(self.image, &mut mode, owners.as_mut_ptr(), &mut n) };
        if r == -libc::ENOENT {
            return Ok(Vec::new());
        }
        check(|| "rbd_lock_get_owners".into(), r)?;
        let n = n.min(owners.len());
        // SAFETY: librbd filled `n` NUL-terminated strings.
        let v = owners[..n].iter().map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()).collect();
        // SAFETY: handing back what librbd allocated, once.
        unsafe { (self.api.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), n) };
        Ok(v)
    }

    /// The addresses of the clients watching the image (every client that has it open).
    pub fn watchers(&self) -> Result<Vec<String>, RbdError> {
        let mut list: Vec<Watcher> = Vec::new();
        let mut n: usize = 8;
        loop {
            list.resize_with(n, || Watcher { addr: std::ptr::null_mut(), id: 0, cookie: 0 });
            // SAFETY: a live image; an array of `n` entries for librbd to fill.
            let r = unsafe { (self.api.rbd_watchers_list)(self.image, list.as_mut_ptr().cast(), &mut n) };
            if r == -libc::ERANGE && n > list.len() {
                continue;
            }
            check(|| "rbd_watchers_list".into(), r)?;
            break;
        }
        let n = n.min(list.len());
        let v = list[..n]
            .iter()
            // SAFETY: librbd filled `n` entries, each with a NUL-terminated address.
            .map(|w| unsafe { CStr::from_ptr(w.addr) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: handing back what librbd allocated, once.
        unsafe { (self.api.rbd_watchers_list_cleanup)(list.as_mut_ptr().cast(), n) };
        Ok(v)
    }

    /// Breaks `owner`'s exclusive lock (a client that died holding it).
    pub fn break_lock(&self, owner: &str) -> Result<(), RbdError> {
        let o = cstr("lock owner", owner)?;
        // SAFETY: a live image and a NUL-terminated owner.
        check(|| format!("rbd_lock_break({owner})"), unsafe {
            (self.api.rbd_lock_break)(self.image, LOCK_MODE_EXCLUSIVE, o.as_ptr())
        })?;
        Ok(())
    }

    /// Starts `op`; its completion carries `arg`.
    ///
    /// # Safety
    /// The buffers `op` names must stay valid (and, for a read, not otherwise accessed) until
    /// its completion has been collected by [`poll_completions`](Self::poll_completions).
    // SAFETY: the contract above is the caller's; librbd keeps the iovec array and the memory
    // it names until the completion, and touches nothing else of ours.
    pub unsafe fn start(&self, op: &Aio<'_>, arg: u64) -> Result<(), RbdError> {
        let mut c = std::ptr::null_mut();
        // SAFETY: no callback: the completion is announced on the image's eventfd instead;
        // `arg` is a plain number carried as a pointer and never dereferenced.
        check(|| "rbd_aio_create_completion".into(), unsafe {
            (self.api.rbd_aio_create_completion)(arg as usize as *mut c_void, None, &mut c)
        })?;
        let a = &self.api;
        // SAFETY: a live image and completion; the iovec arrays and the memory they name are
        // valid until the completion is collected (this function's contract).
        let r = unsafe {
            match *op {
                Aio::Read { offset, into: iov } => (a.rbd_aio_readv)(self.image, iov.as_ptr(), iov.len() as i32, offset, c),
                Aio::Write { offset, from: iov, .. } => (a.rbd_aio_writev)(self.image, iov.as_ptr(), iov.len() as i32, offset, c),
                Aio::Discard { offset, len } => (a.rbd_aio_discard)(self.image, offset, len, c),
                Aio::WriteZeroes { offset, len } => (a.rbd_aio_write_zeroes)(self.image, offset, len as usize, c, 0, 0),
                Aio::Flush => (a.rbd_aio_flush)(self.image, c),
            }
        };
        if r < 0 {
            // SAFETY: the completion was not handed to librbd; it is released once.
            unsafe { (a.rbd_aio_release)(c) };
            return Err(RbdError::Call { call: format!("start {op:?}"), errno: -r });
        }
        Ok(())
    }

    /// Collects up to `max` completed requests into `out`; returns how many.
    pub fn poll_completions(&self, out: &mut Vec<Completed>, max: usize) -> usize {
        let mut comps: [*mut c_void; 64] = [std::ptr::null_mut(); 64];
        let mut total = 0;
        while total < max {
            let want = (max - total).min(comps.len());
            // SAFETY: a live image and room for `want` completions.
            let n = unsafe { (self.api.rbd_poll_io_events)(self.image, comps.as_mut_ptr(), want as i32) };
            if n <= 0 {
                break;
            }
            for &c in &comps[..n as usize] {
                // SAFETY: each is a completion librbd handed back, complete; read and
                // released once.
                unsafe {
                    out.push(Completed {
                        arg: (self.api.rbd_aio_get_arg)(c) as usize as u64,
                        result: (self.api.rbd_aio_get_return_value)(c),
                    });
                    (self.api.rbd_aio_release)(c);
                }
            }
            total += n as usize;
            if (n as usize) < want {
                break;
            }
        }
        total
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: a live image, closed once (librbd waits for its requests first).
        unsafe { (self.api.rbd_close)(self.image) };
    }
}
