//! A remote NBD server as backend.
//!
//! The domain cannot open sockets: the supervisor connects (unix or TCP) and passes the
//! connected socket; negotiation happens here, after confinement, so nothing the server sends
//! is parsed outside the sandbox except the supervisor's one size probe at device start.
//!
//! A batch is sent pipelined and its replies are read as they come, in any order; sending and
//! receiving interleave (`MSG_DONTWAIT` and `poll`), so a server that answers big reads while
//! big writes are still going out cannot deadlock the connection. A `Flush` waits for every
//! earlier reply first, since NBD's flush covers only writes already answered. Requests larger
//! than the server's payload limit are split.
//!
//! When the server goes away (end of stream, reset, timeout, `ESHUTDOWN`, a reply that breaks
//! the protocol) the backend reports itself [`lost`](Backend::lost): the domain exits without
//! answering the batch, and the supervisor reconnects and reissues it.

use crate::BackendError;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use bulkhead_block::SetupError;
use bulkhead_block::{Backend, BlockError, Caps, Io, Remote, Request, SliceList};
use bulkhead_nbd::client::{self, ExportInfo};
use bulkhead_nbd::proto::{self, *};
use proto::RequestHeader as Wire;

/// Largest trim or write-zeroes range in one command (the length field is 32 bits).
const MAX_RANGE: u64 = 1 << 30;
/// Chunk of emulated write-zeroes on servers without `NBD_CMD_WRITE_ZEROES`.
const ZERO_CHUNK: usize = 1 << 20;
/// Commands of one phase are numbered in the low bits of the cookie.
const INDEX_BITS: u32 = 20;

/// Where a command's payload comes from or goes to.
#[derive(Debug, Clone, Copy)]
enum Data {
    None,
    /// Bytes `at..at + len` of request `io`'s buffers.
    Io(u64),
    /// Zeroes (emulated write-zeroes).
    Zero,
}

#[derive(Debug, Clone, Copy)]
struct Cmd {
    io: usize,
    typ: u16,
    flags: u16,
    offset: u64,
    len: u32,
    data: Data,
}

impl Cmd {
    fn payload_out(&self) -> u64 {
        if self.typ == CMD_WRITE {
            self.len as u64
        } else {
            0
        }
    }
}

/// A remote NBD export.
pub struct NbdBackend {
    sock: OwnedFd,
    export: String,
    size: u64,
    timeout: Duration,
    info: Option<ExportInfo>,
    lost: Option<String>,
    seq: u64,
    zeroes: Vec<u8>,
}

impl std::fmt::Debug for NbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdBackend").field("export", &self.export).field("size", &self.size).field("info", &self.info).finish()
    }
}

impl NbdBackend {
    /// A backend on a connected socket, not yet negotiated; `size` is the device's size (the
    /// export must be at least that large); `timeout` bounds negotiation and any wait for a
    /// reply.
    pub fn new(sock: OwnedFd, export: &str, size: u64, timeout: Duration) -> Self {
        NbdBackend { sock, export: export.to_string(), size, timeout, info: None, lost: None, seq: 0, zeroes: Vec::new() }
    }

    /// What negotiation learned, once started.
    pub fn info(&self) -> Option<ExportInfo> {
        self.info
    }

    fn negotiate(&mut self) -> Result<(), BackendError> {
        let info =
            client::handshake(self.sock.as_fd(), &self.export, self.timeout).map_err(|e| BackendError::link(e.to_string()))?;
        if info.size < self.size {
            return Err(BackendError::link(format!(
                "export `{}` is {} bytes, smaller than the device's {}",
                self.export, info.size, self.size
            )));
        }
        self.info = Some(info);
        Ok(())
    }

    fn lose(&mut self, why: String) {
        if self.lost.is_none() {
            self.lost = Some(why);
        }
    }

