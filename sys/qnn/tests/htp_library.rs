//! Against Qualcomm's own HTP library built for x86-64 (`scripts/fetch-qnn.sh` fills the cache;
//! `LLMD_QNN_LIB` names another copy).

use std::path::PathBuf;

/// Where Qualcomm's HTP library is: `LLMD_QNN_LIB`, else the cache `scripts/fetch-qnn.sh` fills
/// (run here if it is not filled yet).
fn htp_library() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMD_QNN_LIB") {
        return p.into();
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new(root.join("scripts/fetch-qnn.sh"))
        .output()
        .expect("scripts/fetch-qnn.sh runs");
    assert!(out.status.success(), "scripts/fetch-qnn.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("libQnnHtp.so")
}

#[test]
fn the_htp_library_offers_one_htp_provider_with_api_2() {
    let lib = qnn_sys::Library::open(&htp_library()).expect("libQnnHtp.so loads");
    let p = lib.providers();
    eprintln!("{p:?}");
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].backend_id, qnn_sys::BACKEND_ID_HTP);
    assert_eq!(p[0].name, "HTP_QTI_AISW");
    assert_eq!(p[0].api.core.major, 2, "{p:?}");
}

#[test]
fn a_file_that_is_not_a_qnn_library_is_a_typed_error() {
    let e = qnn_sys::Library::open(std::path::Path::new("/nonexistent/libQnnHtp.so")).err().expect("refused");
    assert!(matches!(e, qnn_sys::LoadError::Open(_)), "{e}");
}
