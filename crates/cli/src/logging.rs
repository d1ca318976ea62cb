//! The log of `serve` and the commands: one line per event on standard error, `bulkhead: ` and
//! the event, with its device named where it has one. Warnings and errors say so. The level is
//! `[log] level` in the configuration (`info` unless set). What domains print is relayed
//! whatever the level, prefixed and rate-limited (`bulkhead_supervisor::domain_log`), as are a
//! device's own rate-limited lines (restarts, storms).

use log::{Level, LevelFilter, Log, Metadata, Record};

struct Stderr;

static LOGGER: Stderr = Stderr;

impl Log for Stderr {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        // The libraries' own chatter (libublk says every device and queue it sets up) is
        // below what an operator reads: only their warnings and errors, unless debugging.
        let library = !metadata.target().starts_with("bulkhead");
        let max = if library { log::max_level().min(LevelFilter::Warn).max(debugging()) } else { log::max_level() };
        metadata.level() <= max
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let what = match record.level() {
            Level::Error => "error: ",
            Level::Warn => "warning: ",
            Level::Info => "",
            Level::Debug => "debug: ",
            Level::Trace => "trace: ",
        };
        // One write per line, so lines of several threads do not interleave.
        let line = format!("bulkhead: {what}{}\n", record.args());
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }

    fn flush(&self) {}
}

/// `Debug` when the level is `debug` or more (libraries then log at that level too), else
/// `Off`.
fn debugging() -> LevelFilter {
    if log::max_level() >= LevelFilter::Debug {
        log::max_level()
    } else {
        LevelFilter::Off
    }
}

/// Installs the logger at `info`.
pub fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Info);
    }
}

/// Sets the level.
pub fn set_level(level: bulkhead_config::LogLevel) {
    log::set_max_level(match level {
        bulkhead_config::LogLevel::Error => LevelFilter::Error,
        bulkhead_config::LogLevel::Warn => LevelFilter::Warn,
        bulkhead_config::LogLevel::Info => LevelFilter::Info,
        bulkhead_config::LogLevel::Debug => LevelFilter::Debug,
    });
}
