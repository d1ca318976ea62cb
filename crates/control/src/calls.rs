//! Every call of the control API: its request, its reply, and the [`Service`] method that
//! answers it, declared once in [`calls!`] so the three cannot drift apart.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{ControlError, StatusReport};

/// A call: a request whose answer is a [`Self::Reply`].
pub trait Call: Serialize + Into<Request> {
    /// What the answer's `ok` holds.
    type Reply: Serialize + for<'de> Deserialize<'de>;
}

/// Declares the calls: `Type "cmd" => method -> Reply`. Generates [`Request`], each call's
/// [`Call`] impl and `From` into [`Request`], the [`Service`] trait, and the dispatch of a
/// request to its method.
macro_rules! calls {
    ($($(#[$doc:meta])* $ty:ident $cmd:literal => $method:ident -> $reply:ty;)*) => {
        /// A request: one line sent to the control socket, tagged by `cmd`.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "cmd")]
        pub enum Request {
            $($(#[$doc])* #[serde(rename = $cmd)] $ty($ty),)*
            /// Hands the connection to the attach conversation
            /// (`bulkhead_client::attach`); only as a connection's first line.
            #[serde(rename = "attach")]
            Attach(Attach),
        }

        $(
            impl Call for $ty {
                type Reply = $reply;
            }
            impl From<$ty> for Request {
                fn from(c: $ty) -> Request {
                    Request::$ty(c)
                }
            }
        )*

        /// What answers the calls: `serve` implements it over its supervisor and exports.
        pub trait Service: Send + Sync {
            $($(#[$doc])* fn $method(&self, call: $ty) -> Result<$reply, ControlError>;)*
        }

        /// Answers `req` through `service`, as the line to send back (no newline). `None` for
        /// [`Request::Attach`], which is not a call with one answer.
        pub(crate) fn answer_line(service: &dyn Service, req: Request) -> Option<String> {
            match req {
                $(Request::$ty(c) => Some(line(&crate::Answer::from(service.$method(c)))),)*
                Request::Attach(_) => None,
            }
        }
    };
}

pub(crate) fn line<T: Serialize>(answer: &crate::Answer<T>) -> String {
    // Every reply type is plain data: serialising it cannot fail.
    serde_json::to_string(answer)
        .unwrap_or_else(|e| format!(r#"{{"error":{{"code":"failed","message":"the answer could not be written: {e}"}}}}"#))
}

calls! {
    /// Who answers: the protocol version and the program's.
    Hello "hello" => hello -> HelloReply;
    /// Every device, view and export, with its figures (`bulkhead status`).
    Status "status" => status -> StatusReport;
    /// Replaces a device's domains with fresh ones (`bulkhead device restart`).
    Restart "restart" => restart -> Changed;
    /// Runs a device's filters in another place (`bulkhead device tap`).
    SetTap "tap" => set_tap -> Changed;
    /// Makes an inactive device write: the destination's half of a live migration's
    /// hand-over (`bulkhead device activate`).
    Activate "activate" => activate -> Activity;
    /// Drains and flushes a device and makes it stop writing: the source's half of a live
    /// migration's hand-over (`bulkhead device deactivate`).
    Deactivate "deactivate" => deactivate -> Activity;
    /// Inserts a filter into a running device (`bulkhead filter add DEVICE`).
    AddFilter "filter_add" => add_filter -> Changed;
    /// Removes a filter from a running device (`bulkhead filter remove DEVICE`).
    RemoveFilter "filter_remove" => remove_filter -> Changed;
    /// Takes, reverts to or deletes a snapshot of a device's `cow` overlay.
    Snapshot "snapshot" => snapshot -> Changed;
    /// Lists the snapshots of a device's `cow` overlay.
    ListSnapshots "snapshot_list" => list_snapshots -> Snapshots;
    /// Shows or changes a view's QoS (`bulkhead view qos`).
    SetQos "qos" => set_qos -> QosReply;
    /// Starts devices given as `[[device]]` tables and exports them (`bulkhead device add`).
    AddDevice "device_add" => add_device -> DevicesAdded;
    /// Unexports a device, drains and flushes it, and ends its domains (`bulkhead device remove`).
    RemoveDevice "device_remove" => remove_device -> DeviceRemoved;
    /// Adds a view to a running device and exports it (`bulkhead view add`).
    AddView "view_add" => add_view -> ViewAdded;
    /// Unexports a view, drains and flushes it, and takes it out of its device (`bulkhead view
    /// DEVICE remove`).
    RemoveView "view_remove" => remove_view -> ViewRemoved;
    /// The running configuration as TOML that `serve --config` accepts (`bulkhead config dump`).
    DumpConfig "config_dump" => dump_config -> ConfigText;
    /// Applies the configuration file as edited since (`bulkhead reload`, SIGHUP).
    Reload "reload" => reload -> Reloaded;
    /// Hands every kept descriptor to a new `serve` from the binary on disk, then ends
    /// (`bulkhead upgrade`; needs a keeper).
    Upgrade "upgrade" => upgrade -> Upgrading;
}

/// `upgrade`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Upgrade {}

/// The answer to `upgrade`: the hand-over has begun.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Upgrading {
    /// The `serve` that is handing over and ending.
    pub pid: u32,
    /// What keeps the descriptors meanwhile: `keeper` (bulkhead's own) or `systemd`.
    pub keeper: String,
}

/// `device_add`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddDevice {
    /// One or more `[[device]]` tables, in the configuration file's syntax.
    pub table: String,
}

/// The answer to `device_add`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevicesAdded {
    /// Each device started, in the order given.
    pub devices: Vec<AddedDevice>,
}

/// A device `device_add` started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddedDevice {
    /// Its name.
    pub name: String,
    /// Its views' names.
    pub views: Vec<String>,
    /// The exports that offer it: `fuse`, `nbd`, `vhost_user`.
    pub exports: Vec<String>,
}

/// `device_remove`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveDevice {
    /// The device.
    pub name: String,
    /// Remove it even while it is in use: its users' requests then fail.
    #[serde(default)]
    pub force: bool,
}

/// The answer to `device_remove`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRemoved {
    /// The device.
    pub name: String,
    /// Users it had and that `force` cut off (empty when it was idle).
    pub cut_off: Vec<String>,
}

/// `view_add`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddView {
    /// The running device the view is part of.
    pub device: String,
    /// The view's `[[device.view]]` table, as its keys (`name = "tenant1"` and so on).
    pub table: String,
}

/// The answer to `view_add`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewAdded {
    /// The view.
    pub name: String,
    /// Its device.
    pub device: String,
    /// The exports that offer it: `fuse`, `nbd`, `vhost_user`.
    pub exports: Vec<String>,
}