    /// Plans the commands of one request into `phase`; returns its immediate result if it
    /// needs no command.
    fn plan(&self, i: usize, req: &Request<'_>, info: &ExportInfo, phase: &mut Vec<Cmd>) -> Option<Result<u64, BlockError>> {
        let in_range = |offset: u64, len: u64| offset.checked_add(len).is_some_and(|e| e <= self.size);
        let max = info.max_payload.max(4096) as u64;
        let mut split = |typ: u16, flags: u16, offset: u64, len: u64, chunk: u64, zero: bool| {
            let mut at = 0;
            while at < len {
                let n = (len - at).min(chunk);
                let data = match (typ, zero) {
                    (CMD_READ | CMD_WRITE, false) => Data::Io(at),
                    (CMD_WRITE, true) => Data::Zero,
                    _ => Data::None,
                };
                phase.push(Cmd { io: i, typ, flags, offset: offset + at, len: n as u32, data });
                at += n;
            }
        };
        match req {
            Request::Read { offset, into: bufs } => {
                let len = bufs.total_len();
                if !in_range(*offset, len) {
                    return Some(Err(BlockError::Invalid("range beyond device")));
                }
                split(CMD_READ, 0, *offset, len, max, false);
            }
            Request::Write { offset, from: bufs, fua } => {
                let len = bufs.total_len();
                if !in_range(*offset, len) {
                    return Some(Err(BlockError::Invalid("range beyond device")));
                }
                if info.has(TFLAG_READ_ONLY) {
                    return Some(Err(BlockError::ReadOnly));
                }
                let flags = if *fua && info.has(TFLAG_SEND_FUA) { CMD_FLAG_FUA } else { 0 };
                split(CMD_WRITE, flags, *offset, len, max, false);
            }
            Request::Flush => unreachable!("flushes are planned by execute"),
            Request::Discard { offset, len } => {
                if !in_range(*offset, *len) {
                    return Some(Err(BlockError::Invalid("range beyond device")));
                }
                if info.has(TFLAG_READ_ONLY) {
                    return Some(Err(BlockError::ReadOnly));
                }
                if !info.has(TFLAG_SEND_TRIM) {
                    return Some(Err(BlockError::NotSupported("discard on this NBD export")));
                }
                split(CMD_TRIM, 0, *offset, *len, MAX_RANGE, false);
            }
            Request::WriteZeroes { offset, len } => {
                if !in_range(*offset, *len) {
                    return Some(Err(BlockError::Invalid("range beyond device")));
                }
                if info.has(TFLAG_READ_ONLY) {
                    return Some(Err(BlockError::ReadOnly));
                }
                if info.has(TFLAG_SEND_WRITE_ZEROES) {
                    split(CMD_WRITE_ZEROES, 0, *offset, *len, MAX_RANGE, false);
                } else {
                    split(CMD_WRITE, 0, *offset, *len, max.min(ZERO_CHUNK as u64), true);
                }
            }
        }
        if phase.is_empty() || phase.last().is_some_and(|c| c.io != i) {
            // A zero-length request.
            return Some(Ok(0));
        }
        None
    }

