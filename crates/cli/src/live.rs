//! What `serve` changes while it runs: devices added and removed with their exports, the
//! running configuration kept as tables (`bulkhead config dump`), and reloads of the
//! configuration file (`bulkhead reload`, SIGHUP).
//!
//! One change at a time: each holds the running configuration's lock from its check to its
//! last step, so what `config dump` prints is always what runs.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bulkhead_config::{Config, DeviceConfig, Tap};
use bulkhead_control::{AddedDevice, ControlError, ErrorCode, Reloaded, ViewAdded, ViewRemoved};
use bulkhead_supervisor::{DeviceChange, Supervisor};

use crate::exports::{ExportFigures, Exports, Offer, Refused};

/// How long a removed or deactivated device's requests in flight may take to finish.
pub const DRAIN: Duration = Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The running configuration and the exports, changed together.
pub struct Live {
    pub sup: Arc<Supervisor>,
    pub exports: Exports,
    /// What runs, as tables.
    config: Mutex<Config>,
    /// The file `serve` was started with (none: the embedded default).
    config_path: Option<PathBuf>,
    /// Where the running configuration is kept for a `serve` that takes over.
    kept: std::sync::OnceLock<Arc<crate::kept::Kept>>,
}

impl Live {
    pub fn new(sup: Arc<Supervisor>, exports: Exports, config: Config, config_path: Option<PathBuf>) -> Live {
        Live { sup, exports, config: Mutex::new(config), config_path, kept: std::sync::OnceLock::new() }
    }

    /// Keeps the running configuration in `kept` now and after every change, so a `serve`
    /// that takes over serves what this one did (devices and views added since start too).
    pub fn keep_config(&self, kept: Arc<crate::kept::Kept>) {
        let cfg = lock(&self.config);
        kept.keep_text("config", &cfg.dump());
        let _ = self.kept.set(kept);
    }

    /// Replaces the running configuration (the caller holds its lock).
    fn set(&self, cfg: &mut Config, next: Config) {
        *cfg = next;
        if let Some(k) = self.kept.get() {
            k.keep_text("config", &cfg.dump());
        }
    }

    /// The exports' figures, for the metrics.
    pub fn export_figures(&self) -> ExportFigures {
        let names: Vec<String> = self.sup.devices().iter().map(|d| d.name().to_string()).collect();
        self.exports.figures(&names)
    }

    /// The running configuration as TOML that `serve --config` accepts.
    pub fn dump(&self) -> String {
        let cfg = lock(&self.config);
        format!(
            "# The configuration of bulkhead serve (pid {}) as it runs: `bulkhead config dump`.\n{}",
            std::process::id(),
            cfg.dump()
        )
    }

    /// Starts the devices of `text` (`[[device]]` tables) and exports them. All or nothing:
    /// if one cannot start, those started before it are removed again.
    pub fn add_devices(&self, text: &str) -> Result<Vec<AddedDevice>, ControlError> {
        let mut cfg = lock(&self.config);
        let parsed = Config::parse_devices(text, "device table").map_err(|e| ControlError::invalid(e.to_string()))?;
        for (d, _) in &parsed {
            let names = std::iter::once(d.name.get_ref()).chain(d.views.iter().map(|v| v.name.get_ref()));
            for n in names {
                if cfg.devices.iter().any(|r| r.name.get_ref() == n || r.views.iter().any(|v| v.name.get_ref() == n)) {
                    return Err(ControlError::new(ErrorCode::InUse, format!("a device or view named `{n}` is served already")));
                }
            }
        }
        let mut raw = cfg.raw.clone();
        for (_, table) in &parsed {
            device_array(&mut raw).push(toml::Value::Table(table.clone()));
        }
        let next = Config::from_table(&raw, "the configuration with the new devices")
            .map_err(|e| ControlError::invalid(e.to_string()))?;
        let mut added: Vec<AddedDevice> = Vec::new();
        for (d, _) in &parsed {
            match self.start_device(&next, d) {
                Ok(a) => added.push(a),
                Err(e) => {
                    for a in added.iter().rev() {
                        self.take_back(&a.name);
                    }
                    return Err(e);
                }
            }
        }
        self.set(&mut cfg, next);
        Ok(added)
    }

