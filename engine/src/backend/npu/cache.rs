//! Finalized NPU contexts cached on disk: a QNN context binary per model, quantization, chunk
//! size, chip and QNN library, so that a later start loads its graphs instead of finalizing them
//! (finalize and warm-up time is the first complaint about NPU runtimes).
//!
//! A cache file (`npu-<crc of the key>.qnnctx`) holds a header — magic, format version, the
//! whole key as JSON, and each graph's tensor ids — then the library's context binary and a
//! CRC-32 of everything before it. It is served only when its key equals the one asked for
//! field by field (the file name is only a hint) and its CRC holds; a stale, truncated or corrupt
//! file is rebuilt and replaced (written to a temporary name, synced, renamed), never loaded.
//!
//! The key: the library (provider name, build id, core and backend API versions), the chip, the
//! chunk size, and a CRC-32 over every group's name, quantization and int8 weights — so a
//! changed model, calibration or quantization option changes it.

use super::device::{NpuContext, QnnDevice};
use super::graph::{build_linear_group, graph_name, retrieve_linear_group, LinearGroup};
use super::quant::WeightScales;
use crate::error::NpuError;
use qnn_sys::api::Graph;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"LLMDNPUC";
/// The cache file's layout; bump on any change.
pub const FORMAT_VERSION: u32 = 1;

/// What a cached context was made for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheKey {
    pub provider: String,
    pub build_id: String,
    pub core_api: String,
    pub backend_api: String,
    pub soc: u32,
    pub chunk: usize,
    pub groups: usize,
    /// CRC-32 and FNV-1a 64 of every group's name, quantization parameters and weights (96 bits:
    /// two models or calibrations of the same shapes do not share a key by chance).
    pub groups_crc: u32,
    pub groups_fnv: u64,
}

#[derive(Serialize, Deserialize)]
struct Header {
    key: CacheKey,
    /// Per graph, in layer-major group order: the input's tensor id and the outputs'.
    ids: Vec<(u32, Vec<u32>)>,
}

/// Each graph's tensor ids, in layer-major group order: the input's and the outputs'.
pub type GraphIds = Vec<(u32, Vec<u32>)>;

/// Where a context came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Loaded from the cache file.
    Loaded,
    /// Built and finalized, then stored (why: no file, another key, or a damaged file).
    Built { reason: String },
}

/// The key for `groups` at `chunk` rows on `device` (its library and chip).
pub fn key_for(device: &QnnDevice, groups: &[LinearGroup], chunk: usize) -> Result<CacheKey, NpuError> {
    key_with(device, chunk, groups.len(), &mut |h: &mut Feed<'_>| {
        for g in groups {
            h(g.name.as_bytes());
            for q in std::iter::once(g.input).chain(g.projections.iter().map(|p| p.output)) {
                h(&q.scale.to_le_bytes());
                h(&q.zero_point.to_le_bytes());
                h(&[q.bits]);
            }
            for p in &g.projections {
                h(p.name.as_bytes());
                h(&(p.weights.rows as u64).to_le_bytes());
                h(&(p.weights.cols as u64).to_le_bytes());
                match &p.weights.scales {
                    WeightScales::PerTensor(s) => h(&s.to_le_bytes()),
                    WeightScales::PerChannel(v) => v.iter().for_each(|s| h(&s.to_le_bytes())),
                }
                h(&p.weights.q.iter().map(|&v| v as u8).collect::<Vec<u8>>());
                if let Some(b) = &p.bias {
                    b.iter().for_each(|v| h(&v.to_le_bytes()));
                }
            }
        }
    })
}

/// The cache file for `key` in `dir`.
pub fn path_for(dir: &Path, key: &CacheKey) -> Result<PathBuf, NpuError> {
    let json = serde_json::to_vec(key).map_err(|e| NpuError::Cache(e.to_string()))?;
    Ok(dir.join(format!("npu-{:08x}.qnnctx", crc32fast::hash(&json))))
}

/// Reads a cache file: its header if the key matches and the CRC holds, the file's bytes, and
/// where the binary starts and ends in them.
fn read(path: &Path, key: &CacheKey) -> Result<(Header, Vec<u8>, std::ops::Range<usize>), String> {
    let bytes = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "no cache file yet".to_owned(),
        _ => format!("the cache file could not be read ({e})"),
    })?;
    if bytes.len() < 8 + 4 + 4 + 4 || &bytes[..8] != MAGIC {
        return Err("not an NPU cache file".into());
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err("the cache file is truncated or corrupt (CRC mismatch)".into());
    }
    let version = u32::from_le_bytes([body[8], body[9], body[10], body[11]]);
    if version != FORMAT_VERSION {
        return Err(format!("cache format {version}, this build reads {FORMAT_VERSION}"));
    }
    let hlen = u32::from_le_bytes([body[12], body[13], body[14], body[15]]) as usize;
    let header_bytes = body.get(16..16 + hlen).ok_or("the header runs past the file")?;
    let header: Header = serde_json::from_slice(header_bytes).map_err(|e| format!("an unreadable header: {e}"))?;
    if header.key != *key {
        return Err("made for another model, quantization, chunk size, chip or QNN library".into());
    }
    let end = body.len();
    Ok((header, bytes, 16 + hlen..end))
}

