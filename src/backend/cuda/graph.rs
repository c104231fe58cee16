//! CUDA graphs for decode steps: record the device work of a step once, replay it for every later
//! step of the same shape.
//!
//! A decode step of an 8B model is ~600 small launches; launching them one by one from the host costs
//! more than the GPU needs to run them. A graph removes that cost, but replays exactly the recorded
//! launches: the same kernels, launch configurations and parameter bytes (device addresses included).
//! Three things make a step replayable without changing the model code:
//!
//! * **Step memory.** While a step is recorded or replayed, every buffer an op allocates comes from a
//!   fixed arena through a deterministic first-fit allocator, so the same sequence of allocations and
//!   frees yields the same addresses every time. Buffers are reclaimed at the start of the next step.
//! * **Staged inputs.** Host data an op needs on the device (token ids, rotary tables, block tables,
//!   pool slots, attention metadata) is written into a pinned host buffer at deterministic offsets and
//!   copied to a fixed device buffer with one copy right before the graph runs. Identical arrays within
//!   a step share one staged copy, so per-layer metadata is copied once per step, not once per layer.
//! * **A launch trace.** Every launch, GEMM and device copy is hashed (name, grid, block, shared
//!   memory, every parameter field). Replay runs the model's host code again with launches skipped and
//!   compares each hash with the recording; the graph is launched only when the whole trace matches.
//!   Otherwise the recording is dropped and the step runs directly. So a replayed step does exactly
//!   what the direct run would do, bit for bit, and a shape the recording did not foresee (a longer
//!   context that changes a launch) costs one direct step and a new recording, never a wrong result.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr};
use xxhash_rust::xxh64::Xxh64;

pub(super) use super::capture::Mode;
use super::capture::StepGraph;
use super::libs::cuda_err;
use super::staging::Pinned;
use crate::backend::{StepKey, StepStats};
use crate::error::Result;

/// Alignment of step allocations and staged arrays (cuBLASLt and 16-byte vector loads want ≥ 16).
const ALIGN: usize = 256;
/// Initial step arena (grows by doubling when a recording runs out). A decode step's peak is a few
/// activations plus the split-K partials: ~70 MB for 64 rows of the 8B shape.
const ARENA_BYTES: usize = 256 << 20;
/// Initial staging buffers.
const STAGING_BYTES: usize = 1 << 20;
/// Failed recordings of one step key before it runs directly for good. A key whose capture keeps
/// failing (e.g. its host code reads device data) would otherwise be captured and then run again
/// directly on every step: twice the host work, forever.
const MAX_RECORD_FAILURES: u32 = 3;

/// First-fit allocator over `[0, cap)` with coalescing frees. Deterministic: the same calls give the
/// same offsets.
#[derive(Debug)]
struct FirstFit {
    cap: usize,
    free: Vec<(usize, usize)>, // sorted, disjoint (offset, len)
    epoch: u64,
}

impl FirstFit {
    fn new(cap: usize) -> Self {
        FirstFit {
            cap,
            free: vec![(0, cap)],
            epoch: 0,
        }
    }

    fn reset(&mut self) {
        self.free = vec![(0, self.cap)];
        self.epoch += 1;
    }

    fn alloc(&mut self, len: usize) -> Option<usize> {
        let len = len.max(1).div_ceil(ALIGN) * ALIGN;
        let i = self.free.iter().position(|&(_, l)| l >= len)?;
        let (off, l) = self.free[i];
        if l == len {
            self.free.remove(i);
        } else {
            self.free[i] = (off + len, l - len);
        }
        Some(off)
    }

    fn release(&mut self, off: usize, len: usize, epoch: u64) {
        if epoch != self.epoch {
            return; // the arena was reset since: the block is already free
        }
        let len = len.max(1).div_ceil(ALIGN) * ALIGN;
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, len));
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// A buffer in step memory; returned to the arena on drop (unless the arena was reset since).
#[derive(Debug)]
pub(super) struct Lease {
    arena: Arc<Mutex<FirstFit>>,
    off: usize,
    len: usize,
    epoch: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Ok(mut a) = self.arena.lock() {
            a.release(self.off, self.len, self.epoch);
        }
    }
}

/// Failed recordings per step key, and the keys given up on.
#[derive(Debug, Default)]
struct Failures {
    counts: HashMap<StepKey, u32>,
    given_up: HashSet<StepKey>,
}