    /// Sends `cmds`, reads every reply, and records failures in `results`. `Err` means the
    /// connection is lost.
    fn run_phase(&mut self, ios: &[Io<'_>], cmds: &[Cmd], results: &mut [Result<u64, BlockError>]) -> Result<(), BackendError> {
        if cmds.is_empty() {
            return Ok(());
        }
        if cmds.len() >= 1 << INDEX_BITS {
            return Err(BackendError::link("too many commands in one batch"));
        }
        if cmds.iter().any(|c| matches!(c.data, Data::Zero)) && self.zeroes.is_empty() {
            self.zeroes = vec![0u8; ZERO_CHUNK];
        }
        let fd = self.sock.as_raw_fd();
        self.seq = self.seq.wrapping_add(1) & ((1 << (64 - INDEX_BITS)) - 1);
        let seq = self.seq;
        let mut next = 0usize; // next command to send
        let mut sent = 0u64; // bytes of it sent (28-byte header, then payload)
        let mut answered = vec![false; cmds.len()];
        let mut left = cmds.len();
        let mut rx = Rx::Header { buf: [0; 16], got: 0 };
        let mut deadline = Instant::now() + self.timeout;
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(bulkhead_shmem::MAX_SLICES + 1);
        while left > 0 {
            let mut progress = false;
            while next < cmds.len() {
                let c = &cmds[next];
                let header =
                    Wire { flags: c.flags, typ: c.typ, cookie: (seq << INDEX_BITS) | next as u64, offset: c.offset, len: c.len }
                        .encode();
                iov.clear();
                if sent < Wire::SIZE as u64 {
                    iov.push(libc::iovec {
                        iov_base: header[sent as usize..].as_ptr() as *mut libc::c_void,
                        iov_len: Wire::SIZE - sent as usize,
                    });
                }
                let done_payload = sent.saturating_sub(Wire::SIZE as u64);
                if c.payload_out() > done_payload {
                    let (from, n) = (done_payload, c.payload_out() - done_payload);
                    match c.data {
                        Data::Io(at) => push_range(&mut iov, request_bufs(&ios[c.io].req), at + from, n, false)?,
                        Data::Zero => iov.push(libc::iovec { iov_base: self.zeroes.as_ptr() as *mut _, iov_len: n as usize }),
                        Data::None => {}
                    }
                }
                match sendmsg(fd, &iov)? {
                    None => break,
                    Some(n) => {
                        progress = true;
                        sent += n as u64;
                        if sent == Wire::SIZE as u64 + c.payload_out() {
                            next += 1;
                            sent = 0;
                        }
                    }
                }
            }
            loop {
                match &mut rx {
                    Rx::Header { buf, got } => {
                        let Some(n) =
                            recv(fd, &mut [libc::iovec { iov_base: buf[*got..].as_mut_ptr().cast(), iov_len: 16 - *got }])?
                        else {
                            break;
                        };
                        progress = true;
                        *got += n;
                        if *got < 16 {
                            continue;
                        }
                        let magic = be32(&buf[0..4]);
                        if magic != SIMPLE_REPLY_MAGIC {
                            return Err(BackendError::link(if magic == STRUCTURED_REPLY_MAGIC {
                                "structured reply that was not negotiated".into()
                            } else {
                                format!("bad reply magic {magic:#x}")
                            }));
                        }
                        let error = be32(&buf[4..8]);
                        let cookie = be64(&buf[8..16]);
                        let j = (cookie & ((1 << INDEX_BITS) - 1)) as usize;
                        let in_flight = j < next || (j == next && sent > 0);
                        if cookie >> INDEX_BITS != seq || j >= cmds.len() || !in_flight || answered[j] {
                            return Err(BackendError::link(format!("reply with cookie {cookie:#x} to no request in flight")));
                        }
                        let c = &cmds[j];
                        if error == ESHUTDOWN {
                            return Err(BackendError::link("the server is shutting down"));
                        }
                        if error != 0 {
                            let op = op_name(c.typ);
                            if results[c.io].is_ok() {
                                results[c.io] = Err(BlockError::Os { op, offset: c.offset, errno: errno_of_error(error) });
                            }
                            answered[j] = true;
                            left -= 1;
                            rx = Rx::Header { buf: [0; 16], got: 0 };
                        } else if c.typ == CMD_READ && c.len > 0 {
                            rx = Rx::Data { j, got: 0 };
                        } else {
                            answered[j] = true;
                            left -= 1;
                            rx = Rx::Header { buf: [0; 16], got: 0 };
                        }
                    }
                    Rx::Data { j, got } => {
                        let c = &cmds[*j];
                        let Data::Io(at) = c.data else { unreachable!("reads carry their buffers") };
                        iov.clear();
                        push_range(&mut iov, request_bufs(&ios[c.io].req), at + *got, c.len as u64 - *got, true)?;
                        let Some(n) = recv(fd, &mut iov)? else {
                            break;
                        };
                        progress = true;
                        *got += n as u64;
                        if *got == c.len as u64 {
                            answered[*j] = true;
                            left -= 1;
                            rx = Rx::Header { buf: [0; 16], got: 0 };
                        }
                    }
                }
                if left == 0 {
                    break;
                }
            }
            if left == 0 {
                break;
            }
            if progress {
                deadline = Instant::now() + self.timeout;
                continue;
            }
            let events = libc::POLLIN | if next < cmds.len() { libc::POLLOUT } else { 0 };
            client::wait_fd(self.sock.as_fd(), events, deadline)
                .map_err(|_| BackendError::link(format!("no progress on the connection for {} ms", self.timeout.as_millis())))?;
        }
        Ok(())
    }
}

enum Rx {
    Header { buf: [u8; 16], got: usize },
    Data { j: usize, got: u64 },
}

fn op_name(typ: u16) -> &'static str {
    match typ {
        CMD_READ => "nbd read",
        CMD_WRITE => "nbd write",
        CMD_FLUSH => "nbd flush",
        CMD_TRIM => "nbd trim",
        _ => "nbd write-zeroes",
    }
}

fn request_bufs<'r, 'a>(req: &'r Request<'a>) -> &'r SliceList<'a> {
    match req {
        Request::Read { into: bufs, .. } | Request::Write { from: bufs, .. } => bufs,
        _ => unreachable!("only reads and writes carry buffers"),
    }
}

