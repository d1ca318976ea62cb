//! Which run directory a command uses, so that every command finds the running `serve`
//! without flags, in a checkout and on a packaged host alike.
//!
//! `serve` uses, in order: `--run-dir`, `$BULKHEAD_RUN_DIR`, the configuration's `run_dir`,
//! then `./bulkhead-run`. Every other command uses `--run-dir` or `$BULKHEAD_RUN_DIR` if
//! given; otherwise the first of `./bulkhead-run` and the packaged configuration's run
//! directory (`run_dir` in /etc/bulkhead/bulkhead.toml, else `/run/bulkhead`) where a `serve`
//! listens. docs/operations.md says the same.

use std::path::{Path, PathBuf};

/// The run directory of a `serve` started from a checkout.
pub const LOCAL: &str = "./bulkhead-run";
/// The packaged configuration, whose `serve` the packaged unit starts.
pub const PACKAGED_CONFIG: &str = "/etc/bulkhead/bulkhead.toml";
/// The packaged unit's run directory, where the packaged configuration names none.
pub const PACKAGED: &str = "/run/bulkhead";

/// The run directory `serve` uses: `given` (the flag or the environment), else the
/// configuration's `run_dir`, else [`LOCAL`].
pub fn for_serve(given: Option<PathBuf>, configured: Option<&Path>) -> PathBuf {
    given.or_else(|| configured.map(Path::to_path_buf)).unwrap_or_else(|| PathBuf::from(LOCAL))
}

/// The run directory of the `serve` a command asks: `given` (the flag or the environment),
/// else the first candidate where a `serve` listens; else an error naming where it looked.
pub fn find(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = given {
        return Ok(dir);
    }
    let candidates = candidates(Path::new(PACKAGED_CONFIG));
    if let Some(dir) = candidates.iter().find(|d| listening(d)) {
        return Ok(dir.clone());
    }
    let looked: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
    anyhow::bail!(
        "no bulkhead serve is running: none listens in {} (give --run-dir DIR, or set BULKHEAD_RUN_DIR)",
        looked.join(" or ")
    )
}

/// Where to look, in order: the checkout's directory, then the packaged one.
fn candidates(packaged_config: &Path) -> Vec<PathBuf> {
    let packaged = std::fs::read_to_string(packaged_config)
        .ok()
        .and_then(|text| text.parse::<toml::Table>().ok())
        .and_then(|t| t.get("run_dir").and_then(toml::Value::as_str).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(PACKAGED));
    vec![PathBuf::from(LOCAL), packaged]
}

/// Whether a `serve` answers on `dir`'s control socket.
fn listening(dir: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(bulkhead_control::socket_path(dir)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_takes_the_flag_then_the_configuration_then_the_local_directory() {
        assert_eq!(for_serve(Some("/a".into()), Some(Path::new("/b"))), PathBuf::from("/a"));
        assert_eq!(for_serve(None, Some(Path::new("/b"))), PathBuf::from("/b"));
        assert_eq!(for_serve(None, None), PathBuf::from(LOCAL));
    }

    #[test]
    fn commands_look_in_the_checkout_then_where_the_packaged_configuration_says() {
        let dir = std::env::temp_dir().join(format!("bulkhead-run-dir-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("bulkhead.toml");
        std::fs::write(&cfg, "run_dir = \"/srv/bh\"\n[[device]]\nname = \"d\"\nsize = \"1M\"\n").unwrap();
        assert_eq!(candidates(&cfg), vec![PathBuf::from(LOCAL), PathBuf::from("/srv/bh")]);
        std::fs::write(&cfg, "[keeper]\nenabled = true\n").unwrap();
        assert_eq!(candidates(&cfg), vec![PathBuf::from(LOCAL), PathBuf::from(PACKAGED)]);
        assert_eq!(candidates(&dir.join("missing.toml"))[1], PathBuf::from(PACKAGED));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_given_directory_is_used_as_it_is_and_none_found_names_where_it_looked() {
        assert_eq!(find(Some("/x".into())).unwrap(), PathBuf::from("/x"));
        // No serve listens in the test's working directory or at an unused packaged path.
        if !listening(Path::new(LOCAL)) && !listening(Path::new(PACKAGED)) {
            let e = find(None).unwrap_err().to_string();
            assert!(e.contains(LOCAL) && e.contains("BULKHEAD_RUN_DIR"), "{e}");
        }
    }
}
