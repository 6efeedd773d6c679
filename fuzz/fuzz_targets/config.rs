//! Fuzz target `config`: see `llmd_daemon::fuzzing::config`.
#![no_main]

libfuzzer_sys::fuzz_target!(init: llmd_engine::fuzzing::init(), |data: &[u8]| llmd_daemon::fuzzing::config(data));