/// Appends iovecs for bytes `from..from + len` of `bufs`.
fn push_range(iov: &mut Vec<libc::iovec>, bufs: &SliceList<'_>, from: u64, len: u64, writable: bool) -> Result<(), BackendError> {
    let mut skip = from;
    let mut want = len;
    for s in bufs.iter() {
        if want == 0 {
            break;
        }
        let sl = s.len() as u64;
        if skip >= sl {
            skip -= sl;
            continue;
        }
        let n = (sl - skip).min(want);
        let part = s.sub(skip as usize, n as usize).map_err(|e| BackendError::link(e.to_string()))?;
        let base =
            if writable { part.as_mut_ptr().map_err(|e| BackendError::link(e.to_string()))? } else { part.as_ptr() as *mut u8 };
        iov.push(libc::iovec { iov_base: base.cast(), iov_len: n as usize });
        skip = 0;
        want -= n;
    }
    if want != 0 {
        return Err(BackendError::link("request buffers shorter than the request"));
    }
    Ok(())
}

/// One non-blocking `sendmsg`; `None` if it would block.
fn sendmsg(fd: RawFd, iov: &[libc::iovec]) -> Result<Option<usize>, BackendError> {
    // SAFETY: plain data for sendmsg to read.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len();
    loop {
        // SAFETY: the iovecs point into live buffers (header on the caller's stack, grant
        // windows held by the batch, or the zero buffer).
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => return Ok(None),
            std::io::ErrorKind::Interrupted => continue,
            _ => return Err(BackendError::link(format!("send: {e}"))),
        }
    }
}

/// One non-blocking `recvmsg`; `None` if it would block; end of stream is an error.
fn recv(fd: RawFd, iov: &mut [libc::iovec]) -> Result<Option<usize>, BackendError> {
    // SAFETY: plain data for recvmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    loop {
        // SAFETY: the iovecs point into writable memory owned by the caller for the call.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        if n > 0 {
            return Ok(Some(n as usize));
        }
        if n == 0 {
            return Err(BackendError::link("the server closed the connection"));
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => return Ok(None),
            std::io::ErrorKind::Interrupted => continue,
            _ => return Err(BackendError::link(format!("receive: {e}"))),
        }
    }
}

impl Backend for NbdBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        let i = self.info.unwrap_or(ExportInfo { size: 0, flags: 0, min_block: 1, pref_block: 4096, max_payload: 1 << 20 });
        Caps {
            flush: i.has(TFLAG_SEND_FLUSH),
            fua: i.has(TFLAG_SEND_FUA),
            discard: i.has(TFLAG_SEND_TRIM),
            write_zeroes: i.has(TFLAG_SEND_WRITE_ZEROES),
            read_only: i.has(TFLAG_READ_ONLY),
        }
    }

    fn execute(&mut self, ios: &mut [Io<'_>]) {
        self.run(ios);
    }

    fn remote(&mut self) -> Option<&mut dyn Remote> {
        Some(self)
    }
}

impl Remote for NbdBackend {
    fn start(&mut self) -> Result<(), SetupError> {
        if self.info.is_none() && self.lost.is_none() {
            if let Err(e) = self.negotiate() {
                self.lose(e.to_string());
            }
        }
        match &self.lost {
            Some(why) => Err(SetupError::new(why.clone())),
            None => Ok(()),
        }
    }

    fn lost(&self) -> Option<&str> {
        self.lost.as_deref()
    }
}

