//! TLS for the NBD export (`NBD_OPT_STARTTLS`): X.509 certificates through rustls, or
//! pre-shared keys through OpenSSL.
//!
//! Certificates are read from a directory laid out as qemu and nbdkit lay theirs out:
//! `server-cert.pem` (the chain), `server-key.pem`, and, to ask clients for certificates of
//! their own, `ca-cert.pem`. Pre-shared keys are read from a file in the format of GnuTLS's
//! `psktool`, which qemu (`tls-creds-psk`), nbdkit (`--tls-psk`) and libnbd (`tls-psk-file`)
//! read too: one `identity:hexkey` a line. rustls has no external pre-shared keys, so those
//! sessions run on OpenSSL. After the client's `STARTTLS`, a relay thread speaks TLS on the
//! connection's socket and passes the plaintext over a socket pair to the rest of the server,
//! which goes on negotiating and serving on its end as on any other connection. Both
//! libraries sit behind one `Session` face, so the relay is the same for both.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use std::collections::HashMap;

use openssl::ssl::{ErrorCode, Ssl, SslContext, SslMethod, SslStream, SslVersion};
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

/// The export's TLS: when, and with which credentials.
#[derive(Clone)]
pub struct Tls {
    /// When.
    pub mode: TlsMode,
    creds: Creds,
}

/// What a client proves itself and the server with.
#[derive(Clone)]
enum Creds {
    /// The server's certificate, through rustls; clients' too with `verify_peer`.
    X509 { config: Arc<rustls::ServerConfig>, verify_peer: bool },
    /// Keys both sides hold, through OpenSSL (rustls has none).
    Psk { ctx: SslContext, identities: usize },
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Tls");
        d.field("mode", &self.mode);
        match &self.creds {
            Creds::X509 { verify_peer, .. } => d.field("x509_verify_peer", verify_peer),
            Creds::Psk { identities, .. } => d.field("psk_identities", identities),
        };
        d.finish_non_exhaustive()
    }
}

/// Credentials that cannot be used: the file (or files) and what is wrong with them.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {problem}")]
pub struct TlsError {
    /// The file or files, as the configuration names them.
    pub what: String,
    /// What is wrong.
    pub problem: String,
}

impl TlsError {
    fn of(path: &Path, problem: impl std::fmt::Display) -> TlsError {
        TlsError { what: path.display().to_string(), problem: problem.to_string() }
    }
}

/// The longest key accepted, in bytes (OpenSSL's limit; `psktool` makes 32).
const MAX_PSK: usize = 512;

impl Tls {
    /// Reads the certificate directory `dir`; with `verify_peer`, clients must show a
    /// certificate that `dir/ca-cert.pem` signed. Errors name the file.
    pub fn load(dir: &Path, mode: TlsMode, verify_peer: bool) -> Result<Tls, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cert_path = dir.join("server-cert.pem");
        let key_path = dir.join("server-key.pem");
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert_path)
            .and_then(|it| it.collect::<Result<_, _>>())
            .map_err(|e| TlsError::of(&cert_path, e))?;
        if certs.is_empty() {
            return Err(TlsError::of(&cert_path, "no certificate in it"));
        }
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| TlsError::of(&key_path, e))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::of(&cert_path, e))?;
        let builder = if verify_peer {
            let ca_path = dir.join("ca-cert.pem");
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(&ca_path).map_err(|e| TlsError::of(&ca_path, e))? {
                let c = c.map_err(|e| TlsError::of(&ca_path, e))?;
                roots.add(c).map_err(|e| TlsError::of(&ca_path, e))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::of(&ca_path, e))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder.with_single_cert(certs, key).map_err(|e| TlsError {
            what: format!("{} and {}", cert_path.display(), key_path.display()),
            problem: e.to_string(),
        })?;
        Ok(Tls { mode, creds: Creds::X509 { config: Arc::new(config), verify_peer } })
    }

    /// Reads the pre-shared keys in `file` (`identity:hexkey` a line, as `psktool` writes
    /// them). A client that names an identity there and proves it holds the key is served;
    /// TLS 1.3 (or 1.2 with a PSK cipher suite), no certificate. Errors name the file and line.
    pub fn load_psk(file: &Path, mode: TlsMode) -> Result<Tls, TlsError> {
        let text = std::fs::read_to_string(file).map_err(|e| TlsError::of(file, e))?;
        let keys = parse_psk(&text).map_err(|e| TlsError::of(file, e))?;
        if keys.is_empty() {
            return Err(TlsError::of(file, "no `identity:hexkey` line in it"));
        }
        let identities = keys.len();
        let ctx = psk_context(keys).map_err(|e| TlsError::of(file, format!("OpenSSL: {e}")))?;
        Ok(Tls { mode, creds: Creds::Psk { ctx, identities } })
    }

    /// What clients prove themselves with, for the log: `X.509` or `PSK`.
    pub fn kind(&self) -> &'static str {
        match self.creds {
            Creds::X509 { .. } => "X.509",
            Creds::Psk { .. } => "PSK",
        }
    }
}

