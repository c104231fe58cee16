//! Agents built on the engine: actions (parse, canonicalise, match) and the two-pass controllers.

/// Re-exported from the top-level leaf module, so `recall::agent::action::...` keeps working.
pub use crate::action;
pub mod causalcache;
pub mod chart;
pub mod compare;
pub mod dataset;
pub mod demo;
pub mod eval;
pub mod labels;
pub mod offline;
pub mod scopemem;
pub mod scorers;
