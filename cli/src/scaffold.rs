//! `dpumesh filter new` and `dpumesh filter build`: a filter project from a template,
//! and the project built into a component and a precompiled `.cwasm`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use dpumesh_runtime::{Runtime, RuntimeConfig};

use crate::progress::Step;

/// Languages a project can be written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    /// Rust with the `dpumesh-filter-sdk` crate.
    Rust,
    /// Python, componentized by componentize-py.
    Python,
    /// JavaScript, componentized by ComponentizeJS.
    Js,
    /// C, compiled by clang for wasm32-wasi and componentized in-process.
    C,
}

impl Lang {
    /// The language of the project in `dir`, by its marker file.
    fn detect(dir: &Path) -> Option<Self> {
        if dir.join("Cargo.toml").is_file() {
            Some(Self::Rust)
        } else if dir.join("app.py").is_file() {
            Some(Self::Python)
        } else if dir.join("filter.js").is_file() {
            Some(Self::Js)
        } else if dir.join("filter.c").is_file() {
            Some(Self::C)
        } else {
            None
        }
    }
}

/// The WIT contract this binary serves, handed to guest toolchains.
const WIT: &str = include_str!("../../wit/filter.wit");

const COMPONENTIZE_PY: &str = "componentize-py==0.25.1";
const COMPONENTIZE_JS: &str = "@bytecodealliance/componentize-js@0.23";
/// Runs ComponentizeJS through its JS API (its CLI fails on file access here).
const COMPONENTIZE_MJS: &str = include_str!("../templates/js/componentize.mjs");

/// The sample policy's suite, shared by every language's template and sample.
const SUITE: &str = include_str!("../../samples/filters/apikey.suite.yaml");

const RUST_FILES: &[(&str, &str)] = &[
    (
        "Cargo.toml",
        include_str!("../templates/rust/Cargo.toml.tmpl"),
    ),
    (
        "rust-toolchain.toml",
        include_str!("../templates/rust/rust-toolchain.toml.tmpl"),
    ),
    (
        ".gitignore",
        include_str!("../templates/rust/gitignore.tmpl"),
    ),
    (
        "README.md",
        include_str!("../templates/rust/README.md.tmpl"),
    ),
    // The Rust sample is the template: the scaffold and the sample cannot drift.
    (
        "src/lib.rs",
        include_str!("../../samples/filters/rust/src/lib.rs"),
    ),
];

const PYTHON_FILES: &[(&str, &str)] = &[
    (
        ".gitignore",
        include_str!("../templates/python/gitignore.tmpl"),
    ),
    (
        "README.md",
        include_str!("../templates/python/README.md.tmpl"),
    ),
    // The Python sample is the template.
    (
        "app.py",
        include_str!("../../samples/filters/python/app.py"),
    ),
];

const JS_FILES: &[(&str, &str)] = &[
    (".gitignore", include_str!("../templates/js/gitignore.tmpl")),
    ("README.md", include_str!("../templates/js/README.md.tmpl")),
    // The JavaScript sample is the template.
    (
        "filter.js",
        include_str!("../../samples/filters/js/filter.js"),
    ),
];

const C_FILES: &[(&str, &str)] = &[
    (".gitignore", include_str!("../templates/c/gitignore.tmpl")),
    ("README.md", include_str!("../templates/c/README.md.tmpl")),
    // The C sample is the template.
    ("filter.c", include_str!("../../samples/filters/c/filter.c")),
];

const C_PACKAGES: &str = "clang lld wasi-libc libclang-rt-14-dev-wasm32";

/// Where `install-toolchain.sh` puts ComponentizeJS: `$DPUMESH_JS_TOOLS`, else
/// `$XDG_CACHE_HOME/dpumesh/js-tools`, else `~/.cache/dpumesh/js-tools`.
fn js_tools() -> PathBuf {
    if let Some(dir) = std::env::var_os("DPUMESH_JS_TOOLS") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("."));
    cache.join("dpumesh").join("js-tools")
}

/// The SDK next to the sources this binary was built from.
fn default_sdk() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../sdk")
}