impl NbdBackend {
    /// Runs a batch on the connection (see [`Backend::execute`]).
    fn run(&mut self, ios: &mut [Io<'_>]) {
        let info = match (self.start(), self.info) {
            (Ok(()), Some(info)) => info,
            _ => {
                for io in ios.iter_mut() {
                    io.result = Err(BlockError::Os { op: "nbd", offset: 0, errno: libc::EIO });
                }
                return;
            }
        };
        let mut results: Vec<Result<u64, BlockError>> = ios
            .iter()
            .map(|io| Ok(if matches!(io.req, Request::Read { .. } | Request::Write { .. }) { io.req.transfer_len() } else { 0 }))
            .collect();
        let mut phase: Vec<Cmd> = Vec::new();
        // Writes with FUA on a server without it: durable once the next flush is answered.
        let mut fua_waiting: Vec<usize> = Vec::new();
        let mut outcome = Ok(());
        for i in 0..ios.len() {
            if let Request::Flush = ios[i].req {
                if !info.has(TFLAG_SEND_FLUSH) {
                    continue; // the server writes through
                }
                outcome = self.flush_after(&*ios, &mut phase, i, &mut fua_waiting, &mut results);
                if outcome.is_err() {
                    break;
                }
                continue;
            }
            if let Request::Write { fua: true, .. } = ios[i].req {
                if !info.has(TFLAG_SEND_FUA) && info.has(TFLAG_SEND_FLUSH) {
                    fua_waiting.push(i);
                }
            }
            if let Some(r) = self.plan(i, &ios[i].req, &info, &mut phase) {
                results[i] = r;
            }
        }
        if outcome.is_ok() {
            outcome = if fua_waiting.is_empty() {
                let cmds = std::mem::take(&mut phase);
                self.run_phase(&*ios, &cmds, &mut results)
            } else {
                let last = *fua_waiting.last().expect("not empty");
                self.flush_after(&*ios, &mut phase, last, &mut fua_waiting, &mut results)
            };
        }
        if let Err(why) = outcome {
            self.lose(why.to_string());
            for io in ios.iter_mut() {
                io.result = Err(BlockError::Os { op: "nbd", offset: 0, errno: libc::EIO });
            }
            return;
        }
        for (io, r) in ios.iter_mut().zip(results) {
            io.result = r;
        }
    }
}

impl NbdBackend {
    /// Runs the commands planned so far, then a flush on behalf of request `i`; the flush's
    /// result also settles every write waiting on it for FUA.
    fn flush_after(
        &mut self,
        ios: &[Io<'_>],
        phase: &mut Vec<Cmd>,
        i: usize,
        fua_waiting: &mut Vec<usize>,
        results: &mut [Result<u64, BlockError>],
    ) -> Result<(), BackendError> {
        let cmds = std::mem::take(phase);
        self.run_phase(ios, &cmds, results)?;
        let flush = [Cmd { io: i, typ: CMD_FLUSH, flags: 0, offset: 0, len: 0, data: Data::None }];
        self.run_phase(ios, &flush, results)?;
        if let Err(e) = &results[i] {
            let e = e.clone();
            for &w in fua_waiting.iter() {
                if results[w].is_ok() {
                    results[w] = Err(e.clone());
                }
            }
        }
        fua_waiting.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_shmem::{memfd, Mapping, Protection, SliceList};
    use std::os::unix::net::UnixStream;

    /// Serves `export` of `size` bytes with the export's own server code would need the
    /// frontend; a minimal in-memory NBD server is enough to test the client's framing.
    fn mini_server(size: u64, flags: u16, mut sock: UnixStream, fail_after: Option<usize>) -> Vec<u8> {
        use std::io::{Read, Write};
        let mut disk = vec![0u8; size as usize];
        let mut g = NBDMAGIC.to_be_bytes().to_vec();
        g.extend_from_slice(&IHAVEOPT.to_be_bytes());
        g.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        sock.write_all(&g).unwrap();
        let mut cf = [0u8; 4];
        sock.read_exact(&mut cf).unwrap();
        let mut h = [0u8; 16];
        sock.read_exact(&mut h).unwrap();
        let mut data = vec![0u8; be32(&h[12..16]) as usize];
        sock.read_exact(&mut data).unwrap();
        let mut info = INFO_EXPORT.to_be_bytes().to_vec();
        info.extend_from_slice(&size.to_be_bytes());
        info.extend_from_slice(&(TFLAG_HAS_FLAGS | flags).to_be_bytes());
        sock.write_all(&option_reply(OPT_GO, REP_INFO, &info)).unwrap();
        let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [1u32, 4096, 64 * 1024] {
            bs.extend_from_slice(&v.to_be_bytes());
        }
        sock.write_all(&option_reply(OPT_GO, REP_INFO, &bs)).unwrap();
        sock.write_all(&option_reply(OPT_GO, REP_ACK, &[])).unwrap();
        let mut served = 0;
        loop {
            let mut r = [0u8; 28];
            if sock.read_exact(&mut r).is_err() {
                return disk;
            }
            let req = Wire::decode(&r).unwrap();
            if fail_after == Some(served) {
                return disk; // drop the connection mid-batch
            }
            served += 1;
            let (o, l) = (req.offset as usize, req.len as usize);
            match req.typ {
                CMD_READ => {
                    sock.write_all(&simple_reply(0, req.cookie)).unwrap();
                    sock.write_all(&disk[o..o + l]).unwrap();
                }
                CMD_WRITE => {
                    sock.read_exact(&mut disk[o..o + l]).unwrap();
                    sock.write_all(&simple_reply(0, req.cookie)).unwrap();
                }
                CMD_WRITE_ZEROES | CMD_TRIM => {
                    disk[o..o + l].fill(0);
                    sock.write_all(&simple_reply(0, req.cookie)).unwrap();
                }
                CMD_FLUSH => sock.write_all(&simple_reply(0, req.cookie)).unwrap(),
                CMD_DISC => return disk,
                _ => sock.write_all(&simple_reply(EINVAL, req.cookie)).unwrap(),
            }
        }
    }

    fn arena(len: usize) -> (OwnedFd, Mapping) {
        let fd = memfd::create("t", len as u64).unwrap();
        let m = Mapping::new(fd.as_raw_fd(), len, Protection::ReadWrite).unwrap();
        (fd, m)
    }

    #[test]
    fn batches_split_beyond_the_payload_limit_and_read_back() {
        let (a, b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || mini_server(4 << 20, TFLAG_SEND_FLUSH | TFLAG_SEND_WRITE_ZEROES, b, None));
        let mut be = NbdBackend::new(OwnedFd::from(a), "x", 4 << 20, Duration::from_secs(5));
        be.start().unwrap();
        assert_eq!(be.info().unwrap().max_payload, 64 * 1024);
        let (_f, m) = arena(1 << 20);
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + 3) as u8).collect();
        m.slice(0, data.len()).unwrap().copy_from(&data).unwrap();
        // Two windows, so a chunk boundary falls inside the second one.
        let mut bufs = SliceList::new();
        bufs.push(m.slice(0, 100_000).unwrap());
        bufs.push(m.slice(100_000, 200_000).unwrap());
        let mut ios = [
            Io::new(Request::Write { offset: 12345, from: bufs, fua: true }),
            Io::new(Request::Flush),
            Io::new(Request::WriteZeroes { offset: 12345 + 1000, len: 1000 }),
        ];
        be.execute(&mut ios);
        assert_eq!(ios[0].result, Ok(300_000));
        assert_eq!(ios[1].result, Ok(0));
        assert_eq!(ios[2].result, Ok(0));
        let out = m.slice(400_000, 300_000).unwrap();
        let mut ios = [Io::new(Request::Read { offset: 12345, into: SliceList::one(out) })];
        be.execute(&mut ios);
        assert_eq!(ios[0].result, Ok(300_000));
        let mut got = vec![0u8; 300_000];
        out.copy_to(&mut got);
        let mut want = data.clone();
        want[1000..2000].fill(0);
        assert_eq!(got, want);
        assert!(be.lost().is_none());
        drop(be);
        server.join().unwrap();
    }

