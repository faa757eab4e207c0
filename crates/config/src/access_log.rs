//! The access log's settings: where JSON lines go, which fields they have (each a
//! template of Envoy-style command operators), and the share of requests logged.

use std::collections::BTreeMap;

use serde::Deserialize;

/// `access_log:` in the proxy config.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLogConfig {
    /// A file (relative to the config file; `{node}` is replaced by the node's name)
    /// or `-` for standard output.
    #[serde(default = "default_path")]
    pub path: String,
    /// The share of requests logged, above 0 and at most 1 (every Nth request for
    /// 1/N: the share is exact over time, not random).
    #[serde(default = "every_request")]
    pub sample: f64,
    /// Field name → template (`"%REQ(:METHOD)% %REQ(:PATH)%"`); the default is
    /// [`DEFAULT_FIELDS`].
    #[serde(default)]
    pub fields: Option<BTreeMap<String, String>>,
}

fn default_path() -> String {
    "access-{node}.log".to_owned()
}

fn every_request() -> f64 {
    1.0
}

/// The fields of a line when the config names none (Envoy's default, in JSON, with
/// the mesh's own: source, verdict, denying filter, node).
pub const DEFAULT_FIELDS: &[(&str, &str)] = &[
    ("start_time", "%START_TIME%"),
    ("method", "%REQ(:METHOD)%"),
    ("path", "%REQ(:PATH)%"),
    ("authority", "%REQ(:AUTHORITY)%"),
    ("response_code", "%RESPONSE_CODE%"),
    ("grpc_status", "%GRPC_STATUS%"),
    ("response_flags", "%RESPONSE_FLAGS%"),
    ("duration", "%DURATION%"),
    ("source", "%SOURCE%"),
    ("service", "%UPSTREAM_CLUSTER%"),
    ("route", "%ROUTE_NAME%"),
    ("upstream_host", "%UPSTREAM_HOST%"),
    ("attempts", "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"),
    ("verdict", "%VERDICT%"),
    ("denied_by", "%DENIED_BY%"),
    ("x_request_id", "%REQ(X-REQUEST-ID)%"),
    ("trace_id", "%TRACE_ID%"),
    ("user_agent", "%REQ(USER-AGENT)%"),
    ("node", "%HOSTNAME%"),
];

/// What an operator stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operator {
    /// `%START_TIME%`: RFC 3339, milliseconds, UTC.
    StartTime,
    /// `%REQ(:METHOD)%`
    Method,
    /// `%REQ(:PATH)%` (secret query values redacted)
    Path,
    /// `%REQ(:AUTHORITY)%`
    Authority,
    /// `%REQ(NAME)%`: a request header (lowercased name; a credential redacted).
    Header(String),
    /// `%RESPONSE_CODE%`
    ResponseCode,
    /// `%GRPC_STATUS%`
    GrpcStatus,
    /// `%DURATION%`: milliseconds.
    Duration,
    /// `%RESPONSE_FLAGS%`: why the mesh answered (`none`, `timeout`, ...).
    ResponseFlags,
    /// `%UPSTREAM_HOST%`
    UpstreamHost,
    /// `%UPSTREAM_CLUSTER%`: the destination service.
    UpstreamCluster,
    /// `%ROUTE_NAME%`
    RouteName,
    /// `%SOURCE%` (or Envoy's `%DOWNSTREAM_PEER_URI_SAN%`): the caller.
    Source,
    /// `%UPSTREAM_REQUEST_ATTEMPT_COUNT%`
    Attempts,
    /// `%HOSTNAME%`: the node.
    Hostname,
    /// `%TRACE_ID%`
    TraceId,
    /// `%VERDICT%`: allowed, denied, failed.
    Verdict,
    /// `%DENIED_BY%`: the filter that denied.
    DeniedBy,
    /// `%FILTER_DURATIONS%`: `name=µs` per filter.
    FilterDurations,
}