/// `view_remove`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveView {
    /// The view.
    pub name: String,
    /// Remove it even while it is in use: its users' requests then fail.
    #[serde(default)]
    pub force: bool,
}

/// The answer to `view_remove`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewRemoved {
    /// The view.
    pub name: String,
    /// The device it was part of.
    pub device: String,
    /// Users it had and that `force` cut off (empty when it was idle).
    pub cut_off: Vec<String>,
}

/// `config_dump`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DumpConfig {}

/// The answer to `config_dump`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigText {
    /// TOML.
    pub toml: String,
}

/// `reload`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reload {}

/// The answer to `reload`: what changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reloaded {
    /// The file read.
    pub path: String,
    /// Devices started.
    pub added: Vec<String>,
    /// Devices removed.
    pub removed: Vec<String>,
    /// Changes applied to running devices and views, one line each.
    pub changed: Vec<String>,
}

/// `hello`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {}

/// The answer to `hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    /// The protocol version the server speaks ([`crate::PROTOCOL_VERSION`]).
    pub protocol: u32,
    /// The program's version.
    pub version: String,
    /// The `serve` process.
    pub pid: u32,
    /// Set when this `serve` runs the binary of the one before it because the binary on disk
    /// did not start (a failed upgrade): what happened to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fell_back: Option<String>,
}

