//! The client side of NBD negotiation, for the `nbd` backend: fixed newstyle, `NBD_OPT_GO`
//! asking for block-size constraints, falling back to `NBD_OPT_EXPORT_NAME` on servers that
//! predate GO. Simple replies only (structured replies are not requested).
//!
//! Everything here reads from a server that is not trusted: every length is bounded before
//! anything is allocated, and every read and write has a deadline (`MSG_DONTWAIT` and `poll`,
//! whether or not the socket is blocking). The descriptor must be a socket.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use crate::proto::*;

/// The magic of oldstyle negotiation, refused with a clear message.
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Longest option reply read during negotiation.
const MAX_REPLY: u32 = 64 * 1024;
/// Most option replies to one GO before the server is judged to be stalling.
const MAX_REPLIES: u32 = 64;

/// What negotiation learned about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (`TFLAG_*`).
    pub flags: u16,
    /// Smallest block the server accepts.
    pub min_block: u32,
    /// Preferred block size.
    pub pref_block: u32,
    /// Largest payload the server accepts in one request.
    pub max_payload: u32,
}

impl ExportInfo {
    /// Whether the export advertises `flag`.
    pub fn has(&self, flag: u16) -> bool {
        self.flags & TFLAG_HAS_FLAGS != 0 && self.flags & flag != 0
    }
}

/// Why talking to a server failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection failed or was closed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// The server sent something the protocol does not allow.
    #[error("server broke the protocol: {0}")]
    Protocol(String),
    /// The server refused the export.
    #[error("server refused: {0}")]
    Refused(String),
    /// The server did not answer in time.
    #[error("no answer from the server within {0} ms")]
    Timeout(u128),
}

/// Waits until `fd` is ready for `events` or the deadline passes.
pub fn wait_fd(fd: BorrowedFd<'_>, events: i16, deadline: Instant) -> Result<(), ClientError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ClientError::Timeout(0));
        }
        let mut pfd = [libc::pollfd { fd: fd.as_raw_fd(), events, revents: 0 }];
        // An interrupted wait counts as nothing ready: the loop waits again.
        if bulkhead_sys::poll(&mut pfd, left.as_millis().clamp(1, i32::MAX as u128) as i32)? > 0 {
            return Ok(());
        }
    }
}

