//! The control API of `bulkhead serve`: typed requests and answers over its control socket,
//! the server `serve` runs, and the client the CLI, the C library and tools use.
//!
//! One request per line, one answer per line, both JSON (docs/control.md has every call with
//! an example). A request is an object whose `cmd` names the call, with an optional `version`
//! (the protocol version the client speaks; [`PROTOCOL_VERSION`] when absent):
//!
//! ```text
//! → {"cmd":"restart","device":"disk0"}
//! ← {"ok":{"device":"disk0","driver_pid":4242}}
//! → {"cmd":"restart","devcie":"disk0"}
//! ← {"error":{"code":"bad_request","message":"unknown field `devcie`, expected `device`"}}
//! ```
//!
//! Each call is a type implementing [`Call`], whose [`Call::Reply`] is what `ok` holds: the
//! server ([`Service`], [`dispatch`]) and the client ([`Client::call`]) are both written against
//! those types, so a field renamed on one side fails to compile on the other rather than
//! showing up as a blank.
//!
//! The socket is `0600` (or `0660` with a configured group), and every connection's peer is
//! checked again with `SO_PEERCRED` ([`Access`]).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod calls;
mod client;
mod server;
mod status;
pub mod table;

pub use calls::*;
pub use client::{Client, ClientError};
pub use server::{dispatch, read_line, Access, AttachHandler, ControlServer, Service, MAX_LINE};
pub use status::*;

/// The version of the protocol this build speaks. A request naming a later one is refused
/// with [`ErrorCode::UnsupportedVersion`]; one naming this or an earlier one is served.
pub const PROTOCOL_VERSION: u32 = 1;

/// The control socket of the `serve` whose run directory is `run_dir`.
pub fn socket_path(run_dir: &std::path::Path) -> std::path::PathBuf {
    run_dir.join("control.sock")
}

/// What kind of error an answer carries: what a client may act on without reading the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The line is not a request: not JSON, an unknown `cmd`, a missing or unknown field, a
    /// value of the wrong type.
    BadRequest,
    /// The request names a protocol version later than the server's.
    UnsupportedVersion,
    /// The line is longer than [`MAX_LINE`].
    TooLarge,
    /// No device, view or snapshot of that name.
    NotFound,
    /// The request is well formed but asks for something impossible (a bad filter table, a
    /// QoS value out of range, a name already taken).
    Invalid,
    /// The device is in use (mounted, connected) and the call was not forced.
    InUse,
    /// The call was refused for who made it.
    Denied,
    /// The call was tried and failed (a domain did not start, a flush failed).
    Failed,
}

/// An error answer: a code, and a message naming what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ControlError {
    /// What kind.
    pub code: ErrorCode,
    /// In words, naming the device, the key or the field.
    pub message: String,
}

impl ControlError {
    /// An error of `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ControlError { code, message: message.into() }
    }

    /// [`ErrorCode::BadRequest`].
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    /// [`ErrorCode::NotFound`].
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// [`ErrorCode::Invalid`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Invalid, message)
    }

    /// [`ErrorCode::Failed`].
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Failed, message)
    }
}

/// One answer line: `{"ok": REPLY}` or `{"error": {"code": …, "message": …}}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Answer<T> {
    /// The call's reply.
    Ok(T),
    /// Why it failed.
    Error(ControlError),
}

impl<T> From<Result<T, ControlError>> for Answer<T> {
    fn from(r: Result<T, ControlError>) -> Self {
        match r {
            Ok(v) => Answer::Ok(v),
            Err(e) => Answer::Error(e),
        }
    }
}

impl<T> From<Answer<T>> for Result<T, ControlError> {
    fn from(a: Answer<T>) -> Self {
        match a {
            Answer::Ok(v) => Ok(v),
            Answer::Error(e) => Err(e),
        }
    }
}
