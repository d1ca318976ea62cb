//! `bench guard --filters`: real filters under write capture, as Chariot's figures 5 and 6. For
//! each filter (trace, crypt, cow) and each setting (`off`, `dwc`, `scdwc` with C in {0, 5, 10, 20,
//! 40, 60, 80, 100}, scdwc also gated by page protection, and each also with protection keys
//! where the processor has them), a supervisor in this process serves one
//! device with that filter, exported over FUSE, and fio runs 4 KiB random reads and writes on it;
//! the row is its throughput and the machine's CPU use meanwhile.

use crate::BenchError;
use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_config::Config;
use bulkhead_filters::{GuardMode, GuardSpec};
use bulkhead_supervisor::Supervisor;
use serde::Serialize;

use crate::Table;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Seconds of fio per setting.
    pub seconds: u32,
    /// Where the files go.
    pub scratch: PathBuf,
    /// The settings (`off` is always measured first, as the rows' reference).
    pub settings: Vec<Setting>,
    /// The device's spin budget in µs (`spin_budget_us`), `None` for the self-tuning `auto`.
    pub spin_budget_us: Option<u64>,
}

/// The settings, as Chariot's x axis: off, DWC, then SCDWC with these C.
pub const CACHES: [u32; 8] = [0, 5, 10, 20, 40, 60, 80, 100];

/// What shuts the other owners' memory for each guarded call, beside the mode's own page
/// protection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Gate {
    /// Nothing (`guard_keys = false`).
    None,
    /// Protection keys (`guard_keys = true`).
    Keys,
    /// Page protection of the other owners' open pages (`guard_pages = true`, keys off).
    Pages,
}

impl Gate {
    /// As settings and reports spell it: `""`, `" +keys"`, `" +pages"`.
    pub fn suffix(self) -> &'static str {
        match self {
            Gate::None => "",
            Gate::Keys => " +keys",
            Gate::Pages => " +pages",
        }
    }

    /// As a table's column: `-`, `keys`, `pages`.
    pub fn cell(self) -> &'static str {
        match self {
            Gate::None => "-",
            Gate::Keys => "keys",
            Gate::Pages => "pages",
        }
    }
}

/// One setting of the guard: a mode, and what gates the calls as well.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Setting {
    /// off, dwc, or scdwc with C.
    pub mode: GuardMode,
    /// `guard_keys`, `guard_pages`.
    pub gate: Gate,
}

impl Options {
    /// Refuses settings this machine cannot run: protection keys on a processor without them.
    pub fn check(&self) -> Result<(), BenchError> {
        if self.settings.iter().any(|s| s.gate == Gate::Keys) && !bulkhead_sys::pkey::supported() {
            return Err(BenchError::Options(
                "--settings: `+keys` needs protection keys, which this processor does not have".into(),
            ));
        }
        Ok(())
    }
}

impl Setting {
    /// `off`.
    pub const OFF: Setting = Setting { mode: GuardMode::Off, gate: Gate::None };

    /// Chariot's settings (DWC, then SCDWC with each of [`CACHES`]), then SCDWC gated by
    /// page protection, then all of them with protection keys where the processor has them;
    /// `off` first if `with_off`.
    pub fn all(with_off: bool) -> Vec<Setting> {
        let mut v = Vec::new();
        if with_off {
            v.push(Setting::OFF);
        }
        let scdwc = |gate| CACHES.iter().map(move |&cache| Setting { mode: GuardMode::Scdwc { cache }, gate });
        v.push(Setting { mode: GuardMode::Dwc, gate: Gate::None });
        v.extend(scdwc(Gate::None));
        v.extend(scdwc(Gate::Pages));
        if bulkhead_sys::pkey::supported() {
            v.push(Setting { mode: GuardMode::Dwc, gate: Gate::Keys });
            v.extend(scdwc(Gate::Keys));
        }
        v
    }

