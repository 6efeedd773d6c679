//! Fuzz target `llmd`: see `llmd_engine::fuzzing::llmd`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llmd_engine::fuzzing::llmd(data));
