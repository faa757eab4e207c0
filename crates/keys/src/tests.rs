use jsonwebtoken::EncodingKey;
use test_case::test_case;

use super::*;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/keys");

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{name}")).expect("fixture present")
}

fn jwks() -> KeySet {
    let json = String::from_utf8(fixture("jwks.json")).unwrap();
    KeySet::from_jwks(&json).expect("fixture JWKS loads")
}

fn encoding_key(alg: Algorithm) -> EncodingKey {
    match alg.key_kind() {
        KeyKind::Secret => EncodingKey::from_secret(b"dpumesh-test-secret-0123456789abcdef"),
        KeyKind::Rsa => EncodingKey::from_rsa_pem(&fixture("rsa.pem")).unwrap(),
        KeyKind::P256 => EncodingKey::from_ec_pem(&fixture("p256.pem")).unwrap(),
        KeyKind::P384 => EncodingKey::from_ec_pem(&fixture("p384.pem")).unwrap(),
        KeyKind::P521 => unreachable!("ES512 is signed with p521 (see sign)"),
        KeyKind::Ed25519 => EncodingKey::from_ed_pem(&fixture("ed25519.pem")).unwrap(),
    }
}

/// An ES512 signature (r ‖ s) with the P-521 fixture key.
fn sign_es512(message: &[u8]) -> Vec<u8> {
    use p521::ecdsa::signature::Signer as _;
    use p521::pkcs8::DecodePrivateKey as _;
    let pem = String::from_utf8(fixture("p521.pem")).unwrap();
    let secret = p521::SecretKey::from_pkcs8_pem(&pem).unwrap();
    let key = p521::ecdsa::SigningKey::from_bytes(&secret.to_bytes()).unwrap();
    let sig: p521::ecdsa::Signature = key.sign(message);
    sig.to_vec()
}

fn sign(alg: Algorithm, message: &[u8]) -> Vec<u8> {
    use base64::Engine as _;
    if alg == Algorithm::Es512 {
        return sign_es512(message);
    }
    let sig = jsonwebtoken::crypto::sign(message, &encoding_key(alg), to_jwt(alg)).unwrap();
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(sig)
        .unwrap()
}

#[test_case(Algorithm::Hs256, "hs-1")]
#[test_case(Algorithm::Hs384, "hs-1")]
#[test_case(Algorithm::Hs512, "hs-1")]
#[test_case(Algorithm::Rs256, "rsa-1")]
#[test_case(Algorithm::Rs384, "rsa-1")]
#[test_case(Algorithm::Rs512, "rsa-1")]
#[test_case(Algorithm::Ps256, "rsa-1")]
#[test_case(Algorithm::Ps384, "rsa-1")]
#[test_case(Algorithm::Ps512, "rsa-1")]
#[test_case(Algorithm::Es256, "ec-p256")]
#[test_case(Algorithm::Es384, "ec-p384")]
#[test_case(Algorithm::Es512, "ec-p521")]
#[test_case(Algorithm::EdDsa, "ed-1")]
fn every_algorithm_verifies_with_and_without_kid(alg: Algorithm, kid: &str) {
    let set = jwks();
    let message = b"header.payload";
    let sig = sign(alg, message);
    assert_eq!(
        set.verify(alg, Some(kid), message, &sig),
        Ok(kid.to_owned())
    );
    // Without a kid, every key of the right kind is tried.
    assert_eq!(set.verify(alg, None, message, &sig), Ok(kid.to_owned()));
    // A changed message does not verify.
    assert_eq!(
        set.verify(alg, Some(kid), b"header.payloaX", &sig),
        Err(VerifyError::InvalidSignature)
    );
    assert_eq!(
        set.verify(alg, None, b"header.payloaX", &sig),
        Err(VerifyError::InvalidSignature)
    );
}

#[test]
fn hs256_with_an_rsa_public_key_is_rejected_by_construction() {
    // The classic confusion attack: sign HS256 with the RSA public key's bytes as the
    // secret and present it under the RSA key's kid.
    let set = jwks();
    let sig = sign(Algorithm::Hs256, b"m");
    assert_eq!(
        set.verify(Algorithm::Hs256, Some("rsa-1"), b"m", &sig),
        Err(VerifyError::KeyAlgorithmMismatch)
    );
    assert_eq!(
        set.verify(Algorithm::Es256, Some("ec-p384"), b"m", &sig),
        Err(VerifyError::KeyAlgorithmMismatch)
    );
}

