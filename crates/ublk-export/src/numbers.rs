//! Which `/dev/ublkbN` each device of a run directory has: configured, or given by the kernel
//! the first time and kept in `<run-dir>/ublk/numbers.json`, so that a device keeps its number
//! across restarts of `serve` and a successor knows which devices the kernel holds for it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The numbers of one run directory.
#[derive(Debug)]
pub(crate) struct Numbers {
    file: PathBuf,
    map: BTreeMap<String, u32>,
}

impl Numbers {
    /// The numbers kept under `dir` (none yet if there is no file; a file that does not parse
    /// is set aside with a warning: the devices then get numbers as if new).
    pub fn load(dir: &Path) -> std::io::Result<Numbers> {
        std::fs::create_dir_all(dir)?;
        let file = dir.join("numbers.json");
        let map = match std::fs::read_to_string(&file) {
            Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
                log::warn!("{}: {e}: its numbers are forgotten", file.display());
                BTreeMap::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(e),
        };
        Ok(Numbers { file, map })
    }

    /// The number kept for `name`.
    pub fn get(&self, name: &str) -> Option<u32> {
        self.map.get(name).copied()
    }

    /// Every name and number kept.
    pub fn all(&self) -> impl Iterator<Item = (&str, u32)> {
        self.map.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// Keeps `number` for `name` (written at once, replacing the file whole).
    pub fn set(&mut self, name: &str, number: u32) -> std::io::Result<()> {
        if self.map.insert(name.to_string(), number) != Some(number) {
            self.save()?;
        }
        Ok(())
    }

    /// Forgets `name` (its device was removed).
    pub fn forget(&mut self, name: &str) -> std::io::Result<()> {
        if self.map.remove(name).is_some() {
            self.save()?;
        }
        Ok(())
    }

    fn save(&self) -> std::io::Result<()> {
        let tmp = self.file.with_extension("json.new");
        std::fs::write(&tmp, serde_json::to_string_pretty(&self.map).unwrap_or_default())?;
        std::fs::rename(&tmp, &self.file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_kept_across_loads_and_forgotten_on_removal() {
        let dir = std::env::temp_dir().join(format!("bulkhead-ublk-numbers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut n = Numbers::load(&dir).unwrap();
        assert_eq!(n.get("a"), None);
        n.set("a", 3).unwrap();
        n.set("b", 0).unwrap();
        let mut again = Numbers::load(&dir).unwrap();
        assert_eq!((again.get("a"), again.get("b")), (Some(3), Some(0)));
        again.forget("a").unwrap();
        assert_eq!(Numbers::load(&dir).unwrap().all().collect::<Vec<_>>(), vec![("b", 0)]);
        std::fs::write(dir.join("numbers.json"), "{not json").unwrap();
        assert_eq!(Numbers::load(&dir).unwrap().get("b"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
