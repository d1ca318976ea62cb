//! The supervisor's errors: a sentence that names the device, the view, the file or the key,
//! and a kind that says what the caller can do about it (as vhost's `should_reconnect` does),
//! so that no decision is taken on the words.

use std::fmt;

/// What kind of failure, for the caller to decide on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// What was asked cannot be: a bad value, a name taken, a change the device does not allow.
    Invalid,
    /// No device, view or snapshot of that name.
    NotFound,
    /// Applications are attached, and the call was not forced.
    InUse,
    /// Another change holds the device, or `serve` is shutting down: the same call may work
    /// later.
    Busy,
    /// A remote server (an NBD server, a Ceph cluster) could not be reached: worth trying again.
    Unreachable,
    /// It was tried and failed: storage that could not be opened, a domain that did not start
    /// or answer, a system call the host refused.
    Failed,
}

/// A failure of the supervisor. What it displays is whole (the cause included), since it is
/// what a log line or a control reply says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into() }
    }

    /// [`ErrorKind::Invalid`].
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Invalid, message)
    }

    /// [`ErrorKind::NotFound`].
    pub fn not_found(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::NotFound, message)
    }

    /// [`ErrorKind::InUse`].
    pub fn in_use(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InUse, message)
    }

    /// [`ErrorKind::Busy`].
    pub fn busy(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Busy, message)
    }

    /// [`ErrorKind::Unreachable`].
    pub fn unreachable(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Unreachable, message)
    }

    /// [`ErrorKind::Failed`].
    pub fn failed(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Failed, message)
    }

    /// What kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether the same call is worth making again later: a remote that did not answer, or a
    /// device busy with another change.
    pub fn should_retry(&self) -> bool {
        matches!(self.kind, ErrorKind::Unreachable | ErrorKind::Busy)
    }

    /// The same error, said of `what` (`device \`d\``, a file): its message prefixed.
    pub fn context(self, what: impl fmt::Display) -> Error {
        Error { kind: self.kind, message: format!("{what}: {}", self.message) }
    }

    /// The sentence alone.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// The control API's answer for a supervisor error: its kind decides the code.
impl From<Error> for bulkhead_control::ControlError {
    fn from(e: Error) -> Self {
        use bulkhead_control::ErrorCode;
        let code = match e.kind {
            ErrorKind::Invalid => ErrorCode::Invalid,
            ErrorKind::NotFound => ErrorCode::NotFound,
            ErrorKind::InUse => ErrorCode::InUse,
            ErrorKind::Busy | ErrorKind::Unreachable | ErrorKind::Failed => ErrorCode::Failed,
        };
        bulkhead_control::ControlError::new(code, e.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_keeps_the_kind_and_only_some_kinds_are_worth_retrying() {
        let e = Error::unreachable("cluster at 10.0.0.1: timed out").context("device `r`");
        assert_eq!(e.to_string(), "device `r`: cluster at 10.0.0.1: timed out");
        assert_eq!(e.kind(), ErrorKind::Unreachable);
        assert!(e.should_retry() && Error::busy("x").should_retry());
        assert!(!Error::failed("x").should_retry() && !Error::invalid("x").should_retry());
    }
}
