//! Strict GGUF (v2, v3) reader over a memory map.
//!
//! Every count, length, dimension, offset and size is checked against the bytes that remain
//! before it is used, so a hostile file yields a [`FormatError`] — never a panic, an
//! out-of-bounds read, or an allocation larger than the file.

use super::ModelBytes;
use crate::error::FormatError;
use crate::quant::GgmlType;
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A metadata array, stored by element type so it takes no more memory than its encoding
/// (plus the fixed size of a `String` per string element).
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            Array::String(v) => Some(v),
            _ => None,
        }
    }

    /// Numeric elements as f64 (`None` for strings).
    pub fn to_f64(&self) -> Option<Vec<f64>> {
        Some(match self {
            Array::U8(v) => v.iter().map(|&x| x as f64).collect(),
            Array::I8(v) => v.iter().map(|&x| x as f64).collect(),
            Array::U16(v) => v.iter().map(|&x| x as f64).collect(),
            Array::I16(v) => v.iter().map(|&x| x as f64).collect(),
            Array::U32(v) => v.iter().map(|&x| x as f64).collect(),
            Array::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Array::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Array::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
            Array::U64(v) => v.iter().map(|&x| x as f64).collect(),
            Array::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Array::F64(v) => v.clone(),
            Array::String(_) => return None,
        })
    }
}

