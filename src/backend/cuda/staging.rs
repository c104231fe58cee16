//! Page-locked host memory, and the pinned ring that direct (unrecorded) ops copy their host inputs
//! through.
//!
//! From pageable memory the driver has to bounce a host-to-device copy through its own pinned
//! buffers, and the call may block the host until earlier work on the stream has drained (CUDA leaves
//! this to the driver: see "API synchronization behavior"); every op that uploads metadata (block
//! tables, row indices, tile records) could then wait for all queued GPU work, and the host would
//! never run ahead of the device. From page-locked memory the copy is a true asynchronous DMA and the
//! call returns at once. The ring has two halves; bytes are written into the current half and copied
//! on the stream. When a half is full the ring records an event behind its last copy and moves to the
//! other half, first waiting for that half's event: the host never overwrites bytes a queued copy has
//! yet to read, and it only waits for copies queued a whole half of data ago.

use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream};

use super::libs::cuda_err;
use crate::error::Result;

/// Bytes per half of the direct-mode ring. Per-op metadata is a few KB; the rotary tables of a
/// 4096-row prefill chunk are 1 MiB each. Larger arrays (a screenshot's pixels) take the pageable
/// path, which synchronises, once per image.
pub(super) const RING_HALF_BYTES: usize = 8 << 20;
/// Arrays start on cache-line boundaries of the ring (not needed for correctness).
const ALIGN: usize = 64;

/// Pinned host memory (page-locked, so copies from it are true async DMAs).
pub(super) struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is owned by this struct and only used under the owner's mutex.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(super) fn new(len: usize) -> Result<Self> {
        // SAFETY: a fresh page-locked allocation of `len` bytes, freed once in Drop.
        let ptr =
            unsafe { result::malloc_host(len, 0) }.map_err(|e| cuda_err(format!("pinned alloc: {e:?}")))?;
        Ok(Pinned {
            ptr: ptr as *mut u8,
            len,
        })
    }

    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host` in `new`.
        unsafe {
            let _ = result::free_host(self.ptr as *mut std::ffi::c_void);
        }
    }
}

/// Where the next array goes: `(half, offset in it)`, and whether the ring must switch halves first.
fn place(current: usize, used: usize, len: usize, half: usize) -> Option<(usize, usize, bool)> {
    if len > half {
        return None;
    }
    if used + len > half {
        Some((current ^ 1, 0, true))
    } else {
        Some((current, used, false))
    }
}

/// The two-half pinned ring of direct-mode copies (see the module comment).
pub(super) struct PinnedRing {
    buf: Pinned,
    half: usize,
    current: usize,
    used: usize,
    /// Recorded behind the last copy out of each half when the ring left it.
    fences: [Option<CudaEvent>; 2],
}

impl PinnedRing {
    pub(super) fn new(half: usize) -> Result<Self> {
        Ok(PinnedRing {
            buf: Pinned::new(2 * half)?,
            half,
            current: 0,
            used: 0,
            fences: [None, None],
        })
    }

    /// Queues a copy of `bytes` to device address `dst` on `stream` through the ring; `false`
    /// (nothing queued) when `bytes` is larger than a half.
    pub(super) fn copy(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        bytes: &[u8],
        dst: u64,
    ) -> Result<bool> {
        let Some((half, off, switch)) = place(self.current, self.used, bytes.len(), self.half) else {
            return Ok(false);
        };
        if switch {
            self.switch_halves(ctx, stream)?;
        }
        let start = half * self.half + off;
        // SAFETY: `start + len` lies inside the buffer (`place`); no queued copy reads this range: the
        // half's previous copies completed (its fence was waited for when the ring entered it).
        let src = unsafe {
            let p = self.buf.ptr().add(start);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
            std::slice::from_raw_parts(p as *const u8, bytes.len())
        };
        // SAFETY: `dst` holds at least `bytes.len()` bytes (the caller's fresh allocation).
        unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(|e| cuda_err(format!("host to device copy: {e:?}")))?;
        self.used = (off + bytes.len()).div_ceil(ALIGN) * ALIGN;
        Ok(true)
    }

    /// Fences the current half and enters the other one once its last copies have run.
    fn switch_halves(&mut self, ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<()> {
        let fence = ctx
            .new_event(None)
            .map_err(|e| cuda_err(format!("event: {e:?}")))?;
        fence
            .record(stream)
            .map_err(|e| cuda_err(format!("event: {e:?}")))?;
        self.fences[self.current] = Some(fence);
        self.current ^= 1;
        self.used = 0;
        if let Some(done) = self.fences[self.current].take() {
            done.synchronize()
                .map_err(|e| cuda_err(format!("staging fence: {e:?}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::place;

    #[test]
    fn arrays_fill_a_half_then_switch_and_oversize_ones_are_refused() {
        assert_eq!(place(0, 0, 100, 1000), Some((0, 0, false)));
        assert_eq!(place(0, 900, 100, 1000), Some((0, 900, false)), "exactly full");
        assert_eq!(place(0, 901, 100, 1000), Some((1, 0, true)));
        assert_eq!(place(1, 500, 600, 1000), Some((0, 0, true)));
        assert_eq!(place(0, 0, 1001, 1000), None);
    }
}
