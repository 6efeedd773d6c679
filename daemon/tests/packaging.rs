//! Tier 7 (packaging): the Soong build files parse, and every crate, binary and AIDL interface
//! in the tree has a module with the dependencies its Cargo.toml declares; the init service
//! and the shipped config are what the daemon expects.

use android_bp::{BluePrint, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every Android.bp in the tree (outside target/ and hidden directories), parsed.
fn blueprints() -> Vec<(PathBuf, BluePrint)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).expect("readable").filter_map(|e| e.ok()) {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() && !name.starts_with('.') && name != "target" && name != "models" {
                walk(&p, out);
            } else if name == "Android.bp" {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&root(), &mut files);
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f).expect("readable");
            let bp = BluePrint::parse(&text).unwrap_or_else(|e| panic!("{} does not parse: {e}", f.display()));
            (f, bp)
        })
        .collect()
}

fn strings(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::Array(a)) => {
            a.iter().filter_map(|x| if let Value::String(s) = x { Some(s.clone()) } else { None }).collect()
        }
        _ => Vec::new(),
    }
}

/// A module's rustlibs and proc_macros, following `defaults`.
fn deps(bps: &[(PathBuf, BluePrint)], m: &android_bp::Module) -> BTreeSet<String> {
    let mut out: BTreeSet<String> =
        strings(m.get("rustlibs")).into_iter().chain(strings(m.get("proc_macros"))).collect();
    for d in strings(m.get("defaults")) {
        let def = bps
            .iter()
            .flat_map(|(_, b)| &b.modules)
            .find(|x| x.get_string("name") == Some(&d))
            .unwrap_or_else(|| panic!("defaults {d} not found"));
        out.extend(deps(bps, def));
    }
    out
}

fn prop(bps: &[(PathBuf, BluePrint)], m: &android_bp::Module, key: &str) -> Option<String> {
    m.get_string(key).cloned().or_else(|| {
        strings(m.get("defaults")).iter().find_map(|d| {
            bps.iter()
                .flat_map(|(_, b)| &b.modules)
                .find(|x| x.get_string("name") == Some(d))
                .and_then(|x| prop(bps, x, key))
        })
    })
}

fn soong_lib(crate_name: &str) -> String {
    format!("lib{}", crate_name.replace('-', "_"))
}

