//! The control socket's server: who may connect, how lines are framed, and the dispatch of a
//! request to the [`Service`].

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bulkhead_doorbell::EventFd;

pub use crate::calls::Service;
use crate::calls::{answer_line, line, parse_request, Attach, Request};
use crate::{Answer, ControlError, ErrorCode};

/// The longest request line (a `[[device]]` table with its filters fits many times over).
pub const MAX_LINE: usize = 64 << 10;

/// Connections served at once; more are answered with an error and closed.
const MAX_CONNECTIONS: usize = 64;

/// How long a connection may sit without sending a request.
const IDLE: Duration = Duration::from_secs(60);

/// How long an answer may wait for a client to read it.
const WRITE_WAIT: Duration = Duration::from_secs(10);

/// Takes over a connection whose first request is `attach`.
pub type AttachHandler = Arc<dyn Fn(UnixStream, Attach) + Send + Sync>;

/// Who may use the socket: its owner (and root), and the members of one group if one is
/// configured. The socket's mode says the same to the kernel; every connection's peer is
/// checked again with `SO_PEERCRED`, which also covers a socket passed on as a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// The owner: the user `serve` runs as.
    pub owner: u32,
    /// A group whose members may use it too (the socket is then `0660`, else `0600`).
    pub group: Option<u32>,
}

impl Access {
    /// The user this process runs as, and nobody else.
    pub fn owner_only() -> Self {
        Access { owner: bulkhead_sys::euid(), group: None }
    }

    /// The owner and the members of `group` (a name from /etc/group, or a number).
    pub fn with_group(group: &str) -> Result<Self, String> {
        Ok(Access { group: Some(group_id(group)?), ..Self::owner_only() })
    }

    /// Whether the peer `(pid, uid, gid)` may use the socket.
    fn allows(&self, pid: i32, uid: u32, gid: u32) -> bool {
        if uid == 0 || uid == self.owner {
            return true;
        }
        let Some(g) = self.group else { return false };
        gid == g || supplementary_groups(pid).contains(&g)
    }
}

/// The id of group `name` (or `name` itself, if a number).
fn group_id(name: &str) -> Result<u32, String> {
    if let Ok(n) = name.parse() {
        return Ok(n);
    }
    let groups = std::fs::read_to_string("/etc/group").map_err(|e| format!("cannot read /etc/group: {e}"))?;
    groups
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let n = f.next()?;
            let id = f.nth(1)?.parse().ok()?;
            Some((n, id))
        })
        .find_map(|(n, id)| (n == name).then_some(id))
        .ok_or_else(|| format!("no group `{name}` in /etc/group"))
}

/// The supplementary groups of `pid`, from /proc (empty if it is gone).
fn supplementary_groups(pid: i32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:").map(|g| g.split_whitespace().filter_map(|x| x.parse().ok()).collect()))
        })
        .unwrap_or_default()
}

/// Answers one request line through `service`, as the line to send back (no newline).
/// `None` for a well-formed `attach`, which is not a call with one answer.
pub fn dispatch(service: &dyn Service, request: &str) -> Option<String> {
    match parse_request(request) {
        Ok(req) => answer_line(service, req),
        Err(e) => Some(line::<()>(&Answer::Error(e))),
    }
}

/// A running control socket; removed on drop.
pub struct ControlServer {
    path: PathBuf,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer").field("path", &self.path).finish()
    }
}

impl ControlServer {
    /// Binds `path` (replacing a stale socket) with the mode `access` implies, and serves
    /// `service`, handing connections that ask to attach to `attach`.
    pub fn start(path: &Path, access: Access, service: Arc<dyn Service>, attach: Option<AttachHandler>) -> std::io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        if let Some(g) = access.group {
            std::os::unix::fs::chown(path, None, Some(g))?;
        }
        let mode = if access.group.is_some() { 0o660 } else { 0o600 };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(EventFd::new()?);
        let s = stop.clone();
        let open = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::Builder::new().name("control".into()).spawn(move || {
            // Asleep until a client connects or `stop` rings: nothing wakes an idle serve.
            let mut fds = [
                libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            loop {
                if bulkhead_sys::poll(&mut fds, -1).is_err() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                if fds[1].revents != 0 {
                    return;
                }
                loop {
                    match listener.accept() {
                        Ok((conn, _)) => admit(conn, access, &service, &attach, &open),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        // Nothing more to take now.
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        // Out of descriptors, say: looked at again in a moment, not at once.
                        Err(_) => {
                            std::thread::sleep(Duration::from_millis(50));
                            break;
                        }
                    }
                }
            }
        })?;
        Ok(ControlServer { path: path.to_path_buf(), stop, thread: Some(thread) })
    }

