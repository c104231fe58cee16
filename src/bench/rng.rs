//! Seeded random numbers: every random value of the bench (weights, pixels, token ids, the ScopeMem
//! prefix, the selector's scorer) comes from a [`Rng`] seeded with [`derive`], so a run depends only
//! on `--seed` and the shapes.

/// SplitMix64: small, fast, seedable, and good enough for weights and token ids.
#[derive(Debug, Clone)]
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub(super) fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Uniform in `0..n` (`0..1` for `n = 0`), with SplitMix's negligible modulo bias.
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// A seed derived from a parent seed and labels.
pub(super) fn derive(seed: u64, labels: &[u64]) -> u64 {
    let mut r = Rng::new(seed ^ 0x6a09_e667_f3bc_c908);
    for &l in labels {
        r.0 ^= l.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        r.next_u64();
    }
    r.next_u64()
}
