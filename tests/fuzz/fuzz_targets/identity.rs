//! What a peer's certificate and a pod's registration carry, as the mesh reads them:
//! any DER a peer presents (`spiffe_of`), any SPIFFE URI in it, any registration
//! token. Never a panic; a URI that parses prints back to itself; no token but the
//! right one proves a service.
#![no_main]

use dpumesh_identity::registration::RegistrationKey;
use dpumesh_identity::{SpiffeId, spiffe_of};
use libfuzzer_sys::fuzz_target;
use rustls::pki_types::CertificateDer;

fn key() -> &'static (RegistrationKey, String) {
    static KEY: std::sync::OnceLock<(RegistrationKey, String)> = std::sync::OnceLock::new();
    KEY.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("dpumesh-fuzz-key-{}", std::process::id()));
        let key = RegistrationKey::load_or_create(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let token = key.token("frontend");
        (key, token)
    })
}

fuzz_target!(|data: &[u8]| {
    let _ = spiffe_of(&CertificateDer::from(data));
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(id) = SpiffeId::parse(text) {
            assert_eq!(id.to_string(), text);
        }
        // Compared with the token only once it verified: comparing every input with
        // it would hand libFuzzer the token (it learns the operands of string
        // comparisons), which a first version of this target did.
        let (key, token) = key();
        if key.verify("frontend", text) {
            assert_eq!(
                &text.to_ascii_lowercase(),
                token,
                "only the token proves a service"
            );
        }
    }
});
