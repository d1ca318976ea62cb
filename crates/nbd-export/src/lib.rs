//! The NBD export: serves every device to NBD clients (qemu, libnbd tools, the kernel's nbd
//! client, other hosts) on `<run-dir>/nbd.sock` and, when configured, TCP, with TLS
//! (`NBD_OPT_STARTTLS`, X.509) when configured.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod server;
pub mod tls;

pub use server::{memory_bound, socket_path, Listeners, NbdServer, ServerConfig, ServerStats, MAX_PAYLOAD};
