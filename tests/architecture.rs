//! The shape of the source tree, checked: imports point only down the layers that
//! docs/ARCHITECTURE.md lists, sibling files of one module import each other in one direction only,
//! and files and functions stay small enough to read (or say why they are not).
//!
//! The layer table is read from the document itself (its fenced `layers` block), so the document and
//! the code cannot drift apart: a new top-level module must be placed in the table before it builds.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Longest file (lines) and function (lines, signature to closing brace) without a stated reason.
const MAX_FILE_LINES: usize = 1000;
const MAX_FN_LINES: usize = 100;
/// A function over the limit carries a comment with this phrase saying why it is long.
const LONG_MARKER: &str = "Long because";

/// `(path relative to src/, contents)` of every Rust file of the library and the binary.
fn sources() -> Vec<(String, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&root, &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let rel = p
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            (rel, fs::read_to_string(&p).unwrap())
        })
        .collect()
}

/// The layers, bottom first, each a set of peer modules, from docs/ARCHITECTURE.md's `layers` block
/// (written top first).
fn layers() -> Vec<BTreeSet<String>> {
    let doc = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ARCHITECTURE.md"))
        .expect("docs/ARCHITECTURE.md");
    let block = doc
        .split("```layers\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/ARCHITECTURE.md has a ```layers block");
    let mut layers: Vec<BTreeSet<String>> = block
        .lines()
        .map(|l| l.split_whitespace().map(String::from).collect::<BTreeSet<_>>())
        .filter(|s| !s.is_empty())
        .collect();
    layers.reverse();
    layers
}

/// The top-level module a file belongs to (`model` for `model/text.rs`, `error` for `error.rs`);
/// `None` for the crate roots.
fn top_module(rel: &str) -> Option<String> {
    let first = rel.split('/').next().unwrap().trim_end_matches(".rs");
    (!matches!(first, "lib" | "main")).then(|| first.to_string())
}

/// Code lines only: comments and doc comments (which may name any module) dropped.
fn code(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first segment of every path that follows `prefix` (a whole path segment: `crate::` does not
/// match inside `my_crate::`): `prefix::a::X` gives `a`; `prefix::{a::X, b, c::{Y, Z}}` gives `a`,
/// `b`, `c`, groups read with their nesting.
fn heads_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices(prefix) {
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let rest = &code[i + prefix.len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.insert(ident(rest));
            continue;
        };
        // Split the group at its top-level commas; its end is the `}` that closes it.
        let (mut depth, mut start) = (0usize, 0usize);
        for (j, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.insert(ident(group[start..j].trim()));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.insert(ident(group[start..j].trim()));
                    start = j + 1;
                }
                _ => {}
            }
        }
    }
    out.remove("");
    out
}

/// Identifiers after `crate::` (and `$crate::` in macros), including every item of `crate::{a, b}`.
fn crate_refs(code: &str) -> BTreeSet<String> {
    heads_after(code, "crate::")
}

/// What a crate-root name belongs to: re-exports and exported macros map to their module.
fn owner(name: &str) -> &str {
    match name {
        "Error" | "Result" => "error",
        "with_backend" => "backend",
        other => other,
    }
}

#[test]
fn imports_point_down_the_layers() {
    let layers = layers();
    let rank = |m: &str| layers.iter().position(|l| l.contains(m));
    let mut violations = Vec::new();
    let mut seen_modules = BTreeSet::new();
    for (rel, text) in sources() {
        let Some(me) = top_module(&rel) else { continue };
        seen_modules.insert(me.clone());
        let my_rank = rank(&me).unwrap_or_else(|| panic!("module `{me}` ({rel}) is not in the layers"));
        let code = code(&text);
        // `super::` chains that climb to the crate root name crate-level modules too.
        let root = "super::".repeat(module_of(&rel).map_or(0, |m| m.len()));
        let mut names = crate_refs(&code);
        names.extend(heads_after(&code, &root));
        for name in names {
            let target = owner(&name);
            if target == me {
                continue;
            }
            match rank(target) {
                None => violations.push(format!("{rel}: `crate::{name}` is in no layer")),
                Some(r) if r >= my_rank => violations.push(format!(
                    "{rel}: {me} (layer {my_rank}) imports {target} (layer {r}), which is not below it"
                )),
                Some(_) => {}
            }
        }
    }
    let listed: BTreeSet<String> = layers.iter().flatten().cloned().collect();
    let stale: Vec<&String> = listed.difference(&seen_modules).collect();
    assert!(
        stale.is_empty(),
        "layers name modules that do not exist: {stale:?}"
    );
    assert!(
        violations.is_empty(),
        "imports that do not point down:\n{}",
        violations.join("\n")
    );
}

