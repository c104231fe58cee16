//! A kernel benchmark harness in the manner of llm.c's `dev/cuda`: for every op case (the shapes of
//! the op-parity tests, [`cases`]) and every kernel version or launch configuration a backend offers
//! ([`KernelBench::versions`]), run the version on fresh random inputs, validate its output against the
//! CPU twin ([`CpuBackend`](crate::backend::cpu::CpuBackend) on the same bf16-rounded inputs, the
//! relative error of tests/cuda_ops.rs), and only then time it: warm-up runs, then timed runs each
//! after a flush of the last-level cache (L2 on a GPU), reporting the minimum and median and the
//! median's GB/s, TFLOP/s and share of the roofline (the case's bytes over the memory bandwidth or
//! its FLOPs over the matrix rate, whichever is larger: [`Cost`], [`Roofline`]).
//!
//! A version that fails validation is never timed: it is listed in [`Report::failures`], logged as an
//! error, and [`Report::ensure_valid`] turns it into an error. `recall kernels` is the command line
//! (docs/KERNELS.md); tests/kernel_bench.rs runs the validation on the CPU in CI.

mod cases;
mod cost;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod harness;
mod inputs;
mod ops;
mod report;
mod timing;

pub use cases::{cases, Case, CaseSet, Op, Shape};
pub use cost::{cost, Cost};
pub use harness::{check_version, run, tolerance, BF16_TOL, F32_TOL};
pub use ops::{
    add_rms_norm_unfused, dispatch, qk_write_composed, Operands, Out, Outs, Params, RunFn, Version,
};
pub use report::{Report, Row};
pub use timing::{Roofline, Timing};

use crate::backend::Backend;
use crate::error::Result;

/// What [`run`] benchmarks and how.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The case table(s).
    pub set: CaseSet,
    /// Only these ops (all when empty).
    pub ops: Vec<Op>,
    /// Validate every version, time none.
    pub validate_only: bool,
    /// Untimed runs before the timed ones.
    pub warmup: usize,
    /// Timed runs (each after a cache flush).
    pub iters: usize,
    /// Bytes written to flush the caches before each timed run [default: the backend's,
    /// [`KernelBench::default_flush_bytes`]].
    pub flush_bytes: Option<usize>,
    /// The roofline's memory bandwidth in GB/s [default: the backend's, [`KernelBench::roofline`]].
    pub peak_gbs: Option<f64>,
    /// The roofline's matrix rate in TFLOP/s [default: the backend's].
    pub peak_tflops: Option<f64>,
    /// Seed of the random inputs.
    pub seed: u64,
    /// Show a progress bar on the terminal.
    pub progress: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            set: CaseSet::Parity,
            ops: Vec::new(),
            validate_only: false,
            warmup: 2,
            iters: 10,
            flush_bytes: None,
            peak_gbs: None,
            peak_tflops: None,
            seed: 0x5eed,
            progress: false,
        }
    }
}

/// A backend the harness can benchmark: its versions of each op, how it flushes its caches and times
/// a run, and its roofline.
pub trait KernelBench: Backend + Sized {
    /// Memory whose writing evicts the cache the timed runs must not find warm.
    type Flush;

    /// The versions of `op`, [`Version::dispatch`] (the trait op) first.
    fn versions(&self, op: Op) -> Vec<Version<Self>> {
        vec![Version::dispatch(op)]
    }

    /// Bytes of the default flush: at least twice the last-level cache.
    fn default_flush_bytes(&self) -> usize;

    /// Allocates the flush memory.
    fn new_flush(&self, bytes: usize) -> Result<Self::Flush>;

    /// Writes all of the flush memory, evicting whatever a previous run left in the cache.
    fn flush_cache(&self, flush: &mut Self::Flush) -> Result<()>;

    /// Seconds one call of `run` takes on the device (wall time on a CPU; the kernels' device time
    /// on a GPU).
    fn time_run(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<f64>;

    /// Checked runs on (`true`) or timed runs (`false`): a GPU fills fresh outputs with NaN while
    /// checking, so that an element a kernel forgets to write fails validation.
    fn set_checking(&self, on: bool) {
        let _ = on;
    }

    /// The roofline: the given ceilings, measured or default ones for the rest.
    fn roofline(&self, gbs: Option<f64>, tflops: Option<f64>) -> Roofline;
}