    /// Starts device `d` of configuration `cfg` and offers it on every export that is on.
    fn start_device(&self, cfg: &Config, d: &DeviceConfig) -> Result<AddedDevice, ControlError> {
        let name = d.name.get_ref().clone();
        let fronts = self.sup.add_device(d).map_err(|e| ControlError::failed(e.to_string()))?;
        match self.exports.offer(&Offer::all(cfg, &fronts)) {
            Ok(kinds) => {
                let views = d.views.iter().map(|v| v.name.get_ref().clone()).collect();
                let exports: Vec<String> = kinds.iter().map(|k| k.name().to_string()).collect();
                log::info!(
                    "device {name}: added ({})",
                    if exports.is_empty() { "not exported".into() } else { exports.join(", ") }
                );
                Ok(AddedDevice { name, views, exports })
            }
            Err(e) => {
                let _ = self.sup.remove_device(&name, true, DRAIN);
                Err(ControlError::failed(format!("device `{name}`: {e}")))
            }
        }
    }

    /// Takes a device just added out again, its users cut off: an addition of several that
    /// failed part way.
    fn take_back(&self, name: &str) {
        let fronts = self.sup.frontends(name);
        let names: Vec<&str> = fronts.iter().map(|d| d.name()).collect();
        if let Err(e) = self.exports.withdraw(&names, true) {
            log::warn!("device {name}: {e}");
        }
        if let Err(e) = self.sup.remove_device(name, true, DRAIN) {
            log::warn!("device {name}: cannot take it out again: {e}");
        }
    }

    /// Who uses device or view `name` through the exports, a phrase each.
    fn users(&self, name: &str) -> Vec<String> {
        self.exports.users(name)
    }

    /// Removes device `name`: refused while it is in use unless `force`; otherwise it is
    /// unexported, drained, flushed and its domains ended. Returns the users cut off.
    pub fn remove_device(&self, name: &str, force: bool) -> Result<Vec<String>, ControlError> {
        let mut cfg = lock(&self.config);
        self.remove_locked(&mut cfg, name, force)
    }

    fn remove_locked(&self, cfg: &mut Config, name: &str, force: bool) -> Result<Vec<String>, ControlError> {
        if !self.sup.has_device(name) {
            return Err(match self.sup.owner_of(name) {
                Some(owner) => ControlError::invalid(format!(
                    "`{name}` is a view of device `{owner}`: a view goes with its device (remove `{owner}`, or edit the \
                     configuration and reload)"
                )),
                None => ControlError::not_found(format!("no device `{name}`")),
            });
        }
        let fronts = self.sup.frontends(name);
        let users: Vec<String> = fronts.iter().flat_map(|d| self.users(d.name())).collect();
        if !users.is_empty() && !force {
            return Err(ControlError::new(
                ErrorCode::InUse,
                format!("device `{name}` is in use: {}; stop its users first, or remove it with --force", users.join("; ")),
            ));
        }
        let names: Vec<&str> = fronts.iter().map(|d| d.name()).collect();
        let withdrawn = self.exports.withdraw(&names, force).map_err(|e| refusal("device", name, e))?;
        if let Err(e) = self.sup.remove_device(name, force, DRAIN) {
            // Still running: offered again, as it was.
            self.exports.restore(withdrawn);
            return Err(e.context(format!("device `{name}`")).into());
        }
        let mut raw = cfg.raw.clone();
        device_array(&mut raw).retain(|d| d.get("name").and_then(toml::Value::as_str) != Some(name));
        match Config::from_table(&raw, "the running configuration") {
            Ok(next) => self.set(cfg, next),
            Err(e) => log::warn!("device {name}: removed, but the running configuration cannot be updated: {e}"),
        }
        if !users.is_empty() {
            log::warn!("device {name}: removed by force; cut off: {}", users.join("; "));
        }
        Ok(users)
    }

    /// Adds the view of `text` (its `[[device.view]]` table's keys) to the running device
    /// `device` and exports it where the device's views are exported.
    pub fn add_view(&self, device: &str, text: &str) -> Result<ViewAdded, ControlError> {
        let mut cfg = lock(&self.config);
        let Some(d) = device_config(&cfg, device) else {
            return Err(match self.sup.owner_of(device) {
                Some(owner) => {
                    ControlError::invalid(format!("`{device}` is a view of device `{owner}`: views are added to a device"))
                }
                None => ControlError::not_found(format!("no device `{device}`")),
            });
        };
        let (view, table) = bulkhead_config::parse_view(text, &d).map_err(|e| ControlError::invalid(e.to_string()))?;
        let name = view.name.get_ref().clone();
        if cfg.devices.iter().any(|r| r.name.get_ref() == &name || r.views.iter().any(|v| v.name.get_ref() == &name)) {
            return Err(ControlError::new(ErrorCode::InUse, format!("a device or view named `{name}` is served already")));
        }
        let mut raw = cfg.raw.clone();
        let edit = Edit::ViewAdded { device, table: &table };
        edit_raw(&mut raw, &edit).ok_or_else(|| ControlError::not_found(format!("no device `{device}`")))?;
        let next =
            Config::from_table(&raw, "the configuration with the new view").map_err(|e| ControlError::invalid(e.to_string()))?;
        let exports = self.start_view(&next, device, &name)?;
        self.set(&mut cfg, next);
        Ok(ViewAdded { name, device: device.to_string(), exports })
    }

