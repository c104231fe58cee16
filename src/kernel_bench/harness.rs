//! The loop: per case, inputs and the CPU twin's outputs once; per version, a checked run, then (when
//! it passed) warm-up and timed runs.

use super::cases::{cases, Case, Op};
use super::cost::cost;
use super::inputs::{host_inputs, upload, upload_targets, HostInputs};
use super::ops::{reference, to_host, Operands, Version};
use super::report::{Report, Row};
use super::timing::Timing;
use super::{KernelBench, Options};
use crate::backend::cpu::CpuBackend;
use crate::error::{Error, Result};
use crate::rng::{derive, Rng};

/// Bound of the relative error of bf16 outputs (tests/cuda_ops.rs).
pub const BF16_TOL: f32 = 1e-2;
/// Bound of f32 outputs, and of every output of an f32 backend.
pub const F32_TOL: f32 = 1e-5;

/// The bound of `op`'s relative error on a backend with activations of `element_bytes`: as
/// tests/cuda_ops.rs (0 for copies and argmax, [`F32_TOL`] for `log_softmax_gather`, [`BF16_TOL`] for
/// the rest), and at most [`F32_TOL`] on an f32 backend.
pub fn tolerance(op: Op, element_bytes: usize) -> f32 {
    let bound = match op {
        Op::GatherRows | Op::ScatterRows | Op::Embedding | Op::Argmax => 0.0,
        Op::LogSoftmaxGather => F32_TOL,
        _ => BF16_TOL,
    };
    if element_bytes >= 4 {
        bound.min(F32_TOL)
    } else {
        bound
    }
}

/// Validates and times every version of every selected case on `be`.
///
/// Errors only when the harness itself cannot run (no case selected, inputs that cannot be
/// uploaded, a timed run that fails); versions that fail validation are listed in
/// [`Report::failures`] and never timed.
///
/// ```
/// use recall::backend::cpu::CpuBackend;
/// use recall::kernel_bench::{run, Op, Options};
/// let opts = Options { ops: vec![Op::Scale], iters: 2, flush_bytes: Some(1 << 20), peak_gbs: Some(10.0),
///                      peak_tflops: Some(1.0), ..Options::default() };
/// let report = run(&CpuBackend, &opts)?;
/// report.ensure_valid()?;
/// assert!(report.rows.iter().all(|r| r.op == "scale" && r.timing.is_some()));
/// println!("{}", report.to_table());
/// # Ok::<(), recall::Error>(())
/// ```
pub fn run<B: KernelBench>(be: &B, opts: &Options) -> Result<Report> {
    let selected: Vec<Case> = cases(opts.set)
        .into_iter()
        .filter(|c| opts.ops.is_empty() || opts.ops.contains(&c.op))
        .collect();
    if selected.is_empty() {
        return Err(Error::InvalidRequest(format!(
            "kernel bench: no case of {:?} in the {:?} table",
            opts.ops, opts.set
        )));
    }
    let roofline = (!opts.validate_only).then(|| be.roofline(opts.peak_gbs, opts.peak_tflops));
    let flush_bytes = opts.flush_bytes.unwrap_or_else(|| be.default_flush_bytes());
    let mut flush = match opts.validate_only {
        true => None,
        false => Some(be.new_flush(flush_bytes)?),
    };
    if let Some(r) = &roofline {
        tracing::info!(
            "roofline {:.0} GB/s, {:.1} TFLOP/s ({})",
            r.gbs,
            r.tflops,
            r.source
        );
    }
    let mut report = Report::new(be.describe(), roofline, opts, flush_bytes);
    let bar = progress(opts.progress, selected.len());
    for case in &selected {
        bar.set_message(case.op.name());
        let mut rng = Rng::new(case_seed(opts.seed, case));
        bench_case(be, case, &mut rng, flush.as_mut(), opts, &mut report)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(report)
}

fn progress(show: bool, cases: usize) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    indicatif::ProgressBar::new(cases as u64).with_style(
        indicatif::ProgressStyle::with_template("{msg:20} {bar:30} {pos}/{len} cases")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    )
}