/// A line of a `psktool` file that is not `identity:hexkey`.
#[derive(Debug)]
struct PskLineError {
    line: usize,
    problem: String,
}

impl std::fmt::Display for PskLineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.problem)
    }
}

/// The keys of a `psktool` file by identity; an error names the line.
fn parse_psk(text: &str) -> Result<HashMap<Vec<u8>, Vec<u8>>, PskLineError> {
    let mut keys = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let n = i + 1;
        let Some((id, hex)) = line.rsplit_once(':') else {
            return Err(PskLineError { line: n, problem: "not `identity:hexkey`".into() });
        };
        if id.is_empty() {
            return Err(PskLineError { line: n, problem: "the identity is empty".into() });
        }
        let hex = hex.trim();
        if hex.is_empty() || hex.len() % 2 != 0 || hex.len() / 2 > MAX_PSK {
            return Err(PskLineError { line: n, problem: format!("the key must be 1 to {MAX_PSK} bytes in hexadecimal digits") });
        }
        let key = (0..hex.len())
            .step_by(2)
            .map(|j| u8::from_str_radix(&hex[j..j + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| PskLineError { line: n, problem: "the key is not hexadecimal".into() })?;
        if keys.insert(id.as_bytes().to_vec(), key).is_some() {
            return Err(PskLineError { line: n, problem: format!("identity `{id}` again") });
        }
    }
    Ok(keys)
}

/// An OpenSSL server context that answers with the key of the identity a client names, and
/// with nothing (the handshake fails) for an identity it does not know.
fn psk_context(keys: HashMap<Vec<u8>, Vec<u8>>) -> Result<SslContext, openssl::error::ErrorStack> {
    let mut b = SslContext::builder(SslMethod::tls_server())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
    // TLS 1.2 clients (no certificate here): key exchanges authenticated by the key alone,
    // with an ephemeral Diffie-Hellman first. TLS 1.3 uses its default suites.
    b.set_cipher_list("ECDHE-PSK:PSK:!eNULL")?;
    b.set_psk_server_callback(move |_ssl, identity, out| match identity.and_then(|id| keys.get(id)) {
        Some(k) if k.len() <= out.len() => {
            out[..k.len()].copy_from_slice(k);
            Ok(k.len())
        }
        _ => {
            let who = identity.map(String::from_utf8_lossy).unwrap_or_default();
            if let Some(held) = crate::peer::CLIENT_LOG.allow() {
                log::info!(
                    "nbd client: TLS: no pre-shared key for identity `{}`{}",
                    who.escape_debug(),
                    bulkhead_sys::LogLimit::held_note(held)
                );
            }
            Ok(0)
        }
    });
    Ok(b.build())
}

/// Decrypted bytes the relay holds for the server before it stops reading the client.
const HOLD: usize = 1 << 20;

fn set_nonblocking(fd: &impl AsFd) -> io::Result<()> {
    bulkhead_sys::set_nonblocking(fd.as_fd())
}

/// Starts TLS on `sock` (the handshake is the relay's first work) and returns the plaintext
/// end for the server. The relay ends when either side closes or breaks, closing the other.
pub(crate) fn relay(sock: Arc<OwnedFd>, tls: &Tls) -> io::Result<OwnedFd> {
    let conn: Box<dyn Session> = match &tls.creds {
        Creds::X509 { config, .. } => {
            Box::new(X509Session(rustls::ServerConnection::new(config.clone()).map_err(io::Error::other)?))
        }
        Creds::Psk { ctx, .. } => Box::new(PskSession::new(ctx)?),
    };
    let (ours, theirs) = UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    set_nonblocking(&*sock)?;
    std::thread::Builder::new().name("nbd-tls".into()).spawn(move || {
        if let Err(e) = pump(&sock, ours, conn) {
            if let Some(held) = crate::peer::CLIENT_LOG.allow() {
                log::info!("nbd client: TLS: {e}{}", bulkhead_sys::LogLimit::held_note(held));
            }
        }
    })?;
    Ok(theirs.into())
}

/// One TLS session as the relay drives it: encrypted bytes in and out on the client's side,
/// plaintext in and out on the server's. Nothing here blocks; "not now" is `WouldBlock`.
trait Session: Send {
    /// Encrypted bytes wait to go to the client.
    fn wants_write(&self) -> bool;
    /// Sends waiting encrypted bytes to `net`.
    fn write_tls(&mut self, net: &mut std::fs::File) -> io::Result<usize>;
    /// Takes encrypted bytes from `net` (0: the client closed).
    fn read_tls(&mut self, net: &mut std::fs::File) -> io::Result<usize>;
    /// Works through the bytes taken: the handshake, records, alerts. An error ends the
    /// session (its alert, if any, is waiting to be written).
    fn process(&mut self) -> io::Result<()>;
    /// Plaintext from the client (0: it closed the session).
    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Plaintext for the client, all of it.
    fn write_plain(&mut self, data: &[u8]) -> io::Result<()>;
    /// The handshake is not done.
    fn is_handshaking(&self) -> bool;
    /// Says goodbye (close_notify).
    fn close(&mut self);
}

/// A certificate session on rustls.
struct X509Session(rustls::ServerConnection);

impl Session for X509Session {
    fn wants_write(&self) -> bool {
        self.0.wants_write()
    }
    fn write_tls(&mut self, net: &mut std::fs::File) -> io::Result<usize> {
        self.0.write_tls(net)
    }
    fn read_tls(&mut self, net: &mut std::fs::File) -> io::Result<usize> {
        self.0.read_tls(net)
    }
    fn process(&mut self) -> io::Result<()> {
        self.0.process_new_packets().map(|_| ()).map_err(io::Error::other)
    }
    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.reader().read(buf)
    }
    fn write_plain(&mut self, data: &[u8]) -> io::Result<()> {
        self.0.writer().write_all(data)
    }
    fn is_handshaking(&self) -> bool {
        self.0.is_handshaking()
    }
    fn close(&mut self) {
        self.0.send_close_notify();
    }
}