/// `status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Status {}

/// `restart`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Restart {
    /// The device.
    pub device: String,
}

/// `activate`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Activate {
    /// The device.
    pub device: String,
    /// What the other end's device looked like to its guest (from its `deactivate`): a
    /// device that differs is not activated, and the answer names the difference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<Geometry>,
}

/// `deactivate`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deactivate {
    /// The device.
    pub device: String,
}

/// What a guest sees of a device and what must match at both ends of a migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Geometry {
    /// Bytes.
    pub size_bytes: u64,
    /// The logical block the exports offer (512, or a `crypt` filter's sector).
    pub block_size: u32,
    /// Writes are refused whatever the device's activity (`read_only` of the backend).
    pub read_only: bool,
}

impl Geometry {
    /// The first way `self` differs from `other` (the expected), in words; `None` if alike.
    pub fn mismatch(&self, expected: &Geometry) -> Option<String> {
        if self.size_bytes != expected.size_bytes {
            return Some(format!("size is {} bytes here and {} at the other end", self.size_bytes, expected.size_bytes));
        }
        if self.block_size != expected.block_size {
            return Some(format!("block is {} bytes here and {} at the other end", self.block_size, expected.block_size));
        }
        if self.read_only != expected.read_only {
            let says = |ro: bool| if ro { "read-only" } else { "read-write" };
            return Some(format!("it is {} here and {} at the other end", says(self.read_only), says(expected.read_only)));
        }
        None
    }
}

/// The answer to `activate` and `deactivate`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activity {
    /// The device.
    pub device: String,
    /// It writes now.
    pub active: bool,
    /// It was not so before the call (`false`: nothing was done).
    pub changed: bool,
    /// The driver domain now serving it.
    pub driver_pid: u32,
    /// What its guests see.
    pub geometry: Geometry,
}

/// `tap`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetTap {
    /// The device.
    pub device: String,
    /// Where its filters run from now on.
    pub mode: bulkhead_config::Tap,
}

/// `filter_add`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddFilter {
    /// The device.
    pub device: String,
    /// Position (0: nearest the frontend; absent: nearest the backend).
    #[serde(default)]
    pub at: Option<usize>,
    /// The filter as the body of a `[[device.filter]]` table: `type = "delay"\nread_us = 100`.
    pub table: String,
}

/// `filter_remove`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveFilter {
    /// The device.
    pub device: String,
    /// Position (0: nearest the frontend).
    pub at: usize,
}

pub use bulkhead_filters::cow::SnapshotAction;

/// `snapshot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// The device.
    pub device: String,
    /// What to do.
    pub op: SnapshotAction,
    /// The snapshot.
    pub name: String,
}

/// `snapshot_list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListSnapshots {
    /// The device.
    pub device: String,
}

/// The answer to `snapshot_list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshots {
    /// The device.
    pub device: String,
    /// Its overlay's snapshots, oldest first.
    pub snapshots: Vec<SnapshotEntry>,
}

/// One snapshot, as qcow2's snapshot table records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotEntry {
    /// Its unique id.
    pub id: String,
    /// Its name.
    pub name: String,
    /// When it was taken: seconds since the epoch.
    pub date_sec: u32,
    /// And nanoseconds.
    pub date_nsec: u32,
    /// The virtual disk size when it was taken, if recorded.
    pub disk_size: Option<u64>,
    /// Bytes of saved VM state.
    pub vm_state_size: u64,
}

/// `qos`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetQos {
    /// The view.
    pub view: String,
    /// Settings over its current caps, by the configuration's keys (`iops = "2000"`); none
    /// shows the caps in force.
    #[serde(default)]
    pub set: BTreeMap<String, String>,
}

/// The answer to `qos`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosReply {
    /// The view.
    pub view: String,
    /// The caps now in force.
    pub qos: bulkhead_qos::Caps,
    /// The same in words.
    pub summary: String,
}

/// The answer to a change of a device: its new generation's driver domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changed {
    /// The device.
    pub device: String,
    /// The driver domain now serving it.
    pub driver_pid: u32,
}