    /// Starts view `name` of `device` as configuration `cfg` has it, and offers it on the
    /// exports; returns their names. A view that cannot be exported is taken out again.
    fn start_view(&self, cfg: &Config, device: &str, name: &str) -> Result<Vec<String>, ControlError> {
        let d = device_config(cfg, device).ok_or_else(|| ControlError::not_found(format!("no device `{device}`")))?;
        let view = d
            .views
            .iter()
            .find(|v| v.name.get_ref() == name)
            .ok_or_else(|| ControlError::not_found(format!("no view `{name}`")))?;
        let front = self.sup.add_view(device, view).map_err(|e| e.context(format!("device `{device}`")))?;
        match self.exports.offer(&Offer::all(cfg, std::slice::from_ref(&front))) {
            Ok(kinds) => {
                let exports: Vec<String> = kinds.iter().map(|k| k.name().to_string()).collect();
                log::info!(
                    "view {name} of device {device}: added ({})",
                    if exports.is_empty() { "not exported".into() } else { exports.join(", ") }
                );
                Ok(exports)
            }
            Err(e) => {
                let _ = self.sup.remove_view(name, true, DRAIN);
                Err(ControlError::failed(format!("view {e}")))
            }
        }
    }

    /// Removes view `name` from its device: refused while it is in use unless `force`;
    /// otherwise it is unexported, drained, flushed and taken out of the device, whose other
    /// users see a pause. Returns the device and the users cut off.
    pub fn remove_view(&self, name: &str, force: bool) -> Result<ViewRemoved, ControlError> {
        let mut cfg = lock(&self.config);
        let (device, cut_off) = self.stop_view(name, force)?;
        let mut raw = cfg.raw.clone();
        let _ = edit_raw(&mut raw, &Edit::ViewRemoved { view: name });
        match Config::from_table(&raw, "the running configuration") {
            Ok(next) => self.set(&mut cfg, next),
            Err(e) => log::warn!("view {name}: removed, but the running configuration cannot be updated: {e}"),
        }
        Ok(ViewRemoved { name: name.to_string(), device, cut_off })
    }

    /// Unexports view `name` and takes it out of its device; returns the device and the users
    /// cut off.
    fn stop_view(&self, name: &str, force: bool) -> Result<(String, Vec<String>), ControlError> {
        let device = match self.sup.owner_of(name) {
            Some(d) if d == name => {
                return Err(ControlError::invalid(format!("`{name}` is a device: remove it with `bulkhead device remove`")))
            }
            Some(d) => d,
            None => return Err(ControlError::not_found(format!("no view `{name}`"))),
        };
        let users = self.users(name);
        if !users.is_empty() && !force {
            return Err(ControlError::new(
                ErrorCode::InUse,
                format!("view `{name}` is in use: {}; stop its users first, or remove it with --force", users.join("; ")),
            ));
        }
        let withdrawn = self.exports.withdraw(&[name], force).map_err(|e| refusal("view", name, e))?;
        if let Err(e) = self.sup.remove_view(name, force, DRAIN) {
            // Still served: offered again, as it was.
            self.exports.restore(withdrawn);
            return Err(e.context(format!("view `{name}`")).into());
        }
        if !users.is_empty() {
            log::warn!("view {name}: removed by force; cut off: {}", users.join("; "));
        }
        Ok((device, users))
    }

    /// Edits the running configuration after a change made through the control socket.
    pub fn note(&self, edit: Edit<'_>) {
        let mut cfg = lock(&self.config);
        let mut raw = cfg.raw.clone();
        let next = edit_raw(&mut raw, &edit)
            .ok_or_else(|| "no such table".to_string())
            .and_then(|()| Config::from_table(&raw, "the running configuration").map_err(|e| e.to_string()));
        match next {
            Ok(next) => self.set(&mut cfg, next),
            Err(e) => log::warn!("the running configuration cannot record a change: {e}"),
        }
    }

