//! Fuzz target `tokenizer`: see `llmd_engine::fuzzing::tokenizer`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llmd_engine::fuzzing::tokenizer(data));