#[test]
fn every_crate_and_binary_has_a_soong_module_with_its_dependencies() {
    let bps = blueprints();
    assert!(bps.iter().any(|(f, _)| f == &root().join("Android.bp")), "no top-level Android.bp");
    let modules: BTreeMap<String, (&android_bp::Module, PathBuf)> = bps
        .iter()
        .flat_map(|(f, b)| {
            b.modules.iter().filter_map(move |m| m.get_string("name").map(|n| (n.clone(), (m, f.clone()))))
        })
        .collect();
    let ws: toml::Value =
        toml::from_str(&std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml")).expect("toml");
    for member in ws["workspace"]["members"].as_array().expect("members") {
        let dir = root().join(member.as_str().expect("member"));
        let manifest: toml::Value =
            toml::from_str(&std::fs::read_to_string(dir.join("Cargo.toml")).expect("manifest")).expect("toml");
        let name = manifest["package"]["name"].as_str().expect("name");
        // The Rust crate's name: `[lib] name` when the manifest sets one (qnn-emu-sys builds
        // libllmd_qnn_emu), else the package's.
        let crate_name =
            manifest.get("lib").and_then(|l| l.get("name")).and_then(|n| n.as_str()).unwrap_or(name).replace('-', "_");
        let declared: BTreeSet<String> = manifest
            .get("dependencies")
            .and_then(|d| d.as_table())
            .map(|t| t.keys().map(|k| soong_lib(k)).collect())
            .unwrap_or_default();
        // The library.
        let lib = soong_lib(name);
        let (m, file) = modules.get(&lib).unwrap_or_else(|| panic!("crate {name} has no module {lib}"));
        assert_eq!(m.typ, "rust_library", "{lib} in {}", file.display());
        assert_eq!(prop(&bps, m, "crate_name").as_deref(), Some(crate_name.as_str()), "{lib}: crate_name");
        let have = deps(&bps, m);
        let missing: Vec<_> = declared.difference(&have).collect();
        assert!(missing.is_empty(), "{lib} lacks {missing:?} (declared in {}/Cargo.toml)", dir.display());
        // Each binary.
        for bin in manifest.get("bin").and_then(|b| b.as_array()).into_iter().flatten() {
            let bname = bin["name"].as_str().expect("bin name");
            let (m, _) = modules.get(bname).unwrap_or_else(|| panic!("binary {bname} has no module"));
            assert_eq!(m.typ, "rust_binary", "{bname}");
            let have = deps(&bps, m);
            assert!(have.contains(&lib), "{bname} does not depend on {lib}");
            let missing: Vec<_> = declared.difference(&have).collect();
            assert!(missing.is_empty(), "{bname} lacks {missing:?}");
        }
        // A test module for crates with tests.
        assert!(
            bps.iter()
                .flat_map(|(_, b)| &b.modules)
                .any(|m| m.typ == "rust_test" && prop(&bps, m, "crate_name").as_deref() == Some(crate_name.as_str()))
                || name == "llmd-aidl",
            "crate {name} has no rust_test module"
        );
    }
}

#[test]
fn the_aidl_interface_covers_every_aidl_file_and_is_versioned() {
    let bps = blueprints();
    let ifaces: Vec<_> = bps
        .iter()
        .flat_map(|(f, b)| b.modules.iter().filter(|m| m.typ == "aidl_interface").map(move |m| (f.clone(), m)))
        .collect();
    assert_eq!(ifaces.len(), 1, "one aidl_interface");
    let (file, m) = &ifaces[0];
    assert_eq!(m.get_string("name").map(String::as_str), Some("com.llmd"));
    let dir = file.parent().expect("dir");
    let globs = strings(m.get("srcs"));
    let aidl_dir = dir.join("aidl/com/llmd");
    for e in std::fs::read_dir(&aidl_dir).expect("aidl dir") {
        let rel = e.expect("entry").path().strip_prefix(dir).expect("relative").to_string_lossy().into_owned();
        assert!(
            globs
                .iter()
                .any(|g| g.strip_suffix("*.aidl").is_some_and(|pre| rel.starts_with(pre) && rel.ends_with(".aidl"))
                    || g == &rel),
            "{rel} is not in the aidl_interface srcs"
        );
    }
    let backend = m.get_map("backend").expect("backend");
    for b in ["java", "rust"] {
        match backend.0.get(b) {
            Some(Value::Map(x)) => assert_eq!(x.0.get("enabled"), Some(&Value::Boolean(true)), "{b} backend"),
            _ => panic!("no {b} backend"),
        }
    }
    let versions = match m.get("versions_with_info") {
        Some(Value::Array(v)) => v.clone(),
        _ => panic!("no versions_with_info"),
    };
    let frozen: Vec<String> = versions
        .iter()
        .filter_map(|v| {
            if let Value::Map(x) = v {
                x.0.get("version").and_then(|s| if let Value::String(s) = s { Some(s.clone()) } else { None })
            } else {
                None
            }
        })
        .collect();
    assert!(frozen.contains(&llmd_aidl::ILlmService::VERSION.to_string()), "the current version is not declared");
    for v in &frozen {
        assert!(dir.join(format!("aidl_api/com.llmd/{v}")).is_dir(), "version {v} is not frozen in aidl_api/");
    }
}

#[test]
fn the_kotlin_client_links_the_java_backend_of_the_interface() {
    let bps = blueprints();
    let m = bps
        .iter()
        .flat_map(|(_, b)| &b.modules)
        .find(|m| m.get_string("name").map(String::as_str) == Some("llmd-client"))
        .expect("an llmd-client module");
    assert_eq!(m.typ, "android_library");
    assert!(
        strings(m.get("static_libs"))
            .iter()
            .any(|l| l == &format!("com.llmd-V{}-java", llmd_aidl::ILlmService::VERSION)),
        "llmd-client does not link com.llmd's Java backend"
    );
    assert!(
        strings(m.get("srcs")).iter().any(|s| s.starts_with("src/main/kotlin")),
        "llmd-client has no Kotlin sources"
    );
}

#[test]
fn the_init_service_runs_llmd_with_its_config_and_least_privilege() {
    let rc = std::fs::read_to_string(root().join("init/llmd.rc")).expect("init/llmd.rc");
    let lines: Vec<&str> = rc.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let start = lines.iter().position(|l| l.starts_with("service llmd ")).expect("a service llmd");
    let words: Vec<&str> = lines[start].split_whitespace().collect();
    assert_eq!(words[2], "/system/bin/llmd");
    let cfg_at = words.iter().position(|w| *w == "--config").expect("--config");
    let cfg = words[cfg_at + 1];
    assert_eq!(cfg, "/system/etc/llmd/llmd.toml", "the config path the prebuilt_etc installs");
    let options: Vec<&str> = lines[start + 1..]
        .iter()
        .take_while(|l| !l.starts_with("on ") && !l.starts_with("service "))
        .copied()
        .collect();
    let has = |k: &str| options.iter().find(|o| o.split_whitespace().next() == Some(k)).copied();
    assert!(has("class").is_some(), "no class");
    let user = has("user").expect("a user").split_whitespace().nth(1).expect("user name");
    assert_ne!(user, "root", "llmd must not run as root");
    assert!(has("group").is_some(), "no group");
    assert_eq!(has("capabilities"), Some("capabilities"), "capabilities must be present and empty");
    assert!(has("task_profiles").is_some(), "no task profiles");
    assert!(has("restart_period").is_some(), "no restart back-off");
    // The models directory the shipped config names is created by init.
    let shipped = llmd_daemon::config::Config::from_file(&root().join("daemon/config/llmd.toml"))
        .expect("the shipped config parses");
    shipped.validate().expect("the shipped config is valid");
    let models = shipped.models_dir.expect("models_dir").display().to_string();
    assert!(
        lines.iter().any(|l| l.starts_with("mkdir ") && l.split_whitespace().nth(1) == Some(models.as_str())),
        "init does not create {models}"
    );
}