/// Where a tensor lives and what it is.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, innermost (contiguous) first, as GGUF stores them.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A validated GGUF file.
pub struct GgufFile {
    bytes: Arc<ModelBytes>,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.b.len() - self.pos) as u64
    }
    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], FormatError> {
        if n > self.remaining() {
            return Err(FormatError::Truncated { what, offset: self.pos as u64, needed: n, len: self.b.len() as u64 });
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FormatError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    /// A count of items each at least `min_item` bytes long, checked against what remains.
    fn count(&mut self, what: &'static str, min_item: u64) -> Result<u64, FormatError> {
        let n = self.u64(what)?;
        if n.saturating_mul(min_item) > self.remaining() {
            return Err(FormatError::CountTooLarge { what, count: n, remaining: self.remaining() });
        }
        Ok(n)
    }
    fn string(&mut self, what: &'static str) -> Result<String, FormatError> {
        let len = self.u64(what)?;
        let start = self.pos as u64;
        let s = self.take(len, what)?;
        std::str::from_utf8(s).map(str::to_owned).map_err(|_| FormatError::InvalidUtf8 { offset: start })
    }
}

/// Smallest encoded size of one value of a GGUF value type (for bounding array counts).
fn min_value_size(value_type: u32) -> Option<u64> {
    Some(match value_type {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

fn read_array<T>(
    c: &mut Cursor<'_>,
    n: u64,
    mut one: impl FnMut(&mut Cursor<'_>) -> Result<T, FormatError>,
) -> Result<Vec<T>, FormatError> {
    // `n` was checked against the bytes left, so this allocation is bounded by the file.
    let mut v = Vec::with_capacity(n as usize);
    for _ in 0..n {
        v.push(one(c)?);
    }
    Ok(v)
}

fn read_value(c: &mut Cursor<'_>, key: &str, value_type: u32) -> Result<Value, FormatError> {
    Ok(match value_type {
        0 => Value::U8(c.array::<1>("u8 value")?[0]),
        1 => Value::I8(c.array::<1>("i8 value")?[0] as i8),
        2 => Value::U16(u16::from_le_bytes(c.array("u16 value")?)),
        3 => Value::I16(i16::from_le_bytes(c.array("i16 value")?)),
        4 => Value::U32(c.u32("u32 value")?),
        5 => Value::I32(i32::from_le_bytes(c.array("i32 value")?)),
        6 => Value::F32(f32::from_le_bytes(c.array("f32 value")?)),
        7 => Value::Bool(c.array::<1>("bool value")?[0] != 0),
        8 => Value::String(c.string("string value")?),
        9 => {
            let elem_type = c.u32("array element type")?;
            if elem_type == 9 {
                return Err(FormatError::NestedArray { key: key.to_owned() });
            }
            let min = min_value_size(elem_type)
                .ok_or_else(|| FormatError::UnknownValueType { key: key.to_owned(), value_type: elem_type })?;
            let n = c.count("array element", min)?;
            Value::Array(match elem_type {
                0 => Array::U8(c.take(n, "u8 array")?.to_vec()),
                1 => Array::I8(c.take(n, "i8 array")?.iter().map(|&b| b as i8).collect()),
                2 => Array::U16(read_array(c, n, |c| Ok(u16::from_le_bytes(c.array("u16 value")?)))?),
                3 => Array::I16(read_array(c, n, |c| Ok(i16::from_le_bytes(c.array("i16 value")?)))?),
                4 => Array::U32(read_array(c, n, |c| c.u32("u32 value"))?),
                5 => Array::I32(read_array(c, n, |c| Ok(i32::from_le_bytes(c.array("i32 value")?)))?),
                6 => Array::F32(read_array(c, n, |c| Ok(f32::from_le_bytes(c.array("f32 value")?)))?),
                7 => Array::Bool(c.take(n, "bool array")?.iter().map(|&b| b != 0).collect()),
                8 => Array::String(read_array(c, n, |c| c.string("string value"))?),
                10 => Array::U64(read_array(c, n, |c| c.u64("u64 value"))?),
                11 => Array::I64(read_array(c, n, |c| Ok(i64::from_le_bytes(c.array("i64 value")?)))?),
                _ => Array::F64(read_array(c, n, |c| Ok(f64::from_le_bytes(c.array("f64 value")?)))?),
            })
        }
        10 => Value::U64(c.u64("u64 value")?),
        11 => Value::I64(i64::from_le_bytes(c.array("i64 value")?)),
        12 => Value::F64(f64::from_le_bytes(c.array("f64 value")?)),
        other => return Err(FormatError::UnknownValueType { key: key.to_owned(), value_type: other }),
    })
}

impl GgufFile {
    /// Memory-maps and validates a GGUF file.
    pub fn open(path: &Path) -> Result<Self, FormatError> {
        Self::parse(ModelBytes::map(path)?)
    }

    /// Validates GGUF bytes already in memory (or mapped).
    pub fn parse(bytes: ModelBytes) -> Result<Self, FormatError> {
        let b: &[u8] = &bytes;
        let mut c = Cursor { b, pos: 0 };
        let magic: [u8; 4] = c.array("magic")?;
        if &magic != MAGIC {
            return Err(FormatError::BadMagic { found: magic });
        }
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            return Err(FormatError::UnsupportedVersion(version));
        }
        // A tensor info is at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
        let n_tensors = c.count("tensor", 24)?;
        // A key-value pair is at least 8 (key len) + 4 (type) + 1 (value) bytes.
        let n_kv = c.count("metadata key-value", 13)?;

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let value_type = c.u32("metadata value type")?;
            let value = read_value(&mut c, &key, value_type)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(FormatError::DuplicateKey(key));
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v.as_u64().ok_or(FormatError::WrongKeyType {
                    key: "general.alignment".into(),
                    expected: "unsigned integer",
                })?;
                if a == 0 || !a.is_power_of_two() || a > 65536 {
                    return Err(FormatError::BadAlignment(a));
                }
                a
            }
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = HashSet::new();
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor dimension count")?;
            if n_dims > MAX_DIMS {
                return Err(FormatError::TooManyDims { name, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for axis in 0..n_dims as usize {
                let d = c.u64("tensor dimension")?;
                if d == 0 || d > i64::MAX as u64 {
                    return Err(FormatError::BadDimension { name, axis, dim: d });
                }
                dims.push(d);
            }
            let type_id = c.u32("tensor type")?;
            let ty = GgmlType::from_id(type_id)
                .filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K))
                .ok_or_else(|| FormatError::UnknownTensorType { name: name.clone(), type_id })?;
            let offset = c.u64("tensor offset")?;
            let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            let row = dims.first().copied().unwrap_or(1);
            let block = ty.block_size() as u64;
            if row % block != 0 {
                return Err(FormatError::RowNotBlockAligned { name, row, block });
            }
            let size = elements
                .and_then(|e| (e / block).checked_mul(ty.type_size() as u64))
                .filter(|&s| s <= b.len() as u64)
                .ok_or_else(|| FormatError::TensorTooLarge { name: name.clone(), elements: format!("{dims:?}") })?;
            if !names.insert(name.clone()) {
                return Err(FormatError::DuplicateTensor(name));
            }
            tensors.push(TensorInfo { name, dims, ty, offset, size });
        }

        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let data_len = (b.len() as u64).saturating_sub(data_start);
        for t in &tensors {
            if t.offset % alignment != 0 {
                return Err(FormatError::MisalignedTensor { name: t.name.clone(), offset: t.offset, alignment });
            }
            let end = t.offset.checked_add(t.size).filter(|&e| e <= data_len);
            if end.is_none() {
                return Err(FormatError::TensorOutOfBounds {
                    name: t.name.clone(),
                    start: t.offset,
                    end: t.offset.saturating_add(t.size),
                    data_len,
                });
            }
        }
        let mut order: Vec<&TensorInfo> = tensors.iter().collect();
        order.sort_by_key(|t| t.offset);
        for w in order.windows(2) {
            if w[0].offset + w[0].size > w[1].offset {
                return Err(FormatError::OverlappingTensors { a: w[0].name.clone(), b: w[1].name.clone() });
            }
        }
        Ok(Self { bytes: Arc::new(bytes), version, metadata, tensors, alignment, data_start })
    }

    /// A file of metadata alone (no tensor): what the tokenizer and the configuration are read
    /// from, for callers that have the keys without a file (the fuzz targets, tests).
    pub fn from_metadata(metadata: BTreeMap<String, Value>) -> Self {
        Self {
            bytes: Arc::new(ModelBytes::Owned(Vec::new())),
            version: 3,
            metadata,
            tensors: Vec::new(),
            alignment: DEFAULT_ALIGNMENT,
            data_start: 0,
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Byte range of a tensor in the file (bounds were checked at parse time).
    pub fn tensor_range(&self, t: &TensorInfo) -> std::ops::Range<usize> {
        let start = (self.data_start + t.offset) as usize;
        start..start + t.size as usize
    }

    /// The bytes of a tensor.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &self.bytes[self.tensor_range(t)]
    }

    /// The underlying bytes (shared with the memory map).
    pub fn bytes(&self) -> &Arc<ModelBytes> {
        &self.bytes
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Result<&str, FormatError> {
        let v = self.get(key).ok_or_else(|| FormatError::MissingKey { key: key.into() })?;
        v.as_str().ok_or(FormatError::WrongKeyType { key: key.into(), expected: "string" })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, FormatError> {
        let v = self.get(key).ok_or_else(|| FormatError::MissingKey { key: key.into() })?;
        v.as_u64().ok_or(FormatError::WrongKeyType { key: key.into(), expected: "unsigned integer" })
    }

    pub fn get_f64_opt(&self, key: &str) -> Result<Option<f64>, FormatError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or(FormatError::WrongKeyType { key: key.into(), expected: "number" }),
        }
    }

    pub fn get_u64_opt(&self, key: &str) -> Result<Option<u64>, FormatError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.get_u64(key).map(Some),
        }
    }
}

use crate::config::{Arch, ModelConfig, RopeStyle};

impl ModelConfig {
    /// Reads `general.architecture` and the `<arch>.*` keys of a GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, FormatError> {
        let arch_name = g.get_str("general.architecture")?;
        let (arch, rope_style) = match arch_name {
            "llama" | "mistral" => (Arch::Llama, RopeStyle::Interleaved),
            "qwen2" => (Arch::Qwen2, RopeStyle::Neox),
            other => return Err(FormatError::UnsupportedArchitecture(other.to_owned())),
        };
        let k = |s: &str| format!("{arch_name}.{s}");
        let usize_key = |s: &str| -> Result<usize, FormatError> {
            let v = g.get_u64(&k(s))?;
            usize::try_from(v)
                .map_err(|_| FormatError::BadHyperParameter { what: "size", detail: format!("{} = {v}", k(s)) })
        };
        let n_layers = usize_key("block_count")?;
        let d_model = usize_key("embedding_length")?;
        let n_heads = usize_key("attention.head_count")?;
        let n_kv_heads = match g.get_u64_opt(&k("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => n_heads,
        };
        let ffn_dim = usize_key("feed_forward_length")?;
        let context_length = usize_key("context_length")?;
        let head_dim = match g.get_u64_opt(&k("attention.key_length"))? {
            Some(v) => v as usize,
            None if n_heads > 0 => d_model / n_heads,
            None => 0,
        };
        let rope_dims = match g.get_u64_opt(&k("rope.dimension_count"))? {
            Some(v) => v as usize,
            None => head_dim,
        };
        let rope_theta = g.get_f64_opt(&k("rope.freq_base"))?.unwrap_or(10000.0) as f32;
        let rope_freq_scale = match (
            g.get(&k("rope.scaling.type")).and_then(|v| v.as_str()),
            g.get_f64_opt(&k("rope.scaling.factor"))?,
        ) {
            (Some("linear"), Some(f)) if f > 0.0 => (1.0 / f) as f32,
            (None | Some("none"), _) => 1.0,
            (Some("linear"), _) => 1.0,
            (Some(other), _) => {
                return Err(FormatError::BadHyperParameter {
                    what: "rope scaling",
                    detail: format!("unsupported type {other:?}"),
                })
            }
        };
        let norm_eps = g.get_f64_opt(&k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5) as f32;
        let vocab_size = match g.get_u64_opt(&k("vocab_size"))? {
            Some(v) => v as usize,
            None => g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map(|a| a.len()).unwrap_or(0),
        };
        let c = Self {
            arch,
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            vocab_size,
            context_length,
            rope_theta,
            rope_dims,
            rope_freq_scale,
            rope_style,
            norm_eps,
        };
        c.validate()?;
        Ok(c)
    }
}