/// The bytes between OpenSSL and the socket: OpenSSL reads what the relay took from the
/// client and writes what the relay sends, so it never touches the socket itself.
#[derive(Default)]
struct Wire {
    /// From the client, not yet read by OpenSSL.
    rx: Vec<u8>,
    /// For the client.
    tx: Vec<u8>,
}

impl Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.rx.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = buf.len().min(self.rx.len());
        buf[..n].copy_from_slice(&self.rx[..n]);
        self.rx.drain(..n);
        Ok(n)
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tx.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A pre-shared-key session on OpenSSL.
struct PskSession(SslStream<Wire>);

impl PskSession {
    fn new(ctx: &SslContext) -> io::Result<Self> {
        let mut ssl = Ssl::new(ctx).map_err(io::Error::other)?;
        ssl.set_accept_state();
        Ok(PskSession(SslStream::new(ssl, Wire::default()).map_err(io::Error::other)?))
    }
}

/// An OpenSSL call's error as the relay sees it: "not now" for one that wants more bytes.
fn ossl(e: openssl::ssl::Error) -> io::Error {
    match e.code() {
        ErrorCode::WANT_READ | ErrorCode::WANT_WRITE => io::ErrorKind::WouldBlock.into(),
        _ => io::Error::other(e.to_string()),
    }
}