/// Package names: lower-case ASCII letters, digits, `-` and `_`, starting with a letter.
fn check_name(name: &str) -> Result<()> {
    let ok = name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !ok {
        bail!(
            "{name:?} is not a valid filter name: use lower-case letters, digits, - and _, starting with a letter"
        );
    }
    Ok(())
}

/// Creates project `name` in `parent/name`.
pub fn new(name: &str, lang: Lang, parent: &Path, sdk: Option<&Path>) -> Result<PathBuf> {
    check_name(name)?;
    let dir = parent.join(name);
    if dir.exists() {
        bail!("{} already exists", dir.display());
    }
    let sdk = match lang {
        Lang::Rust => {
            let sdk = sdk.map_or_else(default_sdk, Path::to_path_buf);
            sdk.canonicalize().with_context(|| {
                format!("the filter SDK is not at {} (pass --sdk)", sdk.display())
            })?
        }
        Lang::Python | Lang::Js | Lang::C => PathBuf::new(),
    };
    let files = match lang {
        Lang::Rust => RUST_FILES,
        Lang::Python => PYTHON_FILES,
        Lang::Js => JS_FILES,
        Lang::C => C_FILES,
    };
    for (path, text) in files {
        let text = text
            .replace("{{name}}", name)
            .replace("{{sdk}}", &sdk.display().to_string())
            .replace("dpumesh-sample-apikey", name);
        write(&dir.join(path), &text)?;
    }
    let suite = SUITE.replacen("suite: apikey", &format!("suite: {name}"), 1);
    write(&dir.join("suite.yaml"), &suite)?;
    Ok(dir)
}

fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The package name in a Cargo manifest's `[package]` section.
fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package
            && let Some(value) = line.strip_prefix("name")
            && let Some(value) = value.trim_start().strip_prefix('=')
        {
            return Some(value.trim().trim_matches('"').to_owned());
        }
    }
    None
}

/// Builds the project in `dir` into `dir/build/NAME.wasm` and `NAME.cwasm`; returns
/// the component's path.
pub fn build(dir: &Path) -> Result<PathBuf> {
    let Some(lang) = Lang::detect(dir) else {
        bail!(
            "{} is not a filter project: no Cargo.toml (Rust), app.py (Python), filter.js (JavaScript) or filter.c (C); create one with `dpumesh filter new NAME --lang LANG`",
            dir.display()
        );
    };
    // Absolute: guest toolchains run in the project directory.
    let out = std::path::absolute(dir.join("build"))?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let started = Instant::now();
    let (name, bytes) = match lang {
        Lang::Rust => build_rust(dir)?,
        Lang::Python => build_python(dir, &out)?,
        Lang::Js => build_js(dir, &out)?,
        Lang::C => build_c(dir, &out)?,
    };
    let compiled = started.elapsed();
    let component = out.join(format!("{name}.wasm"));
    std::fs::write(&component, &bytes)?;

    let started = Instant::now();
    let progress = Step::start("precompiling for this machine's engine");
    let runtime = Runtime::new(RuntimeConfig::default())?;
    let precompiled = runtime.precompile(&name, &bytes)?;
    let cwasm = out.join(format!("{name}.cwasm"));
    std::fs::write(&cwasm, &precompiled)?;
    progress.finish("precompiled for this machine's engine");
    println!(
        "  {} ({:.1} KiB, built in {:.1} s)\n  {} ({:.1} KiB, precompiled in {:.0} ms)",
        component.display(),
        bytes.len() as f64 / 1024.0,
        compiled.as_secs_f64(),
        cwasm.display(),
        precompiled.len() as f64 / 1024.0,
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(component)
}

fn build_rust(dir: &Path) -> Result<(String, Vec<u8>)> {
    let manifest = dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)?;
    let name = package_name(&text)
        .with_context(|| format!("no [package] name in {}", manifest.display()))?;
    let what = format!("building {name} (Rust) for wasm32-wasip2");
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cargo
        .current_dir(dir)
        .args(["build", "--release", "--target", "wasm32-wasip2"]);
    // A cargo running us (tests, xtasks) must not pass its own settings on.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_MAKEFLAGS",
    ] {
        cargo.env_remove(var);
    }
    run(
        &what,
        &mut cargo,
        "cargo",
        "install Rust with ./scripts/install-toolchain.sh",
        "cargo build",
        dir,
        "; if the target is missing: rustup target add wasm32-wasip2",
    )?;
    let target_dir = cargo_target_dir(dir)?;
    let artifact = target_dir
        .join("wasm32-wasip2/release")
        .join(format!("{}.wasm", name.replace('-', "_")));
    let bytes = std::fs::read(&artifact)
        .with_context(|| format!("cargo built no component at {}", artifact.display()))?;
    Ok((name, bytes))
}

