//! The log of `serve` and the commands: one line per event on standard error, `bulkhead: ` and
//! the event, with its device named where it has one. Warnings and errors say so. The level is
//! `[log] level` in the configuration (`info` unless set). What domains print is relayed
//! whatever the level, prefixed and rate-limited (`bulkhead_supervisor::domain_log`), as are a
//! device's own rate-limited lines (restarts, storms). When standard error is the journal
//! (systemd's `JOURNAL_STREAM` names it), each line starts with its priority (`<3>` for an
//! error, `<4>` a warning, `<6>` information, `<7>` debugging), so that `journalctl -p
//! warning` finds the warnings.

use std::os::fd::AsFd;
use std::sync::OnceLock;

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
        let priority = if to_journal() { priority(record.level()) } else { "" };
        // One write per line, so lines of several threads do not interleave.
        let line = format!("{priority}bulkhead: {what}{}\n", record.args());
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }

    fn flush(&self) {}
}

/// The journal's priority prefix for `level` (sd-daemon(3)).
fn priority(level: Level) -> &'static str {
    match level {
        Level::Error => "<3>",
        Level::Warn => "<4>",
        Level::Info => "<6>",
        Level::Debug | Level::Trace => "<7>",
    }
}

/// Whether standard error is the journal's stream: `JOURNAL_STREAM` holds its device and
/// inode, as systemd.exec(5) says.
fn to_journal() -> bool {
    static JOURNAL: OnceLock<bool> = OnceLock::new();
    *JOURNAL.get_or_init(|| {
        use std::os::unix::fs::MetadataExt;
        let Ok(stream) = std::env::var("JOURNAL_STREAM") else { return false };
        let Some((dev, ino)) = stream.split_once(':') else { return false };
        let Ok(stderr) = std::io::stderr().as_fd().try_clone_to_owned() else { return false };
        let Ok(meta) = std::fs::File::from(stderr).metadata() else { return false };
        dev.parse() == Ok(meta.dev()) && ino.parse() == Ok(meta.ino())
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_has_the_journal_priority_of_its_kind() {
        assert_eq!(priority(Level::Error), "<3>");
        assert_eq!(priority(Level::Warn), "<4>");
        assert_eq!(priority(Level::Info), "<6>");
        assert_eq!(priority(Level::Debug), "<7>");
    }
}
