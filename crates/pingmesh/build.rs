//! Compiles `proto/pingmesh.proto` into the gRPC client and server code (tonic +
//! prost). Needs `protoc` (Debian: protobuf-compiler; scripts/install-toolchain.sh).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/pingmesh.proto");
    tonic_prost_build::configure().compile_protos(&["proto/pingmesh.proto"], &["proto"])?;
    Ok(())
}
