//! The runtime's layers, checked over its sources (docs/ARCHITECTURE.md draws them):
//! - the transport seam runs one way: no file under `src/transport/` names the agent, its
//!   context, a peer, a link, the server or CUDA IPC (they sit above it);
//! - no import circle among the runtime's modules (files), nor among its top-level modules.
//!
//! A module's references are the `crate::...` paths in it (`use` lines and inline paths,
//! brace groups included), `super::...` paths, and, in a `mod.rs`, paths through its own
//! submodules. Comments are skipped. A module declaring and re-exporting its own submodules is
//! structure, not a dependency: edges from a module to its descendants are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What the transport files may not reach: everything above the seam.
const ABOVE_THE_SEAM: &[&str] = &["agent", "ctx", "peer", "link", "server", "ipc"];

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Module path of a source file relative to `src/` ("transport/ucx/mod.rs" -> "transport::ucx").
fn module_of(rel: &Path) -> String {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts.join("::")
}

fn sources(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).expect("read src").map(|e| e.expect("dir entry").path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            sources(&p, root, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&p).expect("read source");
            out.push((module_of(p.strip_prefix(root).expect("under src")), text));
        }
    }
}

/// The source without comments (line comments, doc comments, block comments); string literals
/// are kept as they are (a "//" inside one ends nothing that matters here: paths are code).
fn strip_comments(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let (mut i, mut in_str) = (0, false);
    while i < b.len() {
        let c = b[i];
        if in_str {
            out.push(c as char);
            if c == b'\\' && i + 1 < b.len() {
                out.push(b[i + 1] as char);
                i += 2;
                continue;
            }
            in_str = c != b'"';
            i += 1;
            continue;
        }
        if c == b'"' && !(i > 0 && b[i - 1] == b'\'' && i + 1 < b.len() && b[i + 1] == b'\'') {
            in_str = true;
            out.push('"');
            i += 1;
        } else if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    out
}

fn ident_at(s: &[u8], mut i: usize) -> (String, usize) {
    let start = i;
    while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == b'_') {
        i += 1;
    }
    (String::from_utf8_lossy(&s[start..i]).into_owned(), i)
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && s[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// Parse a path (with brace groups) starting at `i` with segments `prefix` already read; push
/// every full path it names into `out`.
fn paths_at(s: &[u8], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut segs = prefix;
    loop {
        i = skip_ws(s, i);
        if i < s.len() && s[i] == b'{' {
            i += 1;
            loop {
                i = skip_ws(s, i);
                if i >= s.len() {
                    return i;
                }
                if s[i] == b'}' {
                    return i + 1;
                }
                if s[i] == b',' {
                    i += 1;
                    continue;
                }
                let before = i;
                i = paths_at(s, i, segs.clone(), out);
                // `self`, `*`, `as` renames: step over what is not a path.
                if i == before {
                    i += 1;
                }
            }
        }
        let (id, j) = ident_at(s, i);
        if id.is_empty() {
            if !segs.is_empty() {
                out.push(segs);
            }
            return i;
        }
        i = j;
        if id == "as" {
            // `x as y`: the rename is not a path.
            let k = skip_ws(s, i);
            let (_, k) = ident_at(s, k);
            out.push(segs);
            return k;
        }
        segs.push(id);
        let k = skip_ws(s, i);
        if s.get(k) == Some(&b':') && s.get(k + 1) == Some(&b':') {
            i = k + 2;
        } else {
            out.push(segs);
            return i;
        }
    }
}

/// The modules `module` (whose stripped source is `code`) refers to, among `known`.
fn references(module: &str, code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let s = code.as_bytes();
    let mut paths: Vec<Vec<String>> = Vec::new();
    let parent: Vec<String> = {
        let mut p: Vec<String> = module.split("::").filter(|x| !x.is_empty()).map(String::from).collect();
        p.pop();
        p
    };
    let own: Vec<String> = module.split("::").filter(|x| !x.is_empty()).map(String::from).collect();
    // A file's inline `mod tests` sees the file itself as `super`.
    let tests_at = code.find("mod tests").unwrap_or(usize::MAX);
    let children: BTreeSet<String> = known
        .iter()
        .filter_map(|k| k.strip_prefix(&format!("{module}::")).filter(|r| !module.is_empty() && !r.contains("::")).map(String::from))
        .collect();
    let mut i = 0;
    while i < s.len() {
        let boundary = i == 0 || !(s[i - 1].is_ascii_alphanumeric() || s[i - 1] == b'_' || s[i - 1] == b':');
        if !boundary {
            i += 1;
            continue;
        }
        let (id, j) = ident_at(s, i);
        if id.is_empty() {
            i += 1;
            continue;
        }
        let k = skip_ws(s, j);
        let path_follows = s.get(k) == Some(&b':') && s.get(k + 1) == Some(&b':');
        if path_follows && id == "crate" {
            i = paths_at(s, k + 2, Vec::new(), &mut paths);
        } else if path_follows && id == "super" {
            let base = if i > tests_at { own.clone() } else { parent.clone() };
            i = paths_at(s, k + 2, base, &mut paths);
        } else if path_follows && children.contains(&id) {
            // `use initiator::UcxRail;` in `ucx/mod.rs`: a path through a submodule.
            i = paths_at(s, k + 2, [own.clone(), vec![id]].concat(), &mut paths);
        } else {
            i = j;
        }
    }
    let mut refs = BTreeSet::new();
    for p in paths {
        // The longest prefix that is a module of the crate.
        let node = (1..=p.len()).rev().map(|n| p[..n].join("::")).find(|m| known.contains(m));
        if let Some(node) = node {
            let descendant = module.is_empty() || node.starts_with(&format!("{module}::"));
            if node != module && !descendant {
                refs.insert(node);
            }
        }
    }
    refs
}

fn graph(files: &[(String, String)]) -> Graph {
    let known: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).filter(|m| !m.is_empty()).collect();
    files.iter().filter(|(m, _)| !m.is_empty()).map(|(m, code)| (m.clone(), references(m, &strip_comments(code), &known))).collect()
}

/// Every edge collapsed onto top-level modules ("transport::ucx::target" -> "transport").
fn collapse(g: &Graph) -> Graph {
    let top = |m: &str| m.split("::").next().unwrap_or(m).to_string();
    let mut out = Graph::new();
    for (m, refs) in g {
        let e = out.entry(top(m)).or_default();
        for r in refs {
            if top(r) != top(m) {
                e.insert(top(r));
            }
        }
    }
    out
}

/// A cycle, if any: the modules around it, first repeated at the end.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(n: &str, g: &Graph, mark: &mut BTreeMap<String, Mark>, stack: &mut Vec<String>) -> Option<Vec<String>> {
        mark.insert(n.to_string(), Mark::Open);
        stack.push(n.to_string());
        for r in g.get(n).into_iter().flatten() {
            match mark.get(r.as_str()).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let at = stack.iter().position(|s| s == r).expect("on the stack");
                    let mut c = stack[at..].to_vec();
                    c.push(r.clone());
                    return Some(c);
                }
                Mark::New => {
                    if let Some(c) = visit(r, g, mark, stack) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        stack.pop();
        mark.insert(n.to_string(), Mark::Done);
        None
    }
    let mut mark = BTreeMap::new();
    for n in g.keys() {
        if mark.get(n.as_str()).copied().unwrap_or(Mark::New) == Mark::New {
            if let Some(c) = visit(n, g, &mut mark, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// Transport modules that refer to something above the seam: (module, what).
fn seam_violations(g: &Graph) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for (m, refs) in g {
        if m == "transport" || m.starts_with("transport::") {
            for r in refs {
                let top = r.split("::").next().unwrap_or(r);
                if ABOVE_THE_SEAM.contains(&top) {
                    v.push((m.clone(), r.clone()));
                }
            }
        }
    }
    v
}

fn runtime() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    assert!(files.len() > 15, "found only {} source files under {}", files.len(), src.display());
    graph(&files)
}

#[test]
fn transports_import_nothing_above_the_seam() {
    let g = runtime();
    assert!(g.contains_key("transport::tcp") && g.contains_key("transport::ucx::rails"), "{:?}", g.keys());
    // The parser sees the seam's own imports (so an empty answer below means something).
    assert!(g["transport::tcp"].contains("transport") && g["transport::tcp"].contains("net"), "{:?}", g["transport::tcp"]);
    let v = seam_violations(&g);
    assert!(v.is_empty(), "transport files import from above the seam: {v:?}");
}

#[test]
fn no_import_cycles_among_the_runtimes_modules() {
    let g = runtime();
    assert!(g["link"].contains("transport") && g["peer"].contains("link"), "{:?}", g["link"]);
    for (m, refs) in &g {
        eprintln!("{m} -> {}", refs.iter().cloned().collect::<Vec<_>>().join(", "));
    }
    if let Some(c) = find_cycle(&g) {
        panic!("import cycle among files: {}", c.join(" -> "));
    }
    if let Some(c) = find_cycle(&collapse(&g)) {
        panic!("import cycle among top-level modules: {}", c.join(" -> "));
    }
}

/// The checks find what they are for (a check that cannot fail proves nothing).
#[test]
fn the_checks_catch_a_transport_reaching_up_and_a_cycle() {
    let f = |m: &str, s: &str| (m.to_string(), s.to_string());
    let files = vec![
        f("lib", "pub mod link; pub mod transport; pub mod net;"),
        f("transport", "pub(crate) mod tcp;\nuse crate::net::dial;\n"),
        f("transport::tcp", "use super::{Host, Transport};\n// use crate::peer::Peer;\nfn f() { crate::link::LINK_CHECK; }\n"),
        f("link", "use crate::transport::{tcp::TcpRails, Host};\n/// crate::agent::Ctx in a doc comment\n"),
        f("net", "use crate::{error::Error, link::Link as L};\n"),
        f("error", "const S: &str = \"crate::agent\";\n"),
        f("agent", ""),
        f("peer", ""),
    ];
    let g = graph(&files);
    assert_eq!(g["transport::tcp"], BTreeSet::from(["transport".to_string(), "link".to_string()]));
    assert_eq!(g["link"], BTreeSet::from(["transport".to_string(), "transport::tcp".to_string()]));
    assert_eq!(g["net"], BTreeSet::from(["error".to_string(), "link".to_string()]));
    assert!(g["transport"].contains("net") && !g["transport"].contains("transport::tcp"), "{:?}", g["transport"]);
    assert_eq!(seam_violations(&g), vec![("transport::tcp".to_string(), "link".to_string())]);
    let c = find_cycle(&g).expect("cycle found");
    assert!(c.first() == c.last() && c.len() >= 3, "{c:?}");
    assert!(find_cycle(&collapse(&g)).is_some());
    // Without the upward edges there is none.
    let mut ok = g.clone();
    ok.get_mut("transport::tcp").unwrap().remove("link");
    ok.get_mut("net").unwrap().remove("link");
    assert_eq!(find_cycle(&ok), None);
    assert_eq!(find_cycle(&collapse(&ok)), None);
    // A file's inline test module sees the file itself as `super`.
    let t = references("link", "use super::x;\nmod tests { use super::*; }", &BTreeSet::from(["link".to_string(), "x".to_string()]));
    assert_eq!(t, BTreeSet::from(["x".to_string()]));
}