    /// Applies the configuration file as edited: new devices start, removed ones go, and what
    /// can change live does (tap mode, filters that do not transform the data, views' QoS).
    /// Anything else is refused, naming it, and nothing is applied.
    pub fn reload(&self) -> Result<Reloaded, ControlError> {
        let Some(path) = &self.config_path else {
            return Err(ControlError::invalid("serve runs on its embedded default: there is no configuration file to reload"));
        };
        let mut cfg = lock(&self.config);
        let next = Config::load(path).map_err(|e| ControlError::invalid(e.to_string()))?;
        let plan = plan(&cfg, &next)?;
        // Devices to remove must be idle: checked before anything changes.
        for name in &plan.removed {
            let users: Vec<String> = self.sup.frontends(name).iter().flat_map(|d| self.users(d.name())).collect();
            if !users.is_empty() {
                return Err(ControlError::new(
                    ErrorCode::InUse,
                    format!("device `{name}` would be removed but is in use: {}; nothing was applied", users.join("; ")),
                ));
            }
        }
        for step in &plan.steps {
            if let Step::RemoveView { view } = step {
                let users = self.users(view);
                if !users.is_empty() {
                    return Err(ControlError::new(
                        ErrorCode::InUse,
                        format!("view `{view}` would be removed but is in use: {}; nothing was applied", users.join("; ")),
                    ));
                }
            }
        }
        let mut report =
            Reloaded { path: path.display().to_string(), added: Vec::new(), removed: Vec::new(), changed: Vec::new() };
        for name in &plan.added {
            let d = device_config(&next, name).expect("planned from it");
            if let Err(e) = self.start_device(&next, &d) {
                for a in report.added.iter().rev() {
                    self.take_back(a);
                }
                return Err(ControlError::failed(format!("{}; nothing was applied", e.message)));
            }
            report.added.push(name.clone());
        }
        // What runs, as it changes: the devices added, then each change applied.
        let mut working = cfg.raw.clone();
        for name in &report.added {
            if let Some(table) = device_entry(&next.raw, name).cloned() {
                device_array(&mut working).push(toml::Value::Table(table));
            }
        }
        for (i, step) in plan.steps.iter().enumerate() {
            let done: Result<(), ControlError> = match step {
                Step::Change { device, change, .. } => {
                    self.sup.change_device(device, change.clone()).map(|_| ()).map_err(Into::into)
                }
                Step::Qos { view, caps } => self.sup.set_qos(view, &caps_settings(caps)).map(|_| ()).map_err(Into::into),
                Step::AddView { device, view, .. } => self.start_view(&next, device, view).map(|_| ()),
                Step::RemoveView { view } => self.stop_view(view, false).map(|_| ()),
            };
            if let Err(e) = done {
                // What was done stays done, and the running configuration says so.
                if let Ok(c) = Config::from_table(&working, "the running configuration") {
                    self.set(&mut cfg, c);
                }
                return Err(ControlError::failed(format!(
                    "{}: {e}; applied before it: {} device(s) added, {i} change(s); not applied: the rest (run reload again \
                     once the cause is fixed)",
                    step.what(),
                    report.added.len()
                )));
            }
            let _ = edit_raw(&mut working, &step.edit());
            report.changed.push(step.what());
        }
        if let Ok(c) = Config::from_table(&working, "the running configuration") {
            self.set(&mut cfg, c);
        }
        for name in &plan.removed {
            match self.remove_locked(&mut cfg, name, false) {
                Ok(_) => report.removed.push(name.clone()),
                Err(e) => {
                    return Err(ControlError::new(
                        e.code,
                        format!("{}; applied before it: {:?} added, {:?} changed", e.message, report.added, report.changed),
                    ))
                }
            }
        }
        self.set(&mut cfg, next);
        log::info!(
            "reloaded {}: {} added, {} removed, {} changed",
            report.path,
            report.added.len(),
            report.removed.len(),
            report.changed.len()
        );
        Ok(report)
    }
}

/// A change made through the control socket, for the running configuration.
pub enum Edit<'a> {
    Tap {
        device: &'a str,
        mode: Tap,
    },
    /// Activated or deactivated: a `serve` that takes over starts it so.
    Active {
        device: &'a str,
        active: bool,
    },
    FilterAdded {
        device: &'a str,
        at: Option<usize>,
        table: &'a str,
    },
    FilterRemoved {
        device: &'a str,
        at: usize,
    },
    Qos {
        view: &'a str,
        caps: bulkhead_qos::Caps,
    },
    ViewAdded {
        device: &'a str,
        table: &'a toml::Table,
    },
    ViewRemoved {
        view: &'a str,
    },
    /// A change the configuration does not record (a restart, a snapshot).
    None {
        device: &'a str,
    },
}

