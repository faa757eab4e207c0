//! Config errors: the file, the key path and the line, for every file we read.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// A config error: where and what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub file: PathBuf,
    /// Key path, e.g. `chains.api[2]`; empty for the whole file.
    pub path: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if !self.path.is_empty() {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl ConfigError {
    /// An error about the whole of `file` (it cannot be read, say).
    pub fn file(file: &Path, message: impl Into<String>) -> Self {
        Self {
            file: file.to_owned(),
            path: String::new(),
            line: None,
            message: message.into(),
        }
    }

    /// An error at key path `path` of `file` whose text is `text` (located in it).
    pub fn at(
        file: &Path,
        text: &str,
        path: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        let path = path.into();
        Self {
            file: file.to_owned(),
            line: locate(text, &path),
            path,
            message: message.into(),
        }
    }
}

/// Parses YAML `text` (read from `file`) into `T`; an error names the key path and the
/// line.
pub fn parse_yaml<T: DeserializeOwned>(file: &Path, text: &str) -> Result<T, ConfigError> {
    let deserializer = serde_norway::Deserializer::from_str(text);
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        let inner = e.into_inner();
        let line = inner
            .location()
            .map(|l| l.line())
            .or_else(|| locate(text, &path));
        // serde_norway appends "at line N column M"; the line is reported apart.
        let mut message = inner.to_string();
        if let Some(at) = message.find(" at line ") {
            message.truncate(at);
        }
        ConfigError {
            file: file.to_owned(),
            path,
            line,
            message,
        }
    })
}

/// The 1-based line of key path `path` (`a.b[2].c`) in block-style YAML, or of its
/// nearest ancestor found. Flow collections (`[a, b]`) are located by their key.
pub fn locate(text: &str, path: &str) -> Option<usize> {
    let target = segments(path);
    if target.is_empty() {
        return None;
    }
    for len in (1..=target.len()).rev() {
        if let Some(line) = locate_exact(text, &target[..len]) {
            return Some(line);
        }
    }
    None
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

fn segments(path: &str) -> Vec<Segment> {
    let mut out = Vec::new();
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (key, mut rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            out.push(Segment::Key(key.to_owned()));
        }
        while let Some(end) = rest.find(']') {
            if let Ok(i) = rest[1..end].parse() {
                out.push(Segment::Index(i));
            }
            rest = &rest[end + 1..];
        }
    }
    out
}

fn locate_exact(text: &str, target: &[Segment]) -> Option<usize> {
    // Open nodes: (indent, path segment); sequence counters per indent.
    let mut stack: Vec<(usize, Segment)> = Vec::new();
    let mut seq_counts: Vec<(usize, usize)> = Vec::new();
    for (number, raw) in text.lines().enumerate() {
        let content = raw.trim_start();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let mut indent = raw.len() - content.len();
        let mut rest = content;
        // `- ` items, possibly `- key: value` on the same line.
        while let Some(after) = rest
            .strip_prefix("- ")
            .or(rest.strip_prefix('-').filter(|r| r.is_empty()))
        {
            stack.retain(|(i, _)| *i < indent);
            seq_counts.retain(|(i, _)| *i <= indent);
            let index = match seq_counts.iter_mut().find(|(i, _)| *i == indent) {
                Some((_, n)) => {
                    *n += 1;
                    *n
                }
                None => {
                    seq_counts.push((indent, 0));
                    0
                }
            };
            stack.push((indent, Segment::Index(index)));
            if stack.iter().map(|(_, s)| s).eq(target.iter()) {
                return Some(number + 1);
            }
            let skipped = rest.len() - after.len();
            indent += skipped + (after.len() - after.trim_start().len());
            rest = after.trim_start();
        }
        let Some(colon) = key_end(rest) else {
            continue;
        };
        let key = rest[..colon].trim().trim_matches(|c| c == '"' || c == '\'');
        stack.retain(|(i, _)| *i < indent);
        seq_counts.retain(|(i, _)| *i <= indent);
        stack.push((indent, Segment::Key(key.to_owned())));
        if stack.iter().map(|(_, s)| s).eq(target.iter()) {
            return Some(number + 1);
        }
    }
    None
}

/// Where a `key:` ends (a colon followed by a space or the end of the line).
fn key_end(line: &str) -> Option<usize> {
    let bytes = line.as_bytes();
    (0..bytes.len()).find(|&i| bytes[i] == b':' && (i + 1 == bytes.len() || bytes[i + 1] == b' '))
}