/// The module path of a source file (`memory::selector::compose` for `memory/selector/compose.rs`,
/// `memory::selector` for its `mod.rs`); `None` for the crate roots.
fn module_of(rel: &str) -> Option<Vec<String>> {
    let mut parts: Vec<String> = rel.trim_end_matches(".rs").split('/').map(String::from).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    (!matches!(parts[..], [ref p] if p == "lib" || p == "main")).then_some(parts)
}

/// What a `mod.rs` re-exports, by name: `pub use compose::{compose, Allocation};` maps both names to
/// the child `compose` (every identifier of the statement after the child's name, which may name a
/// path segment too: harmless, as it then maps a name no sibling imports).
fn reexports(mod_rs: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for stmt in mod_rs.split(';') {
        let stmt = stmt.trim_start();
        let Some(path) = ["pub use ", "pub(crate) use ", "pub(super) use "]
            .iter()
            .find_map(|p| stmt.strip_prefix(p))
        else {
            continue;
        };
        let mut idents = path
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty() && !matches!(*w, "self" | "as" | "crate" | "super"));
        let Some(child) = idents.next() else { continue };
        for name in idents {
            map.insert(name.to_string(), child.to_string());
        }
    }
    map
}

#[test]
fn sibling_files_do_not_import_each_other_in_a_cycle() {
    // Nodes are modules (files, or folders with their mod.rs); an edge joins two children of one
    // module when one names the other, by its path (`super::hgkv`, `crate::model::hgkv`, in groups
    // too) or by an item the parent's mod.rs re-exports from it (`super::{Allocation, Swap}`).
    let sources = sources();
    let modules: BTreeSet<Vec<String>> = sources.iter().filter_map(|(rel, _)| module_of(rel)).collect();
    let parents: BTreeMap<Vec<String>, BTreeMap<String, String>> = sources
        .iter()
        .filter(|(rel, _)| rel.ends_with("/mod.rs"))
        .map(|(rel, text)| (module_of(rel).unwrap(), reexports(&code(text))))
        .collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rel, text) in &sources {
        let Some(me) = module_of(rel) else { continue };
        let code = code(text);
        for k in 1..me.len() {
            let (parent, node) = (&me[..k], me[..=k].join("::"));
            let mut names = heads_after(&code, &format!("crate::{}::", parent.join("::")));
            if k == me.len() - 1 {
                names.extend(heads_after(&code, "super::"));
            }
            for name in names {
                let child = if modules.contains(&[parent, std::slice::from_ref(&name)].concat()) {
                    Some(name)
                } else {
                    parents.get(parent).and_then(|r| r.get(&name)).cloned()
                };
                if let Some(child) = child {
                    let target = format!("{}::{child}", parent.join("::"));
                    if target != node {
                        edges.entry(node.clone()).or_default().insert(target);
                    }
                }
            }
        }
    }
    // Depth-first search for a back edge.
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(1) => {
                let from = stack.iter().position(|s| s == n).unwrap();
                return Some([&stack[from..], &[n.to_string()]].concat());
            }
            Some(_) => return None,
            None => {}
        }
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, edges, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if let Some(cycle) = visit(n, &edges, &mut state, &mut Vec::new()) {
            panic!("import cycle: {}", cycle.join(" -> "));
        }
    }
}

