//! The harness's results: one row per validated (case, version), as a table and as JSON.

use super::timing::{Roofline, Timing};
use super::Options;
use crate::error::{Error, Result};

/// One validated version on one case.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Row {
    pub op: &'static str,
    pub version: &'static str,
    pub case: String,
    /// From the perf table.
    pub perf: bool,
    /// Largest relative error against the CPU twin.
    pub max_err: f32,
    /// Its bound.
    pub bound: f32,
    /// Napkin bytes and FLOPs of the case ([`Cost`](super::Cost)).
    pub bytes: f64,
    pub flops: f64,
    /// `None` with `--validate-only`.
    pub timing: Option<Timing>,
}

/// Everything one [`run`](super::run) found.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// The backend and its device.
    pub backend: String,
    /// `None` with `--validate-only`.
    pub roofline: Option<Roofline>,
    pub flush_bytes: usize,
    pub warmup: usize,
    pub iters: usize,
    pub rows: Vec<Row>,
    /// (case, version) pairs whose kernel declines the case (e.g. decode-v2 on prefill rows).
    pub not_applicable: usize,
    /// Versions that failed validation (or errored), one message each: never timed.
    pub failures: Vec<String>,
}

impl Report {
    pub(super) fn new(
        backend: String,
        roofline: Option<Roofline>,
        opts: &Options,
        flush_bytes: usize,
    ) -> Self {
        Report {
            backend,
            roofline,
            flush_bytes,
            warmup: opts.warmup,
            iters: opts.iters.max(1),
            rows: Vec::new(),
            not_applicable: 0,
            failures: Vec::new(),
        }
    }

    /// An error listing the failed versions, if any.
    pub fn ensure_valid(&self) -> Result<()> {
        if self.failures.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidRequest(format!(
            "{} kernel version(s) failed validation:\n  {}",
            self.failures.len(),
            self.failures.join("\n  ")
        )))
    }

    /// The report as JSON.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map_err(|e| Error::InvalidRequest(format!("kernel bench JSON: {e}")))
    }

    /// The header lines: backend, roofline, flush and runs.
    fn header(&self) -> String {
        let mut h = format!("recall kernels on {}\n", self.backend);
        match &self.roofline {
            Some(r) => h.push_str(&format!(
                "roofline {:.0} GB/s, {:.1} TFLOP/s ({}); {:.0} MiB cache flush before each of {} timed runs \
                 after {} warm-up\n",
                r.gbs,
                r.tflops,
                r.source,
                self.flush_bytes as f64 / (1 << 20) as f64,
                self.iters,
                self.warmup
            )),
            None => h.push_str("validation only: nothing timed\n"),
        }
        h
    }

    /// A plain-text table: op, version, case, error and bound, min and median ms, GB/s, TFLOP/s, what
    /// bounds the case and the median's share of the roofline; then a summary line.
    pub fn to_table(&self) -> String {
        let head = [
            "op", "version", "case", "max err", "tol", "min ms", "med ms", "GB/s", "TFLOP/s", "bound by",
            "% roof",
        ];
        let mut cells: Vec<[String; 11]> = vec![head.map(String::from)];
        for r in &self.rows {
            let t = r.timing.as_ref();
            let num =
                |f: fn(&Timing) -> f64, prec: usize| t.map_or("-".into(), |t| format!("{:.prec$}", f(t)));
            cells.push([
                r.op.to_string(),
                r.version.to_string(),
                truncate(&r.case, 44),
                format!("{:.1e}", r.max_err),
                format!("{:.0e}", r.bound),
                num(|t| t.min_ms, 4),
                num(|t| t.median_ms, 4),
                num(|t| t.gbs, 1),
                if r.flops > 0.0 {
                    num(|t| t.tflops, 2)
                } else {
                    "-".into()
                },
                t.map_or("-".into(), |t| t.bound.to_string()),
                num(|t| t.roofline_pct, 1),
            ]);
        }
        let widths: Vec<usize> = (0..head.len())
            .map(|i| cells.iter().map(|c| c[i].chars().count()).max().unwrap_or(0))
            .collect();
        let mut out = self.header();
        // Validation only: no timing columns.
        let shown = if self.roofline.is_some() { head.len() } else { 5 };
        for c in &cells {
            let line: Vec<String> = c[..shown]
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (s, &w))| pad(s, w, i < 3))
                .collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
        }
        out.push_str(&self.summary());
        out
    }

    /// One line: how many (case, version) pairs were validated, declined and failed.
    pub fn summary(&self) -> String {
        let worst = self
            .rows
            .iter()
            .map(|r| r.max_err / r.bound.max(f32::MIN_POSITIVE))
            .fold(0f32, f32::max);
        format!(
            "validated {} (case, version) pairs, largest error {:.0}% of its bound; {} not applicable; {} FAILED\n",
            self.rows.len(),
            100.0 * worst.min(1.0),
            self.not_applicable,
            self.failures.len()
        )
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_string();
    }
    let mut t: String = s.chars().take(n - 1).collect();
    t.push('…');
    t
}

/// `s` padded to `w` characters (left-aligned text, right-aligned numbers).
fn pad(s: &str, w: usize, left: bool) -> String {
    let fill = " ".repeat(w.saturating_sub(s.chars().count()));
    if left {
        format!("{s}{fill}")
    } else {
        format!("{fill}{s}")
    }
}
