//! The docs stay true: BENCHMARKS.md stays a reference of current figures within its line
//! budget, each of its sections gives its command and the date and processor of its run, and every citation of a docs section
//! (`docs/X.md, "Section"`, in the docs and in code comments) names a section that exists,
//! and the README's command list is the command line's.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Lines BENCHMARKS.md may have: it holds the current figures; what they replaced is in its
/// history, and investigations behind a figure in docs/bench/.
const BENCHMARKS_LINES: usize = 500;

#[test]
fn benchmarks_stays_within_its_budget_and_each_section_gives_its_command() {
    let text = std::fs::read_to_string(repo().join("docs/BENCHMARKS.md")).unwrap();
    let lines = text.lines().count();
    assert!(
        lines <= BENCHMARKS_LINES,
        "docs/BENCHMARKS.md has {lines} lines, over its budget of {BENCHMARKS_LINES}: replace what a new result \
         supersedes, and move an investigation to docs/bench/"
    );
    let mut sections = text.split("\n## ").skip(1);
    let mut without = Vec::new();
    for s in sections.by_ref() {
        let title = s.lines().next().unwrap_or_default();
        if !s.contains("```sh") {
            without.push(title.to_string());
        }
    }
    assert!(without.is_empty(), "BENCHMARKS.md sections without a ```sh block of their command: {without:?}");
    // And the run's date and machine: a figure without them cannot be compared with the next.
    let undated: Vec<_> = text
        .split("\n## ")
        .skip(1)
        .filter(|s| !(has_date(s) && (names_processor(s) || s.contains("processor was not recorded"))))
        .map(|s| s.lines().next().unwrap_or_default().to_string())
        .collect();
    assert!(undated.is_empty(), "BENCHMARKS.md sections without the date (YYYY-MM-DD) and processor of their run: {undated:?}");
}

/// Whether `text` holds a date written YYYY-MM-DD.
fn has_date(text: &str) -> bool {
    let b = text.as_bytes();
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    (0..b.len().saturating_sub(9))
        .any(|i| digits(i..i + 4) && b[i + 4] == b'-' && digits(i + 5..i + 7) && b[i + 7] == b'-' && digits(i + 8..i + 10))
}

/// Whether `text` names the processor a run was on.
fn names_processor(text: &str) -> bool {
    ["Intel", "AMD", "EPYC", "Xeon"].iter().any(|p| text.contains(p))
}

#[test]
fn the_section_check_reads_dates_and_processors() {
    assert!(has_date("five runs (2026-11-28, AMD EPYC)") && names_processor("five runs (2026-11-28, AMD EPYC)"));
    assert!(!has_date("run 2026-11 on 28") && !names_processor("a 2-vCPU guest"));
}

/// The files cited from, under the repository: the docs, the README, ARCHITECTURE.md and every
/// Rust source.
fn citing_files(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut stack = vec![root.join("docs"), root.join("crates")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "md" || x == "rs") {
                out.push(p);
            }
        }
    }
    out
}

/// The names a page's sections can be cited by: its headings, and the bold labels that open
/// its list items (`* **Crowded CPUs.** …`), without backticks.
fn section_names(page: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in page.lines() {
        let t = line.trim_start();
        if let Some(h) = t.strip_prefix('#') {
            names.push(h.trim_start_matches('#').trim().replace('`', ""));
        } else if let Some(rest) = t.strip_prefix("* **").or_else(|| t.strip_prefix("- **")) {
            if let Some(end) = rest.find("**") {
                names.push(rest[..end].trim_end_matches('.').replace('`', ""));
            }
        }
    }
    names
}

/// `text` with comment markers and line breaks folded into single spaces, so that a citation
/// broken over lines reads as one.
fn folded(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let t = line.trim_start();
        let t = ["//!", "///", "//", "*"].iter().find_map(|m| t.strip_prefix(m)).unwrap_or(t);
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(t.trim());
    }
    out
}

/// Every `PATH.md, "Section"` in `text`: the path and the section.
fn citations(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(".md, \"") {
        let before = &rest[..at];
        let start = before.rfind(|c: char| !(c.is_alphanumeric() || "/._-".contains(c))).map_or(0, |i| i + 1);
        let path = format!("{}.md", &before[start..]);
        let after = &rest[at + ".md, \"".len()..];
        let Some(end) = after.find('"') else { break };
        out.push((path, after[..end].to_string()));
        rest = &after[end..];
    }
    out
}

#[test]
fn every_cited_docs_section_exists() {
    let root = repo();
    let mut broken = Vec::new();
    // This file's own examples are not citations.
    for file in citing_files(&root).into_iter().filter(|f| !f.ends_with(file!())) {
        let text = folded(&std::fs::read_to_string(&file).unwrap());
        for (path, section) in citations(&text) {
            let here = file.parent().unwrap().join(&path);
            let target = [root.join(&path), here, root.join("docs").join(&path)].into_iter().find(|p| p.is_file());
            let Some(target) = target else {
                broken.push(format!("{}: {path} does not exist", file.strip_prefix(&root).unwrap().display()));
                continue;
            };
            let names = section_names(&std::fs::read_to_string(&target).unwrap());
            let wanted = section.replace('`', "");
            if !names.iter().any(|n| n.starts_with(&wanted)) {
                broken.push(format!("{}: {path} has no section \"{section}\"", file.strip_prefix(&root).unwrap().display()));
            }
        }
    }
    assert!(broken.is_empty(), "citations of docs sections that do not resolve:\n{}", broken.join("\n"));
}

