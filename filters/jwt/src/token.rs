//! Parsing a compact JWS (RFC 7515) strictly: three base64url segments, JSON objects
//! without duplicate members.

use std::fmt;

use dpumesh_filter_sdk::util::base64url_decode;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::{Map, Value};

/// Why a token could not be parsed. Each maps to a fixed description (never echoing
/// attacker-controlled text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    /// Not three segments.
    Segments,
    /// A segment is not base64url.
    Base64,
    /// Header or payload is not a JSON object (or has duplicate members).
    Json,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Segments => "Jwt is not in the form of Header.Payload.Signature",
            Self::Base64 => "Jwt is not base64url encoded",
            Self::Json => "Jwt header or payload is not a JSON object",
        })
    }
}

/// A JSON object that refuses duplicate member names (RFC 7515 §5.2 says parsers MUST
/// either reject them or use the last; rejecting closes the door on confusion between
/// components that pick differently).
struct Strict(Map<String, Value>);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Strict;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
                let mut out = Map::new();
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    if out.insert(k, v).is_some() {
                        return Err(serde::de::Error::custom("duplicate member"));
                    }
                }
                Ok(Strict(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// A parsed, not yet verified token.
#[derive(Debug, Clone)]
pub struct Token<'t> {
    /// `header.payload`, the signed bytes.
    pub signing_input: &'t str,
    /// The JOSE header.
    pub header: Map<String, Value>,
    pub claims: Map<String, Value>,
    /// The payload JSON as sent.
    pub payload_json: Vec<u8>,
    /// The signature bytes.
    pub signature: Vec<u8>,
}

fn object(bytes: &[u8]) -> Result<Map<String, Value>, ParseError> {
    serde_json::from_slice::<Strict>(bytes)
        .map(|s| s.0)
        .map_err(|_| ParseError::Json)
}

/// Parses `token` strictly.
pub fn parse(token: &str) -> Result<Token<'_>, ParseError> {
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(ParseError::Segments);
    };
    if h.is_empty() || p.is_empty() {
        return Err(ParseError::Segments);
    }
    let decode = |segment: &str| {
        if segment.contains('=') {
            return Err(ParseError::Base64);
        }
        base64url_decode(segment).ok_or(ParseError::Base64)
    };
    let header = object(&decode(h)?)?;
    let payload_json = decode(p)?;
    let claims = object(&payload_json)?;
    let signature = decode(s)?;
    Ok(Token {
        signing_input: &token[..h.len() + 1 + p.len()],
        header,
        claims,
        payload_json,
        signature,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dpumesh_filter_sdk::util::base64url_encode as b64;

    fn token(header: &str, payload: &str) -> String {
        format!(
            "{}.{}.{}",
            b64(header.as_bytes()),
            b64(payload.as_bytes()),
            b64(b"sig")
        )
    }

    #[test]
    fn parses_a_well_formed_token() {
        let t = token(r#"{"alg":"HS256"}"#, r#"{"sub":"a"}"#);
        let parsed = parse(&t).unwrap();
        assert_eq!(parsed.header["alg"], "HS256");
        assert_eq!(parsed.claims["sub"], "a");
        assert_eq!(parsed.signature, b"sig");
        assert_eq!(parsed.signing_input.matches('.').count(), 1);
    }

    #[test]
    fn refuses_hostile_shapes() {
        assert_eq!(parse("a.b").unwrap_err(), ParseError::Segments);
        assert_eq!(parse("a.b.c.d").unwrap_err(), ParseError::Segments);
        assert_eq!(parse("..").unwrap_err(), ParseError::Segments);
        assert_eq!(parse("!!!.e30.c2ln").unwrap_err(), ParseError::Base64);
        assert_eq!(parse("e30=.e30.c2ln").unwrap_err(), ParseError::Base64);
        assert_eq!(
            parse(&token(r#"{"alg":"HS256"}"#, "[1,2]")).unwrap_err(),
            ParseError::Json
        );
        assert_eq!(
            parse(&token(r#"{"alg":"HS256"}"#, r#"{"sub":"a","sub":"b"}"#)).unwrap_err(),
            ParseError::Json
        );
        assert_eq!(parse(&token("null", "{}")).unwrap_err(), ParseError::Json);
    }
}
