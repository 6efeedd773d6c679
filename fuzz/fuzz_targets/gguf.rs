//! Fuzz target `gguf`: see `llmd_engine::fuzzing::gguf`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llmd_engine::fuzzing::gguf(data));
