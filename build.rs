//! Generates include/kvstage.h with cbindgen and sets the shared library's SONAME.

use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets the version");
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").expect("cargo sets the version");
    let patch = std::env::var("CARGO_PKG_VERSION_PATCH").expect("cargo sets the version");

    // 0.x: a minor release may break the ABI, so the SONAME carries it (libkvstage.so.0.2);
    // from 1.0 on, the major alone (libkvstage.so.1). CMakeLists.txt and the Python loader agree.
    let soversion = if major == "0" { format!("0.{minor}") } else { major.clone() };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvstage.so.{soversion}");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");

    let mut config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml is valid");
    // The version macros come from Cargo.toml, the one version source.
    config.after_includes = Some(format!(
        "\n#define KVSTAGE_VERSION_MAJOR {major}\n#define KVSTAGE_VERSION_MINOR {minor}\n\
         #define KVSTAGE_VERSION_PATCH {patch}\n#define KVSTAGE_VERSION_STRING \"{major}.{minor}.{patch}\"\n\
         #define KVSTAGE_VERSION ((KVSTAGE_VERSION_MAJOR << 16) | (KVSTAGE_VERSION_MINOR << 8) | KVSTAGE_VERSION_PATCH)\n"
    ));
    let bindings = cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen could not generate the header");
    let header = crate_dir.join("include").join("kvstage.h");
    // write() leaves the file untouched when the content is unchanged, so builds stay incremental.
    bindings.write_to_file(header);
}