/// Applies `edit` to the running configuration's tables; `None` if a table it names is not
/// there.
fn edit_raw(raw: &mut toml::Table, edit: &Edit<'_>) -> Option<()> {
    match *edit {
        Edit::Tap { device, mode } => device_table(raw, device).map(|t| {
            t.insert("tap".into(), toml::Value::String(mode.as_str().into()));
        }),
        Edit::Active { device, active } => device_table(raw, device).map(|t| {
            t.insert("active".into(), toml::Value::Boolean(active));
        }),
        Edit::FilterAdded { device, at, table } => {
            let f = toml::from_str::<toml::Table>(table).ok()?;
            device_table(raw, device).map(|t| {
                let list = array(t, "filter");
                let at = at.unwrap_or(list.len()).min(list.len());
                list.insert(at, toml::Value::Table(f));
            })
        }
        Edit::FilterRemoved { device, at } => device_table(raw, device).and_then(|t| {
            let list = array(t, "filter");
            (at < list.len()).then(|| {
                list.remove(at);
            })
        }),
        Edit::Qos { view, caps } => view_table(raw, view).map(|t| set_caps(t, &caps)),
        Edit::ViewAdded { device, table } => {
            device_table(raw, device).map(|t| array(t, "view").push(toml::Value::Table(table.clone())))
        }
        Edit::ViewRemoved { view } => {
            for d in device_array(raw).iter_mut().filter_map(toml::Value::as_table_mut) {
                let Some(list) = d.get_mut("view").and_then(toml::Value::as_array_mut) else { continue };
                if let Some(i) = list.iter().position(|v| v.get("name").and_then(toml::Value::as_str) == Some(view)) {
                    list.remove(i);
                    if list.is_empty() {
                        d.remove("view");
                    }
                    return Some(());
                }
            }
            None
        }
        Edit::None { device } => device_table(raw, device).map(|_| ()),
    }
}

/// A withdrawal an export refused, for the control socket: `in_use` when a user holds the
/// device or view, `failed` when something else went wrong.
fn refusal(what: &str, name: &str, e: Refused) -> ControlError {
    if e.source.in_use() {
        ControlError::new(ErrorCode::InUse, format!("{what} `{name}` is in use: {e}"))
    } else {
        ControlError::failed(format!("{what} `{name}`: {} export: {e}", e.export.name()))
    }
}

/// What a reload does.
#[derive(Debug, Default)]
struct Plan {
    added: Vec<String>,
    removed: Vec<String>,
    steps: Vec<Step>,
}

#[derive(Debug)]
enum Step {
    Change { device: String, change: DeviceChange, what: String },
    Qos { view: String, caps: bulkhead_qos::Caps },
    AddView { device: String, view: String, table: toml::Table },
    RemoveView { view: String },
}

impl Step {
    /// The same change, for the running configuration.
    fn edit(&self) -> Edit<'_> {
        match self {
            Step::Change { device, change: DeviceChange::Tap(mode), .. } => Edit::Tap { device, mode: *mode },
            Step::Change { device, change: DeviceChange::AddFilter { at, table }, .. } => {
                Edit::FilterAdded { device, at: *at, table }
            }
            Step::Change { device, change: DeviceChange::RemoveFilter(at), .. } => Edit::FilterRemoved { device, at: *at },
            Step::Change { device, .. } => Edit::None { device },
            Step::Qos { view, caps } => Edit::Qos { view, caps: *caps },
            Step::AddView { device, table, .. } => Edit::ViewAdded { device, table },
            Step::RemoveView { view } => Edit::ViewRemoved { view },
        }
    }

    fn what(&self) -> String {
        match self {
            Step::Change { what, .. } => what.clone(),
            Step::Qos { view, caps } => format!("view `{view}`: QoS {caps}"),
            Step::AddView { device, view, .. } => format!("device `{device}`: view `{view}` added"),
            Step::RemoveView { view } => format!("view `{view}` removed"),
        }
    }
}

