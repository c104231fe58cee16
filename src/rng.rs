//! Seeded random numbers for synthetic inputs: the agent-step bench (weights, pixels, token ids) and
//! the kernel harness (case inputs) draw from one [`Rng`], so a run depends only on its seed and the
//! shapes, on every machine.

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast, seedable, good enough for weights and ids.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`: the top 24 bits, exact in an f32.
    pub(crate) fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn sym(&mut self) -> f32 {
        self.f32() * 2.0 - 1.0
    }

    /// `n` values uniform in `[lo, hi)`.
    pub(crate) fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * self.f32()).collect()
    }

    /// Uniform in `0..n` (`0..1` for `n = 0`), with SplitMix's negligible modulo bias.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A uniform permutation of `v` (Fisher–Yates).
    pub(crate) fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// A seed derived from a parent seed and labels.
pub(crate) fn derive(seed: u64, labels: &[u64]) -> u64 {
    let mut r = Rng::new(seed ^ 0x6a09_e667_f3bc_c908);
    for &l in labels {
        r.0 ^= l.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        r.next_u64();
    }
    r.next_u64()
}
