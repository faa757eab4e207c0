//! Tokens for suites: signed by the runner from a header, claims and a private key, so
//! suites stay language-neutral data and signatures are real.

use std::collections::BTreeMap;
use std::str::FromStr;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::{Algorithm, EncodingKey};
use serde_json::Value;

use crate::suite::{Suite, TokenSpec};

/// Why a token could not be made.
#[derive(Debug, thiserror::Error)]
#[error("token {name}: {message}")]
pub struct TokenError {
    /// The token's name.
    pub name: String,
    /// What is wrong.
    pub message: String,
}

/// Makes every token of `suite` at its clock.
pub fn mint_all(suite: &Suite) -> Result<BTreeMap<String, String>, TokenError> {
    suite
        .tokens
        .iter()
        .map(|(name, spec)| {
            mint(suite, spec)
                .map(|t| (name.clone(), t))
                .map_err(|message| TokenError {
                    name: name.clone(),
                    message,
                })
        })
        .collect()
}

fn relative_time(value: &Value, now: u64) -> Value {
    let Some(text) = value.as_str() else {
        return value.clone();
    };
    let offset = if text == "now" {
        Some(0i64)
    } else if let Some(n) = text.strip_prefix("now+") {
        n.parse::<i64>().ok()
    } else if let Some(n) = text.strip_prefix("now-") {
        n.parse::<i64>().ok().map(|n| -n)
    } else {
        None
    };
    match offset {
        Some(offset) => Value::from(now as i64 + offset),
        None => value.clone(),
    }
}

fn mint(suite: &Suite, spec: &TokenSpec) -> Result<String, String> {
    if let Some(raw) = &spec.raw {
        return Ok(raw.clone());
    }
    let alg_name = spec
        .alg
        .clone()
        .ok_or("alg is required unless raw is given")?;
    let mut header = serde_json::Map::new();
    header.insert("alg".into(), Value::from(alg_name.clone()));
    header.insert("typ".into(), Value::from("JWT"));
    for (k, v) in &spec.header {
        if v.is_null() {
            header.remove(k);
        } else {
            header.insert(k.clone(), v.clone());
        }
    }
    let mut claims: serde_json::Map<String, Value> = spec
        .claims
        .iter()
        .map(|(k, v)| (k.clone(), relative_time(v, suite.clock)))
        .collect();
    if spec.pad_claim_bytes > 0 {
        claims.insert("pad".into(), Value::from("x".repeat(spec.pad_claim_bytes)));
    }
    let header_b64 = URL_SAFE_NO_PAD.encode(Value::Object(header).to_string());
    let signing_input = format!(
        "{header_b64}.{}",
        URL_SAFE_NO_PAD.encode(Value::Object(claims.clone()).to_string())
    );
    if alg_name == "none" {
        return Ok(format!("{signing_input}."));
    }
    let signature = if alg_name == "ES512" {
        // jsonwebtoken has no ES512: signed with RustCrypto's p521 (r ‖ s, RFC 7518).
        let file = spec.key_file.as_ref().ok_or("ES512 needs a key_file")?;
        URL_SAFE_NO_PAD.encode(sign_es512(&suite.resolve(file), signing_input.as_bytes())?)
    } else {
        sign_with_jsonwebtoken(suite, spec, &alg_name, &signing_input)?
    };
    if spec.tamper {
        claims.insert("tampered".into(), Value::from(true));
        let payload = URL_SAFE_NO_PAD.encode(Value::Object(claims).to_string());
        return Ok(format!("{header_b64}.{payload}.{signature}"));
    }
    Ok(format!("{signing_input}.{signature}"))
}

/// The signature (base64url) of `signing_input` by jsonwebtoken.
fn sign_with_jsonwebtoken(
    suite: &Suite,
    spec: &TokenSpec,
    alg_name: &str,
    signing_input: &str,
) -> Result<String, String> {
    let alg = Algorithm::from_str(alg_name).map_err(|e| format!("alg {alg_name}: {e}"))?;
    let key = match (&spec.secret, &spec.key_file) {
        (Some(secret), _) => EncodingKey::from_secret(secret.as_bytes()),
        (None, Some(file)) => {
            let path = suite.resolve(file);
            let pem = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let parsed = match alg {
                Algorithm::RS256
                | Algorithm::RS384
                | Algorithm::RS512
                | Algorithm::PS256
                | Algorithm::PS384
                | Algorithm::PS512 => EncodingKey::from_rsa_pem(&pem),
                Algorithm::ES256 | Algorithm::ES384 => EncodingKey::from_ec_pem(&pem),
                Algorithm::EdDSA => EncodingKey::from_ed_pem(&pem),
                _ => return Err(format!("{alg_name} needs a secret, not a key file")),
            };
            parsed.map_err(|e| format!("{}: {e}", path.display()))?
        }
        (None, None) => return Err("secret or key_file is required".to_owned()),
    };
    jsonwebtoken::crypto::sign(signing_input.as_bytes(), &key, alg)
        .map_err(|e| format!("signing: {e}"))
}

/// An ES512 signature over `message` with the P-521 PKCS#8 key in `path`.
fn sign_es512(path: &std::path::Path, message: &[u8]) -> Result<Vec<u8>, String> {
    use p521::ecdsa::signature::Signer as _;
    use p521::pkcs8::DecodePrivateKey as _;
    let pem = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let secret = p521::SecretKey::from_pkcs8_pem(&pem)
        .map_err(|e| format!("{}: not a P-521 key: {e}", path.display()))?;
    let key = p521::ecdsa::SigningKey::from_bytes(&secret.to_bytes())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let signature: p521::ecdsa::Signature = key.sign(message);
    Ok(signature.to_vec())
}

/// Replaces every `${token.NAME}` in `text`.
pub fn substitute(text: &str, tokens: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${token.") {
        out.push_str(&rest[..start]);
        let after = &rest[start + "${token.".len()..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("unterminated ${{token.…}} in {text:?}"))?;
        let name = &after[..end];
        let token = tokens
            .get(name)
            .ok_or_else(|| format!("no token named {name:?}"))?;
        out.push_str(token);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn substitution_replaces_every_reference() {
        let tokens = BTreeMap::from([("a".to_owned(), "AAA".to_owned())]);
        assert_eq!(
            substitute("Bearer ${token.a} ${token.a}!", &tokens).unwrap(),
            "Bearer AAA AAA!"
        );
        assert!(
            substitute("${token.b}", &tokens)
                .unwrap_err()
                .contains("\"b\"")
        );
        assert!(substitute("${token.a", &tokens).is_err());
    }

    #[test]
    fn relative_times_follow_the_clock() {
        assert_eq!(relative_time(&Value::from("now+60"), 100), Value::from(160));
        assert_eq!(relative_time(&Value::from("now-60"), 100), Value::from(40));
        assert_eq!(
            relative_time(&Value::from("later"), 100),
            Value::from("later")
        );
    }
}