/// Works out what turns `old` into `new`, or names the first change that cannot be applied
/// live.
fn plan(old: &Config, new: &Config) -> Result<Plan, ControlError> {
    let cannot = |what: String| ControlError::invalid(format!("{what}: cannot be applied live; nothing was applied"));
    let keys: std::collections::BTreeSet<&String> =
        old.raw.keys().chain(new.raw.keys()).filter(|k| !Config::LIVE.contains(&k.as_str())).collect();
    for k in keys {
        if let Some(path) = first_difference(old.raw.get(k), new.raw.get(k), k) {
            return Err(cannot(format!("key `{path}` changed (a setting of serve itself: restart serve)")));
        }
    }
    let mut plan = Plan::default();
    let raw_of = |cfg: &Config, name: &str| device_entry(&cfg.raw, name).cloned();
    for d in &old.devices {
        if !new.devices.iter().any(|n| n.name == d.name) {
            plan.removed.push(d.name.get_ref().clone());
        }
    }
    for n in &new.devices {
        let name = n.name.get_ref();
        let Some(o) = old.devices.iter().find(|o| o.name == n.name) else {
            plan.added.push(name.clone());
            continue;
        };
        let (Some(ot), Some(nt)) = (raw_of(old, name), raw_of(new, name)) else { continue };
        let keys: std::collections::BTreeSet<&String> = ot.keys().chain(nt.keys()).collect();
        for k in keys {
            if DeviceConfig::LIVE.contains(&k.as_str()) {
                continue;
            }
            if let Some(path) = first_difference(ot.get(k), nt.get(k), k) {
                return Err(cannot(format!("device `{name}`: key `{path}` changed (remove the device and add it again)")));
            }
        }
        // Views: those gone are removed, new ones added; of the others only the QoS may change.
        let (ov, nv) = (array_of(&ot, "view"), array_of(&nt, "view"));
        let named = |list: &[toml::Value], n: &str| -> Option<toml::Table> {
            list.iter().find(|t| t.get("name").and_then(toml::Value::as_str) == Some(n)).and_then(|t| t.as_table().cloned())
        };
        for view in o.views.iter().filter(|v| !n.views.iter().any(|w| w.name == v.name)) {
            plan.steps.push(Step::RemoveView { view: view.name.get_ref().clone() });
        }
        for view in &n.views {
            let vname = view.name.get_ref();
            let Some(b) = named(&nv, vname) else { continue };
            let Some(a) = named(&ov, vname) else {
                plan.steps.push(Step::AddView { device: name.clone(), view: vname.clone(), table: b });
                continue;
            };
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                if bulkhead_config::View::LIVE.contains(&k.as_str()) {
                    continue;
                }
                if let Some(path) = first_difference(a.get(k), b.get(k), k) {
                    return Err(cannot(format!(
                        "device `{name}`: view `{vname}`: key `{path}` changed (remove the view and add it again)"
                    )));
                }
            }
            let was = o.views.iter().find(|v| v.name == view.name).map(|v| v.caps());
            if was != Some(view.caps()) {
                plan.steps.push(Step::Qos { view: vname.clone(), caps: view.caps() });
            }
        }
        // Filters: those that transform the data stay as they are, in order; the others may
        // come and go.
        let (of, nf) = (array_of(&ot, "filter"), array_of(&nt, "filter"));
        if of != nf {
            let (ofs, nfs) = (o.filters(), n.filters());
            let transforming = |tables: &[toml::Value], resolved: &[bulkhead_config::Filter]| -> Vec<toml::Value> {
                tables.iter().zip(resolved).filter(|(_, f)| f.spec.transforms()).map(|(t, _)| t.clone()).collect()
            };
            if transforming(&of, &ofs) != transforming(&nf, &nfs) {
                return Err(cannot(format!(
                    "device `{name}`: a filter that transforms the data (cow, crypt) changed; it holds what the device holds"
                )));
            }
            for (i, f) in ofs.iter().enumerate().rev().filter(|(_, f)| !f.spec.transforms()) {
                plan.steps.push(Step::Change {
                    device: name.clone(),
                    change: DeviceChange::RemoveFilter(i),
                    what: format!("device `{name}`: filter {} at position {i} removed", f.spec.type_name()),
                });
            }
            for (i, (t, f)) in nf.iter().zip(&nfs).enumerate().filter(|(_, (_, f))| !f.spec.transforms()) {
                let table = toml::to_string(t).map_err(|e| ControlError::failed(e.to_string()))?;
                plan.steps.push(Step::Change {
                    device: name.clone(),
                    change: DeviceChange::AddFilter { at: Some(i), table },
                    what: format!("device `{name}`: filter {} inserted at position {i}", f.spec.type_name()),
                });
            }
        }
        if o.tap != n.tap {
            plan.steps.push(Step::Change {
                device: name.clone(),
                change: DeviceChange::Tap(n.tap),
                what: format!("device `{name}`: tap mode {} → {}", o.tap.as_str(), n.tap.as_str()),
            });
        }
    }
    Ok(plan)
}

/// The dotted path of the first place `a` and `b` differ, from `path`.
fn first_difference(a: Option<&toml::Value>, b: Option<&toml::Value>, path: &str) -> Option<String> {
    match (a, b) {
        (Some(toml::Value::Table(x)), Some(toml::Value::Table(y))) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| first_difference(x.get(k), y.get(k), &format!("{path}.{k}")))
        }
        (a, b) if a == b => None,
        _ => Some(path.to_string()),
    }
}

fn array_of(t: &toml::Table, key: &str) -> Vec<toml::Value> {
    t.get(key).and_then(toml::Value::as_array).cloned().unwrap_or_default()
}