    #[test]
    fn a_dropped_connection_marks_the_backend_lost_and_answers_nothing_good() {
        let (a, b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || mini_server(1 << 20, TFLAG_SEND_FLUSH, b, Some(1)));
        let mut be = NbdBackend::new(OwnedFd::from(a), "x", 1 << 20, Duration::from_secs(5));
        let (_f, m) = arena(1 << 16);
        let mut ios = [
            Io::new(Request::Read { offset: 0, into: SliceList::one(m.slice(0, 4096).unwrap()) }),
            Io::new(Request::Read { offset: 4096, into: SliceList::one(m.slice(4096, 4096).unwrap()) }),
        ];
        be.execute(&mut ios);
        assert!(be.lost().unwrap().contains("closed"), "{:?}", be.lost());
        assert!(ios.iter().all(|io| io.result.is_err()));
        server.join().unwrap();
    }

    #[test]
    fn an_export_smaller_than_the_device_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || mini_server(1 << 20, 0, b, None));
        let mut be = NbdBackend::new(OwnedFd::from(a), "x", 2 << 20, Duration::from_secs(5));
        let e = be.start().unwrap_err();
        assert!(e.to_string().contains("smaller than the device"), "{e}");
        drop(be);
        server.join().unwrap();
    }

    #[test]
    fn a_silent_server_times_out() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut be = NbdBackend::new(OwnedFd::from(a), "x", 1 << 20, Duration::from_millis(200));
        let e = be.start().unwrap_err();
        assert!(e.to_string().contains("200 ms"), "{e}");
    }
}
