//! The runtime's modules stand in layers (docs/architecture.md): a module names only
//! modules below it, so a WIT or ABI change cannot ripple back up and no import circle
//! forms. This reads every `crate::…` path in the crate's sources (tests and comments
//! left out) and fails on one that points up or sideways.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// From the ground up. A module may name those before it; submodules of one module
/// may name each other. `fusion::driver` (the driver's text and `enter-filter`) sits
/// with the ABI paths, under the engine that links it; the rest of `fusion` composes
/// instances and sits above them.
const LAYERS: &[&str] = &[
    "error",
    "stamp",
    "timing",
    "stderr",
    "limits",
    "epoch",
    "budget",
    "health",
    "input",
    "callout",
    "artifacts",
    "queues",
    "bindings",
    "imports",
    "call",
    "canon",
    "proxywasm",
    "fusion::driver",
    "runtime",
    "filter",
    "instance",
    "fusion",
    "chain",
    "generation",
    "local",
    "worker",
];

/// The layer module `path` (a `crate::` path or a file's module path) belongs to.
fn layer_of(path: &str) -> Option<(usize, &'static str)> {
    LAYERS
        .iter()
        .enumerate()
        .filter(|(_, m)| path == **m || path.starts_with(&format!("{m}::")))
        .max_by_key(|(_, m)| m.len())
        .map(|(i, m)| (i, *m))
}

/// `src/a/b.rs` → `a::b`; `src/a/mod.rs` → `a`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable").flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its unit tests and comments.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every module path a file names: `crate::a::b` and `use crate::{a, b::{c, d}}`
/// (groups nested to any depth).
fn named(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if rest.starts_with('{') {
            let (group, after) = braced(rest);
            expand("", group, &mut out);
            rest = after;
            continue;
        }
        out.push(ident_path(rest).trim_end_matches(':').to_owned());
    }
    out
}

/// The leading `a::b::c` of `text`.
fn ident_path(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(text.len());
    &text[..end]
}

/// `{…}` at the start of `text`: what is inside, and what follows the closing brace.
fn braced(text: &str) -> (&str, &str) {
    let mut depth = 0;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return (&text[1..i], &text[i + 1..]);
                }
            }
            _ => {}
        }
    }
    (&text[1..], "")
}

/// The paths of a use group's items, each under `prefix`.
fn expand(prefix: &str, group: &str, out: &mut Vec<String>) {
    let mut depth = 0;
    let mut start = 0;
    let mut items = Vec::new();
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    for item in items.into_iter().map(str::trim).filter(|i| !i.is_empty()) {
        let head = ident_path(item);
        let full = format!("{prefix}{head}");
        match item[head.len()..].trim_start().strip_prefix('{') {
            Some(_) => {
                let (inner, _) = braced(item[head.len()..].trim_start());
                expand(&full, inner, out);
            }
            None => out.push(full.trim_end_matches(':').to_owned()),
        }
    }
}

#[test]
fn every_module_names_only_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut wrong: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut unplaced = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        if module == "lib" {
            continue;
        }
        let Some((mine, my_layer)) = layer_of(&module) else {
            unplaced.push(module);
            continue;
        };
        let text = std::fs::read_to_string(file).expect("readable");
        for path in named(&code(&text)) {
            // `crate::Name`: a re-export of lib.rs, which names no layer.
            let Some((theirs, their_layer)) = layer_of(&path) else {
                continue;
            };
            if their_layer != my_layer && theirs > mine {
                wrong.entry(module.clone()).or_default().push(path);
            }
        }
    }
    assert!(
        unplaced.is_empty(),
        "modules in no layer (add them to LAYERS): {unplaced:?}"
    );
    assert!(
        wrong.is_empty(),
        "modules naming a layer above their own: {wrong:#?}"
    );
}

#[test]
fn the_check_sees_a_path_that_points_up() {
    let code = code("use crate::{chain::ChainRunner, error::LoadError};\n// crate::worker\n");
    assert_eq!(named(&code), ["chain::ChainRunner", "error::LoadError"]);
    // A nested group does not hide what follows it.
    let nested = self::code("use crate::{bindings::{self, Verdict}, worker::WorkerPool};\n");
    assert_eq!(
        named(&nested),
        ["bindings::self", "bindings::Verdict", "worker::WorkerPool"]
    );
    assert_eq!(
        layer_of("fusion::driver::ENTER").map(|l| l.1),
        Some("fusion::driver")
    );
    assert_eq!(layer_of("fusion::instance").map(|l| l.1), Some("fusion"));
    assert!(layer_of("chain").unwrap().0 > layer_of("instance").unwrap().0);
}