/// Every version of one case: checked, then timed when it passed and timing is on.
fn bench_case<B: KernelBench>(
    be: &B,
    case: &Case,
    rng: &mut Rng,
    mut flush: Option<&mut B::Flush>,
    opts: &Options,
    report: &mut Report,
) -> Result<()> {
    let mut p = prepare(be, case, rng)?;
    let c = cost(case);
    let bytes = c.bytes(be.element_bytes());
    for v in be.versions(case.op) {
        let err = match check(be, &mut p, &v) {
            Ok(Some(err)) => err,
            Ok(None) => {
                report.not_applicable += 1;
                continue;
            }
            Err(e) => {
                tracing::error!("{e}");
                report.failures.push(e.to_string());
                continue;
            }
        };
        let timing = match (flush.as_deref_mut(), &report.roofline) {
            (Some(f), Some(roof)) => Some(Timing::new(time(be, &mut p, &v, f, opts)?, bytes, c.flops, roof)),
            _ => None,
        };
        report.rows.push(Row {
            op: case.op.name(),
            version: v.name,
            case: p.label.clone(),
            perf: case.perf,
            max_err: err,
            bound: p.tol,
            bytes,
            flops: c.flops,
            timing,
        });
    }
    Ok(())
}

/// A case ready to run: its inputs on the host and on the backend, and the CPU twin's outputs.
struct Prepared<B: KernelBench> {
    op: Op,
    label: String,
    host: HostInputs,
    target: Operands<B>,
    /// The operands were written by a run (an op that writes in place).
    dirty: bool,
    want: Vec<Vec<f32>>,
    tol: f32,
}

fn prepare<B: KernelBench>(be: &B, case: &Case, rng: &mut Rng) -> Result<Prepared<B>> {
    let host = host_inputs(case, rng);
    let (target, mut cpu) = upload(be, &host)?;
    let label = case.label();
    let outs = reference(case.op)(&CpuBackend, &mut cpu)?
        .ok_or_else(|| Error::InvalidRequest(format!("kernel bench: no CPU reference for {label}")))?;
    Ok(Prepared {
        op: case.op,
        want: to_host(&CpuBackend, &cpu, outs)?,
        tol: tolerance(case.op, be.element_bytes()),
        label,
        host,
        target,
        dirty: false,
    })
}

/// One checked run of `v`: its largest relative error, `None` when the version does not cover the
/// case, an error when it fails (or its error is over the bound).
fn check<B: KernelBench>(be: &B, p: &mut Prepared<B>, v: &Version<B>) -> Result<Option<f32>> {
    if p.dirty {
        p.target.x = upload_targets(be, &p.host)?;
    }
    p.dirty = p.op.mutates();
    be.set_checking(true);
    let ran = (v.run)(be, &mut p.target);
    be.set_checking(false);
    let fail = |m: String| {
        Error::InvalidRequest(format!(
            "kernel validation failed: {} {} {}: {m}",
            p.op.name(),
            v.name,
            p.label
        ))
    };
    let Some(outs) = ran.map_err(|e| fail(e.to_string()))? else {
        return Ok(None);
    };
    let got = to_host(be, &p.target, outs)?;
    compare(&got, &p.want, p.tol).map(Some).map_err(fail)
}

/// Warm-up, then timed runs each after a cache flush: seconds per run.
fn time<B: KernelBench>(
    be: &B,
    p: &mut Prepared<B>,
    v: &Version<B>,
    flush: &mut B::Flush,
    opts: &Options,
) -> Result<Vec<f64>> {
    for _ in 0..opts.warmup {
        (v.run)(be, &mut p.target)?;
    }
    be.synchronize()?;
    let mut seconds = Vec::with_capacity(opts.iters.max(1));
    for _ in 0..opts.iters.max(1) {
        be.flush_cache(flush)?;
        let target = &mut p.target;
        seconds.push(be.time_run(&mut || (v.run)(be, target).map(drop))?);
    }
    Ok(seconds)
}

