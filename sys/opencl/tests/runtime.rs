//! Against a real OpenCL runtime (PoCL in CI: `scripts/setup-opencl.sh`). Without one the tests
//! say so and pass, unless `LLMD_REQUIRE_OPENCL=1` (set by `scripts/test.sh`), which makes a
//! missing runtime a failure.

#![allow(clippy::unwrap_used)]

use opencl_rt_sys::{Access, Arg, ClError, Context, Library};
use std::sync::mpsc;
use std::sync::Arc;

fn context() -> Option<Arc<Context>> {
    let required = std::env::var("LLMD_REQUIRE_OPENCL").is_ok_and(|v| v == "1");
    let lib = match Library::open(None) {
        Ok(l) => l,
        Err(e) if !required => {
            eprintln!("skipped: no OpenCL library ({e})");
            return None;
        }
        Err(e) => panic!("LLMD_REQUIRE_OPENCL=1 and {e}"),
    };
    let devs = lib.devices().unwrap();
    let Some(d) = devs.first() else {
        assert!(!required, "LLMD_REQUIRE_OPENCL=1 and {} has no device", lib.path());
        eprintln!("skipped: no OpenCL device");
        return None;
    };
    eprintln!("{} / {} ({}), {}", d.platform, d.name, d.kind, d.driver_version);
    Some(Context::new(&lib, d).unwrap())
}

const SRC: &str = "__kernel void axpy(__global const float* x, __global float* y, float a) {
    size_t i = get_global_id(0); y[i] += a * x[i];
}";

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn a_kernel_runs_and_its_program_comes_back_from_its_binary() {
    let Some(ctx) = context() else { return };
    let prog = ctx.program_from_source(SRC, "").unwrap();
    let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let xb = ctx.buffer_from(Access::ReadOnly, &f32s(&x), true).unwrap();
    let yb = ctx.buffer_from(Access::ReadWrite, &f32s(&vec![1.0; 1000]), false).unwrap();
    let k = prog.kernel("axpy").unwrap();
    ctx.enqueue(&k, &[Arg::Mem(&xb), Arg::Mem(&yb), Arg::F32(2.0)], &[1000], None).unwrap();
    let (tx, rx) = mpsc::channel();
    ctx.on_done(Box::new(move |r| tx.send(r).unwrap())).unwrap();
    assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(60)).unwrap(), Ok(()));
    let mut out = vec![0u8; 4000];
    ctx.read(&yb, 0, &mut out).unwrap();
    let y: Vec<f32> = out.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert!(y.iter().enumerate().all(|(i, &v)| v == 1.0 + 2.0 * i as f32));
    let s = ctx.stats();
    assert_eq!((s.kernels, s.host_waits, s.bytes_from_device), (1, 1, 4000));

    // Its binary builds again, and the kernel gives the same result.
    let bin = prog.binary().unwrap();
    assert!(!bin.is_empty());
    let again = ctx.program_from_binary(&bin, "").unwrap();
    ctx.enqueue(&again.kernel("axpy").unwrap(), &[Arg::Mem(&xb), Arg::Mem(&yb), Arg::F32(-2.0)], &[1000], None)
        .unwrap();
    ctx.read(&yb, 0, &mut out).unwrap();
    assert!(out.chunks_exact(4).all(|c| f32::from_le_bytes(c.try_into().unwrap()) == 1.0));
}

#[test]
fn bad_source_bad_binaries_and_bad_arguments_are_errors() {
    let Some(ctx) = context() else { return };
    let e = ctx.program_from_source("__kernel void f() { undeclared = 1; }", "").err().unwrap();
    assert!(matches!(&e, ClError::Build { log } if log.contains("undeclared")), "{e}");
    assert!(ctx.program_from_binary(b"not a binary", "").is_err());
    let prog = ctx.program_from_source(SRC, "").unwrap();
    assert!(prog.kernel("nope").is_err());
    let yb = ctx.buffer(Access::ReadWrite, 16).unwrap();
    let mut big = vec![0u8; 32];
    assert!(ctx.read(&yb, 0, &mut big).is_err(), "past the buffer's end");
    assert!(ctx.write(&yb, 8, &[0; 16]).is_err(), "past the buffer's end");
}

/// Host bytes of our own for a shared buffer, and a flag set when they are dropped.
struct Owned(Vec<u8>, Arc<std::sync::atomic::AtomicBool>);

impl AsRef<[u8]> for Owned {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        self.1.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_buffer_over_host_memory_is_read_in_place_and_holds_it_until_released() {
    let Some(ctx) = context() else { return };
    let prog = ctx.program_from_source(SRC, "").unwrap();
    let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut bytes = vec![0u8; 64];
    bytes.extend(f32s(&x));
    let owned: opencl_rt_sys::SharedBytes = Arc::new(Owned(bytes, dropped.clone()));
    // Past the end, or empty: refused.
    assert!(ctx.buffer_shared(owned.clone(), 64..4065).is_err());
    assert!(ctx.buffer_shared(owned.clone(), 64..64).is_err());
    let xb = ctx.buffer_shared(owned.clone(), 64..4064).unwrap();
    assert_eq!(xb.len(), 4000);
    drop(owned);
    assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst), "the buffer holds its host memory");
    let yb = ctx.buffer_from(Access::ReadWrite, &f32s(&vec![1.0; 1000]), false).unwrap();
    let k = prog.kernel("axpy").unwrap();
    ctx.enqueue(&k, &[Arg::Mem(&xb), Arg::Mem(&yb), Arg::F32(2.0)], &[1000], None).unwrap();
    let before = ctx.stats();
    // Released while the kernel may still run: the drop waits for the queue first.
    drop(xb);
    assert!(dropped.load(std::sync::atomic::Ordering::SeqCst), "released with the buffer");
    let mut out = vec![0u8; 4000];
    ctx.read(&yb, 0, &mut out).unwrap();
    let y: Vec<f32> = out.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert!(y.iter().enumerate().all(|(i, &v)| v == 1.0 + 2.0 * i as f32));
    // Nothing was copied to the device for it.
    assert_eq!(before.bytes_to_device, 4000, "only y's 4000 bytes went up");
}

#[test]
fn a_copy_between_buffers_lands_at_its_offset_and_a_range_past_either_end_is_refused() {
    let Some(ctx) = context() else { return };
    let src = ctx.buffer_from(Access::ReadOnly, &(0u8..64).collect::<Vec<_>>(), false).unwrap();
    let dst = ctx.buffer_from(Access::ReadWrite, &[0xffu8; 48], false).unwrap();
    // Unaligned offsets on both sides (a group's projections land at any float).
    ctx.copy(&src, 5, &dst, 7, 20).unwrap();
    let mut out = vec![0u8; 48];
    ctx.read(&dst, 0, &mut out).unwrap();
    let mut want = vec![0xffu8; 48];
    want[7..27].copy_from_slice(&(5u8..25).collect::<Vec<_>>());
    assert_eq!(out, want);
    for (so, dof, n) in [(50, 0, 20), (0, 40, 20), (usize::MAX, 0, 2), (0, 0, 65)] {
        assert!(matches!(ctx.copy(&src, so, &dst, dof, n), Err(ClError::Invalid(_))), "{so} {dof} {n}");
    }
    ctx.copy(&src, 64, &dst, 48, 0).unwrap();
}