    /// `off`, `dwc` or a cache size from 0 to 256, with `+keys` for protection keys or, for
    /// a cache size, `+pages` for the page gate.
    pub fn parse(s: &str) -> Result<Setting, String> {
        let s = s.trim();
        let (base, gate) = if let Some(b) = s.strip_suffix("+keys") {
            (b, Gate::Keys)
        } else if let Some(b) = s.strip_suffix("+pages") {
            (b, Gate::Pages)
        } else {
            (s, Gate::None)
        };
        let bad = || {
            format!(
                "`{s}` is not `off`, `dwc` or a cache size from 0 to {}, with `+keys` for protection keys (not with off) or `+pages` for the page gate (only with a cache size)",
                bulkhead_guard::shadow::MAX_CACHE
            )
        };
        let mode = match base {
            "off" if gate == Gate::None => GuardMode::Off,
            "dwc" if gate != Gate::Pages => GuardMode::Dwc,
            c => match c.parse::<u32>() {
                Ok(cache) if cache as usize <= bulkhead_guard::shadow::MAX_CACHE => GuardMode::Scdwc { cache },
                _ => return Err(bad()),
            },
        };
        Ok(Setting { mode, gate })
    }

    /// C, for scdwc.
    pub fn cache(&self) -> Option<u32> {
        match self.mode {
            GuardMode::Scdwc { cache } => Some(cache),
            _ => None,
        }
    }

    /// As reports name it: `off`, `dwc`, `scdwc C=60`, with ` +keys` or ` +pages`.
    pub fn label(&self) -> String {
        let base = match self.cache() {
            Some(c) => format!("scdwc C={c}"),
            None => self.mode.as_str().to_string(),
        };
        format!("{base}{}", self.gate.suffix())
    }

    /// The guard a filter gets for it, as the configuration would resolve it.
    pub fn spec(&self) -> GuardSpec {
        GuardSpec { mode: self.mode, keys: self.gate == Gate::Keys, pages: self.gate == Gate::Pages }
    }

    /// The filter table's guard keys for it.
    fn config_lines(&self) -> String {
        let GuardSpec { keys, pages, .. } = self.spec();
        match self.mode {
            GuardMode::Off => String::new(),
            GuardMode::Dwc => format!("guard = \"dwc\"\nguard_keys = {keys}\n"),
            GuardMode::Scdwc { cache } => {
                format!("guard = \"scdwc\"\nguard_cache = {cache}\nguard_keys = {keys}\nguard_pages = {pages}\n")
            }
        }
    }
}

/// One filter at one setting.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// trace, crypt or cow.
    pub filter: String,
    /// off, dwc or scdwc.
    pub guard: String,
    /// C, for scdwc.
    pub cache: Option<u32>,
    /// What gated the calls too.
    pub gate: Gate,
    /// Reads and writes per second together.
    pub iops: f64,
    /// MiB/s, reads and writes together.
    pub mibs: f64,
    /// Busy share of all CPUs during the run, percent.
    pub cpu_pct: f64,
    /// Throughput as a share of `off`, percent.
    pub of_off_pct: f64,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Seconds of fio per row.
    pub seconds: u32,
    /// The device's spin budget in µs, `None` for `auto`.
    pub spin_budget_us: Option<u64>,
    /// The rows.
    pub rows: Vec<Row>,
    /// Filters left out, and why.
    pub skipped: Vec<String>,
}

const SIZE_MIB: u64 = 64;

fn cpu_busy() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (v.iter().sum::<u64>() - idle, v.iter().sum())
}

