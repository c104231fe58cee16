//! Cache flushes, the roofline's two ceilings, and the statistics of a timed version.

use std::time::Instant;

use rayon::prelude::*;

/// The ceilings a time is compared with: memory bandwidth and matrix-product rate.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Roofline {
    /// Bytes moved per second, in GB/s.
    pub gbs: f64,
    /// Floating-point operations per second, in TFLOP/s (0 when unknown).
    pub tflops: f64,
    /// Where the two numbers come from.
    pub source: String,
}

impl Roofline {
    /// Seconds the case needs at least: the larger of its bytes over the bandwidth and its FLOPs over
    /// the rate.
    pub fn floor_s(&self, bytes: f64, flops: f64) -> f64 {
        let mem = if self.gbs > 0.0 {
            bytes / (self.gbs * 1e9)
        } else {
            0.0
        };
        let math = if self.tflops > 0.0 {
            flops / (self.tflops * 1e12)
        } else {
            0.0
        };
        mem.max(math)
    }

    /// Whether the FLOPs, not the bytes, set the floor.
    pub fn compute_bound(&self, bytes: f64, flops: f64) -> bool {
        self.tflops > 0.0 && self.gbs > 0.0 && flops / (self.tflops * 1e12) > bytes / (self.gbs * 1e9)
    }
}

/// Timings of one version on one case.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Timing {
    /// Timed runs (each after a cache flush).
    pub runs: usize,
    pub min_ms: f64,
    pub median_ms: f64,
    /// Bytes over the median time.
    pub gbs: f64,
    /// FLOPs over the median time.
    pub tflops: f64,
    /// The roofline's floor over the median time, in percent.
    pub roofline_pct: f64,
    /// `flop` when the FLOPs set the floor, `mem` when the bytes do.
    pub bound: &'static str,
}

impl Timing {
    /// Statistics of `seconds` (one entry per timed run) for a case moving `bytes` and doing `flops`.
    pub fn new(mut seconds: Vec<f64>, bytes: f64, flops: f64, roof: &Roofline) -> Timing {
        seconds.sort_by(f64::total_cmp);
        let runs = seconds.len();
        let median = if runs == 0 { 0.0 } else { seconds[runs / 2] };
        let per_s = |x: f64| if median > 0.0 { x / median } else { 0.0 };
        Timing {
            runs,
            min_ms: seconds.first().copied().unwrap_or(0.0) * 1e3,
            median_ms: median * 1e3,
            gbs: per_s(bytes) / 1e9,
            tflops: per_s(flops) / 1e12,
            roofline_pct: 100.0 * per_s(roof.floor_s(bytes, flops)),
            bound: if roof.compute_bound(bytes, flops) {
                "flop"
            } else {
                "mem"
            },
        }
    }
}

/// Bytes of the largest cache of this CPU (Linux sysfs), if known.
pub fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
        .filter_map(|s| parse_size(s.trim()))
        .max()
}

/// `32768K`, `1M`, `512` (bytes) as bytes.
fn parse_size(s: &str) -> Option<usize> {
    let (num, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = num.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => Some(n << 10),
        "M" => Some(n << 20),
        "G" => Some(n << 30),
        _ => None,
    }
}

/// The CPU's default flush: twice its last-level cache, at least 64 MiB.
pub fn cpu_flush_bytes() -> usize {
    (2 * last_level_cache_bytes().unwrap_or(32 << 20)).max(64 << 20)
}

/// Host memory written by every rayon thread to evict the CPU's caches.
pub struct CpuFlush {
    buf: Vec<u8>,
    round: u8,
}

impl CpuFlush {
    pub fn new(bytes: usize) -> Self {
        CpuFlush {
            buf: vec![0; bytes.max(1)],
            round: 0,
        }
    }

    /// Writes the whole buffer with a new value.
    pub fn flush(&mut self) {
        self.round = self.round.wrapping_add(1);
        let v = self.round;
        self.buf.par_chunks_mut(1 << 20).for_each(|c| c.fill(v));
        std::hint::black_box(&self.buf);
    }
}

/// GB/s of a parallel copy between two 128 MiB buffers (bytes read plus bytes written, as STREAM
/// counts them), the best of 5: the CPU roofline's bandwidth when none is given.
pub fn cpu_copy_gbs() -> f64 {
    let n = 32 << 20; // f32 elements: 128 MiB per buffer
    let src: Vec<f32> = (0..n).into_par_iter().map(|i| i as f32).collect();
    let mut dst = vec![0f32; n];
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        dst.par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&dst);
        best = best.max((8 * n) as f64 / t.elapsed().as_secs_f64());
    }
    best / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("32768K"), Some(32 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("x"), None);
    }

    #[test]
    fn roofline_picks_the_larger_floor() {
        let r = Roofline {
            gbs: 1000.0,
            tflops: 100.0,
            source: String::new(),
        };
        // 1 GB: 1 ms; 1 TFLOP: 10 ms.
        assert!((r.floor_s(1e9, 1e12) - 0.01).abs() < 1e-12);
        assert!(r.compute_bound(1e9, 1e12));
        assert!(!r.compute_bound(1e9, 0.0));
        let t = Timing::new(vec![0.03, 0.01, 0.02], 1e9, 1e12, &r);
        assert_eq!((t.min_ms, t.median_ms, t.bound), (10.0, 20.0, "flop"));
        assert!((t.roofline_pct - 50.0).abs() < 1e-9);
    }
}