/// Writes a cache file atomically (temporary name, fsync, rename).
fn write(path: &Path, header: &Header, binary: &[u8]) -> Result<(), NpuError> {
    let io = |e: std::io::Error| NpuError::Cache(format!("writing {}: {e}", path.display()));
    let json = serde_json::to_vec(header).map_err(|e| NpuError::Cache(e.to_string()))?;
    let mut out = Vec::with_capacity(16 + json.len() + binary.len() + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(binary);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let r = (|| {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&out)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r.map_err(io)
}

/// A context holding `groups`' graphs at `chunk` rows: loaded from `dir`'s cache file for `key`
/// when there is a sound one, else built, finalized and stored there.
pub fn load_or_build(
    device: &QnnDevice,
    dir: &Path,
    key: &CacheKey,
    groups: &[LinearGroup],
    chunk: usize,
) -> Result<(NpuContext, GraphIds, CacheOutcome), NpuError> {
    load_or_build_with(device, dir, key, groups.len(), |context| build_groups(context, groups, chunk))
}

/// Builds and finalizes `groups`' graphs at `chunk` rows in `context`, returning each one's
/// tensor ids (what [`graphs`] retrieves them by).
pub fn build_groups(context: &NpuContext, groups: &[LinearGroup], chunk: usize) -> Result<GraphIds, NpuError> {
    let mut ids = Vec::with_capacity(groups.len());
    for g in groups {
        let io = build_linear_group(context, g, chunk)?.io();
        let input = io.inputs.first().map(|i| i.1).unwrap_or(0);
        ids.push((input, io.outputs.iter().map(|o| o.1).collect()));
    }
    Ok(ids)
}

/// A context of `graphs` graphs: loaded from `dir`'s cache file for `key` when there is a sound
/// one, else made by `build` (which builds and finalizes every graph in the context and returns
/// each one's tensor ids, in the order the caller retrieves them) and stored there. Both graph
/// families of the NPU (the W8A8 linear groups, HeteroLLM's fp16 matmuls) go through it.
pub fn load_or_build_with(
    device: &QnnDevice,
    dir: &Path,
    key: &CacheKey,
    graphs: usize,
    build: impl FnOnce(&NpuContext) -> Result<GraphIds, NpuError>,
) -> Result<(NpuContext, GraphIds, CacheOutcome), NpuError> {
    let path = path_for(dir, key)?;
    let reason = match read(&path, key) {
        Ok((header, bytes, at)) if header.ids.len() == graphs => match device.context_from_binary(&bytes[at]) {
            Ok(context) => return Ok((context, header.ids, CacheOutcome::Loaded)),
            Err(e) => format!("the library refused the cached binary: {e}"),
        },
        Ok(_) => "the cache file lists another number of graphs".into(),
        Err(why) => why,
    };
    let context = device.context()?;
    let ids = build(&context)?;
    let binary = context.0.binary()?;
    // A cache that cannot be written (a read-only or full disk) costs the next start a
    // finalize, not this one its graphs.
    let reason = match write(&path, &Header { key: key.clone(), ids: ids.clone() }, &binary) {
        Ok(()) => reason,
        Err(e) => format!("{reason}; not stored: {e}"),
    };
    Ok((context, ids, CacheOutcome::Built { reason }))
}

/// The key of a context of other graphs than [`key_for`]'s linear groups (HeteroLLM's fp16
/// matmuls): the library and chip as there, `chunk` and `graphs` as the caller counts them,
/// and the CRC-32 and FNV-1a 64 of `content` (every graph's name, shape and weights, fed by
/// the caller).
pub fn key_with(
    device: &QnnDevice,
    chunk: usize,
    graphs: usize,
    content: &mut dyn FnMut(&mut Feed<'_>),
) -> Result<CacheKey, NpuError> {
    let p = device.provider();
    let mut crc = crc32fast::Hasher::new();
    let mut fnv = 0xCBF2_9CE4_8422_2325u64;
    content(&mut |b: &[u8]| {
        crc.update(b);
        for &x in b {
            fnv = (fnv ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01B3);
        }
    });
    Ok(CacheKey {
        provider: p.name.clone(),
        build_id: device.build_id().to_owned(),
        core_api: p.core_api.clone(),
        backend_api: p.backend_api.clone(),
        soc: device.soc(),
        chunk,
        groups: graphs,
        groups_crc: crc.finalize(),
        groups_fnv: fnv,
    })
}

/// What [`key_with`]'s caller feeds its content to.
pub type Feed<'a> = dyn FnMut(&[u8]) + 'a;

/// The graphs of a context from [`load_or_build`], by the ids it returned.
pub fn graphs(
    context: &NpuContext,
    groups: &[LinearGroup],
    chunk: usize,
    ids: &[(u32, Vec<u32>)],
) -> Result<Vec<Graph>, NpuError> {
    groups
        .iter()
        .zip(ids)
        .map(|(g, (input, outputs))| {
            retrieve_linear_group(&context.0, g, chunk, *input, outputs).map_err(|e| match e {
                NpuError::Qnn(q) => {
                    NpuError::Shape { graph: graph_name(g, chunk), detail: format!("not retrieved: {q}") }
                }
                e => e,
            })
        })
        .collect()
}
