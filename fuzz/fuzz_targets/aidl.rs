//! Fuzz target `aidl`: see `llmd_daemon::fuzzing::aidl`.
#![no_main]

libfuzzer_sys::fuzz_target!(init: llmd_engine::fuzzing::init(), |data: &[u8]| llmd_daemon::fuzzing::aidl(data));
