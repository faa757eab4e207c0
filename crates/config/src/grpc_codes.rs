//! A set of gRPC status codes, written as their names (`[unavailable,
//! resource-exhausted]`, as Envoy's `retry_on` names them): the statuses a route
//! retries gRPC calls on.

use std::fmt;

use dpumesh_head::grpc::STATUS_NAMES;
use serde::{Deserialize, Deserializer};

/// gRPC status codes 0–16, one bit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GrpcCodes(u32);

impl GrpcCodes {
    /// No code.
    pub const NONE: Self = Self(0);

    /// The codes named (each one of [`STATUS_NAMES`]), or the first unknown name.
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut bits = 0;
        for name in names {
            let code = STATUS_NAMES
                .iter()
                .position(|n| *n == name)
                .ok_or_else(|| name.to_owned())?;
            bits |= 1 << code;
        }
        Ok(Self(bits))
    }

    /// Whether `code` is in the set.
    pub fn contains(self, code: u32) -> bool {
        code < 32 && self.0 & (1 << code) != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl<'de> Deserialize<'de> for GrpcCodes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let names = Vec::<String>::deserialize(d)?;
        Self::from_names(names.iter().map(String::as_str)).map_err(|unknown| {
            serde::de::Error::custom(format!(
                "unknown gRPC status {unknown:?} (one of: {})",
                STATUS_NAMES.join(", ")
            ))
        })
    }
}

impl fmt::Display for GrpcCodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = (0..STATUS_NAMES.len())
            .filter(|c| self.contains(*c as u32))
            .map(|c| STATUS_NAMES[c])
            .collect();
        write!(f, "[{}]", names.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_make_the_set_and_an_unknown_name_is_named() {
        let codes: GrpcCodes = serde_norway::from_str("[unavailable, resource-exhausted]").unwrap();
        assert!(codes.contains(14) && codes.contains(8));
        assert!(!codes.contains(0) && !codes.contains(13) && !codes.contains(40));
        assert_eq!(codes.to_string(), "[resource-exhausted, unavailable]");
        let e = serde_norway::from_str::<GrpcCodes>("[unavailible]")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"unavailible\"") && e.contains("unavailable"),
            "{e}"
        );
        assert!(GrpcCodes::default().is_empty());
    }
}