fn fio(file: &Path, seconds: u32) -> Result<(f64, f64), BenchError> {
    let out = Command::new("fio")
        .args(["--name=guard", "--direct=1", "--rw=randrw", "--bs=4k", "--ioengine=psync", "--time_based"])
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--size={}M", SIZE_MIB - 8))
        .arg(format!("--runtime={seconds}"))
        .arg("--output-format=json")
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    if !out.status.success() {
        return Err(BenchError::Run(format!("fio on {}: {}", file.display(), String::from_utf8_lossy(&out.stderr).trim())));
    }
    let v = crate::fio_report(&out.stdout, &file.display().to_string())?;
    let job = &v["jobs"][0];
    let iops = job["read"]["iops"].as_f64().unwrap_or(0.0) + job["write"]["iops"].as_f64().unwrap_or(0.0);
    let bw = job["read"]["bw"].as_f64().unwrap_or(0.0) + job["write"]["bw"].as_f64().unwrap_or(0.0);
    Ok((iops, bw / 1024.0))
}

/// The device's configuration for `filter` with `guard` lines.
fn device(filter: &str, files: &Files, guard: &str, spin_budget_us: Option<u64>) -> String {
    // Under DWC every write to guarded memory is a fault and a single step: a cow allocating
    // a qcow2 L2 table (8,192 entries, each written alone) can take over the default watchdog's
    // second, and a replaced domain would start the same allocation over.
    let spin = spin_budget_us.map_or(String::new(), |us| format!("spin_budget_us = {us}\n"));
    let head = format!("[nbd]\nenabled = false\n[fuse]\nenabled = false\n[[device]]\nname = \"g\"\nwatchdog_ms = 30000\n{spin}");
    match filter {
        "trace" => format!(
            "{head}size = \"{SIZE_MIB}M\"\n[device.backend]\ntype = \"ram\"\n[[device.filter]]\ntype = \"trace\"\npath = \"{}\"\n{guard}",
            files.trace.display()
        ),
        "crypt" => format!(
            "{head}[device.backend]\ntype = \"file\"\npath = \"{}\"\n[[device.filter]]\ntype = \"crypt\"\nkey_file = \"{}\"\n{guard}",
            files.luks.display(),
            files.key.display()
        ),
        _ => format!(
            "{head}size = \"{SIZE_MIB}M\"\n[device.backend]\ntype = \"ram\"\n[[device.filter]]\ntype = \"cow\"\noverlay = \"{}\"\n{guard}",
            files.overlay.display()
        ),
    }
}

struct Files {
    trace: PathBuf,
    luks: PathBuf,
    key: PathBuf,
    overlay: PathBuf,
}

fn run_one(exe: &Path, filter: &str, files: &Files, guard: &str, opts: &Options) -> Result<(f64, f64, f64), BenchError> {
    let _ = std::fs::remove_file(&files.overlay);
    let config = Config::parse(&device(filter, files, guard, opts.spin_budget_us), "bench guard").map_err(|e| e.to_string())?;
    let sup = Supervisor::start(&config, Some(exe)).map_err(|e| e.to_string())?;
    let mnt = opts.scratch.join(format!("bench-guard-fuse-{}", std::process::id()));
    let fuse = bulkhead_fuse_export::FuseExport::mount(&mnt, sup.devices(), 4).map_err(|e| BenchError::Run(e.to_string()));
    let r = fuse.and_then(|fuse| {
        let before = cpu_busy();
        let r = fio(&mnt.join("g"), opts.seconds);
        let after = cpu_busy();
        drop(fuse);
        let cpu = 100.0 * (after.0 - before.0) as f64 / ((after.1 - before.1).max(1)) as f64;
        r.map(|(iops, mibs)| (iops, mibs, cpu))
    });
    let _ = std::fs::remove_dir(&mnt);
    sup.shutdown();
    r
}

