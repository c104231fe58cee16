//! The kernel benchmark harness (src/kernel_bench) in CI: its validation of every parity case on the
//! CPU backend, proof that the validation compares something (broken versions are rejected, exact
//! ones pass), one short timed run, and — with the `cuda` feature — the same validation on a GPU, or a
//! SKIP line without one.

use recall::backend::cpu::{CpuBackend, CpuTensor};
use recall::backend::Backend;
use recall::kernel_bench::{
    cases, check_version, run, Case, CaseSet, Op, Operands, Options, Out, Outs, Shape, Version,
};

fn validate_only() -> Options {
    Options {
        validate_only: true,
        ..Options::default()
    }
}

#[test]
fn every_parity_case_validates_on_the_cpu() {
    let report = run(&CpuBackend, &validate_only()).unwrap();
    eprint!("{}", report.summary());
    report.ensure_valid().unwrap();
    let parity = cases(CaseSet::Parity);
    // Every case gave at least one row (the trait op), and linear one per GEMM path besides.
    for op in Op::ALL {
        let want = parity.iter().filter(|c| c.op == op).count();
        let dispatch = report
            .rows
            .iter()
            .filter(|r| r.op == op.name() && r.version == "dispatch")
            .count();
        assert_eq!(dispatch, want, "{}: rows of the trait op", op.name());
    }
    let portable = report
        .rows
        .iter()
        .filter(|r| r.version == "gemm-portable")
        .count();
    assert_eq!(portable, 12, "linear and linear_bias on the portable GEMM");
    assert!(report
        .rows
        .iter()
        .all(|r| r.timing.is_none() && r.max_err <= r.bound));
    assert_eq!(report.not_applicable, 0);
}

/// A "kernel" that is the trait op with one element of its output moved by `rel` of the output's
/// largest magnitude.
fn perturbed(be: &CpuBackend, o: &mut Operands<CpuBackend>, rel: f32) -> recall::Result<Outs<CpuBackend>> {
    let mut y: CpuTensor = be.scale(&o.x[0], o.p.scalar)?;
    let big = y.data.iter().fold(0f32, |m, v| m.max(v.abs()));
    let i = y.data.len() / 2;
    y.data[i] += rel * big;
    Ok(Some(vec![Out::Tensor(y)]))
}

fn scale_case() -> Case {
    let case = cases(CaseSet::Parity)
        .into_iter()
        .find(|c| c.op == Op::Scale && c.shape == Shape::Elems { rows: 64, cols: 1000 })
        .expect("the [64, 1000] scale case");
    assert_eq!(case.label(), "[64, 1000]");
    case
}

#[test]
fn validation_rejects_a_perturbed_output() {
    let case = scale_case();
    let exact = Version::<CpuBackend> {
        name: "exact",
        run: |be, o| perturbed(be, o, 0.0),
    };
    assert_eq!(check_version(&CpuBackend, &case, &exact, 1).unwrap(), Some(0.0));
    // 2% of the largest value in one element of 64000: over the bf16 bound too.
    let off = Version::<CpuBackend> {
        name: "off-by-2%",
        run: |be, o| perturbed(be, o, 2e-2),
    };
    let err = check_version(&CpuBackend, &case, &off, 1)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("kernel validation failed: scale off-by-2% [64, 1000]"),
        "{err}"
    );
    // On an f32 backend the bound is 1e-5: a 1e-4 slip fails too.
    let slight = Version::<CpuBackend> {
        name: "slight",
        run: |be, o| perturbed(be, o, 1e-4),
    };
    assert!(check_version(&CpuBackend, &case, &slight, 1).is_err());
}

