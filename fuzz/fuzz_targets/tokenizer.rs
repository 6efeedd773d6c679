//! Fuzz target `tokenizer`: see `llmd_engine::fuzzing::tokenizer`.
#![no_main]

libfuzzer_sys::fuzz_target!(init: llmd_engine::fuzzing::init(), |data: &[u8]| llmd_engine::fuzzing::tokenizer(data));