impl Failures {
    /// Counts a failed recording of `key`; true when this failure makes it give up on the key.
    fn fail(&mut self, key: StepKey) -> bool {
        let n = self.counts.entry(key).or_insert(0);
        *n += 1;
        *n >= MAX_RECORD_FAILURES && self.given_up.insert(key)
    }

    fn given_up(&self, key: StepKey) -> bool {
        self.given_up.contains(&key)
    }
}

/// One recorded step.
struct Recording {
    graph: StepGraph,
    trace: Vec<u64>,
}

/// The step state of a backend (behind its mutex).
pub(super) struct Steps {
    pub(super) mode: Mode,
    enabled: bool,
    arena: Option<(CudaSlice<u8>, Arc<Mutex<FirstFit>>)>,
    arena_bytes: usize,
    pinned: Option<Pinned>,
    staging: Option<CudaSlice<u8>>,
    staging_bytes: usize,
    staged: usize,
    memo: HashMap<u64, usize>,
    trace: Vec<u64>,
    cursor: usize,
    mismatch: bool,
    overflow: bool,
    recordings: HashMap<StepKey, Recording>,
    /// Keys run directly once already: the first step of a key warms up (cuBLASLt plans, lazily
    /// loaded library kernels) outside any capture; the second is recorded.
    warmed: HashSet<StepKey>,
    failures: Failures,
    stats: StepStats,
}

impl Steps {
    pub(super) fn new() -> Self {
        Steps {
            mode: Mode::Direct,
            enabled: std::env::var("RECALL_CUDA_GRAPHS").map_or(true, |v| v != "0" && v != "off"),
            arena: None,
            arena_bytes: ARENA_BYTES,
            pinned: None,
            staging: None,
            staging_bytes: STAGING_BYTES,
            staged: 0,
            memo: HashMap::new(),
            trace: Vec::new(),
            cursor: 0,
            mismatch: false,
            overflow: false,
            recordings: HashMap::new(),
            warmed: HashSet::new(),
            failures: Failures::default(),
            stats: StepStats::default(),
        }
    }

