//! [`Outcome`]: what one request ends with. Its own file because the scheduler, the post-processing
//! and the engine core all hand it on, and none of them should import another for it.

use crate::engine::{Generation, Score};

/// The result of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Generation(Generation),
    Score(Score),
    /// A warm-up finished.
    Warmed,
    /// The request failed; the engine and its caches stay usable.
    Failed(String),
}
