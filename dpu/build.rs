//! Compiles the OPI storage API's protos (`proto/opi/storage/v1`, served by
//! `control::opi`) into prost messages and tonic servers. protox parses them, so no system
//! `protoc` is needed; the descriptor set is also written out for server reflection.

use std::path::PathBuf;

use prost::Message as _;

const PROTO_DIR: &str = "../proto/opi/storage/v1";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files: Vec<PathBuf> = std::fs::read_dir(PROTO_DIR)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|p| p.extension().is_some_and(|x| x == "proto"))
        .collect();
    println!("cargo:rerun-if-changed={PROTO_DIR}");
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [PROTO_DIR])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("opi_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .build_transport(false)
        // Methods nacred does not serve answer UNIMPLEMENTED.
        .generate_default_stubs(true)
        .compile_fds(fds)?;
    Ok(())
}
