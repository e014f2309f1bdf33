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
    let mut text = Vec::new();
    bindings.write(&mut text);
    let text = with_sections(&String::from_utf8(text).expect("cbindgen writes UTF-8"));
    let header = crate_dir.join("include").join("kvstage.h");
    // Left untouched when unchanged, so builds stay incremental.
    if std::fs::read_to_string(&header).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&header, text).expect("include/kvstage.h is writable");
    }
}

/// The header's sections, in order: each object's functions together, named
/// `kvstage_<object>_<verb>` (a function's section is its longest matching prefix). The modules of
/// src/ffi come in this order; a function outside every section, or a section that comes back
/// after another began, fails the build.
const SECTIONS: &[(&str, &[&str])] = &[
    ("Library: version, capabilities, logging", &["kvstage_version", "kvstage_capabilities_", "kvstage_log_"]),
    ("Errors: status names and the thread's last error", &["kvstage_status_", "kvstage_error_"]),
    ("Engine: options, life, address, describe, counters, completions and events", &["kvstage_engine_"]),
    ("KV pool and components: what a rank registers, what a request names", &["kvstage_kv_layout_", "kvstage_pool_", "kvstage_component_", "kvstage_state_item_", "kvstage_request_parts_"]),
    ("Staging memory: the decode ring, host memory a same-host sender maps", &["kvstage_staging_memory_", "kvstage_staging_register", "kvstage_shared_"]),
    ("Room (decode side): one opening per request", &["kvstage_room_"]),
    ("Session (prefill side): one peering with a decode rank", &["kvstage_session_"]),
    ("Transfer and operation (prefill side): one chunk", &["kvstage_transfer", "kvstage_op_"]),
    ("Geometry helpers: pure functions of shapes", &["kvstage_head_slice_", "kvstage_pairing_", "kvstage_staging_layout_", "kvstage_grid_", "kvstage_chunk_span_", "kvstage_state_"]),
    ("Diagnostics of the host", &["kvstage_doctor_"]),
    ("Test builds only (KVSTAGE_TESTING)", &["kvstage_testing_"]),
];

/// The section of function `name`.
fn section_of(name: &str) -> usize {
    SECTIONS
        .iter()
        .enumerate()
        .flat_map(|(i, (_, prefixes))| prefixes.iter().map(move |p| (i, *p)))
        .filter(|(_, p)| name.starts_with(p))
        .max_by_key(|(_, p)| p.len())
        .unwrap_or_else(|| panic!("{name} is in no section of the header (build.rs SECTIONS)"))
        .0
}

/// The exported function a header line declares, if any.
fn declared_function(line: &str) -> Option<&str> {
    if line.starts_with(' ') || line.starts_with('/') || line.starts_with('#') || line.starts_with("typedef") {
        return None;
    }
    let open = line.find('(')?;
    let name = line[..open].rsplit([' ', '*']).next()?;
    name.starts_with("kvstage_").then_some(name)
}

/// Puts a banner before the first function of each section, and checks that sections are whole.
fn with_sections(text: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let mut seen = Vec::new();
    let mut at = 0;
    while at < lines.len() {
        if let Some(name) = declared_function(&lines[at]) {
            let section = section_of(name);
            if seen.last() != Some(&section) {
                assert!(!seen.contains(&section), "{name}: section \"{}\" began earlier; its functions must be together (module order in src/ffi/mod.rs)", SECTIONS[section].0);
                seen.push(section);
                let mut start = at;
                while start > 0 && (lines[start - 1].starts_with("//") || lines[start - 1].starts_with("#if")) {
                    start -= 1;
                }
                let title = SECTIONS[section].0;
                let banner = format!("// ==== {title} {}", "=".repeat(100usize.saturating_sub(title.len() + 9)));
                lines.splice(start..start, [banner, String::new()]);
                at += 2;
            }
        }
        at += 1;
    }
    lines.join("\n") + "\n"
}
