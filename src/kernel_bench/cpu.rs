//! The CPU backend's versions: its packed GEMM on each instruction set this CPU has (`linear`); every
//! other op has one version (its SIMD width is picked per call and cannot be chosen from outside).

use std::time::Instant;

use super::ops::{Operands, Out, Outs, RunFn, Version};
use super::timing::{cpu_copy_gbs, cpu_flush_bytes, CpuFlush, Roofline};
use super::{KernelBench, Op};
use crate::backend::cpu::gemm::{gemm_with, Isa};
use crate::backend::cpu::{peak, CpuBackend, CpuTensor};
use crate::error::{Error, Result};

/// The GEMM paths (`gemm.rs`): all bitwise the same by construction, so any difference is a bug.
const ISAS: [Isa; 4] = [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable];
const GEMMS: [(&str, RunFn<CpuBackend>); 4] = [
    ("gemm-avx512", gemm_on::<0>),
    ("gemm-avx2", gemm_on::<1>),
    ("gemm-neon", gemm_on::<2>),
    ("gemm-portable", gemm_on::<3>),
];

/// Most multiply-adds the portable path is run for (its scalar FMA chains: about half a second on one
/// core). Larger cases (most of the perf table's GEMMs) count as not applicable for it.
const PORTABLE_MAX_FMAS: usize = 1 << 26;

/// `linear` through `gemm_with` on instruction set `ISAS[I]`, on the weight where it lies.
fn gemm_on<const I: usize>(_: &CpuBackend, o: &mut Operands<CpuBackend>) -> Result<Outs<CpuBackend>> {
    let x = o.act(0)?;
    let panels = o
        .weight(0)?
        .matrix()
        .ok_or_else(|| Error::InvalidRequest("kernel bench: linear weight is not 2-D".into()))?;
    if ISAS[I] == Isa::Portable && x.rows * panels.k * panels.n > PORTABLE_MAX_FMAS {
        return Ok(None);
    }
    let bias = (o.w.len() > 1).then_some(o.p.bias.as_slice());
    if x.cols != panels.k || bias.is_some_and(|b| b.len() != panels.n) {
        return Err(Error::InvalidRequest(format!(
            "kernel bench: x [{}, {}] with panels [{}, {}]",
            x.rows, x.cols, panels.n, panels.k
        )));
    }
    let mut y = vec![0f32; x.rows * panels.n];
    gemm_with(ISAS[I], &x.data, x.rows, &panels, bias, &mut y);
    Ok(Some(vec![Out::Tensor(CpuTensor {
        data: y,
        rows: x.rows,
        cols: panels.n,
    })]))
}

impl KernelBench for CpuBackend {
    type Flush = CpuFlush;

    fn versions(&self, op: Op) -> Vec<Version<Self>> {
        let mut v = vec![Version::dispatch(op)];
        if matches!(op, Op::Linear | Op::LinearBias) {
            for (isa, (name, run)) in ISAS.iter().zip(GEMMS) {
                if isa.available() {
                    v.push(Version { name, run });
                }
            }
        }
        v
    }

    fn default_flush_bytes(&self) -> usize {
        cpu_flush_bytes()
    }

    fn new_flush(&self, bytes: usize) -> Result<CpuFlush> {
        Ok(CpuFlush::new(bytes))
    }

    fn flush_cache(&self, flush: &mut CpuFlush) -> Result<()> {
        flush.flush();
        Ok(())
    }

    fn time_run(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let t = Instant::now();
        run()?;
        Ok(t.elapsed().as_secs_f64())
    }

    fn roofline(&self, gbs: Option<f64>, tflops: Option<f64>) -> Roofline {
        let threads = rayon::current_num_threads();
        let mut source = Vec::new();
        let gbs = gbs.unwrap_or_else(|| {
            source.push("GB/s measured (parallel copy of 128 MiB, read + write)");
            cpu_copy_gbs()
        });
        let tflops = tflops.unwrap_or_else(|| match peak::fma_peak_gflops(50) {
            Some(g) => {
                source.push("TFLOP/s measured (f32 FMA peak)");
                g / 1e3
            }
            None => {
                source.push("no FMA peak on this CPU (give --peak-tflops)");
                0.0
            }
        });
        if source.is_empty() {
            source.push("both given");
        }
        Roofline {
            gbs,
            tflops,
            source: format!("{} on {threads} threads", source.join(", ")),
        }
    }
}