impl Operator {
    fn parse(text: &str) -> Result<Self, String> {
        if let Some(inner) = text.strip_prefix("REQ(").and_then(|t| t.strip_suffix(')')) {
            let name = inner.trim();
            return Ok(match name.to_ascii_lowercase().as_str() {
                ":method" => Self::Method,
                ":path" => Self::Path,
                ":authority" | "host" => Self::Authority,
                "" => return Err("REQ() names no header".to_owned()),
                lower if lower.starts_with(':') => {
                    return Err(format!(
                        "REQ({name}): no such pseudo-header (:METHOD, :PATH, :AUTHORITY)"
                    ));
                }
                lower => {
                    if !lower
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                    {
                        return Err(format!("REQ({name}): not a header name"));
                    }
                    Self::Header(lower.to_owned())
                }
            });
        }
        Ok(match text {
            "START_TIME" => Self::StartTime,
            "RESPONSE_CODE" => Self::ResponseCode,
            "GRPC_STATUS" => Self::GrpcStatus,
            "DURATION" => Self::Duration,
            "RESPONSE_FLAGS" => Self::ResponseFlags,
            "UPSTREAM_HOST" => Self::UpstreamHost,
            "UPSTREAM_CLUSTER" => Self::UpstreamCluster,
            "ROUTE_NAME" => Self::RouteName,
            "SOURCE" | "DOWNSTREAM_PEER_URI_SAN" => Self::Source,
            "UPSTREAM_REQUEST_ATTEMPT_COUNT" => Self::Attempts,
            "HOSTNAME" => Self::Hostname,
            "TRACE_ID" => Self::TraceId,
            "VERDICT" => Self::Verdict,
            "DENIED_BY" => Self::DeniedBy,
            "FILTER_DURATIONS" => Self::FilterDurations,
            other => return Err(format!("unknown operator %{other}%")),
        })
    }
}

/// A piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Op(Operator),
}

/// A field's value: text with operators; a template that is one operator alone gives
/// that operator's typed value (a number for `%RESPONSE_CODE%`, `null` when unset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template(pub Vec<Piece>);

impl Template {
    /// Parses `%OPERATOR%` pieces out of `text` (`%%` is a literal `%`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut rest = text;
        while let Some(at) = rest.find('%') {
            literal.push_str(&rest[..at]);
            let after = &rest[at + 1..];
            if let Some(tail) = after.strip_prefix('%') {
                literal.push('%');
                rest = tail;
                continue;
            }
            let end = after
                .find('%')
                .ok_or_else(|| format!("{text:?}: an operator is not closed with %"))?;
            if !literal.is_empty() {
                pieces.push(Piece::Text(std::mem::take(&mut literal)));
            }
            pieces.push(Piece::Op(Operator::parse(&after[..end])?));
            rest = &after[end + 1..];
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            pieces.push(Piece::Text(literal));
        }
        Ok(Self(pieces))
    }
}

impl AccessLogConfig {
    /// The checked fields, in name order.
    pub fn fields(&self) -> Result<Vec<(String, Template)>, String> {
        let parse = |name: &str, text: &str| {
            Template::parse(text).map_err(|e| format!("fields.{name}: {e}"))
        };
        match &self.fields {
            Some(fields) => {
                if fields.is_empty() {
                    return Err("fields: empty (omit it for the default fields)".to_owned());
                }
                fields
                    .iter()
                    .map(|(n, t)| Ok((n.clone(), parse(n, t)?)))
                    .collect()
            }
            None => DEFAULT_FIELDS
                .iter()
                .map(|(n, t)| Ok(((*n).to_owned(), parse(n, t)?)))
                .collect(),
        }
    }

    /// Checks everything a load checks.
    pub fn check(&self) -> Result<(), String> {
        if !(self.sample > 0.0 && self.sample <= 1.0) {
            return Err(format!(
                "sample: {} is not above 0 and at most 1",
                self.sample
            ));
        }
        if self.path.is_empty() {
            return Err("path: empty (give a file, or - for standard output)".to_owned());
        }
        self.fields().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_parse_operators_text_and_escapes() {
        let t = Template::parse("%REQ(:METHOD)% %REQ(:PATH)% 100%% %RESPONSE_CODE%").unwrap();
        assert_eq!(
            t.0,
            [
                Piece::Op(Operator::Method),
                Piece::Text(" ".into()),
                Piece::Op(Operator::Path),
                Piece::Text(" 100% ".into()),
                Piece::Op(Operator::ResponseCode),
            ]
        );
        assert_eq!(
            Template::parse("%REQ(X-Request-Id)%").unwrap().0,
            [Piece::Op(Operator::Header("x-request-id".into()))]
        );
        for bad in [
            "%NOPE%",
            "%REQ()%",
            "%REQ(:TEAPOT)%",
            "%DURATION",
            "%REQ(a b)%",
        ] {
            assert!(Template::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_default_fields_parse_and_bad_settings_are_named() {
        let c: AccessLogConfig = serde_norway::from_str("{}").unwrap();
        assert_eq!(c.fields().unwrap().len(), DEFAULT_FIELDS.len());
        c.check().unwrap();
        let c: AccessLogConfig = serde_norway::from_str("{sample: 0}").unwrap();
        assert!(c.check().unwrap_err().contains("sample"));
        let c: AccessLogConfig = serde_norway::from_str("{fields: {x: '%BOGUS%'}}").unwrap();
        assert!(c.check().unwrap_err().contains("fields.x"));
        assert!(serde_norway::from_str::<AccessLogConfig>("{colour: red}").is_err());
    }
}