#[test]
fn unknown_kid_and_unknown_set() {
    let set = jwks();
    assert_eq!(
        set.verify(Algorithm::Rs256, Some("nope"), b"m", b"s"),
        Err(VerifyError::UnknownKey)
    );
    let store = KeyStore::new();
    assert_eq!(
        store.verify(Algorithm::Rs256, "missing", None, b"m", b"s"),
        Err(VerifyError::UnknownKeySet)
    );
}

#[test]
fn no_fitting_key_is_a_mismatch() {
    let set = KeySet::from_secret(Some("only"), b"secret");
    assert_eq!(
        set.verify(Algorithm::Rs256, None, b"m", b"s"),
        Err(VerifyError::KeyAlgorithmMismatch)
    );
}

#[test]
fn garbage_signatures_are_invalid_not_panics() {
    let set = jwks();
    for alg in Algorithm::ALL {
        for sig in [&b""[..], b"x", &[0u8; 64], &[0xff; 512]] {
            let got = set.verify(alg, None, b"m", sig);
            assert_eq!(got, Err(VerifyError::InvalidSignature), "{alg}");
        }
    }
}

#[test]
fn jwk_alg_restricts_the_key() {
    let json = r#"{"keys":[{"kty":"oct","kid":"k","alg":"HS512","k":"c2VjcmV0"}]}"#;
    let set = KeySet::from_jwks(json).unwrap();
    let sig = {
        use base64::Engine as _;
        let s = jsonwebtoken::crypto::sign(
            b"m",
            &EncodingKey::from_secret(b"secret"),
            jsonwebtoken::Algorithm::HS256,
        )
        .unwrap();
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .unwrap()
    };
    assert_eq!(
        set.verify(Algorithm::Hs256, Some("k"), b"m", &sig),
        Err(VerifyError::KeyAlgorithmMismatch)
    );
}

