//! Encrypted volumes in the LUKS formats that cryptsetup and qemu write: reading a LUKS1 or
//! LUKS2 header ([`Volume::read`]), opening it with a passphrase ([`Volume::unlock`]: PBKDF2
//! or Argon2 key slots, anti-forensic stripes, the master key's digest), and encrypting and
//! decrypting its sectors with `aes-xts-plain64` ([`SectorCipher`]).
//!
//! Nothing here does I/O of its own: the caller reads the device through a callback, so the
//! same code runs in a sandboxed domain (reading through the layers below it) and in the
//! supervisor. Keys are zeroed when dropped.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod hash;
mod luks;
mod xts;

pub use hash::Hash;
pub use luks::{MasterKey, ReadAt, Volume};
pub use xts::SectorCipher;

/// Why a volume could not be read or opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CryptError {
    /// No LUKS header at the start of the device (nor a LUKS2 secondary one).
    #[error("no LUKS header on the device (format it with cryptsetup luksFormat or qemu-img create -f luks)")]
    NotLuks,
    /// A header field is out of range or inconsistent.
    #[error("LUKS header: {field}: {problem}")]
    Header {
        /// The field, as the format names it (`key-slot 2 stripes`, `keyslots.0.kdf.salt`).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Something the header asks for that is not supported.
    #[error("LUKS header: unsupported: {0}")]
    Unsupported(String),
    /// No key slot opens with the key given.
    #[error("no key slot opens with the key given")]
    WrongKey,
    /// Reading the device failed.
    #[error("reading the LUKS header: {0}")]
    Read(String),
}
