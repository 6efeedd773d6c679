//! Buffers in host memory, for the devices whose buffers are plain bytes on the host (the CPU
//! device; the NPU, whose memory a phone shares with the CPU): one allocation rule and one
//! bounds check for `alloc`, `write` and `read`, and those three for a device whose buffers are
//! [`HostBytes`].

use crate::{Buffer, BufferUsage, DeviceError, DeviceId, Event};
use std::sync::{Arc, Mutex, MutexGuard};

/// A buffer's memory on such a device: its bytes.
pub type HostBytes = Mutex<Vec<u8>>;

/// A buffer of `bytes` zeroed host bytes of device `id` (named `device`): its `alloc`.
pub fn alloc(id: DeviceId, device: &str, usage: BufferUsage, bytes: usize) -> Result<Buffer, DeviceError> {
    let mem: HostBytes = Mutex::new(zeroed(device, usage, bytes)?);
    Ok(Buffer::new(id, usage, bytes, Arc::new(mem)))
}

/// `b`'s bytes, if it is a host buffer of device `id`.
pub fn bytes<'a>(id: DeviceId, device: &str, b: &'a Buffer) -> Result<&'a HostBytes, DeviceError> {
    b.get::<HostBytes>(id)
        .ok_or_else(|| DeviceError::Invalid { device: device.to_owned(), detail: "a buffer of another device".into() })
}

/// Locks a host buffer's bytes (a panicked holder's bytes are still the buffer's).
pub fn lock(m: &HostBytes) -> MutexGuard<'_, Vec<u8>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A device's `write` to a host buffer: after `after`, synchronously.
pub fn write(
    id: DeviceId,
    device: &str,
    dst: &Buffer,
    offset: usize,
    src: &[u8],
    after: &[Event],
) -> Result<Event, DeviceError> {
    Event::wait_all(after)?;
    copy_in(device, &mut lock(bytes(id, device, dst)?), offset, src)?;
    Ok(Event::ready(Ok(())))
}

/// A device's `read` of a host buffer: after `after`, synchronously.
pub fn read(
    id: DeviceId,
    device: &str,
    src: &Buffer,
    offset: usize,
    dst: &mut [u8],
    after: &[Event],
) -> Result<(), DeviceError> {
    Event::wait_all(after)?;
    copy_out(device, &lock(bytes(id, device, src)?), offset, dst)
}

/// `bytes` zeroed bytes, or [`DeviceError::OutOfMemory`] when the host cannot give them.
pub fn zeroed(device: &str, usage: BufferUsage, bytes: usize) -> Result<Vec<u8>, DeviceError> {
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(bytes).map_err(|_| DeviceError::OutOfMemory { device: device.to_owned(), usage, bytes })?;
    v.resize(bytes, 0);
    Ok(v)
}

fn past_end(device: &str, what: &str) -> DeviceError {
    DeviceError::Invalid { device: device.to_owned(), detail: format!("{what} past the buffer's end") }
}

/// Copies `src` into `buf` at `offset` (a device's `write`).
pub fn copy_in(device: &str, buf: &mut [u8], offset: usize, src: &[u8]) -> Result<(), DeviceError> {
    let end = offset.checked_add(src.len()).filter(|&e| e <= buf.len()).ok_or_else(|| past_end(device, "write"))?;
    buf[offset..end].copy_from_slice(src);
    Ok(())
}

/// Copies `dst.len()` bytes of `buf` from `offset` into `dst` (a device's `read`).
pub fn copy_out(device: &str, buf: &[u8], offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
    let end = offset.checked_add(dst.len()).filter(|&e| e <= buf.len()).ok_or_else(|| past_end(device, "read"))?;
    dst.copy_from_slice(&buf[offset..end]);
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn copies_stay_inside_the_buffer() {
        let mut b = zeroed("d", BufferUsage::Activations, 8).unwrap();
        copy_in("d", &mut b, 4, &[1, 2, 3, 4]).unwrap();
        assert!(matches!(copy_in("d", &mut b, 5, &[1, 2, 3, 4]), Err(DeviceError::Invalid { .. })));
        assert!(matches!(copy_in("d", &mut b, usize::MAX, &[1]), Err(DeviceError::Invalid { .. })));
        let mut out = [0u8; 4];
        copy_out("d", &b, 4, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        assert!(matches!(copy_out("d", &b, 6, &mut out), Err(DeviceError::Invalid { .. })));
        assert!(matches!(
            zeroed("d", BufferUsage::Kv, usize::MAX),
            Err(DeviceError::OutOfMemory { usage: BufferUsage::Kv, .. })
        ));
    }
}