#[test]
fn bad_keys_are_skipped_by_name_and_only_an_unusable_set_fails() {
    let err = KeySet::from_jwks("{").unwrap_err();
    assert!(
        err.to_string().starts_with("not a JSON Web Key Set"),
        "{err}"
    );
    // One good key among bad ones: the set loads, each bad key named with why.
    let good = r#"{"kty":"oct","kid":"good","k":"c2VjcmV0"}"#;
    let doc = format!(
        r#"{{"keys":[{{"kty":"RSA","kid":"a","n":"!!!","e":"AQAB"}},{good},{{"kty":"oct","alg":"RS256","k":"c2VjcmV0"}},{{"kty":"EC","kid":"short","crv":"P-521","x":"AQAB","y":"AQAB"}},{{"kty":"RSA","use":"enc","n":"AQAB","e":"AQAB"}},{{"kty":"oct","kid":"weird","alg":"HS999","k":"c2VjcmV0"}}]}}"#
    );
    let set = KeySet::from_jwks(&doc).unwrap();
    assert_eq!(set.len(), 1);
    let skipped = set.skipped().join("\n");
    assert_eq!(set.skipped().len(), 5, "{skipped}");
    assert!(skipped.contains("key #0 (kid \"a\")"), "{skipped}");
    assert!(
        skipped.contains("key #2: alg RS256 does not fit"),
        "{skipped}"
    );
    assert!(
        skipped.contains("key #3 (kid \"short\"): a P-521 coordinate is 66 bytes"),
        "{skipped}"
    );
    assert!(skipped.contains("key #4: an encryption key"), "{skipped}");
    assert!(
        skipped.contains("key #5 (kid \"weird\"): not a signature algorithm"),
        "{skipped}"
    );
    // Nothing usable: an error naming every key and why.
    let err = KeySet::from_jwks(r#"{"keys":[{"kty":"RSA","kid":"a","n":"!!!","e":"AQAB"},{"kty":"RSA","use":"enc","n":"AQAB","e":"AQAB"}]}"#)
        .unwrap_err();
    assert!(
        matches!(&err, KeySetError::NoUsableKeys { skipped } if skipped.len() == 2),
        "{err}"
    );
    assert!(err.to_string().contains("key #0 (kid \"a\")"), "{err}");
    assert!(
        err.to_string().contains("key #1: an encryption key"),
        "{err}"
    );
}

#[test]
fn keys_without_a_kid_are_tried_for_any_token() {
    // An IdP whose JWKS leaves out `kid` while its tokens carry one (Envoy accepts).
    let full = jwks();
    let rsa = serde_json::from_slice::<serde_json::Value>(&fixture("jwks.json")).unwrap()["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["kid"] == "rsa-1")
        .unwrap()
        .clone();
    let mut kidless = rsa.clone();
    kidless.as_object_mut().unwrap().remove("kid");
    let doc =
        serde_json::json!({"keys": [{"kty": "oct", "kid": "other", "k": "c2VjcmV0"}, kidless]});
    let set = KeySet::from_jwks(&doc.to_string()).unwrap();
    let sig = sign(Algorithm::Rs256, b"m");
    assert_eq!(
        set.verify(Algorithm::Rs256, Some("rotated-7"), b"m", &sig),
        Ok(String::new())
    );
    assert_eq!(
        set.verify(Algorithm::Rs256, None, b"m", &sig),
        Ok(String::new())
    );
    assert_eq!(
        set.verify(Algorithm::Rs256, Some("rotated-7"), b"x", &sig),
        Err(VerifyError::InvalidSignature)
    );
    // A key whose kid is another one's is still never tried.
    assert_eq!(
        set.verify(Algorithm::Hs256, Some("rotated-7"), b"m", &sig),
        Err(VerifyError::KeyAlgorithmMismatch)
    );
    assert_eq!(
        full.verify(Algorithm::Rs256, Some("ec-p256"), b"m", &sig),
        Err(VerifyError::KeyAlgorithmMismatch)
    );
}

#[test]
fn store_replacement_bumps_versions_and_keeps_readers_consistent() {
    let store = KeyStore::new();
    store.insert("a", KeySet::from_secret(Some("k"), b"one"));
    let v1 = store.version("a");
    assert!(v1 > 0);
    let sig_one = {
        use base64::Engine as _;
        let s = jsonwebtoken::crypto::sign(
            b"m",
            &EncodingKey::from_secret(b"one"),
            jsonwebtoken::Algorithm::HS256,
        )
        .unwrap();
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .unwrap()
    };
    assert!(
        store
            .verify(Algorithm::Hs256, "a", None, b"m", &sig_one)
            .is_ok()
    );
    store.replace_all([("a".to_owned(), KeySet::from_secret(Some("k"), b"two"))]);
    assert!(store.version("a") > v1);
    assert_eq!(
        store.verify(Algorithm::Hs256, "a", None, b"m", &sig_one),
        Err(VerifyError::InvalidSignature)
    );
    assert_eq!(store.version("b"), 0);
    assert_eq!(store.names(), vec!["a".to_owned()]);
}

#[test]
fn algorithm_names_round_trip() {
    for alg in Algorithm::ALL {
        assert_eq!(alg.name().parse::<Algorithm>(), Ok(alg));
    }
    assert!("none".parse::<Algorithm>().is_err());
}

proptest::proptest! {
    /// Arbitrary documents load or fail with an error, never panic.
    #[test]
    fn arbitrary_documents_never_panic(doc in ".{0,200}") {
        let _ = KeySet::from_jwks(&doc);
    }

    /// Keys with arbitrary parameters are refused or usable, never a panic later.
    #[test]
    fn arbitrary_key_parameters_never_panic(
        kty in "(RSA|EC|OKP|oct|xx)",
        crv in "(P-256|P-384|P-521|Ed25519|X25519)",
        x in "[A-Za-z0-9_-]{0,60}",
        y in "[A-Za-z0-9_-]{0,60}",
        sig in proptest::collection::vec(proptest::num::u8::ANY, 0..80),
    ) {
        let doc = serde_json::json!({"keys": [{"kty": kty, "crv": crv, "x": x, "y": y, "n": x, "e": "AQAB", "k": y}]});
        if let Ok(set) = KeySet::from_jwks(&doc.to_string()) {
            for alg in Algorithm::ALL {
                let _ = set.verify(alg, None, b"m", &sig);
            }
        }
    }
}
