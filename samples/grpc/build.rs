//! Compiles `proto/test.proto` (gRPC's interop service) into tonic client and server
//! code. Needs `protoc` (Debian: protobuf-compiler; scripts/install-toolchain.sh).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/test.proto");
    tonic_prost_build::configure().compile_protos(&["proto/test.proto"], &["proto"])?;
    Ok(())
}
