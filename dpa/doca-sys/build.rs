//! Tells the linker where DOCA's libraries are: `$DOCA_LIB_DIR`, else the DOCA
//! package's default for the target (`/opt/mellanox/doca/lib/<arch>-linux-gnu`).

fn main() {
    println!("cargo:rerun-if-env-changed=DOCA_LIB_DIR");
    let dir = std::env::var("DOCA_LIB_DIR").unwrap_or_else(|_| {
        let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
        format!("/opt/mellanox/doca/lib/{arch}-linux-gnu")
    });
    println!("cargo:rustc-link-search=native={dir}");
}
