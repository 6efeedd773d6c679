//! Fuzz target `chat_template`: see `llmd_engine::fuzzing::chat_template`.
#![no_main]

libfuzzer_sys::fuzz_target!(init: llmd_engine::fuzzing::init(), |data: &[u8]| llmd_engine::fuzzing::chat_template(data));