fn array<'t>(t: &'t mut toml::Table, key: &str) -> &'t mut Vec<toml::Value> {
    let v = t.entry(key.to_string()).or_insert_with(|| toml::Value::Array(Vec::new()));
    if !v.is_array() {
        *v = toml::Value::Array(Vec::new());
    }
    v.as_array_mut().expect("made an array")
}

fn device_array(raw: &mut toml::Table) -> &mut Vec<toml::Value> {
    array(raw, "device")
}

fn device_table<'t>(raw: &'t mut toml::Table, name: &str) -> Option<&'t mut toml::Table> {
    device_array(raw)
        .iter_mut()
        .find(|d| d.get("name").and_then(toml::Value::as_str) == Some(name))
        .and_then(toml::Value::as_table_mut)
}

/// Device `name`'s table, to read.
fn device_entry<'t>(raw: &'t toml::Table, name: &str) -> Option<&'t toml::Table> {
    raw.get("device")?
        .as_array()?
        .iter()
        .find(|d| d.get("name").and_then(toml::Value::as_str) == Some(name))
        .and_then(toml::Value::as_table)
}

fn view_table<'t>(raw: &'t mut toml::Table, name: &str) -> Option<&'t mut toml::Table> {
    device_array(raw)
        .iter_mut()
        .filter_map(|d| d.get_mut("view").and_then(toml::Value::as_array_mut))
        .flat_map(|views| views.iter_mut())
        .find(|v| v.get("name").and_then(toml::Value::as_str) == Some(name))
        .and_then(toml::Value::as_table_mut)
}

fn device_config(cfg: &Config, name: &str) -> Option<DeviceConfig> {
    cfg.devices.iter().find(|d| d.name.get_ref() == name).cloned()
}