/// A LUKS2 volume holding `data_bytes` in `scratch` (`name`.luks), and its key file.
pub(crate) fn make_luks(scratch: &Path, name: &str, data_bytes: u64) -> Result<(PathBuf, PathBuf), BenchError> {
    let img = scratch.join(format!("{name}.luks"));
    let key = scratch.join(format!("{name}.key"));
    std::fs::write(&key, b"bench guard passphrase").map_err(|e| e.to_string())?;
    std::fs::File::create(&img).and_then(|f| f.set_len(data_bytes + (16 << 20))).map_err(|e| e.to_string())?;
    let out = Command::new("cryptsetup")
        .args(["luksFormat", "-q", "--type", "luks2", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
        .args(["--sector-size", "512", "--key-file"])
        .arg(&key)
        .arg(&img)
        .output()
        .map_err(|e| format!("cryptsetup: {e}"))?;
    if !out.status.success() {
        return Err(BenchError::Run(format!("cryptsetup: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok((img, key))
}

/// Runs every filter at every setting.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    let mut skipped = Vec::new();
    let mut filters = vec!["trace"];
    // Files of this run alone (two runs on one scratch directory would write each other's),
    // removed however it ends.
    let dir = opts.scratch.join(format!("bench-guard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let _cleanup = crate::RemoveDir(dir.clone());
    let luks = match make_luks(&dir, "bench-guard", SIZE_MIB << 20) {
        Ok(l) => {
            filters.push("crypt");
            Some(l)
        }
        Err(e) => {
            skipped.push(format!("crypt: no LUKS volume ({e})"));
            None
        }
    };
    filters.push("cow");
    let files = Files {
        trace: dir.join("bench-guard.blktrace"),
        luks: luks.as_ref().map(|l| l.0.clone()).unwrap_or_default(),
        key: luks.as_ref().map(|l| l.1.clone()).unwrap_or_default(),
        overlay: dir.join("bench-guard-overlay.qcow2"),
    };
    let off = Setting::OFF;
    let settings: Vec<Setting> = std::iter::once(off).chain(opts.settings.iter().copied().filter(|s| *s != off)).collect();
    let mut rows = Vec::new();
    for f in &filters {
        let mut off = 0.0;
        for setting in &settings {
            progress(&format!("{f}, {}", setting.label()));
            let (iops, mibs, cpu_pct) = run_one(exe, f, &files, &setting.config_lines(), opts)?;
            if setting.mode == GuardMode::Off {
                off = mibs;
            }
            let of_off_pct = if off > 0.0 { 100.0 * mibs / off } else { 0.0 };
            rows.push(Row {
                filter: f.to_string(),
                guard: setting.mode.as_str().to_string(),
                cache: setting.cache(),
                gate: setting.gate,
                iops,
                mibs,
                cpu_pct,
                of_off_pct,
            });
        }
    }
    Ok(Report { seconds: opts.seconds, spin_budget_us: opts.spin_budget_us, rows, skipped })
}

/// The report as a table, with the goal (scdwc at C = 60 within 10% of off).
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["filter", "guard", "C", "gate", "IOPS", "MiB/s", "CPU %", "of off"]);
    for row in &r.rows {
        t.row(vec![
            row.filter.clone(),
            row.guard.clone(),
            row.cache.map_or("-".into(), |c| c.to_string()),
            row.gate.cell().into(),
            format!("{:.0}", row.iops),
            format!("{:.1}", row.mibs),
            format!("{:.0}", row.cpu_pct),
            format!("{:.0}%", row.of_off_pct),
        ]);
    }
    let spin = r.spin_budget_us.map_or("auto".to_string(), |us| format!("{us} µs"));
    let mut s =
        format!("fio 4 KiB randrw, psync, QD1, {} s per row, through FUSE, spin budget {spin}\n{}", r.seconds, t.render());
    for row in r.rows.iter().filter(|x| x.cache == Some(60)) {
        let (goal, share) = if row.gate == Gate::Pages { ("at least half", 50.0) } else { ("within 10%", 90.0) };
        let met = if row.of_off_pct >= share { "met" } else { "not met" };
        s.push_str(&format!(
            "goal: {} scdwc C=60{} {goal} of off: {:.0}% ({met})\n",
            row.filter,
            row.gate.suffix(),
            row.of_off_pct
        ));
    }
    for k in &r.skipped {
        s.push_str(&format!("skipped: {k}\n"));
    }
    s
}