/// Validates one version on one case: `Ok(Some(max relative error))`, `Ok(None)` when the version
/// does not cover the case, or an error naming the op, version and case when its output is off.
/// The same inputs as [`run`] draws for the case from `seed`.
pub fn check_version<B: KernelBench>(be: &B, case: &Case, v: &Version<B>, seed: u64) -> Result<Option<f32>> {
    let mut p = prepare(be, case, &mut Rng::new(case_seed(seed, case)))?;
    check(be, &mut p, v)
}

/// The seed of `case`'s inputs, from the run's seed and the case's op and label: a case draws the
/// same inputs whichever other cases are selected (`--ops`), and [`check_version`] draws them too.
fn case_seed(seed: u64, case: &Case) -> u64 {
    let key: Vec<u64> = format!("{} {}", case.op.name(), case.label())
        .bytes()
        .map(u64::from)
        .collect();
    derive(seed, &key)
}

/// The largest relative error over all outputs, or why they do not match: a different count or
/// length, a NaN (an unwritten or broken element), a mismatched infinity, or an error over `tol`.
fn compare(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32) -> std::result::Result<f32, String> {
    if got.len() != want.len() {
        return Err(format!("{} outputs, the reference has {}", got.len(), want.len()));
    }
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = rel_err(g, w).map_err(|m| format!("output {i}: {m}"))?;
        if err > tol {
            return Err(format!(
                "output {i}: relative error {err:.3e} over the bound {tol:.0e}{}",
                first_mismatches(g, w, tol)
            ));
        }
        worst = worst.max(err);
    }
    Ok(worst)
}

/// `max |got − want| / max(|want|, rms(want))` (tests/common's `rel_err`).
fn rel_err(got: &[f32], want: &[f32]) -> std::result::Result<f32, String> {
    if got.len() != want.len() {
        return Err(format!(
            "{} elements, the reference has {}",
            got.len(),
            want.len()
        ));
    }
    let rms = rms(want);
    let mut worst = 0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g.is_nan() && !w.is_nan() {
            return Err(format!("NaN at {i} (reference {w}): unwritten or broken output"));
        }
        if !w.is_finite() {
            if g != w && !(g.is_nan() && w.is_nan()) {
                return Err(format!("at {i}: got {g}, reference {w}"));
            }
            continue;
        }
        worst = worst.max((g - w).abs() / w.abs().max(rms));
    }
    Ok(worst)
}

/// The root mean square of the finite values of `want` (the floor of the relative error's
/// denominator), never zero.
fn rms(want: &[f32]) -> f32 {
    let sq: f32 = want.iter().filter(|x| x.is_finite()).map(|x| x * x).sum();
    (sq / want.len().max(1) as f32).sqrt().max(1e-30)
}

/// The first few elements whose error is over `tol`, for the failure message.
fn first_mismatches(got: &[f32], want: &[f32], tol: f32) -> String {
    let rms = rms(want);
    let shown: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| (*g - *w).abs() / w.abs().max(rms) > tol)
        .take(3)
        .map(|(i, (g, w))| format!("at {i}: got {g}, reference {w}"))
        .collect();
    format!("; {}", shown.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_rejects_nan_and_errors_over_the_bound() {
        let want = vec![vec![1.0, -2.0, 4.0]];
        assert_eq!(compare(&want, &want, 0.0), Ok(0.0));
        assert!(compare(&[vec![1.0, f32::NAN, 4.0]], &want, 1.0).is_err());
        assert!(compare(&[vec![1.0, -2.0, 4.1]], &want, 1e-2).is_err());
        assert!(compare(&[vec![1.0, -2.0, 4.01]], &want, 1e-2).is_ok());
        assert!(compare(&[vec![1.0, -2.0]], &want, 1.0).is_err());
        let inf = vec![vec![f32::NEG_INFINITY, 1.0]];
        assert!(compare(&inf, &inf, 0.0).is_ok());
        assert!(compare(&[vec![-1e30, 1.0]], &inf, 1.0).is_err());
    }
}
