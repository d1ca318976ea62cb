//! The control socket: one JSON request per line, one JSON answer per line.
//!
//! Requests: `{"cmd":"status"}`, `{"cmd":"restart","device":NAME}`,
//! `{"cmd":"tap","device":NAME,"mode":"interpose"}`,
//! `{"cmd":"filter","device":NAME,"op":"add","at":N|null,"table":"type = \"delay\"\n…"}`,
//! `{"cmd":"filter","device":NAME,"op":"remove","at":N}`,
//! `{"cmd":"snapshot","device":NAME,"op":"create"|"list"|"revert"|"delete","name":SNAP}`.
//!
//! `{"cmd":"attach",…}` as a connection's first line hands the connection to the attach
//! handler, which keeps it for as long as the application stays attached
//! (`bulkhead_client::attach`).
//!
//! The socket is made `0660`: its owner and group may use it, nobody else.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bulkhead_doorbell::EventFd;

/// Handles one request, returning the answer.
pub type Handler = Arc<dyn Fn(&serde_json::Value) -> serde_json::Value + Send + Sync>;

/// Takes over a connection whose first request is `attach`.
pub type AttachHandler = Arc<dyn Fn(UnixStream, &serde_json::Value) + Send + Sync>;

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
    /// Binds `path` (replacing a stale socket) and serves `handler`.
    pub fn start(path: &Path, handler: Handler) -> std::io::Result<Self> {
        Self::start_with_attach(path, handler, None)
    }

    /// [`start`](Self::start), handing connections that ask to attach to `attach`.
    pub fn start_with_attach(path: &Path, handler: Handler, attach: Option<AttachHandler>) -> std::io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(EventFd::new()?);
        let s = stop.clone();
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
                        Ok((conn, _)) => {
                            let _ = conn.set_nonblocking(false);
                            let (h, a) = (handler.clone(), attach.clone());
                            std::thread::spawn(move || serve_conn(conn, h, a));
                        }
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

fn serve_conn(mut conn: UnixStream, handler: Handler, attach: Option<AttachHandler>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut w = match conn.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    // The first line is read a byte at a time: an attach conversation goes on with
    // descriptors, which a buffered reader would leave behind.
    let Ok(Some(first)) = bulkhead_client::attach::read_line(&mut conn) else { return };
    let answer = |line: &str| match serde_json::from_str::<serde_json::Value>(line) {
        Ok(v) => Ok(v),
        Err(e) => Err(serde_json::json!({ "error": format!("bad request: {e}") })),
    };
    let first = match answer(&first) {
        Ok(v) if v["cmd"] == "attach" => {
            match attach {
                Some(a) => a(conn, &v),
                None => {
                    let _ = writeln!(w, "{}", serde_json::json!({ "error": "this control socket takes no attach" }));
                }
            }
            return;
        }
        Ok(v) => handler(&v),
        Err(e) => e,
    };
    if writeln!(w, "{first}").is_err() {
        return;
    }
    let mut line = String::new();
    // Bound what an untrusted local client can make us buffer.
    let mut r = BufReader::new(conn.take(64 * 1024));
    while matches!(r.read_line(&mut line), Ok(n) if n > 0) {
        let answer = match answer(&line) {
            Ok(v) => handler(&v),
            Err(e) => e,
        };
        if writeln!(w, "{answer}").is_err() {
            return;
        }
        line.clear();
    }
}

/// Sends one request to the control socket at `path` and returns the answer. A change may
/// take a while (a snapshot of a large overlay): the answer is awaited for up to 90 s.
pub fn request(path: &Path, req: &serde_json::Value) -> std::io::Result<serde_json::Value> {
    let mut s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(90)))?;
    writeln!(s, "{req}")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_gets_handler_answer_and_bad_json_gets_error() {
        let dir = std::env::temp_dir().join(format!("bulkhead-ctl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("control.sock");
        let mut srv = ControlServer::start(&path, Arc::new(|v| serde_json::json!({ "echo": v["cmd"] }))).unwrap();
        let a = request(&path, &serde_json::json!({"cmd": "status"})).unwrap();
        assert_eq!(a["echo"], "status");
        let mut s = UnixStream::connect(&path).unwrap();
        writeln!(s, "not json").unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        assert!(line.contains("bad request"));
        srv.stop();
        assert!(!path.exists(), "socket removed on stop");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