/// `attach`: the first line of an application attaching to a device or view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attach {
    /// The device or view.
    pub name: String,
    /// Queues wanted.
    #[serde(default = "one")]
    pub queues: u32,
}

fn one() -> u32 {
    1
}

/// Parses one request line: JSON, an optional `version` no later than
/// [`crate::PROTOCOL_VERSION`], a known `cmd` and exactly its fields.
pub fn parse_request(line: &str) -> Result<Request, ControlError> {
    let mut v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| ControlError::bad_request(format!("not a JSON request: {e}")))?;
    let Some(obj) = v.as_object_mut() else {
        return Err(ControlError::bad_request("a request is a JSON object with `cmd`"));
    };
    if let Some(version) = obj.remove("version") {
        let Some(n) = version.as_u64() else {
            return Err(ControlError::bad_request(format!("`version` must be a number, not {version}")));
        };
        if n > u64::from(crate::PROTOCOL_VERSION) {
            return Err(ControlError::new(
                crate::ErrorCode::UnsupportedVersion,
                format!("protocol version {n} asked; this serve speaks {}", crate::PROTOCOL_VERSION),
            ));
        }
    }
    match obj.get("cmd") {
        None => return Err(ControlError::bad_request("missing `cmd`")),
        Some(c) if !c.is_string() => return Err(ControlError::bad_request(format!("`cmd` must be a string, not {c}"))),
        _ => {}
    }
    serde_json::from_value(v).map_err(|e| ControlError::bad_request(e.to_string()))
}

/// The request line for `req`, with the version this build speaks.
pub fn request_line(req: &Request) -> String {
    let mut v = serde_json::to_value(req).unwrap_or(serde_json::Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.insert("version".into(), crate::PROTOCOL_VERSION.into());
    }
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_ones_name_what_is_wrong() {
        let r = Request::from(AddFilter { device: "d".into(), at: Some(1), table: "type = \"delay\"".into() });
        assert_eq!(parse_request(&request_line(&r)).unwrap(), r);
        assert_eq!(
            parse_request(r#"{"cmd":"restart","device":"disk0"}"#).unwrap(),
            Request::Restart(Restart { device: "disk0".into() })
        );
        assert_eq!(parse_request(r#"{"cmd":"status"}"#).unwrap(), Request::Status(Status {}));
        let e = parse_request(r#"{"cmd":"restart","devcie":"disk0"}"#).unwrap_err();
        assert_eq!(e.code, crate::ErrorCode::BadRequest);
        assert!(e.message.contains("unknown field `devcie`"), "{e}");
        let e = parse_request(r#"{"cmd":"frob"}"#).unwrap_err();
        assert!(e.message.contains("unknown variant `frob`"), "{e}");
        let e = parse_request(r#"{"cmd":"restart"}"#).unwrap_err();
        assert!(e.message.contains("missing field `device`"), "{e}");
        let e = parse_request(r#"{"cmd":"filter_remove","device":"d","at":"x"}"#).unwrap_err();
        assert!(e.message.contains("invalid type"), "{e}");
        let e = parse_request(r#"{"cmd":"tap","device":"d","mode":"sideways"}"#).unwrap_err();
        assert!(e.message.contains("unknown variant `sideways`"), "{e}");
        assert!(parse_request(r#"{"device":"d"}"#).unwrap_err().message.contains("missing `cmd`"));
        assert!(parse_request(r#"{"cmd":7}"#).unwrap_err().message.contains("`cmd` must be a string"));
        assert!(parse_request("[1,2]").unwrap_err().message.contains("JSON object"));
        assert!(parse_request(r#"{"cmd":"status""#).unwrap_err().message.contains("not a JSON request"));
        let e = parse_request(r#"{"cmd":"status","version":99}"#).unwrap_err();
        assert_eq!(e.code, crate::ErrorCode::UnsupportedVersion);
        assert!(parse_request(r#"{"cmd":"status","version":1}"#).is_ok());
    }
}