/// Reads exactly `buf.len()` bytes before `deadline`; end of stream is an error.
pub fn read_full(fd: BorrowedFd<'_>, buf: &mut [u8], deadline: Instant) -> Result<(), ClientError> {
    let mut got = 0;
    while got < buf.len() {
        match bulkhead_sys::recv_now(fd, &mut buf[got..]) {
            Ok(0) => {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the server closed the connection").into())
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait_fd(fd, libc::POLLIN, deadline)?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Writes all of `buf` before `deadline`.
pub fn write_full(fd: BorrowedFd<'_>, buf: &[u8], deadline: Instant) -> Result<(), ClientError> {
    let mut done = 0;
    while done < buf.len() {
        match bulkhead_sys::send_now(fd, &buf[done..]) {
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait_fd(fd, libc::POLLOUT, deadline)?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + data.len());
    v.extend_from_slice(&IHAVEOPT.to_be_bytes());
    v.extend_from_slice(&opt.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// Negotiates `export` on a connected socket, within `timeout`; on success the connection is
/// in the transmission phase.
pub fn handshake(fd: BorrowedFd<'_>, export: &str, timeout: Duration) -> Result<ExportInfo, ClientError> {
    let deadline = Instant::now() + timeout;
    let timed = |e: ClientError| match e {
        ClientError::Timeout(_) => ClientError::Timeout(timeout.as_millis()),
        e => e,
    };
    negotiate(fd, export, deadline).map_err(timed)
}

fn negotiate(fd: BorrowedFd<'_>, export: &str, deadline: Instant) -> Result<ExportInfo, ClientError> {
    if export.len() > 4096 {
        return Err(ClientError::Refused("export name longer than 4096 bytes".into()));
    }
    let mut hello = [0u8; 18];
    read_full(fd, &mut hello[..16], deadline)?;
    if be64(&hello[0..8]) != NBDMAGIC {
        return Err(ClientError::Protocol("no NBDMAGIC greeting: not an NBD server".into()));
    }
    match be64(&hello[8..16]) {
        IHAVEOPT => {}
        OLDSTYLE_MAGIC => return Err(ClientError::Protocol("oldstyle negotiation is not supported".into())),
        m => return Err(ClientError::Protocol(format!("unknown negotiation magic {m:#x}"))),
    }
    read_full(fd, &mut hello[16..18], deadline)?;
    let server_flags = be16(&hello[16..18]);
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(ClientError::Protocol("the server does not offer fixed newstyle negotiation".into()));
    }
    let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
    let client_flags = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
    let mut go = Vec::with_capacity(8 + export.len());
    go.extend_from_slice(&(export.len() as u32).to_be_bytes());
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    let mut out = client_flags.to_be_bytes().to_vec();
    out.extend_from_slice(&option(OPT_GO, &go));
    write_full(fd, &out, deadline)?;

    let mut export_info: Option<(u64, u16)> = None;
    let mut blocks: Option<(u32, u32, u32)> = None;
    for _ in 0..MAX_REPLIES {
        let mut h = [0u8; 20];
        read_full(fd, &mut h, deadline)?;
        if be64(&h[0..8]) != OPT_REPLY_MAGIC {
            return Err(ClientError::Protocol("bad option reply magic".into()));
        }
        if be32(&h[8..12]) != OPT_GO {
            return Err(ClientError::Protocol(format!("reply to option {} when GO was asked", be32(&h[8..12]))));
        }
        let typ = be32(&h[12..16]);
        let len = be32(&h[16..20]);
        if len > MAX_REPLY {
            return Err(ClientError::Protocol(format!("option reply of {len} bytes")));
        }
        let mut data = vec![0u8; len as usize];
        read_full(fd, &mut data, deadline)?;
        match typ {
            REP_INFO if data.len() >= 2 => match be16(&data[0..2]) {
                INFO_EXPORT if data.len() == 12 => export_info = Some((be64(&data[2..10]), be16(&data[10..12]))),
                INFO_BLOCK_SIZE if data.len() == 14 => {
                    blocks = Some((be32(&data[2..6]), be32(&data[6..10]), be32(&data[10..14])))
                }
                INFO_EXPORT | INFO_BLOCK_SIZE => {
                    return Err(ClientError::Protocol(format!("information item of the wrong length {}", data.len())))
                }
                _ => {}
            },
            REP_INFO => return Err(ClientError::Protocol("empty information reply".into())),
            REP_ACK => {
                let (size, flags) =
                    export_info.ok_or_else(|| ClientError::Protocol("GO acknowledged without the export's size".into()))?;
                return finish(size, flags, blocks);
            }
            REP_ERR_UNSUP => return export_name(fd, export, no_zeroes, deadline),
            t if t & (1 << 31) != 0 => {
                let msg: String = String::from_utf8_lossy(&data).chars().take(200).filter(|c| !c.is_control()).collect();
                let what = match t {
                    REP_ERR_UNKNOWN => format!("no export `{export}`"),
                    REP_ERR_POLICY => format!("export `{export}` refused by policy"),
                    _ => format!("export `{export}`: error {:#x}", t),
                };
                return Err(ClientError::Refused(if msg.is_empty() { what } else { format!("{what}: {msg}") }));
            }
            _ => {}
        }
    }
    Err(ClientError::Protocol(format!("more than {MAX_REPLIES} replies to GO")))
}

/// The pre-GO way in: the server answers with size and flags (then 124 zeroes unless agreed
/// otherwise), or closes the connection if there is no such export.
fn export_name(fd: BorrowedFd<'_>, export: &str, no_zeroes: bool, deadline: Instant) -> Result<ExportInfo, ClientError> {
    write_full(fd, &option(OPT_EXPORT_NAME, export.as_bytes()), deadline)?;
    let mut b = [0u8; 10 + 124];
    let want = if no_zeroes { 10 } else { b.len() };
    read_full(fd, &mut b[..want], deadline).map_err(|e| match e {
        ClientError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            ClientError::Refused(format!("the server closed the connection on export `{export}`"))
        }
        e => e,
    })?;
    finish(be64(&b[0..8]), be16(&b[8..10]), None)
}

fn finish(size: u64, flags: u16, blocks: Option<(u32, u32, u32)>) -> Result<ExportInfo, ClientError> {
    if size > i64::MAX as u64 {
        return Err(ClientError::Protocol(format!("export size {size} is beyond any device")));
    }
    // Constraints that break the protocol's own rules are ignored, as the protocol suggests.
    let (min_block, pref_block, max_payload) = match blocks {
        Some((min, pref, max))
            if min.is_power_of_two()
                && min <= 64 * 1024
                && pref.is_power_of_two()
                && pref >= min.max(512)
                && max >= pref
                && max % min == 0 =>
        {
            (min, pref, max.min(MAX_PAYLOAD))
        }
        _ => (1, 4096, MAX_PAYLOAD),
    };
    Ok(ExportInfo { size, flags, min_block, pref_block, max_payload })
}

/// Sends `NBD_CMD_DISC`, best effort, before a connection is closed.
pub fn disconnect(fd: BorrowedFd<'_>) {
    let r = RequestHeader { flags: 0, typ: CMD_DISC, cookie: 0, offset: 0, len: 0 }.encode();
    let _ = write_full(fd, &r, Instant::now() + Duration::from_millis(100));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    /// A scripted server: writes `script` and records what the client sent.
    fn scripted(script: Vec<u8>) -> (UnixStream, std::thread::JoinHandle<Vec<u8>>) {
        let (a, mut b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            b.write_all(&script).unwrap();
            b.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
            let mut got = Vec::new();
            let _ = b.read_to_end(&mut got);
            got
        });
        (a, t)
    }

    fn greeting(flags: u16) -> Vec<u8> {
        let mut v = NBDMAGIC.to_be_bytes().to_vec();
        v.extend_from_slice(&IHAVEOPT.to_be_bytes());
        v.extend_from_slice(&flags.to_be_bytes());
        v
    }

    #[test]
    fn go_gives_size_flags_and_block_sizes() {
        let mut s = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        let mut info = INFO_EXPORT.to_be_bytes().to_vec();
        info.extend_from_slice(&(64u64 << 20).to_be_bytes());
        info.extend_from_slice(&(TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH).to_be_bytes());
        s.extend_from_slice(&option_reply(OPT_GO, REP_INFO, &info));
        let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [512u32, 4096, 1 << 20] {
            bs.extend_from_slice(&v.to_be_bytes());
        }
        s.extend_from_slice(&option_reply(OPT_GO, REP_INFO, &bs));
        s.extend_from_slice(&option_reply(OPT_GO, REP_ACK, &[]));
        let (c, t) = scripted(s);
        let i = handshake(c.as_fd(), "disk0", Duration::from_secs(2)).unwrap();
        assert_eq!(i.size, 64 << 20);
        assert!(i.has(TFLAG_SEND_FLUSH) && !i.has(TFLAG_SEND_FUA));
        assert_eq!((i.min_block, i.pref_block, i.max_payload), (512, 4096, 1 << 20));
        drop(c);
        let sent = t.join().unwrap();
        assert_eq!(be32(&sent[0..4]), FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        assert_eq!(be32(&sent[12..16]), OPT_GO);
        assert_eq!(&sent[24..29], b"disk0");
    }

    #[test]
    fn unknown_export_is_refused_with_its_name() {
        let mut s = greeting(FLAG_FIXED_NEWSTYLE);
        s.extend_from_slice(&option_reply(OPT_GO, REP_ERR_UNKNOWN, b"not here"));
        let (c, _t) = scripted(s);
        let e = handshake(c.as_fd(), "nope", Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("no export `nope`") && e.to_string().contains("not here"), "{e}");
    }

    #[test]
    fn old_servers_fall_back_to_export_name() {
        let mut s = greeting(FLAG_FIXED_NEWSTYLE);
        s.extend_from_slice(&option_reply(OPT_GO, REP_ERR_UNSUP, &[]));
        s.extend_from_slice(&(1u64 << 30).to_be_bytes());
        s.extend_from_slice(&(TFLAG_HAS_FLAGS | TFLAG_READ_ONLY).to_be_bytes());
        s.extend_from_slice(&[0u8; 124]);
        let (c, _t) = scripted(s);
        let i = handshake(c.as_fd(), "", Duration::from_secs(2)).unwrap();
        assert_eq!(i.size, 1 << 30);
        assert!(i.has(TFLAG_READ_ONLY));
        assert_eq!(i.max_payload, MAX_PAYLOAD);
    }

    #[test]
    fn hostile_servers_get_errors_not_allocations_or_hangs() {
        // Not an NBD server.
        let (c, _t) = scripted(b"SSH-2.0-OpenSSH_9.2\r\n".to_vec());
        assert!(matches!(handshake(c.as_fd(), "x", Duration::from_secs(2)), Err(ClientError::Protocol(_))));
        // Oldstyle.
        let mut s = NBDMAGIC.to_be_bytes().to_vec();
        s.extend_from_slice(&OLDSTYLE_MAGIC.to_be_bytes());
        let (c, _t) = scripted(s);
        let e = handshake(c.as_fd(), "x", Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("oldstyle"), "{e}");
        // A 4 GiB option reply is refused before anything is allocated.
        let mut s = greeting(FLAG_FIXED_NEWSTYLE);
        s.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
        s.extend_from_slice(&OPT_GO.to_be_bytes());
        s.extend_from_slice(&REP_INFO.to_be_bytes());
        s.extend_from_slice(&u32::MAX.to_be_bytes());
        let (c, _t) = scripted(s);
        let e = handshake(c.as_fd(), "x", Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("option reply of"), "{e}");
        // ACK without the size.
        let mut s = greeting(FLAG_FIXED_NEWSTYLE);
        s.extend_from_slice(&option_reply(OPT_GO, REP_ACK, &[]));
        let (c, _t) = scripted(s);
        assert!(matches!(handshake(c.as_fd(), "x", Duration::from_secs(2)), Err(ClientError::Protocol(_))));
        // A server that says nothing times out.
        let (c, _keep) = UnixStream::pair().unwrap();
        let t0 = Instant::now();
        let e = handshake(c.as_fd(), "x", Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, ClientError::Timeout(200)), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        // Not fixed newstyle.
        let (c, _t) = scripted(greeting(0));
        assert!(handshake(c.as_fd(), "x", Duration::from_secs(2)).unwrap_err().to_string().contains("fixed newstyle"));
    }
}
