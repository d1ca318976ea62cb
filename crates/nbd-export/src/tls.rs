//! TLS for the NBD export (`NBD_OPT_STARTTLS`), with X.509 certificates through rustls.
//!
//! Certificates are read from a directory laid out as qemu and nbdkit lay theirs out:
//! `server-cert.pem` (the chain), `server-key.pem`, and, to ask clients for certificates of
//! their own, `ca-cert.pem`. After the client's `STARTTLS`, a relay thread speaks TLS on the
//! connection's socket and passes the plaintext over a socket pair to the rest of the server,
//! which goes on negotiating and serving on its end as on any other connection.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// When TLS is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// Offered to clients that ask (`STARTTLS`); plaintext for the others.
    On,
    /// TCP clients must start TLS before anything but `ABORT`. The unix socket, guarded by
    /// its file permissions, still offers it without requiring it.
    Require,
}

/// The export's TLS: when, and with which certificate.
#[derive(Clone)]
pub struct Tls {
    /// When.
    pub mode: TlsMode,
    /// rustls' server configuration.
    pub config: Arc<rustls::ServerConfig>,
    /// Clients must show a certificate signed by `ca-cert.pem`.
    pub verify_peer: bool,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("mode", &self.mode).field("verify_peer", &self.verify_peer).finish_non_exhaustive()
    }
}

impl Tls {
    /// Reads the certificate directory `dir`; with `verify_peer`, clients must show a
    /// certificate that `dir/ca-cert.pem` signed. Errors name the file.
    pub fn load(dir: &Path, mode: TlsMode, verify_peer: bool) -> Result<Tls, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cert_path = dir.join("server-cert.pem");
        let key_path = dir.join("server-key.pem");
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert_path)
            .and_then(|it| it.collect::<Result<_, _>>())
            .map_err(|e| format!("{}: {e}", cert_path.display()))?;
        if certs.is_empty() {
            return Err(format!("{}: no certificate in it", cert_path.display()));
        }
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| format!("{}: {e}", key_path.display()))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = if verify_peer {
            let ca_path = dir.join("ca-cert.pem");
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(&ca_path).map_err(|e| format!("{}: {e}", ca_path.display()))? {
                let c = c.map_err(|e| format!("{}: {e}", ca_path.display()))?;
                roots.add(c).map_err(|e| format!("{}: {e}", ca_path.display()))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("{}: {e}", ca_path.display()))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder
            .with_single_cert(certs, key)
            .map_err(|e| format!("{} and {}: {e}", cert_path.display(), key_path.display()))?;
        Ok(Tls { mode, config: Arc::new(config), verify_peer })
    }
}

/// Decrypted bytes the relay holds for the server before it stops reading the client.
const HOLD: usize = 1 << 20;

fn set_nonblocking(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller holds open.
    let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Starts TLS on `sock` (the handshake is the relay's first work) and returns the plaintext
/// end for the server. The relay ends when either side closes or breaks, closing the other.
pub(crate) fn relay(sock: Arc<OwnedFd>, tls: &Tls) -> io::Result<OwnedFd> {
    let conn = rustls::ServerConnection::new(tls.config.clone()).map_err(io::Error::other)?;
    let (ours, theirs) = UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    set_nonblocking(&*sock)?;
    std::thread::Builder::new().name("nbd-tls".into()).spawn(move || {
        if let Err(e) = pump(&sock, ours, conn) {
            eprintln!("bulkhead: nbd client: TLS: {e}");
        }
    })?;
    Ok(theirs.into())
}

/// Moves bytes both ways until one side ends.
fn pump(sock: &OwnedFd, mut plain: UnixStream, mut conn: rustls::ServerConnection) -> io::Result<()> {
    let mut net = std::fs::File::from(sock.try_clone()?);
    let mut to_plain: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let would_block = |e: &io::Error| e.kind() == io::ErrorKind::WouldBlock;
    loop {
        while conn.wants_write() {
            match conn.write_tls(&mut net) {
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(e),
            }
        }
        while !to_plain.is_empty() {
            match plain.write(&to_plain) {
                Ok(n) => drop(to_plain.drain(..n)),
                Err(e) if would_block(&e) => break,
                // The server hung up: nothing more to pass on.
                Err(_) => return Ok(()),
            }
        }
        let read_net = to_plain.len() < HOLD;
        // Plaintext is taken from the server only once what it sent before is on its way.
        let read_plain = !conn.is_handshaking() && !conn.wants_write();
        let mut pfd = [
            libc::pollfd {
                fd: sock.as_raw_fd(),
                events: if read_net { libc::POLLIN } else { 0 } | if conn.wants_write() { libc::POLLOUT } else { 0 },
                revents: 0,
            },
            libc::pollfd {
                fd: plain.as_raw_fd(),
                events: if read_plain { libc::POLLIN } else { 0 } | if to_plain.is_empty() { 0 } else { libc::POLLOUT },
                revents: 0,
            },
        ];
        wait_either(&mut pfd)?;
        let hup = libc::POLLHUP | libc::POLLERR;
        if pfd[0].revents & (libc::POLLIN | hup) != 0 && read_net {
            loop {
                match conn.read_tls(&mut net) {
                    Ok(0) => return Ok(()),
                    Ok(_) => {}
                    Err(e) if would_block(&e) => break,
                    Err(e) => return Err(e),
                }
                if let Err(e) = conn.process_new_packets() {
                    // Tell the client why before closing.
                    let _ = conn.write_tls(&mut net);
                    return Err(io::Error::other(e));
                }
                loop {
                    match conn.reader().read(&mut buf) {
                        Ok(0) => return Ok(()),
                        Ok(n) => to_plain.extend_from_slice(&buf[..n]),
                        Err(e) if would_block(&e) => break,
                        Err(e) => return Err(e),
                    }
                }
                if to_plain.len() >= HOLD {
                    break;
                }
            }
        } else if pfd[0].revents & hup != 0 {
            return Ok(());
        }
        if pfd[1].revents & (libc::POLLIN | hup) != 0 && read_plain {
            match plain.read(&mut buf) {
                Ok(0) => {
                    conn.send_close_notify();
                    let _ = conn.write_tls(&mut net);
                    return Ok(());
                }
                Ok(n) => conn.writer().write_all(&buf[..n])?,
                Err(e) if would_block(&e) => {}
                Err(_) => return Ok(()),
            }
        } else if pfd[1].revents & hup != 0 && to_plain.is_empty() {
            return Ok(());
        }
    }
}

/// Waits for either descriptor, retrying on EINTR.
fn wait_either(pfd: &mut [libc::pollfd; 2]) -> io::Result<()> {
    loop {
        // SAFETY: two valid pollfds, for the duration of the call.
        let n = unsafe { libc::poll(pfd.as_mut_ptr(), 2, -1) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
