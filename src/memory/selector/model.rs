//! The marginal-utility model interface, and the negated control.

use super::NUM_FEATURES;

/// A model of the marginal utility `Δ(j | S)` from the 28 features. Closures implement it.
///
/// ```
/// use recall::memory::selector::MarginalModel;
/// let model = |f: &[f32; 28]| -f[0]; // prefer recent events
/// assert_eq!(model.score(&[2.0; 28]), -2.0);
/// ```
pub trait MarginalModel {
    /// The predicted marginal of one feature vector.
    fn score(&self, features: &[f32; NUM_FEATURES]) -> f32;

    /// Scores many vectors; `out` is cleared and receives one score per row.
    fn score_batch(&self, rows: &[[f32; NUM_FEATURES]], out: &mut Vec<f32>) {
        out.clear();
        out.extend(rows.iter().map(|r| self.score(r)));
    }
}

impl<F> MarginalModel for F
where
    F: Fn(&[f32; NUM_FEATURES]) -> f32,
{
    fn score(&self, features: &[f32; NUM_FEATURES]) -> f32 {
        self(features)
    }
}

/// A model whose scores are the negation of another's (the "inverted" control).
///
/// ```
/// use recall::memory::selector::{MarginalModel, Negated};
/// let base = |f: &[f32; 28]| f[0];
/// assert_eq!(Negated(&base).score(&[3.0; 28]), -3.0);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Negated<'a, M: ?Sized>(pub &'a M);

impl<M: MarginalModel + ?Sized> MarginalModel for Negated<'_, M> {
    fn score(&self, features: &[f32; NUM_FEATURES]) -> f32 {
        -self.0.score(features)
    }
    fn score_batch(&self, rows: &[[f32; NUM_FEATURES]], out: &mut Vec<f32>) {
        self.0.score_batch(rows, out);
        out.iter_mut().for_each(|v| *v = -*v);
    }
}
