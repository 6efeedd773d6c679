//! The interface is versioned like a stable AIDL interface: `aidl_api/com.llmd/<N>/` holds the frozen
//! definition of each released version, and the current one must not change a frozen version.
//! To change the interface: bump `ILlmService.VERSION`, then copy `aidl/` to `aidl_api/com.llmd/<VERSION>/` (Soong: `m com.llmd-freeze-api`).

use std::path::Path;

fn files(dir: &Path) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(dir)
        .expect("aidl directory")
        .filter_map(|e| e.ok())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read_to_string(e.path()).expect("readable")))
        .collect();
    v.sort();
    v
}

#[test]
fn the_current_version_is_frozen_unchanged() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let version = llmd_aidl::ILlmService::VERSION;
    let frozen = root.join(format!("aidl_api/com.llmd/{version}/com/llmd"));
    assert!(frozen.is_dir(), "version {version} has no frozen copy in aidl_api/com.llmd/{version}/");
    assert_eq!(files(&root.join("aidl/com/llmd")), files(&frozen), "the interface changed without a version bump");
}