/// `caps` as the `key=value` settings `Supervisor::set_qos` takes, every key given.
fn caps_settings(caps: &bulkhead_qos::Caps) -> Vec<(String, String)> {
    caps_values(caps).into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn caps_values(caps: &bulkhead_qos::Caps) -> [(&'static str, u64); 6] {
    [
        ("credit_bytes", caps.credit_bytes),
        ("credit_us", caps.credit_us),
        ("burst_bytes", caps.burst_bytes),
        ("iops", caps.iops),
        ("burst_ios", caps.burst_ios),
        ("weight", u64::from(caps.weight)),
    ]
}

/// Writes `caps` into a view's table: the keys that differ from the defaults.
fn set_caps(t: &mut toml::Table, caps: &bulkhead_qos::Caps) {
    let none = bulkhead_qos::Caps::default();
    let defaults = caps_values(&none);
    for ((k, v), (_, d)) in caps_values(caps).into_iter().zip(defaults) {
        if v == d {
            t.remove(k);
        } else {
            t.insert(k.to_string(), toml::Value::Integer(v as i64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[fuse]
threads = 2

[[device]]
name = "a"
size = "64M"
[device.backend]
type = "ram"
[[device.filter]]
type = "delay"
read_us = 10
[[device.view]]
name = "a-half"
size = "32M"
iops = 100

[[device]]
name = "b"
size = "64M"
[device.backend]
type = "ram"
"#;

    fn cfg(src: &str) -> Config {
        Config::parse(src, "test").unwrap()
    }

    #[test]
    fn a_reload_plan_adds_removes_and_applies_what_can_change_live() {
        let old = cfg(BASE);
        let edited = BASE
            .replace("read_us = 10", "read_us = 20")
            .replace("iops = 100", "iops = 200")
            .replace("name = \"b\"", "name = \"c\"")
            .replace("[[device]]\nname = \"a\"", "[[device]]\nname = \"a\"\ntap = \"interpose\"");
        let p = plan(&old, &cfg(&edited)).unwrap();
        assert_eq!(p.added, ["c"]);
        assert_eq!(p.removed, ["b"]);
        let what: Vec<String> = p.steps.iter().map(Step::what).collect();
        assert!(what.iter().any(|w| w.contains("QoS") && w.contains("200 IOPS")), "{what:?}");
        assert!(what.iter().any(|w| w.contains("filter delay at position 0 removed")), "{what:?}");
        assert!(what.iter().any(|w| w.contains("filter delay inserted at position 0")), "{what:?}");
        assert!(what.iter().any(|w| w.contains("tap mode passthrough → interpose")), "{what:?}");
        // Nothing changed: nothing to do.
        let p = plan(&old, &old.clone()).unwrap();
        assert!(p.added.is_empty() && p.removed.is_empty() && p.steps.is_empty());
    }

    #[test]
    fn a_reload_plan_removes_and_adds_views_by_name() {
        let old = cfg(BASE);
        // A view renamed is one removed and one added; a view appended is added.
        let edited = BASE.replace("name = \"a-half\"", "name = \"a-other\"").replace(
            "[[device]]\nname = \"b\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n",
            "[[device]]\nname = \"b\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n[[device.view]]\nname = \"b-1\"\nsize = \"8M\"\n",
        );
        let p = plan(&old, &cfg(&edited)).unwrap();
        let what: Vec<String> = p.steps.iter().map(Step::what).collect();
        assert_eq!(what, ["view `a-half` removed", "device `a`: view `a-other` added", "device `b`: view `b-1` added"]);
        assert!(p.added.is_empty() && p.removed.is_empty());
    }

    #[test]
    fn carrying_a_plan_out_leaves_nothing_more_to_do() {
        let old = cfg(BASE);
        let edited = BASE
            .replace("read_us = 10", "read_us = 20\n[[device.filter]]\ntype = \"delay\"\nwrite_us = 5")
            .replace(
                "name = \"a-half\"\nsize = \"32M\"",
                "name = \"a-half\"\nsize = \"32M\"\n[[device.view]]\nname = \"a-q\"\nsize = \"16M\"",
            )
            .replace("iops = 100", "iops = 200")
            .replace("name = \"b\"", "name = \"c\"")
            .replace("[[device]]\nname = \"a\"", "[[device]]\nname = \"a\"\ntap = \"interpose\"");
        let new = cfg(&edited);
        let p = plan(&old, &new).unwrap();
        // What `reload` does to the running configuration, step by step.
        let mut raw = old.raw.clone();
        for name in &p.added {
            let table = device_entry(&new.raw, name).cloned().unwrap();
            device_array(&mut raw).push(toml::Value::Table(table));
        }
        for s in &p.steps {
            edit_raw(&mut raw, &s.edit()).unwrap_or_else(|| panic!("{}", s.what()));
        }
        device_array(&mut raw).retain(|d| !p.removed.iter().any(|r| d.get("name").and_then(toml::Value::as_str) == Some(r)));
        let now = Config::from_table(&raw, "carried out").unwrap();
        let again = plan(&now, &new).unwrap();
        assert!(
            again.added.is_empty() && again.removed.is_empty() && again.steps.is_empty(),
            "{:?}",
            again.steps.iter().map(Step::what).collect::<Vec<_>>()
        );
        assert_eq!(now.devices.len(), new.devices.len());
        assert_eq!(now.devices[0].filters(), new.devices[0].filters());
        assert_eq!(now.devices[0].views.len(), 2);
        // And a view removed leaves no empty list behind.
        let mut raw = now.raw.clone();
        edit_raw(&mut raw, &Edit::ViewRemoved { view: "a-q" }).unwrap();
        edit_raw(&mut raw, &Edit::ViewRemoved { view: "a-half" }).unwrap();
        assert!(device_entry(&raw, "a").unwrap().get("view").is_none());
        assert!(edit_raw(&mut raw, &Edit::ViewRemoved { view: "a-half" }).is_none());
    }

    #[test]
    fn a_reload_refuses_what_cannot_change_live_naming_it() {
        let old = cfg(BASE);
        for (edit, says) in [
            (BASE.replace("threads = 2", "threads = 3"), "key `fuse.threads` changed"),
            (
                BASE.replace(
                    "size = \"64M\"\n[device.backend]\ntype = \"ram\"\n[[device.filter]]",
                    "size = \"128M\"\n[device.backend]\ntype = \"ram\"\n[[device.filter]]",
                ),
                "device `a`: key `size` changed",
            ),
            (BASE.replace("size = \"32M\"", "size = \"16M\""), "view `a-half`: key `size` changed"),
        ] {
            let e = plan(&old, &cfg(&edit)).unwrap_err().message;
            assert!(e.contains(says) && e.contains("nothing was applied"), "{e}");
        }
    }

    #[test]
    fn running_configuration_edits_keep_it_valid_and_dumpable() {
        let mut raw = cfg(BASE).raw;
        device_table(&mut raw, "a").unwrap().insert("tap".into(), toml::Value::String("interpose".into()));
        set_caps(
            view_table(&mut raw, "a-half").unwrap(),
            &bulkhead_qos::Caps { iops: 500, ..Default::default() }.with_default_bursts(),
        );
        device_array(&mut raw).retain(|d| d.get("name").and_then(toml::Value::as_str) != Some("b"));
        let c = Config::from_table(&raw, "edited").unwrap();
        assert_eq!(c.devices.len(), 1);
        assert_eq!(c.devices[0].tap, Tap::Interpose);
        assert_eq!(c.devices[0].views[0].caps().iops, 500);
        // What `config dump` prints is what `serve --config` reads back.
        assert_eq!(Config::parse(&c.dump(), "dump").unwrap().devices, c.devices);
    }
}