/// `(name, first line, length)` of every `fn` with a body, found by indentation: the body ends at
/// the first line after the signature that is the signature's indentation followed by `}`.
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let sig = trimmed
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ")
            .trim_start_matches("pub ")
            .trim_start_matches("const ")
            .trim_start_matches("async ")
            .trim_start_matches("unsafe ")
            .trim_start_matches("extern \"C\" ");
        let Some(rest) = sig.strip_prefix("fn ") else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // A declaration without a body (trait item) ends in `;` before any `{`.
        let mut j = i;
        while j < lines.len() && !lines[j].contains('{') && !lines[j].trim_end().ends_with(';') {
            j += 1;
        }
        if j == lines.len() || !lines[j].contains('{') {
            continue;
        }
        let close = format!("{indent}}}");
        if lines[j].trim_end().ends_with('}')
            && lines[j].matches('{').count() == lines[j].matches('}').count()
        {
            continue; // one-line body
        }
        if let Some(end) = (j + 1..lines.len()).find(|&k| lines[k].trim_end() == close) {
            out.push((name, i, end - i + 1));
        }
    }
    out
}

#[test]
fn files_and_functions_stay_readable() {
    let mut problems = Vec::new();
    for (rel, text) in sources() {
        let lines: Vec<&str> = text.lines().collect();
        if lines.len() > MAX_FILE_LINES {
            problems.push(format!(
                "src/{rel}: {} lines (limit {MAX_FILE_LINES})",
                lines.len()
            ));
        }
        for (name, start, len) in functions(&text) {
            // The reason sits in the comment block right above the signature (attributes allowed).
            let reason = lines[..start]
                .iter()
                .rev()
                .take_while(|l| {
                    let t = l.trim_start();
                    t.starts_with("//") || t.starts_with("#[")
                })
                .any(|l| l.contains(LONG_MARKER));
            if len > MAX_FN_LINES && !reason {
                problems.push(format!(
                    "src/{rel}:{}: fn {name} is {len} lines (limit {MAX_FN_LINES}; or say \"{LONG_MARKER} ...\" above it)",
                    start + 1
                ));
            }
        }
    }
    assert!(problems.is_empty(), "hard to read:\n{}", problems.join("\n"));
}

#[test]
fn the_checks_see_what_they_claim_to() {
    // The scanners are checked on known text, so that a broken parser cannot pass the tree silently.
    let refs = crate_refs("use crate::{backend::Backend, error::Result};\nlet x = crate::model::load();");
    assert_eq!(
        refs.into_iter().collect::<Vec<_>>(),
        vec!["backend".to_string(), "error".into(), "model".into()]
    );
    let f = "fn a() {\n    x;\n}\n    pub fn b(\n        y: u8,\n    ) -> u8 {\n        y\n    }\nfn c();\n";
    let found: Vec<(String, usize, usize)> = functions(f);
    assert_eq!(found, vec![("a".to_string(), 0, 3), ("b".to_string(), 3, 5)]);
    assert_eq!(code("// crate::agent\nuse crate::kv;"), "use crate::kv;");
    let heads = heads_after(
        "use super::{a::{X, Y}, b, c::Z};\nuse super::d;\nlet e = my_super::f; super::super::g;",
        "super::",
    );
    assert_eq!(
        heads.into_iter().collect::<Vec<_>>(),
        ["a", "b", "c", "d", "super"]
    );
    let r =
        reexports("pub use compose::{compose, Allocation};\npub(crate) use paper::Paper as P;\nuse x::Y;");
    assert_eq!(r.get("Allocation").map(String::as_str), Some("compose"));
    assert_eq!(r.get("P").map(String::as_str), Some("paper"));
    assert_eq!(r.get("Y"), None);
    assert_eq!(
        module_of("memory/selector/mod.rs"),
        Some(vec!["memory".into(), "selector".into()])
    );
    assert_eq!(module_of("lib.rs"), None);
}
