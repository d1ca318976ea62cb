//! The client: connects to a `serve`'s control socket and makes typed calls.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::calls::{request_line, Call};
use crate::{Answer, ControlError};

/// How long a call waits for its answer: a change may take a while (a snapshot of a large
/// overlay, a device's domains starting).
const ANSWER_WAIT: Duration = Duration::from_secs(90);

/// Why a call did not get its reply.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens at the socket.
    #[error("no bulkhead serve is running on run dir {run_dir} ({socket} not found)")]
    NotRunning {
        /// The run directory.
        run_dir: String,
        /// The socket looked for.
        socket: String,
    },
    /// The socket could not be reached, or the conversation broke.
    #[error("{socket}: {source}")]
    Io {
        /// The socket.
        socket: String,
        /// What went wrong.
        source: std::io::Error,
    },
    /// `serve` answered with an error.
    #[error("{0}")]
    Refused(ControlError),
    /// The answer was not what the call expects (a `serve` of another version).
    #[error("{socket}: unexpected answer: {message}")]
    Protocol {
        /// The socket.
        socket: String,
        /// What was wrong with it.
        message: String,
    },
}

/// A connection to a `serve`'s control socket.
#[derive(Debug)]
pub struct Client {
    conn: UnixStream,
    reader: BufReader<UnixStream>,
    socket: PathBuf,
}

impl Client {
    /// Connects to the `serve` whose run directory is `run_dir`.
    pub fn connect(run_dir: &Path) -> Result<Client, ClientError> {
        let socket = crate::socket_path(run_dir);
        if !socket.exists() {
            return Err(ClientError::NotRunning { run_dir: run_dir.display().to_string(), socket: socket.display().to_string() });
        }
        Self::connect_socket(&socket)
    }

    /// Connects to the control socket at `socket`.
    pub fn connect_socket(socket: &Path) -> Result<Client, ClientError> {
        let io = |source| ClientError::Io { socket: socket.display().to_string(), source };
        let conn = UnixStream::connect(socket).map_err(io)?;
        conn.set_read_timeout(Some(ANSWER_WAIT)).map_err(io)?;
        let reader = BufReader::new(conn.try_clone().map_err(io)?);
        Ok(Client { conn, reader, socket: socket.to_path_buf() })
    }

    /// Makes `call` and returns its reply.
    pub fn call<C: Call>(&mut self, call: C) -> Result<C::Reply, ClientError> {
        let line = self.round_trip(&request_line(&call.into()))?;
        let answer: Answer<C::Reply> = serde_json::from_str(&line)
            .map_err(|e| ClientError::Protocol { socket: self.socket.display().to_string(), message: e.to_string() })?;
        Result::from(answer).map_err(ClientError::Refused)
    }

    /// Sends one raw line and returns the raw answer line: for tools that pass requests
    /// through (and for tests of malformed requests).
    pub fn round_trip(&mut self, request: &str) -> Result<String, ClientError> {
        let io = |source| ClientError::Io { socket: self.socket.display().to_string(), source };
        self.conn.write_all(format!("{request}\n").as_bytes()).map_err(io)?;
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => Err(io(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "serve hung up"))),
            Ok(_) => Ok(line),
            Err(e) => Err(io(e)),
        }
    }
}