#[test]
fn validation_rejects_unwritten_elements_and_wrong_shapes() {
    let case = scale_case();
    let nan = Version::<CpuBackend> {
        name: "nan",
        run: |be, o| {
            let mut y = be.scale(&o.x[0], o.p.scalar)?;
            y.data[7] = f32::NAN;
            Ok(Some(vec![Out::Tensor(y)]))
        },
    };
    let err = check_version(&CpuBackend, &case, &nan, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("NaN at 7"), "{err}");
    let short = Version::<CpuBackend> {
        name: "short",
        run: |be, o| Ok(Some(vec![Out::Tensor(be.rows(&o.x[0], 0, 63)?)])),
    };
    assert!(check_version(&CpuBackend, &case, &short, 1).is_err());
    // A version that declines the case is not a failure, and is not validated.
    let declines = Version::<CpuBackend> {
        name: "declines",
        run: |_, _| Ok(None),
    };
    assert_eq!(check_version(&CpuBackend, &case, &declines, 1).unwrap(), None);
}

/// A wrong kernel for an op with several outputs and in-place writes: the composed `qk_norm_rope_write`
/// without the k norm must fail against the CPU twin.
#[test]
fn validation_checks_every_output_of_a_fused_op() {
    let case = cases(CaseSet::Parity)
        .into_iter()
        .find(|c| {
            c.op == Op::QkNormRopeWrite
                && matches!(
                    c.shape,
                    Shape::QkWrite {
                        norms: true,
                        n: 7,
                        ..
                    }
                )
        })
        .expect("a qk_norm_rope_write case with norms");
    let composed = Version::<CpuBackend> {
        name: "composed",
        run: recall::kernel_bench::qk_write_composed::<CpuBackend>,
    };
    assert_eq!(
        check_version(&CpuBackend, &case, &composed, 3).unwrap(),
        Some(0.0)
    );
    let no_k_norm = Version::<CpuBackend> {
        name: "no-k-norm",
        run: |be, o| {
            let q = be.rope(&be.rms_norm(&o.x[0], &o.w[0], o.p.eps)?, &o.x[3], &o.x[4])?;
            let k = be.rope(&o.x[1], &o.x[3], &o.x[4])?;
            let (v, pools) = (o.x[2].clone(), &mut o.x[5..]);
            be.scatter_rows(&mut pools[0], &o.p.index, &k, false)?;
            be.scatter_rows(&mut pools[1], &o.p.index, &v, false)?;
            Ok(Some(vec![Out::Tensor(q), Out::Operand(5), Out::Operand(6)]))
        },
    };
    let err = check_version(&CpuBackend, &case, &no_k_norm, 3)
        .unwrap_err()
        .to_string();
    assert!(err.contains("output 1"), "the k pool: {err}");
}

#[test]
fn a_short_timed_run_reports_the_roofline() {
    let opts = Options {
        ops: vec![Op::Linear, Op::Add],
        warmup: 1,
        iters: 2,
        flush_bytes: Some(4 << 20),
        peak_gbs: Some(20.0),
        peak_tflops: Some(0.5),
        ..Options::default()
    };
    let report = run(&CpuBackend, &opts).unwrap();
    report.ensure_valid().unwrap();
    let table = report.to_table();
    eprint!("{table}");
    assert!(table.contains("% roof") && table.contains("gemm-portable"));
    for r in &report.rows {
        let t = r.timing.as_ref().expect("timed");
        assert!(
            t.runs == 2 && t.min_ms <= t.median_ms && t.roofline_pct.is_finite(),
            "{r:?}"
        );
        assert_eq!(r.flops > 0.0, r.op == "linear", "{r:?}");
    }
    let json: serde_json::Value = serde_json::from_str(&report.to_json().unwrap()).unwrap();
    assert_eq!(json["rows"].as_array().unwrap().len(), report.rows.len());
}

/// The same validation on a GPU, every CUDA version included; a SKIP line without one.
#[cfg(feature = "cuda")]
#[test]
fn every_parity_case_validates_on_cuda() {
    let g = match recall::backend::cuda::CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIP (no usable GPU): {e}");
            return;
        }
    };
    let report = run(&g, &validate_only()).unwrap();
    eprint!("{}", report.summary());
    report.ensure_valid().unwrap();
    assert!(report.rows.iter().any(|r| r.version == "v1"));
}
