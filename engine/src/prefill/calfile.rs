//! A model's calibration for the NPU path, kept with its NPU artefacts (beside the context
//! cache): a second start reads it instead of running the calibration text through the model
//! twice. Keyed by the model (its shapes and the bytes of two of its weights) and the
//! calibration tokens; read strictly — a file of another model, text or format, a short or
//! damaged one, is ignored and rewritten.

use crate::backend::blocks::CaptureSite;
use crate::error::NpuError;
use crate::model::Transformer;
use crate::prefill::{Calibration, SiteRanges};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"LLMDCAL1";

/// The key of `t` calibrated on `tokens`: a 64-bit FNV-1a over the model's shapes, the first
/// 64 KiB of layer 0's Q weight and of the last layer's down weight (as stored), and the tokens.
pub fn key(t: &Transformer, tokens: &[u32]) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01B3);
        }
    };
    let c = &t.config;
    for v in [c.n_layers, c.d_model, c.ffn_dim, c.n_heads, c.n_kv_heads, c.vocab_size] {
        eat(&(v as u64).to_le_bytes());
    }
    for w in [t.weights.layers.first().map(|l| &l.wq), t.weights.layers.last().map(|l| &l.w_down)].into_iter().flatten()
    {
        eat(w.name.as_bytes());
        match w.source_bytes() {
            Some(b) => eat(&b[..b.len().min(64 << 10)]),
            None => {
                let mut row = vec![0f32; w.cols];
                if crate::backend::npu::linears::dequantize_row(w, 0, &mut row).is_ok() {
                    row.iter().for_each(|v| eat(&v.to_le_bytes()));
                }
            }
        }
    }
    for tok in tokens {
        eat(&tok.to_le_bytes());
    }
    h
}

/// The calibration file for `key` in `dir`.
pub fn path(dir: &Path, key: u64) -> PathBuf {
    dir.join(format!("npu-calibration-{key:016x}.bin"))
}

struct W(Vec<u8>);

impl W {
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f32(&mut self, v: f32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f32s(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        v.iter().for_each(|x| self.f32(*x));
    }
}

/// The file's bytes.
pub fn encode(cal: &Calibration, key: u64) -> Vec<u8> {
    let mut w = W(MAGIC.to_vec());
    w.u64(key);
    w.u64(cal.tokens as u64);
    w.u64(cal.layers.len() as u64);
    for r in cal.layers.iter().flatten() {
        w.f32(r.input.0);
        w.f32(r.input.1);
        w.f32(r.tau);
        w.u64(r.values);
        w.u64(r.outputs.len() as u64);
        for (i, &(lo, hi)) in r.outputs.iter().enumerate() {
            w.f32(lo);
            w.f32(hi);
            let (mins, maxs) = r.output_channels.get(i).map_or((&[][..], &[][..]), |(a, b)| (&a[..], &b[..]));
            w.f32s(mins);
            w.f32s(maxs);
        }
        w.f32s(&r.channel_min);
        w.f32s(&r.channel_max);
        w.u64(r.outlier_counts.len() as u64);
        r.outlier_counts.iter().for_each(|c| w.u64(*c));
    }
    let crc = crc32fast::hash(&w.0);
    w.0.extend_from_slice(&crc.to_le_bytes());
    w.0
}

struct R<'a>(&'a [u8]);

impl R<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err("truncated".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().map_err(|_| "truncated")?))
    }
    fn f32(&mut self) -> Result<f32, String> {
        let b = self.take(4)?;
        Ok(f32::from_le_bytes(b.try_into().map_err(|_| "truncated")?))
    }
    /// A length that the rest of the file can hold at `each` bytes per item.
    fn len(&mut self, each: usize) -> Result<usize, String> {
        let n = self.u64()?;
        if n > (self.0.len() / each.max(1)) as u64 {
            return Err(format!("a length of {n} past the end of the file"));
        }
        Ok(n as usize)
    }
    fn f32s(&mut self) -> Result<Vec<f32>, String> {
        let n = self.len(4)?;
        (0..n).map(|_| self.f32()).collect()
    }
}

