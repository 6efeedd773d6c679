//! Fuzz target `gguf`: see `llmd_engine::fuzzing::gguf`.
#![no_main]

libfuzzer_sys::fuzz_target!(init: llmd_engine::fuzzing::init(), |data: &[u8]| llmd_engine::fuzzing::gguf(data));
