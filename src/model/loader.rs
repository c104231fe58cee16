//! The checkpoint reader lives in [`crate::checkpoint`], below the backends; this path stays for the
//! callers that name it.

pub use crate::checkpoint::{Checkpoint, Dtype, Fill, MappedFile, TensorRef};
