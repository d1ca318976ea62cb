//! The layering the workspace promises, checked rather than hoped for: crates depend only on
//! crates above them in ARCHITECTURE.md's table, and within each crate modules depend one way
//! (no cycle of `crate::` references between a crate's top-level modules; test modules and the
//! crate root, which declares and re-exports them, do not count).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The crates' folders in the order ARCHITECTURE.md's table lists them.
fn table_order() -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("ARCHITECTURE.md")).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("| `crates/"))
        .filter_map(|l| l.split_once("` |").map(|(name, _)| name.to_string()))
        .collect()
}

/// Each crate folder's package name and the workspace packages it depends on (normal and
/// optional dependencies, not dev-dependencies), by package name.
fn crates() -> BTreeMap<String, (String, Vec<String>)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(repo().join("crates")).unwrap() {
        let dir = entry.unwrap().path();
        let Ok(text) = std::fs::read_to_string(dir.join("Cargo.toml")) else { continue };
        let manifest: toml::Table = toml::from_str(&text).unwrap();
        let name = manifest["package"]["name"].as_str().unwrap().to_string();
        let deps = manifest
            .get("dependencies")
            .and_then(toml::Value::as_table)
            .map(|t| t.keys().filter(|k| k.starts_with("bulkhead")).cloned().collect())
            .unwrap_or_default();
        out.insert(dir.file_name().unwrap().to_string_lossy().into_owned(), (name, deps));
    }
    out
}

#[test]
fn crates_depend_only_on_crates_above_them_in_the_architecture_table() {
    let order = table_order();
    let crates = crates();
    let missing: Vec<&String> = crates.keys().filter(|c| !order.contains(c)).collect();
    assert!(missing.is_empty(), "crates missing from ARCHITECTURE.md's table: {missing:?}");
    let gone: Vec<&String> = order.iter().filter(|c| !crates.contains_key(*c)).collect();
    assert!(gone.is_empty(), "ARCHITECTURE.md's table lists crates that do not exist: {gone:?}");
    let position_of_package = |package: &str| {
        crates.iter().find(|(_, (name, _))| name == package).and_then(|(dir, _)| order.iter().position(|c| c == dir))
    };
    let mut against = Vec::new();
    for (dir, (_, deps)) in &crates {
        let me = order.iter().position(|c| c == dir).unwrap();
        for dep in deps {
            let at = position_of_package(dep).unwrap_or_else(|| panic!("{dir} depends on {dep}, which is not in crates/"));
            if at >= me {
                against.push(format!("{dir} -> {dep}"));
            }
        }
    }
    assert!(
        against.is_empty(),
        "dependencies against ARCHITECTURE.md's order (a crate may use only those above it): {against:?}"
    );
}

