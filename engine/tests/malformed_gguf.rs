//! Hostile and broken GGUF files: each yields a typed error naming what is wrong; none panics,
//! hangs, or allocates in proportion to a size the file claims rather than holds.
//!
//! One test function, so the allocation counter sees only this work.

mod common;

use llmd_engine::error::FormatError;
use llmd_engine::format::gguf::GgufFile;
use llmd_engine::format::ModelBytes;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Parsing stores what the file encodes: strings as `String`s (24 bytes of header for at least
/// 8 encoded bytes), tensor infos as ~100-byte structs (for at least 24 encoded bytes), vectors
/// grown by doubling. So total allocation stays within a small multiple of the file's size.
const ALLOC_PER_FILE_BYTE: usize = 16;
/// Fixed allocation allowed whatever the file (error messages, small tables).
const ALLOC_SLACK: usize = 64 * 1024;

const F32: u32 = 0;
const Q8_0: u32 = 8;

/// Writes GGUF files field by field, so each case can break exactly one thing.
#[derive(Clone)]
struct Gguf {
    magic: [u8; 4],
    version: u32,
    kvs: Vec<(Vec<u8>, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    n_tensors_override: Option<u64>,
    n_kv_override: Option<u64>,
    alignment: usize,
    data: Vec<u8>,
}

fn s(x: &str) -> Vec<u8> {
    let mut v = (x.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(x.as_bytes());
    v
}

impl Gguf {
    /// A valid file: two metadata keys, a string array, an F32 vector and a Q8_0 matrix.
    fn valid() -> Self {
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&3u64.to_le_bytes());
        for t in ["a", "bb", "ccc"] {
            arr.extend(s(t));
        }
        let mut data = vec![0u8; 64 + 2 * 34 * 2];
        for (i, x) in data.iter_mut().enumerate() {
            *x = (i % 7) as u8;
        }
        Self {
            magic: *b"GGUF",
            version: 3,
            kvs: vec![
                (s("general.architecture"), 8, s("llama")),
                (s("test.count"), 4, 7u32.to_le_bytes().to_vec()),
                (s("test.tokens"), 9, arr),
            ],
            tensors: vec![("norm".into(), vec![16], F32, 0), ("mat".into(), vec![64, 2], Q8_0, 64)],
            n_tensors_override: None,
            n_kv_override: None,
            alignment: 32,
            data,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = self.magic.to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&self.n_tensors_override.unwrap_or(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&self.n_kv_override.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for (k, t, v) in &self.kvs {
            b.extend_from_slice(k);
            b.extend_from_slice(&t.to_le_bytes());
            b.extend_from_slice(v);
        }
        for (name, dims, ty, off) in &self.tensors {
            b.extend(s(name));
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&off.to_le_bytes());
        }
        while !b.len().is_multiple_of(self.alignment) {
            b.push(0);
        }
        b.extend_from_slice(&self.data);
        b
    }
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, FormatError> {
    GgufFile::parse(ModelBytes::Owned(bytes))
}

/// Parses `bytes`, checking the allocation bound, and returns the error it must produce.
fn expect_err(what: &str, bytes: Vec<u8>) -> FormatError {
    let len = bytes.len();
    let region = Region::new(GLOBAL);
    let result = parse(bytes);
    let stats = region.change();
    let allocated = stats.bytes_allocated + stats.bytes_reallocated.max(0) as usize;
    assert!(
        allocated <= ALLOC_PER_FILE_BYTE * len + ALLOC_SLACK,
        "{what}: allocated {allocated} bytes for a {len}-byte file"
    );
    match result {
        Ok(_) => panic!("{what}: a broken file was accepted"),
        Err(e) => {
            assert!(!e.to_string().is_empty());
            e
        }
    }
}

#[test]
fn malformed_files_give_typed_errors() {
    // The baseline is valid and its tensors are where they should be.
    let good = Gguf::valid();
    let g = parse(good.bytes()).expect("the baseline file is valid");
    assert_eq!(g.tensors.len(), 2);
    assert_eq!(g.tensor_data(g.tensor("mat").expect("mat")).len(), 2 * 2 * 34);
    assert_eq!(g.get("test.tokens").and_then(|v| v.as_array()).map(|a| a.len()), Some(3));

    // Version 2 has the same layout as version 3.
    let mut v2 = Gguf::valid();
    v2.version = 2;
    assert_eq!(parse(v2.bytes()).expect("GGUF v2 parses").version, 2);

    // Truncated at every byte.
    let full = good.bytes();
    for cut in 0..full.len() {
        let e = expect_err(&format!("truncated at {cut}"), full[..cut].to_vec());
        assert!(
            matches!(
                e,
                FormatError::Truncated { .. }
                    | FormatError::CountTooLarge { .. }
                    | FormatError::TensorOutOfBounds { .. }
                    | FormatError::BadMagic { .. }
            ),
            "truncated at {cut}: {e}"
        );
    }

    let case = |what: &str, f: &dyn Fn(&mut Gguf)| {
        let mut g = Gguf::valid();
        f(&mut g);
        expect_err(what, g.bytes())
    };
    macro_rules! check {
        ($what:expr, $f:expr, $pat:pat) => {{
            let e = case($what, &$f);
            assert!(matches!(e, $pat), "{}: got {e}", $what);
        }};
    }
    check!("bad magic", |g: &mut Gguf| g.magic = *b"GGML", FormatError::BadMagic { .. });
    check!("version 1", |g: &mut Gguf| g.version = 1, FormatError::UnsupportedVersion(1));
    check!("version 4", |g: &mut Gguf| g.version = 4, FormatError::UnsupportedVersion(4));
    check!(
        "tensor count u64::MAX",
        |g: &mut Gguf| g.n_tensors_override = Some(u64::MAX),
        FormatError::CountTooLarge { .. }
    );
    check!(
        "tensor count past the end",
        |g: &mut Gguf| g.n_tensors_override = Some(1 << 20),
        FormatError::CountTooLarge { .. }
    );
    check!("kv count u64::MAX", |g: &mut Gguf| g.n_kv_override = Some(u64::MAX), FormatError::CountTooLarge { .. });
    check!(
        "kv count one too many",
        |g: &mut Gguf| g.n_kv_override = Some(4),
        FormatError::UnknownValueType { .. }
            | FormatError::Truncated { .. }
            | FormatError::InvalidUtf8 { .. }
            | FormatError::CountTooLarge { .. }
    );
    check!(
        "key length past the end",
        |g: &mut Gguf| g.kvs[0].0 = u64::MAX.to_le_bytes().to_vec(),
        FormatError::Truncated { .. }
    );
    check!(
        "string value length past the end",
        |g: &mut Gguf| g.kvs[0].2 = (1u64 << 40).to_le_bytes().to_vec(),
        FormatError::Truncated { .. }
    );
    check!(
        "array count past the end",
        |g: &mut Gguf| {
            let mut a = 8u32.to_le_bytes().to_vec();
            a.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
            g.kvs[2].2 = a;
        },
        FormatError::CountTooLarge { .. }
    );
    check!(
        "u8 array count past the end",
        |g: &mut Gguf| {
            let mut a = 0u32.to_le_bytes().to_vec();
            a.extend_from_slice(&(1u64 << 50).to_le_bytes());
            g.kvs[2].2 = a;
        },
        FormatError::CountTooLarge { .. }
    );
    check!(
        "nested array",
        |g: &mut Gguf| {
            let mut a = 9u32.to_le_bytes().to_vec();
            a.extend_from_slice(&1u64.to_le_bytes());
            g.kvs[2].2 = a;
        },
        FormatError::NestedArray { .. }
    );
    check!("unknown value type", |g: &mut Gguf| g.kvs[1].1 = 77, FormatError::UnknownValueType { value_type: 77, .. });
    check!(
        "invalid UTF-8 key",
        |g: &mut Gguf| g.kvs[1].0 = [&5u64.to_le_bytes()[..], &[0x74, 0xff, 0xfe, 0x80, 0x41]].concat(),
        FormatError::InvalidUtf8 { .. }
    );
    check!(
        "invalid UTF-8 string value",
        |g: &mut Gguf| g.kvs[0].2 = [&2u64.to_le_bytes()[..], &[0xc3, 0x28]].concat(),
        FormatError::InvalidUtf8 { .. }
    );
    check!("duplicate key", |g: &mut Gguf| g.kvs[1].0 = s("general.architecture"), FormatError::DuplicateKey(_));
    check!(
        "alignment 0",
        |g: &mut Gguf| g.kvs.push((s("general.alignment"), 4, 0u32.to_le_bytes().to_vec())),
        FormatError::BadAlignment(0)
    );
    check!(
        "alignment 3",
        |g: &mut Gguf| g.kvs.push((s("general.alignment"), 4, 3u32.to_le_bytes().to_vec())),
        FormatError::BadAlignment(3)
    );
    check!(
        "alignment as a string",
        |g: &mut Gguf| g.kvs.push((s("general.alignment"), 8, s("32"))),
        FormatError::WrongKeyType { .. }
    );
    check!(
        "zero dimension",
        |g: &mut Gguf| g.tensors[1].1 = vec![64, 0],
        FormatError::BadDimension { axis: 1, dim: 0, .. }
    );
    check!(
        "five dimensions",
        |g: &mut Gguf| g.tensors[0].1 = vec![1, 1, 1, 1, 16],
        FormatError::TooManyDims { n_dims: 5, .. }
    );
    check!(
        "dimension product overflows",
        |g: &mut Gguf| g.tensors[1].1 = vec![1 << 40, 1 << 40],
        FormatError::TensorTooLarge { .. }
    );
    check!("absurd dimension", |g: &mut Gguf| g.tensors[0].1 = vec![u64::MAX], FormatError::BadDimension { .. });
    check!(
        "tensor larger than the file",
        |g: &mut Gguf| g.tensors[0].1 = vec![1 << 40],
        FormatError::TensorTooLarge { .. }
    );
    check!(
        "unknown tensor type",
        |g: &mut Gguf| g.tensors[0].2 = 99,
        FormatError::UnknownTensorType { type_id: 99, .. }
    );
    check!(
        "activation-only tensor type",
        |g: &mut Gguf| g.tensors[0].2 = 15,
        FormatError::UnknownTensorType { type_id: 15, .. }
    );
    check!(
        "row not a whole number of blocks",
        |g: &mut Gguf| g.tensors[1].1 = vec![33, 2],
        FormatError::RowNotBlockAligned { row: 33, block: 32, .. }
    );
    check!("misaligned offset", |g: &mut Gguf| g.tensors[1].3 = 65, FormatError::MisalignedTensor { offset: 65, .. });
    check!("offset past the end", |g: &mut Gguf| g.tensors[1].3 = 1 << 20, FormatError::TensorOutOfBounds { .. });
    check!("offset that wraps", |g: &mut Gguf| g.tensors[1].3 = u64::MAX - 31, FormatError::TensorOutOfBounds { .. });
    check!("overlapping tensors", |g: &mut Gguf| g.tensors[1].3 = 32, FormatError::OverlappingTensors { .. });
    check!("duplicate tensor", |g: &mut Gguf| g.tensors[1].0 = "norm".into(), FormatError::DuplicateTensor(_));
    check!("data section cut short", |g: &mut Gguf| g.data.truncate(100), FormatError::TensorOutOfBounds { .. });

    // The real model, truncated through its header (vocabulary and all) and into its data.
    {
        let full = std::fs::read(common::default_model_path()).expect("model readable");
        let header_end = 2_600_000.min(full.len());
        for i in 0..150 {
            let cut = i * header_end / 150;
            expect_err(&format!("model truncated at {cut}"), full[..cut].to_vec());
        }
        for cut in [full.len() / 2, full.len() - 1] {
            let e = expect_err(&format!("model truncated at {cut}"), full[..cut].to_vec());
            assert!(matches!(e, FormatError::TensorOutOfBounds { .. }), "model truncated in its data: {e}");
        }
        // Flipping the high byte of the tensor count makes the file claim far more tensors.
        let mut bad = full[..header_end].to_vec();
        bad[15] = 0x7f;
        assert!(matches!(expect_err("model with a huge tensor count", bad), FormatError::CountTooLarge { .. }));
    }
}

/// A type llmd does not read (an i-quant here) is refused by its name, not only its number.
#[test]
fn an_i_quant_tensor_is_refused_by_its_type_name() {
    let mut g = Gguf::valid();
    g.tensors[0].2 = 23;
    let e = expect_err("an IQ4_XS tensor", g.bytes());
    assert!(matches!(e, FormatError::UnknownTensorType { type_id: 23, .. }), "{e:?}");
    assert!(e.to_string().contains("IQ4_XS"), "{e}");
}