    pub(super) fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        if !on {
            self.recordings.clear();
        }
    }

    pub(super) fn stats(&self) -> StepStats {
        self.stats
    }

    /// Called by every launch, GEMM and device copy with the hash of what it would do: `true` when it
    /// must actually be issued.
    pub(super) fn on_launch(&mut self, hash: u64) -> bool {
        match self.mode {
            Mode::Direct => true,
            Mode::Record => {
                self.trace.push(hash);
                true
            }
            Mode::Replay => {
                if self.trace.get(self.cursor) != Some(&hash) {
                    self.mismatch = true;
                }
                self.cursor += 1;
                false
            }
        }
    }

    /// A step-memory buffer of `len` bytes: `(device address, lease)`; `None` when the arena is full
    /// (the step then runs directly and the arena grows).
    pub(super) fn alloc(&mut self, len: usize) -> Option<(u64, Lease)> {
        let (buf, arena) = self.arena.as_ref()?;
        let (off, epoch) = {
            let mut a = arena.lock().ok()?;
            (a.alloc(len), a.epoch)
        };
        let Some(off) = off else {
            self.overflow = true;
            return None;
        };
        let (base, _) = buf.device_ptr(buf.stream());
        Some((
            base + off as u64,
            Lease {
                arena: arena.clone(),
                off,
                len,
                epoch,
            },
        ))
    }

    /// Stages `bytes` for the device; returns their device address, or `None` when staging is full.
    /// `dedup`: the call site's id, under which identical arrays share one copy (`None`: a copy of
    /// its own, for data an op may write).
    pub(super) fn stage(&mut self, bytes: &[u8], dedup: Option<u64>) -> Option<u64> {
        let key = xxhash_rust::xxh64::xxh64(bytes, dedup.unwrap_or(0) ^ bytes.len() as u64);
        let hit = self
            .memo
            .get(&key)
            .filter(|_| dedup.is_some())
            .copied()
            .filter(|&off| self.staged_bytes(off, bytes.len()) == Some(bytes));
        let off = match hit {
            Some(off) => off,
            None => {
                let off = self.staged;
                let end = off + bytes.len();
                let pinned = self.pinned.as_ref()?;
                if end > pinned.len() {
                    self.overflow = true;
                    return None;
                }
                // SAFETY: `off..end` lies inside the pinned buffer, which no copy reads concurrently
                // (the previous step's copy completed: `begin` synchronises on it).
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), pinned.ptr().add(off), bytes.len()) };
                self.staged = end.div_ceil(ALIGN) * ALIGN;
                if dedup.is_some() {
                    self.memo.insert(key, off);
                }
                off
            }
        };
        let dev = self.staging.as_ref()?;
        let (base, _) = dev.device_ptr(dev.stream());
        Some(base + off as u64)
    }

    /// `len` staged bytes at `off` (a hash hit is confirmed against them: equal hashes are not enough).
    fn staged_bytes(&self, off: usize, len: usize) -> Option<&[u8]> {
        let pinned = self.pinned.as_ref()?;
        // SAFETY: only offsets below `staged` (inside the buffer, written this step) are asked for.
        (off + len <= self.staged.min(pinned.len()))
            .then(|| unsafe { std::slice::from_raw_parts(pinned.ptr().add(off), len) })
    }

    fn ensure_buffers(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if self.arena.is_none() {
            let buf = stream
                .alloc_zeros::<u8>(self.arena_bytes)
                .map_err(|e| cuda_err(format!("step arena of {} MiB: {e:?}", self.arena_bytes >> 20)))?;
            self.arena = Some((buf, Arc::new(Mutex::new(FirstFit::new(self.arena_bytes)))));
        }
        if self.staging.is_none() {
            self.pinned = Some(Pinned::new(self.staging_bytes)?);
            let dev = stream
                .alloc_zeros::<u8>(self.staging_bytes)
                .map_err(|e| cuda_err(format!("staging buffer: {e:?}")))?;
            self.staging = Some(dev);
        }
        Ok(())
    }

    /// Prepares a step: fresh step memory, empty staging, the trace to record or to compare with.
    /// Returns the mode the step runs in.
    pub(super) fn begin(&mut self, key: StepKey, stream: &Arc<CudaStream>) -> Result<Mode> {
        let first = |s: &mut Self| !s.recordings.contains_key(&key) && s.warmed.insert(key);
        if !self.enabled || self.failures.given_up(key) || first(self) {
            self.mode = Mode::Direct;
            self.stats.direct += 1;
            return Ok(Mode::Direct);
        }
        // The previous step's staging copy must be done before the host overwrites the buffer.
        stream
            .synchronize()
            .map_err(|e| cuda_err(format!("synchronize: {e:?}")))?;
        self.ensure_buffers(stream)?;
        if let Some((_, a)) = &self.arena {
            a.lock()
                .map_err(|_| cuda_err("step arena lock poisoned"))?
                .reset();
        }
        self.staged = 0;
        self.memo.clear();
        self.mismatch = false;
        self.overflow = false;
        self.cursor = 0;
        self.mode = match self.recordings.get(&key) {
            Some(r) => {
                self.trace = r.trace.clone();
                Mode::Replay
            }
            None => {
                self.trace.clear();
                Mode::Record
            }
        };
        Ok(self.mode)
    }

    /// After a replayed run of the step's host code: whether the trace matched (then the staged
    /// inputs are copied and the graph launched).
    pub(super) fn finish_replay(&mut self, key: StepKey, stream: &Arc<CudaStream>) -> Result<bool> {
        self.mode = Mode::Direct;
        let ok = !self.mismatch && !self.overflow && self.cursor == self.trace.len();
        if !ok {
            tracing::debug!("step {key:?}: launches differ from the recording; running directly");
            self.recordings.remove(&key);
            return Ok(false);
        }
        self.copy_staged(stream)?;
        let r = self
            .recordings
            .get(&key)
            .ok_or_else(|| cuda_err("recording vanished"))?;
        r.graph.launch(stream)?;
        self.stats.replayed += 1;
        Ok(true)
    }

    /// After a recorded run: stores the graph and runs it on this step's staged inputs.
    pub(super) fn finish_record(
        &mut self,
        key: StepKey,
        graph: Option<StepGraph>,
        stream: &Arc<CudaStream>,
    ) -> Result<bool> {
        self.mode = Mode::Direct;
        let Some(graph) = graph.filter(|_| !self.overflow) else {
            self.grow_if_full();
            return Ok(false);
        };
        self.copy_staged(stream)?;
        graph.launch(stream)?;
        let trace = std::mem::take(&mut self.trace);
        self.recordings.insert(key, Recording { graph, trace });
        self.stats.recorded += 1;
        Ok(true)
    }

    /// A recording of `key` failed (the caller then runs the step directly): counted, and after
    /// [`MAX_RECORD_FAILURES`] the key is given up on with a warning.
    pub(super) fn record_failed(&mut self, key: StepKey) {
        self.stats.failed_recordings += 1;
        if self.failures.fail(key) {
            self.stats.given_up += 1;
            tracing::warn!(
                "step {key:?}: recording failed {MAX_RECORD_FAILURES} times; running it directly from now on"
            );
        }
    }

    /// A failed recording or replay: back to direct mode (growing what overflowed).
    pub(super) fn abandon(&mut self, key: StepKey) {
        self.mode = Mode::Direct;
        self.recordings.remove(&key);
        self.grow_if_full();
        self.stats.direct += 1;
    }

    fn grow_if_full(&mut self) {
        if !self.overflow {
            return;
        }
        // Recordings hold addresses in the old buffers: all of them go.
        self.recordings.clear();
        self.arena = None;
        self.staging = None;
        self.pinned = None;
        self.arena_bytes *= 2;
        self.staging_bytes *= 2;
        self.overflow = false; // grown once per overflow, however many paths report it
        tracing::info!(
            "step memory grown to {} MiB arena, {} MiB staging",
            self.arena_bytes >> 20,
            self.staging_bytes >> 20
        );
    }

    fn copy_staged(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if self.staged == 0 {
            return Ok(());
        }
        let (Some(pinned), Some(dev)) = (&self.pinned, &self.staging) else {
            return Err(cuda_err("staging buffers missing"));
        };
        let (dst, _) = dev.device_ptr(stream);
        // SAFETY: both buffers hold at least `staged` bytes; the pinned buffer is not written again
        // before the next `begin`, which synchronises the stream first.
        let src = unsafe { std::slice::from_raw_parts(pinned.ptr(), self.staged) };
        unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(|e| cuda_err(format!("staging copy: {e:?}")))
    }
}

