//! The one way a model reads its weights: a [`Weights`] is a backend, a checkpoint and a name prefix.
//! Modules descend with [`Weights::pp`] (`w.pp("model").pp("visual").pp("blocks").pp(3)`) and take
//! their tensors with [`Weights::get`], which checks the shape before the backend sees the data. Names
//! are therefore always exactly the checkpoint's, built in one place, and no module formats its own.

use std::fmt::Display;

use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, TensorRef};
use crate::error::Result;

/// A view of a checkpoint under a name prefix, loading onto a backend.
///
/// ```
/// use recall::backend::cpu::CpuBackend;
/// use recall::checkpoint::{Checkpoint, Fill};
/// use recall::model::weights::Weights;
/// let ckpt = Checkpoint::synthetic("mem", [("model.norm.weight".to_string(), vec![4], Fill::Ones)])?;
/// let w = Weights::new(&CpuBackend, &ckpt);
/// let norm = w.pp("model").get("norm.weight", &[4])?;
/// assert!(w.pp("model").get("norm.weight", &[5]).is_err()); // shape-checked
/// # let _ = norm;
/// # Ok::<(), recall::Error>(())
/// ```
pub struct Weights<'a, B: Backend> {
    backend: &'a B,
    checkpoint: &'a Checkpoint,
    prefix: String,
}

impl<'a, B: Backend> Weights<'a, B> {
    /// The whole checkpoint (empty prefix).
    pub fn new(backend: &'a B, checkpoint: &'a Checkpoint) -> Self {
        Weights {
            backend,
            checkpoint,
            prefix: String::new(),
        }
    }

    /// The same checkpoint one level down: names below get `{prefix}.{name}.` in front.
    pub fn pp(&self, name: impl Display) -> Self {
        Weights {
            backend: self.backend,
            checkpoint: self.checkpoint,
            prefix: self.name(&name.to_string()),
        }
    }

    /// The full checkpoint name of `name` under this prefix.
    pub fn name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// Whether the checkpoint holds `name` under this prefix.
    pub fn contains(&self, name: &str) -> bool {
        self.checkpoint.contains(&self.name(name))
    }

    /// The tensor `name`, checked to have `shape`, still in the checkpoint (for views such as a
    /// convolution kernel read as a matrix).
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<&'a TensorRef> {
        let t = self.checkpoint.get(&self.name(name))?;
        t.expect_shape(shape)?;
        Ok(t)
    }

    /// The tensor `name`, checked to have `shape`, loaded onto the backend.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        self.backend.load_weight(self.tensor(name, shape)?)
    }

    /// The backend the weights load onto.
    pub fn backend(&self) -> &'a B {
        self.backend
    }

    /// The checkpoint read from.
    pub fn checkpoint(&self) -> &'a Checkpoint {
        self.checkpoint
    }
}
