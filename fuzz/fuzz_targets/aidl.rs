//! Fuzz target `aidl`: see `llmd_daemon::fuzzing::aidl`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llmd_daemon::fuzzing::aidl(data));