    /// Stops accepting and removes the socket.
    pub fn stop(&mut self) {
        self.stop.ring();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Checks a new connection's peer and the number open, and serves it on a thread of its own.
fn admit(conn: UnixStream, access: Access, service: &Arc<dyn Service>, attach: &Option<AttachHandler>, open: &Arc<AtomicUsize>) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_write_timeout(Some(WRITE_WAIT));
    let refuse = |mut conn: UnixStream, e: ControlError| {
        let _ = writeln!(conn, "{}", line::<()>(&Answer::Error(e)));
    };
    match bulkhead_sys::peer_ucred(conn.as_fd()) {
        Ok((pid, uid, gid)) if access.allows(pid, uid, gid) => {}
        Ok((pid, uid, _)) => {
            return refuse(conn, ControlError::new(ErrorCode::Denied, format!("user {uid} (pid {pid}) may not use this socket")))
        }
        Err(e) => return refuse(conn, ControlError::new(ErrorCode::Denied, format!("cannot tell who connected: {e}"))),
    }
    if open.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
        open.fetch_sub(1, Ordering::AcqRel);
        return refuse(conn, ControlError::failed(format!("more than {MAX_CONNECTIONS} control connections open; try again")));
    }
    let (service, attach, open) = (service.clone(), attach.clone(), open.clone());
    let spawned = std::thread::Builder::new().name("control-conn".into()).spawn(move || {
        serve_conn(conn, &*service, attach);
        open.fetch_sub(1, Ordering::AcqRel);
    });
    if spawned.is_err() {
        // The closure (and the connection) went with the failed spawn.
        log::warn!("control: cannot start a thread for a connection");
    }
}

fn serve_conn(mut conn: UnixStream, service: &dyn Service, attach: Option<AttachHandler>) {
    let _ = conn.set_read_timeout(Some(IDLE));
    let Ok(mut w) = conn.try_clone() else { return };
    let mut send = |answer: String| writeln!(w, "{answer}").is_ok();
    // The first line is read a byte at a time: an attach conversation goes on with
    // descriptors, which a buffered reader would leave behind.
    let first = match read_line_bytes(&mut conn) {
        Ok(Some(l)) => l,
        Ok(None) => return,
        Err(e) => {
            send(frame_error(e));
            return;
        }
    };
    match parse_bytes(first) {
        Ok(Request::Attach(a)) => {
            match attach {
                Some(handler) => handler(conn, a),
                None => {
                    send(line::<()>(&Answer::Error(ControlError::invalid("this control socket takes no attach"))));
                }
            }
            return;
        }
        Ok(req) => {
            if !send(answer_line(service, req).unwrap_or_default()) {
                return;
            }
        }
        Err(e) => {
            if !send(line::<()>(&Answer::Error(e))) {
                return;
            }
        }
    }
    let mut r = BufReader::new(conn);
    loop {
        let l = match read_buffered_line(&mut r) {
            Ok(Some(l)) => l,
            Ok(None) => return,
            Err(e) => {
                send(frame_error(e));
                return;
            }
        };
        let answer = match parse_bytes(l) {
            Ok(Request::Attach(_)) => {
                line::<()>(&Answer::Error(ControlError::bad_request("`attach` must be a connection's first line")))
            }
            Ok(req) => answer_line(service, req).unwrap_or_default(),
            Err(e) => line::<()>(&Answer::Error(e)),
        };
        if !send(answer) {
            return;
        }
    }
}

/// The answer to a line that could not be read whole: too long, not UTF-8, or cut short.
fn frame_error(e: std::io::Error) -> String {
    let err = match e.kind() {
        std::io::ErrorKind::FileTooLarge => ControlError::new(ErrorCode::TooLarge, e.to_string()),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            ControlError::bad_request(format!("no request within {} s", IDLE.as_secs()))
        }
        _ => ControlError::bad_request(e.to_string()),
    };
    line::<()>(&Answer::Error(err))
}

/// Parses a request line that may not be UTF-8.
fn parse_bytes(line: Vec<u8>) -> Result<Request, ControlError> {
    let line = String::from_utf8(line).map_err(|e| ControlError::bad_request(format!("request is not UTF-8: {e}")))?;
    parse_request(&line)
}

fn too_long() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::FileTooLarge, format!("request longer than {} KiB", MAX_LINE >> 10))
}

/// Reads one line (up to [`MAX_LINE`]) from `conn`, a byte at a time: nothing past it is
/// consumed, so descriptors sent after it stay with their message. `None` at end of stream.
pub fn read_line(conn: &mut impl Read) -> std::io::Result<Option<String>> {
    match read_line_bytes(conn)? {
        None => Ok(None),
        Some(l) => String::from_utf8(l)
            .map(Some)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("line is not UTF-8: {e}"))),
    }
}

/// [`read_line`], as bytes.
fn read_line_bytes(conn: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match conn.read(&mut b) {
            Ok(0) if line.is_empty() => return Ok(None),
            Ok(0) => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "request cut short")),
            Ok(_) if b[0] == b'\n' => break,
            Ok(_) if line.len() >= MAX_LINE => return Err(too_long()),
            Ok(_) => line.push(b[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(line))
}

/// [`read_line`] through a buffer, for the lines after the first.
fn read_buffered_line(r: &mut impl BufRead) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            if line.is_empty() {
                return Ok(None);
            }
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "request cut short"));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (buf.len(), false),
        };
        if line.len() + take > MAX_LINE {
            return Err(too_long());
        }
        line.extend_from_slice(&buf[..take]);
        r.consume(take + usize::from(done));
        if done {
            return Ok(Some(line));
        }
    }
}