/// The calibration in `bytes`, if they are a sound file for `key` and a model of `layers`
/// layers.
pub fn decode(bytes: &[u8], key: u64, layers: usize) -> Result<Calibration, String> {
    if bytes.len() < MAGIC.len() + 4 || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not a calibration file".into());
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err("damaged (CRC mismatch)".into());
    }
    let mut r = R(&body[MAGIC.len()..]);
    if r.u64()? != key {
        return Err("another model or calibration text".into());
    }
    let tokens = r.u64()? as usize;
    let n = r.u64()?;
    if n != layers as u64 {
        return Err(format!("{n} layers, the model has {layers}"));
    }
    let mut out = Vec::with_capacity(layers);
    for _ in 0..layers {
        let mut l: [SiteRanges; 4] = Default::default();
        for s in [CaptureSite::Qkv, CaptureSite::O, CaptureSite::GateUp, CaptureSite::Down] {
            let x = &mut l[s as usize];
            x.input = (r.f32()?, r.f32()?);
            x.tau = r.f32()?;
            x.values = r.u64()?;
            let np = r.len(8)?;
            for _ in 0..np {
                x.outputs.push((r.f32()?, r.f32()?));
                let (a, b) = (r.f32s()?, r.f32s()?);
                x.output_channels.push((a, b));
            }
            x.channel_min = r.f32s()?;
            x.channel_max = r.f32s()?;
            let nc = r.len(8)?;
            x.outlier_counts = (0..nc).map(|_| r.u64()).collect::<Result<_, _>>()?;
        }
        out.push(l);
    }
    if !r.0.is_empty() {
        return Err("trailing bytes".into());
    }
    Ok(Calibration { layers: out, tokens })
}

/// The calibration of `t` on `tokens`: read from `dir` when a sound file is there, else
/// computed by `calibrate` and written there (atomically; a write that fails is only logged).
/// Returns it and whether it was read.
pub fn load_or_calibrate(
    dir: Option<&Path>,
    t: &Transformer,
    tokens: &[u32],
    calibrate: impl FnOnce() -> Result<Calibration, crate::error::EngineError>,
) -> Result<(Calibration, bool), crate::error::EngineError> {
    let Some(dir) = dir else { return Ok((calibrate()?, false)) };
    let k = key(t, tokens);
    let file = path(dir, k);
    if let Ok(bytes) = std::fs::read(&file) {
        match decode(&bytes, k, t.config.n_layers) {
            Ok(cal) => return Ok((cal, true)),
            Err(e) => tracing::info!(file = %file.display(), "calibration file not used: {e}"),
        }
    }
    let cal = calibrate()?;
    let tmp = file.with_extension("tmp");
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, encode(&cal, k)))
        .and_then(|()| std::fs::rename(&tmp, &file));
    if let Err(e) = written {
        tracing::warn!(file = %file.display(), "the calibration could not be saved: {e}");
        let _ = std::fs::remove_file(&tmp);
    }
    Ok((cal, false))
}

/// Refuses nothing it should read: used by the tests and the fuzzer alike.
pub fn roundtrip_ok(cal: &Calibration, key: u64) -> Result<(), NpuError> {
    let back = decode(&encode(cal, key), key, cal.layers.len()).map_err(NpuError::Cache)?;
    if &back == cal {
        Ok(())
    } else {
        Err(NpuError::Cache("the calibration changed in a round trip".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Calibration {
        let mut l: [SiteRanges; 4] = Default::default();
        for (i, r) in l.iter_mut().enumerate() {
            r.input = (-1.0 - i as f32, 2.0);
            r.tau = 0.5;
            r.values = 99;
            r.outputs = vec![(-3.0, 4.0), (-1.0, 1.0)];
            r.output_channels = vec![(vec![-1.0, -2.0], vec![1.0, 2.0]), (vec![0.0], vec![0.5])];
            r.channel_min = vec![-0.1, -0.2, -0.3];
            r.channel_max = vec![0.1, 0.2, 0.3];
            r.outlier_counts = vec![0, 7, 1];
        }
        Calibration { layers: vec![l.clone(), l], tokens: 42 }
    }

    #[test]
    fn a_calibration_file_round_trips_and_a_bad_one_is_refused() {
        let cal = sample();
        roundtrip_ok(&cal, 7).expect("round trip");
        let bytes = encode(&cal, 7);
        assert!(decode(&bytes, 8, 2).is_err(), "another key");
        assert!(decode(&bytes, 7, 3).is_err(), "another layer count");
        for cut in [0, 5, 12, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode(&bytes[..cut], 7, 2).is_err(), "truncated at {cut}");
        }
        let mut flipped = bytes.clone();
        flipped[40] ^= 1;
        assert!(decode(&flipped, 7, 2).is_err(), "a flipped bit");
    }
}