/// Where cargo puts the project's build output: its workspace's target directory when
/// it is a workspace member, `CARGO_TARGET_DIR` or a `build.target-dir` setting when
/// those say so — cargo knows, so it is asked.
fn cargo_target_dir(dir: &Path) -> Result<PathBuf> {
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cargo.current_dir(dir).args([
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--offline",
    ]);
    let out = cargo
        .output()
        .with_context(|| format!("running cargo metadata in {}", dir.display()))?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed in {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("cargo metadata printed no JSON")?;
    meta["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("cargo metadata names no target directory")
}

/// The project's name: its directory's name.
fn dir_name(dir: &Path) -> Result<String> {
    let absolute = dir.canonicalize()?;
    absolute
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
        .with_context(|| format!("{} has no usable name", dir.display()))
}

/// The WIT folder for a guest toolchain: the project's own `wit/`, else the contract
/// this binary serves, written under `out`.
fn wit_dir(dir: &Path, out: &Path) -> Result<PathBuf> {
    if dir.join("wit").is_dir() {
        return Ok(std::path::absolute(dir.join("wit"))?);
    }
    let wit = out.join("wit");
    write(&wit.join("filter.wit"), WIT)?;
    Ok(wit)
}

fn build_js(dir: &Path, out: &Path) -> Result<(String, Vec<u8>)> {
    let name = dir_name(dir)?;
    let tools = js_tools();
    let entry = tools.join("node_modules/@bytecodealliance/componentize-js/src/componentize.js");
    if !entry.is_file() {
        bail!(
            "ComponentizeJS is not installed in {}: run ./scripts/install-toolchain.sh, or `npm install --prefix {} {COMPONENTIZE_JS}`",
            tools.display(),
            tools.display()
        );
    }
    let wit = wit_dir(dir, out)?;
    let script = out.join("componentize.mjs");
    write(&script, COMPONENTIZE_MJS)?;
    let component = out.join(format!("{name}.wasm"));
    let what = format!("building {name} (JavaScript) with ComponentizeJS");
    let mut node = Command::new("node");
    node.current_dir(dir)
        .arg(&script)
        .arg(&tools)
        .arg("filter.js")
        .arg(&wit)
        .arg(&component);
    run(
        &what,
        &mut node,
        "node",
        "install Node.js 18 or later (apt install nodejs npm)",
        "ComponentizeJS",
        dir,
        "",
    )?;
    Ok((name, read_output(&component, "ComponentizeJS")?))
}

/// C bindings for the `filter` world, generated in-process (wit-bindgen-c) into `out`.
fn c_bindings(wit: &Path, out: &Path) -> Result<()> {
    use wit_bindgen_core::wit_parser::Resolve;

    let mut resolve = Resolve::default();
    let (package, _) = resolve
        .push_dir(wit)
        .map_err(|e| anyhow::anyhow!("reading the WIT in {}: {e:#}", wit.display()))?;
    let world = resolve
        .select_world(&[package], Some("filter"))
        .map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let mut files = wit_bindgen_core::Files::default();
    wit_bindgen_c::Opts::default()
        .build()
        .generate(&mut resolve, world, &mut files)
        .map_err(|e| anyhow::anyhow!("generating C bindings: {e:#}"))?;
    for (name, contents) in files.iter() {
        std::fs::write(out.join(name), contents)?;
    }
    Ok(())
}

fn build_c(dir: &Path, out: &Path) -> Result<(String, Vec<u8>)> {
    let name = dir_name(dir)?;
    let wit = wit_dir(dir, out)?;
    let bindings = out.join("bindings");
    std::fs::create_dir_all(&bindings)?;
    c_bindings(&wit, &bindings)?;
    let core = out.join(format!("{name}.core.wasm"));
    let what = format!("building {name} (C) with clang for wasm32-wasi");
    let mut clang = Command::new("clang");
    clang
        .current_dir(dir)
        .args([
            "--target=wasm32-wasi",
            "-mexec-model=reactor",
            "-O2",
            "-Wall",
            "-Werror",
        ])
        .arg("-I")
        .arg(&bindings)
        .arg("-o")
        .arg(&core)
        .arg("filter.c")
        .arg(bindings.join("filter.c"))
        .arg(bindings.join("filter_component_type.o"));
    run(
        &what,
        &mut clang,
        "clang",
        &format!("install it with `apt-get install {C_PACKAGES}`"),
        "clang",
        dir,
        &format!("; if wasm32-wasi support is missing: apt-get install {C_PACKAGES}"),
    )?;
    let module = std::fs::read(&core)?;
    let component = wit_component::ComponentEncoder::default()
        .module(&module)
        .and_then(|e| {
            e.adapter(
                "wasi_snapshot_preview1",
                wasi_preview1_component_adapter_provider::WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER,
            )
        })
        .and_then(|e| e.validate(true).encode())
        .map_err(|e| anyhow::anyhow!("componentizing {}: {e:#}", core.display()))?;
    Ok((name, component))
}

fn build_python(dir: &Path, out: &Path) -> Result<(String, Vec<u8>)> {
    let name = dir_name(dir)?;
    let wit = wit_dir(dir, out)?;
    let component = out.join(format!("{name}.wasm"));
    let what = format!("building {name} (Python) with componentize-py");
    let mut componentize = Command::new("componentize-py");
    componentize
        .current_dir(dir)
        .arg("-d")
        .arg(&wit)
        .args(["-w", "filter", "componentize", "app", "-o"])
        .arg(&component);
    run(
        &what,
        &mut componentize,
        "componentize-py",
        &format!(
            "install it with `pip install {COMPONENTIZE_PY}` (or ./scripts/install-toolchain.sh)"
        ),
        "componentize-py",
        dir,
        "",
    )?;
    Ok((name, read_output(&component, "componentize-py")?))
}

/// Runs one toolchain step (`what`, shown with progress) for the project in `dir`: a
/// tool that cannot start names how to install it; a failing step names the project
/// and `hint`.
fn run(
    what: &str,
    cmd: &mut Command,
    tool: &str,
    install: &str,
    step: &str,
    dir: &Path,
    hint: &str,
) -> Result<()> {
    let progress = Step::start(what);
    let status = progress
        .run(cmd)
        .map_err(|e| anyhow::anyhow!("cannot run {tool} ({e}): {install}"))?;
    if !status.success() {
        bail!("{step} failed for {}{hint}", dir.display());
    }
    progress.finish(what);
    Ok(())
}

/// The component a toolchain step wrote.
fn read_output(component: &Path, step: &str) -> Result<Vec<u8>> {
    std::fs::read(component).with_context(|| format!("{step} wrote no {}", component.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_name("my-filter_2").is_ok());
        for bad in ["", "2fast", "My", "a b", "../x", "a/b"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_package_name_is_read_from_the_package_section() {
        let manifest = "[workspace]\nname = \"no\"\n[package]\nversion = \"1\"\nname = \"yes\"\n";
        assert_eq!(package_name(manifest).as_deref(), Some("yes"));
        assert_eq!(package_name("[lib]\nname = \"x\"\n"), None);
    }

    #[test]
    fn a_workspace_member_builds_into_its_workspace_target_directory() {
        let member = Path::new(env!("CARGO_MANIFEST_DIR")).join("../samples/filters/guard");
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let want = match std::env::var_os("CARGO_TARGET_DIR") {
            Some(dir) => std::path::absolute(PathBuf::from(dir)).unwrap(),
            None => workspace.canonicalize().unwrap().join("target"),
        };
        let got = cargo_target_dir(&member).unwrap();
        assert_eq!(got, want, "not the member's own target/");
        assert!(!got.starts_with(member.canonicalize().unwrap()));
    }
}