impl Session for PskSession {
    fn wants_write(&self) -> bool {
        !self.0.get_ref().tx.is_empty()
    }
    fn write_tls(&mut self, net: &mut std::fs::File) -> io::Result<usize> {
        let tx = &mut self.0.get_mut().tx;
        let n = net.write(tx)?;
        tx.drain(..n);
        Ok(n)
    }
    fn read_tls(&mut self, net: &mut std::fs::File) -> io::Result<usize> {
        let mut buf = [0u8; 16 << 10];
        let n = net.read(&mut buf)?;
        self.0.get_mut().rx.extend_from_slice(&buf[..n]);
        Ok(n)
    }
    fn process(&mut self) -> io::Result<()> {
        if self.is_handshaking() {
            match self.0.do_handshake().map_err(ossl) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => r?,
            }
        }
        Ok(())
    }
    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.is_handshaking() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        match self.0.ssl_read(buf) {
            Ok(n) => Ok(n),
            Err(e) if e.code() == ErrorCode::ZERO_RETURN => Ok(0),
            Err(e) => Err(ossl(e)),
        }
    }
    fn write_plain(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = self.0.ssl_write(data).map_err(ossl)?;
            data = &data[n..];
        }
        Ok(())
    }
    fn is_handshaking(&self) -> bool {
        !self.0.ssl().is_init_finished()
    }
    fn close(&mut self) {
        let _ = self.0.shutdown();
    }
}

/// Moves bytes both ways until one side ends.
fn pump(sock: &OwnedFd, mut plain: UnixStream, mut conn: Box<dyn Session>) -> io::Result<()> {
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
                if let Err(e) = conn.process() {
                    // Tell the client why before closing.
                    let _ = conn.write_tls(&mut net);
                    return Err(e);
                }
                loop {
                    match conn.read_plain(&mut buf) {
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
                    conn.close();
                    let _ = conn.write_tls(&mut net);
                    return Ok(());
                }
                Ok(n) => conn.write_plain(&buf[..n])?,
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
    // Without a time limit, nothing ready means an interrupted wait: wait again.
    while bulkhead_sys::poll(pfd, -1)? == 0 {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psktool_files_are_read_and_bad_lines_named() {
        let keys = parse_psk("alice:00ff10\n\n# a comment\nbob:ABCDEF0123\r\n").unwrap();
        assert_eq!(keys[&b"alice".to_vec()], vec![0x00, 0xff, 0x10]);
        assert_eq!(keys[&b"bob".to_vec()], vec![0xab, 0xcd, 0xef, 0x01, 0x23]);
        for (text, why) in [
            ("alice:00\nbob", "line 2: not `identity:hexkey`"),
            (":00ff", "line 1: the identity is empty"),
            ("alice:0", "line 1: the key must be"),
            ("alice:", "line 1: the key must be"),
            ("alice:zz", "line 1: the key is not hexadecimal"),
            ("alice:00\nalice:11", "line 2: identity `alice` again"),
        ] {
            let e = parse_psk(text).unwrap_err().to_string();
            assert!(e.starts_with(why), "{text:?}: {e}");
        }
        let long = format!("alice:{}", "00".repeat(MAX_PSK + 1));
        assert!(parse_psk(&long).is_err());
    }

    #[test]
    fn a_psk_file_without_keys_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("bulkhead-psk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("keys.psk");
        std::fs::write(&f, "# nothing yet\n").unwrap();
        let e = Tls::load_psk(&f, TlsMode::On).unwrap_err().to_string();
        assert!(e.contains("keys.psk") && e.contains("no `identity:hexkey` line"), "{e}");
        std::fs::write(&f, "alice:000102030405060708090a0b0c0d0e0f\n").unwrap();
        let t = Tls::load_psk(&f, TlsMode::Require).unwrap();
        assert_eq!(t.kind(), "PSK");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