/// Hash of one launch for the trace.
pub(super) fn launch_hash(
    name: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    fields: impl FnOnce(&mut Xxh64),
) -> u64 {
    let mut h = Xxh64::new(0);
    h.update(name.as_bytes());
    for v in [grid.0, grid.1, grid.2, block.0, block.1, block.2, smem] {
        h.update(&v.to_le_bytes());
    }
    fields(&mut h);
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::{Failures, FirstFit, MAX_RECORD_FAILURES};
    use crate::backend::StepKey;

    #[test]
    fn a_key_is_given_up_after_repeated_failures_only() {
        let (a, b) = (StepKey { rows: 1, tag: 0 }, StepKey { rows: 2, tag: 0 });
        let mut f = Failures::default();
        for i in 1..MAX_RECORD_FAILURES {
            assert!(!f.fail(a), "gave up after {i} failures");
            assert!(!f.given_up(a));
        }
        assert!(f.fail(a), "the last allowed failure gives up");
        assert!(f.given_up(a) && !f.given_up(b), "only the failing key");
        assert!(!f.fail(a), "given up once, counted once");
    }

    #[test]
    fn first_fit_is_deterministic_and_coalesces() {
        let run = || {
            let mut a = FirstFit::new(1 << 20);
            let x = a.alloc(1000).unwrap();
            let y = a.alloc(5000).unwrap();
            let z = a.alloc(300).unwrap();
            a.release(y, 5000, 0);
            let w = a.alloc(4000).unwrap();
            a.release(x, 1000, 0);
            a.release(z, 300, 0);
            a.release(w, 4000, 0);
            (x, y, z, w, a.free.clone())
        };
        let (x, y, z, w, free) = run();
        assert_eq!((x, y, z, w), (0, 1024, 6144, 1024));
        assert_eq!(free, vec![(0, 1 << 20)]);
        assert_eq!(run(), (x, y, z, w, free));
    }

    #[test]
    fn release_after_reset_is_ignored() {
        let mut a = FirstFit::new(4096);
        let x = a.alloc(256).unwrap();
        a.reset();
        a.release(x, 256, 0);
        assert_eq!(a.free, vec![(0, 4096)]);
        assert!(a.alloc(8192).is_none());
    }
}
