//! The C functions, resolved from librados.so.2 and librbd.so.1 at run time.

use std::ffi::{c_char, c_int, c_void};

use crate::RbdError;

type Handle = *mut c_void;
type Callback = Option<unsafe extern "C" fn(Handle, *mut c_void)>;

macro_rules! api {
    ($( $lib:ident : $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// The functions of librados and librbd the backend calls.
        pub struct Api {
            _rados: libloading::Library,
            _rbd: libloading::Library,
            $( pub(crate) $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
        }

        impl Api {
            /// Loads librados.so.2 and librbd.so.1 and resolves every function.
            pub fn load() -> Result<Api, RbdError> {
                let open = |name: &str| {
                    // SAFETY: loading Ceph's client libraries runs their initialisers, which
                    // set up globals and start no thread.
                    unsafe { libloading::Library::new(name) }.map_err(|e| RbdError::Load { lib: name.into(), why: e.to_string() })
                };
                let rados = open("librados.so.2")?;
                let rbd = open("librbd.so.1")?;
                $(
                    let lib = match stringify!($lib) { "rados" => &rados, _ => &rbd };
                    // SAFETY: the symbol has the signature librados.h / librbd.h give it.
                    let $name = unsafe {
                        *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|e| RbdError::Load { lib: stringify!($name).into(), why: e.to_string() })?
                    };
                )*
                Ok(Api { _rados: rados, _rbd: rbd, $( $name, )* })
            }
        }
    };
}

api! {
    rados: rados_create: fn(*mut Handle, *const c_char) -> c_int;
    rados: rados_conf_set: fn(Handle, *const c_char, *const c_char) -> c_int;
    rados: rados_connect: fn(Handle) -> c_int;
    rados: rados_shutdown: fn(Handle);
    rados: rados_ioctx_create: fn(Handle, *const c_char, *mut Handle) -> c_int;
    rados: rados_ioctx_destroy: fn(Handle);
    rados: rados_ioctx_set_namespace: fn(Handle, *const c_char);
    rados: rados_getaddrs: fn(Handle, *mut *mut c_char) -> c_int;
    rados: rados_buffer_free: fn(*mut c_char);
    rados: rados_blocklist_add: fn(Handle, *mut c_char, u32) -> c_int;
    rbd: rbd_open: fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int;
    rbd: rbd_open_read_only: fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int;
    rbd: rbd_close: fn(Handle) -> c_int;
    rbd: rbd_stat: fn(Handle, *mut c_void, usize) -> c_int;
    rbd: rbd_set_image_notification: fn(Handle, c_int, c_int) -> c_int;
    rbd: rbd_lock_get_owners: fn(Handle, *mut c_int, *mut *mut c_char, *mut usize) -> c_int;
    rbd: rbd_lock_get_owners_cleanup: fn(*mut *mut c_char, usize);
    rbd: rbd_lock_break: fn(Handle, c_int, *const c_char) -> c_int;
    rbd: rbd_watchers_list: fn(Handle, *mut c_void, *mut usize) -> c_int;
    rbd: rbd_watchers_list_cleanup: fn(*mut c_void, usize);
    rbd: rbd_aio_create_completion: fn(*mut c_void, Callback, *mut Handle) -> c_int;
    rbd: rbd_aio_release: fn(Handle);
    rbd: rbd_aio_get_arg: fn(Handle) -> *mut c_void;
    rbd: rbd_aio_get_return_value: fn(Handle) -> isize;
    rbd: rbd_aio_readv: fn(Handle, *const libc::iovec, c_int, u64, Handle) -> c_int;
    rbd: rbd_aio_writev: fn(Handle, *const libc::iovec, c_int, u64, Handle) -> c_int;
    rbd: rbd_aio_discard: fn(Handle, u64, u64, Handle) -> c_int;
    rbd: rbd_aio_write_zeroes: fn(Handle, u64, usize, Handle, c_int, c_int) -> c_int;
    rbd: rbd_aio_flush: fn(Handle, Handle) -> c_int;
    rbd: rbd_poll_io_events: fn(Handle, *mut Handle, c_int) -> c_int;
}
