//! The sandbox of a driver domain.
//!
//! Layers, outermost first:
//!
//! 1. [`spawn`]: the supervisor starts a domain with `clone` into new user and pid namespaces
//!    (root inside maps to `nobody` outside) and an empty network and IPC namespace (one that
//!    every domain shares, where the layers below keep domains apart within it), with exactly
//!    the descriptors it needs at 3, 4, … and everything else closed at exec;
//! 2. [`confine`]: once the domain has mapped its channel and opened its engines, it drops what
//!    it could still do: the host's mounts ([`mounts`]: a mount namespace of its own whose only
//!    mount is an empty read-only root, pinning no host filesystem), rlimits (no core dumps, no new processes, bounded address space and
//!    descriptors), no_new_privs, not dumpable, Landlock (no filesystem access at all, no TCP,
//!    no signals or abstract sockets outside its domain), and a seccomp allowlist for its role
//!    ([`seccomp::allowlist`], one line of reason per system call).
//!
//!
//! A spare domain ([`spare`]) applies every layer of 2 that does not depend on its device
//! while it waits for one, and narrows to its role's when it is given one.
//!
//! Where a layer is unavailable the domain starts with a warning; with [`Policy::Required`] it
//! refuses instead. Each layer's outcome is reported in [`Layers`].
#![deny(missing_docs)]

pub mod confine;
pub mod landlock;
pub mod mounts;
pub mod seccomp;
pub mod spare;
pub mod spawn;

use serde::{Deserialize, Serialize};

/// What to do when a layer is unavailable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Refuse to start the domain.
    Required,
    /// Start it with a warning.
    BestEffort,
    /// Apply no sandbox at all (debugging).
    Off,
}

/// Outcome of one layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    /// In force.
    Applied,
    /// Not available here; the reason.
    Unavailable(String),
    /// Not requested.
    Off,
}

impl Layer {
    /// Whether the layer is in force.
    pub fn applied(&self) -> bool {
        matches!(self, Layer::Applied)
    }
}

/// The layers in force in a domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layers {
    /// User, pid, mount, network and IPC namespaces.
    pub namespaces: Layer,
    /// An empty read-only root in place of the copied host mount tree.
    pub mounts: Layer,
    /// Resource limits.
    pub rlimits: Layer,
    /// no_new_privs and not dumpable.
    pub no_new_privs: Layer,
    /// Landlock, with the ABI version used.
    pub landlock: Layer,
    /// Landlock ABI version of the kernel (0: none).
    pub landlock_abi: u32,
    /// Seccomp allowlist.
    pub seccomp: Layer,
    /// Role of the seccomp allowlist.
    pub seccomp_role: String,
    /// An `rbd` domain's connect listener: its descriptor number in the domain, for the
    /// supervisor to take a copy of (see [`seccomp::Role::Rbd`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_listener: Option<i32>,
}

/// What a domain reports to the supervisor once confinement is done: the layers in force, or
/// why it refused to start (a layer required by the policy is unavailable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Report {
    /// The domain is confined and about to serve.
    Confined(Layers),
    /// The domain refused to start.
    Refused {
        /// Why.
        refused: String,
    },
}

/// Why a sandbox layer could not be applied, in the words `status` shows beside it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(pub String);

/// Sandbox errors.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// A layer failed and the policy requires it.
    #[error("sandbox layer {layer} unavailable: {reason}")]
    Required {
        /// Layer name.
        layer: &'static str,
        /// Why.
        reason: String,
    },
    /// A system call failed.
    #[error("{op}: {source}")]
    Sys {
        /// Operation.
        op: &'static str,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
}
