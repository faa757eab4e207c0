//! Which rule applies to a request: first match by path prefix and method.

use crate::config::Rule;

/// The first rule matching `method` and `path`.
pub fn find<'r>(rules: &'r [Rule], method: &str, path: &str) -> Option<&'r Rule> {
    rules.iter().find(|rule| {
        path.starts_with(rule.path_prefix.as_str())
            && (rule.methods.is_empty() || rule.methods.iter().any(|m| m == method))
    })
}
