//! The CUDA backend's versions: the trait op (`dispatch`, what the models run) and every other kernel
//! or mode the backend lets a caller choose — the v1 / flash / flash-v1 / decode-v2 attention kernels,
//! `RECALL_ATTN=v1` (forced-v1) and batch-invariant mode, the unfused `add_rms_norm` and the composed
//! `qk_norm_rope_write`. Timed with CUDA events around each launch (the backend's profiler): device
//! time of the kernels, without launch gaps or host work.

use super::ops::{add_rms_norm_unfused, dispatch, qk_write_composed, Operands, Out, Outs, RunFn, Version};
use super::timing::Roofline;
use super::{KernelBench, Op};
use crate::backend::cuda::{CudaBackend, CudaTensor};
use crate::backend::{Backend, H200_GBS, H200_TFLOPS};
use crate::error::{Error, Result};

/// Columns of the flush tensor.
const FLUSH_COLS: usize = 8192;

type Paged = fn(
    &CudaBackend,
    &CudaTensor,
    &CudaTensor,
    &CudaTensor,
    &Operands<CudaBackend>,
) -> Result<Option<CudaTensor>>;

fn paged_with(be: &CudaBackend, o: &Operands<CudaBackend>, f: Paged) -> Result<Outs<CudaBackend>> {
    let out = f(be, o.act(0)?, o.act(1)?, o.act(2)?, o)?;
    Ok(out.map(|t| vec![Out::Tensor(t)]))
}

fn shape(o: &Operands<CudaBackend>) -> Result<crate::backend::AttnShape> {
    o.p.attn
        .ok_or_else(|| Error::InvalidRequest("kernel bench: paged case without a shape".into()))
}

/// Runs `run` with the attention-v1-only switch and batch-invariant mode as given (`None`: as they
/// are), restoring both after.
fn with_modes(
    be: &CudaBackend,
    o: &mut Operands<CudaBackend>,
    (v1_only, invariant): (Option<bool>, Option<bool>),
    run: RunFn<CudaBackend>,
) -> Result<Outs<CudaBackend>> {
    let was = (be.attention_v1_only(), be.batch_invariant());
    be.set_attention_v1_only(v1_only.unwrap_or(was.0));
    be.set_batch_invariant(invariant.unwrap_or(was.1));
    let r = run(be, o);
    be.set_attention_v1_only(was.0);
    be.set_batch_invariant(was.1);
    r
}

fn paged_versions() -> Vec<Version<CudaBackend>> {
    let v = |name, run| Version { name, run };
    vec![
        v("v1", |be, o| {
            paged_with(be, o, |be, q, k, vv, o| {
                be.paged_attention_v1(q, k, vv, shape(o)?, &o.p.batch()).map(Some)
            })
        }),
        v("flash", |be, o| {
            paged_with(be, o, |be, q, k, vv, o| {
                be.paged_attention_flash(q, k, vv, shape(o)?, &o.p.batch())
            })
        }),
        v("flash-v1", |be, o| {
            paged_with(be, o, |be, q, k, vv, o| {
                be.paged_attention_flash_v1(q, k, vv, shape(o)?, &o.p.batch())
            })
        }),
        v("decode-v2", |be, o| {
            paged_with(be, o, |be, q, k, vv, o| {
                be.paged_decode_v2(q, k, vv, shape(o)?, &o.p.batch())
            })
        }),
        v("forced-v1", |be, o| {
            with_modes(be, o, (Some(true), None), dispatch(Op::PagedAttention))
        }),
        v("batch-invariant", |be, o| {
            with_modes(be, o, (None, Some(true)), dispatch(Op::PagedAttention))
        }),
    ]
}

fn segment_versions() -> Vec<Version<CudaBackend>> {
    let v = |name, run| Version { name, run };
    vec![
        v("v1", |be, o| {
            paged_with(be, o, |be, q, k, vv, o| {
                be.attention_segments_v1(q, k, vv, o.p.heads, &o.p.cu).map(Some)
            })
        }),
        v("flash", |be, o| {
            paged_with(be, o, |be, q, k, vv, o| {
                be.attention_segments_flash(q, k, vv, o.p.heads, &o.p.cu)
            })
        }),
        v("flash-v1", |be, o| {
            paged_with(be, o, |be, q, k, vv, o| {
                be.attention_segments_flash_v1(q, k, vv, o.p.heads, &o.p.cu)
            })
        }),
        v("forced-v1", |be, o| {
            with_modes(be, o, (Some(true), None), dispatch(Op::AttentionSegments))
        }),
    ]
}

impl KernelBench for CudaBackend {
    type Flush = CudaTensor;

    fn versions(&self, op: Op) -> Vec<Version<Self>> {
        let mut v = vec![Version::dispatch(op)];
        match op {
            Op::Linear | Op::LinearBias => v.push(Version {
                name: "batch-invariant",
                run: |be, o| with_modes(be, o, (None, Some(true)), dispatch(Op::Linear)),
            }),
            Op::AddRmsNorm => v.push(Version {
                name: "unfused",
                run: add_rms_norm_unfused::<CudaBackend>,
            }),
            Op::QkNormRopeWrite => v.push(Version {
                name: "composed",
                run: qk_write_composed::<CudaBackend>,
            }),
            Op::PagedAttention => v.extend(paged_versions()),
            Op::AttentionSegments => v.extend(segment_versions()),
            _ => {}
        }
        v
    }

    /// 256 MiB: over twice the H200's 50 MiB L2 (and any other current GPU's).
    fn default_flush_bytes(&self) -> usize {
        256 << 20
    }

    fn new_flush(&self, bytes: usize) -> Result<CudaTensor> {
        self.zeros((bytes / 2).div_ceil(FLUSH_COLS).max(1), FLUSH_COLS)
    }

    /// `scale` over the flush tensor: reads it and writes as much again.
    fn flush_cache(&self, flush: &mut CudaTensor) -> Result<()> {
        *flush = self.scale(flush, 1.0)?;
        Ok(())
    }

    fn time_run(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        self.take_profile()?; // nothing stale
        self.set_profiling(true);
        let r = run();
        self.set_profiling(false);
        r?;
        CudaBackend::synchronize(self)?;
        Ok(self.take_profile()?.iter().map(|t| t.seconds).sum())
    }

    fn set_checking(&self, on: bool) {
        self.set_poison(on);
    }

    fn roofline(&self, gbs: Option<f64>, tflops: Option<f64>) -> Roofline {
        let source = match (gbs, tflops) {
            (None, None) => "H200 defaults (measured copy rate, bf16 GEMM rate)".to_string(),
            (Some(_), Some(_)) => "both given".to_string(),
            (Some(_), None) => "GB/s given, TFLOP/s the H200 default".to_string(),
            (None, Some(_)) => "TFLOP/s given, GB/s the H200 default".to_string(),
        };
        Roofline {
            gbs: gbs.unwrap_or(H200_GBS),
            tflops: tflops.unwrap_or(H200_TFLOPS),
            source: format!("{source} on {}", self.describe()),
        }
    }
}