/// `text` without comments, string and character literals, and `#[cfg(test)]` modules.
fn code_of(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i = text[i..].find("*/").map_or(b.len(), |e| i + e + 2);
        } else if b[i..].starts_with(b"r#\"") || b[i..].starts_with(b"r\"") {
            let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let start = i + 2 + hashes;
            i = text[start..].find(&close).map_or(b.len(), |e| start + e + close.len());
            out.push_str("\"\"");
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 2] == b'\'' || b[i + 1] == b'\\') {
            // A character literal (a lifetime has no closing quote).
            i += if b[i + 1] == b'\\' { text[i + 2..].find('\'').map_or(b.len() - i, |e| e + 3) } else { 3 };
        } else if b[i..].starts_with(b"#[cfg(test)]") {
            // A test module: skip its body.
            let rest = &text[i..];
            match (rest.find("mod "), rest.find('{'), rest.find(';')) {
                (Some(m), Some(open), semi) if m < open && semi.is_none_or(|s| s > open) => {
                    let mut depth = 0;
                    let mut j = i + open;
                    while j < b.len() {
                        match b[j] {
                            b'{' => depth += 1,
                            b'}' => {
                                depth -= 1;
                                if depth == 0 {
                                    break;
                                }
                            }
                            _ => {}
                        }
                        j += 1;
                    }
                    i = j + 1;
                }
                _ => {
                    out.push('#');
                    i += 1;
                }
            }
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// The identifiers at the top level of a `{…}` use group that starts at `text[0]`.
fn group_heads(text: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut word = String::new();
    let mut at_start = true;
    for c in text.chars() {
        match c {
            '{' => {
                depth += 1;
                if depth == 1 {
                    at_start = true;
                    continue;
                }
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => at_start = true,
            _ => {}
        }
        if depth == 1 && at_start {
            if c.is_alphanumeric() || c == '_' {
                word.push(c);
            } else if !word.is_empty() {
                heads.push(std::mem::take(&mut word));
                at_start = false;
            }
        }
    }
    heads
}

/// The top-level modules of the crate at `src` that the file at `rel` (inside module `own`)
/// refers to, other than `own`.
fn references(code: &str, rel: &Path, own: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let nested = rel.components().count() > 1;
    let mut found = BTreeSet::new();
    let mut note = |name: &str| {
        if name != own && modules.contains(name) {
            found.insert(name.to_string());
        }
    };
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    for (at, _) in code.match_indices("crate::") {
        if code[..at].ends_with('$') || code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if rest.starts_with('{') {
            group_heads(rest).iter().for_each(|h| note(h));
        } else {
            note(&ident(rest));
        }
    }
    // `super::` in a top-level module is the crate root; in a nested one, `super::super::`.
    let root = if nested { "super::super::" } else { "super::" };
    for (at, _) in code.match_indices(root) {
        if !nested && code[..at].ends_with("super::") {
            continue;
        }
        let rest = &code[at + root.len()..];
        if rest.starts_with('{') {
            group_heads(rest).iter().for_each(|h| note(h));
        } else {
            note(&ident(rest));
        }
    }
    found
}

/// Every cycle among the top-level modules of the crate whose sources are in `src`, as the
/// modules of each strongly connected group.
fn module_cycles(src: &Path) -> Vec<Vec<String>> {
    let mut files = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let top = |p: &Path| -> String {
        let rel = p.strip_prefix(src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
        first.trim_end_matches(".rs").to_string()
    };
    let is_root = |m: &str| m == "lib" || m == "main";
    let modules: BTreeSet<String> = files.iter().map(|p| top(p)).filter(|m| !is_root(m)).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for f in &files {
        let own = top(f);
        if is_root(&own) {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        let refs = references(&code, f.strip_prefix(src).unwrap(), &own, &modules);
        edges.get_mut(&own).unwrap().extend(refs);
    }
    strongly_connected(&edges).into_iter().filter(|c| c.len() > 1).collect()
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on.insert(v);
            for w in &self.edges[v] {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let lw = self.low[w.as_str()];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w.as_str()) {
                    let iw = self.index[w.as_str()];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    group.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                group.sort();
                self.out.push(group);
            }
        }
    }
    let mut walk =
        Walk { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.out
}

#[test]
fn modules_within_each_crate_depend_one_way() {
    let mut cycles = Vec::new();
    for dir in crates().keys() {
        for c in module_cycles(&repo().join("crates").join(dir).join("src")) {
            cycles.push(format!("{dir}: {}", c.join(" <-> ")));
        }
    }
    assert!(cycles.is_empty(), "module cycles: {cycles:#?}");
}

#[test]
fn the_cycle_check_finds_a_cycle_and_ignores_what_does_not_count() {
    let dir = std::env::temp_dir().join(format!("bulkhead-layering-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("b")).unwrap();
    let write = |p: &str, t: &str| std::fs::write(src.join(p), t).unwrap();
    write("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::A;\n");
    write("a.rs", "use crate::{b::B, c};\n// crate::d is a comment\nconst S: &str = \"crate::c::x\";\n");
    write("b/mod.rs", "mod inner;\n");
    write("b/inner.rs", "use super::super::a::A;\n");
    write("c.rs", "#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\n");
    assert_eq!(module_cycles(&src), vec![vec!["a".to_string(), "b".to_string()]]);
    write("b/inner.rs", "fn f() {}\n");
    assert!(module_cycles(&src).is_empty(), "a test module's use of `a` is no cycle");
    std::fs::remove_dir_all(&dir).unwrap();
}