#[test]
fn the_citation_check_reads_citations_across_lines_and_comment_markers() {
    let text = folded("// as measured (docs/BENCHMARKS.md, \"Waiting for\n// answers\") and docs/x.md, \"A\"");
    assert_eq!(
        citations(&text),
        [("docs/BENCHMARKS.md".to_string(), "Waiting for answers".to_string()), ("docs/x.md".to_string(), "A".to_string())]
    );
    assert_eq!(
        section_names("## Restart (`bulkhead-bench restart`)\n* **Crowded CPUs.** text"),
        ["Restart (bulkhead-bench restart)", "Crowded CPUs"]
    );
}

/// Every path under crates/ or scripts/ that a page of the docs names.
fn named_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for start in ["crates/", "scripts/"] {
        let mut rest = text;
        while let Some(at) = rest.find(start) {
            let path_ok = at == 0 || !rest.as_bytes()[at - 1].is_ascii_alphanumeric() && rest.as_bytes()[at - 1] != b'/';
            let tail = &rest[at..];
            let end = tail.find(|c: char| !(c.is_alphanumeric() || "/._-".contains(c))).unwrap_or(tail.len());
            let path = tail[..end].trim_end_matches('.');
            if path_ok && [".rs", ".sh", ".toml"].iter().any(|x| path.ends_with(x)) {
                out.push(path.to_string());
            }
            rest = &tail[end.max(1)..];
        }
    }
    out
}

#[test]
fn every_file_the_docs_name_exists() {
    let root = repo();
    let mut missing = Vec::new();
    for page in citing_files(&root).into_iter().filter(|p| p.extension().is_some_and(|x| x == "md")) {
        for path in named_paths(&std::fs::read_to_string(&page).unwrap()) {
            if !root.join(&path).exists() {
                missing.push(format!("{}: {path}", page.strip_prefix(&root).unwrap().display()));
            }
        }
    }
    assert!(missing.is_empty(), "files the docs name that do not exist:\n{}", missing.join("\n"));
}

#[test]
fn the_readme_lists_every_command_and_no_other() {
    use std::collections::BTreeSet;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bulkhead")).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let commands: BTreeSet<String> = help
        .split("Commands:")
        .nth(1)
        .expect("--help lists the commands")
        .lines()
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect();
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let block = readme
        .split("## Commands")
        .nth(1)
        .and_then(|r| r.split("```text").nth(1))
        .and_then(|r| r.split("```").next())
        .expect("README has a ## Commands section with a text block");
    let listed: BTreeSet<String> = block
        .lines()
        .filter_map(|l| l.strip_prefix("bulkhead "))
        .filter_map(|r| r.split_whitespace().next())
        .map(String::from)
        .collect();
    let missing: Vec<&String> = commands.difference(&listed).collect();
    let stale: Vec<&String> = listed.difference(&commands).collect();
    assert!(missing.is_empty() && stale.is_empty(), "README's command list: missing {missing:?}, not commands {stale:?}");
}

/// A heading's anchor as GitHub makes it: lower case, spaces to hyphens, and everything but
/// letters, digits, `-` and `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_link_to_a_docs_section_resolves() {
    let root = repo();
    let pages: Vec<PathBuf> = citing_files(&root).into_iter().filter(|p| p.extension().is_some_and(|x| x == "md")).collect();
    let anchors_of = |page: &Path| -> Option<Vec<String>> {
        let text = std::fs::read_to_string(page).ok()?;
        Some(text.lines().filter(|l| l.starts_with('#')).map(|l| anchor(l.trim_start_matches('#'))).collect())
    };
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            let link = &rest[at + 2..];
            let end = link.find([')', ' ']).unwrap_or(link.len());
            let (target, fragment) = match link[..end].split_once('#') {
                Some((t, f)) if !t.contains("://") => (t, f),
                _ => {
                    rest = &link[end..];
                    continue;
                }
            };
            let file = if target.is_empty() { page.clone() } else { page.parent().unwrap().join(target) };
            if file.extension().is_some_and(|x| x == "md") {
                match anchors_of(&file) {
                    Some(a) if a.iter().any(|x| x == fragment) => {}
                    _ => broken.push(format!("{}: {target}#{fragment}", page.strip_prefix(&root).unwrap().display())),
                }
            }
            rest = &link[end..];
        }
    }
    assert!(broken.is_empty(), "links to sections that do not exist: {broken:?}");
}

#[test]
fn anchors_are_githubs() {
    assert_eq!(anchor(" Ceph RBD: `bulkhead-bench rbd`"), "ceph-rbd-bulkhead-bench-rbd");
    assert_eq!(anchor("When `serve` dies or is upgraded"), "when-serve-dies-or-is-upgraded");
}
