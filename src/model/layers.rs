//! The small layers every architecture here is composed from. Each owns its weights, loads them from
//! a [`Weights`] under its own name, and has a `forward`.

use crate::backend::{Backend, Gelu};
use crate::error::{Error, Result};
use crate::model::weights::Weights;

/// `x · Wᵀ (+ b)`: weight `[out, in]` (`{name}.weight`) and optionally bias `[out]` (`{name}.bias`).
pub struct Linear<B: Backend> {
    pub weight: B::Weight,
    pub bias: Option<B::Weight>,
}

impl<B: Backend> Linear<B> {
    /// Loads `weight` (and `bias` when `bias` is true) under `w`.
    pub fn load(w: &Weights<B>, out: usize, inp: usize, bias: bool) -> Result<Self> {
        Ok(Linear {
            weight: w.get("weight", &[out, inp])?,
            bias: if bias { Some(w.get("bias", &[out])?) } else { None },
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.linear(x, &self.weight, self.bias.as_ref())
    }
}

/// The [`Linear`]s of several layers on one input ([`Backend::linears`]: the CPU's bf16 path
/// prepares `x` once for all), each output with the bits of its own `forward`.
pub fn linears<B: Backend, const N: usize>(
    be: &B,
    x: &B::Tensor,
    layers: [&Linear<B>; N],
) -> Result<[B::Tensor; N]> {
    let parts = layers.map(|l| (&l.weight, l.bias.as_ref()));
    be.linears(x, &parts)?
        .try_into()
        .map_err(|got: Vec<_>| Error::Shape {
            op: "linears".into(),
            message: format!("{} outputs for {N} weights", got.len()),
        })
}

/// LayerNorm with weight and bias `[d]` and a fixed eps.
pub struct LayerNorm<B: Backend> {
    pub weight: B::Weight,
    pub bias: B::Weight,
    pub eps: f32,
}

impl<B: Backend> LayerNorm<B> {
    pub fn load(w: &Weights<B>, d: usize, eps: f32) -> Result<Self> {
        Ok(LayerNorm {
            weight: w.get("weight", &[d])?,
            bias: w.get("bias", &[d])?,
            eps,
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// RMSNorm with weight `[d]` (`{name}.weight`) and a fixed eps.
pub struct RmsNorm<B: Backend> {
    pub weight: B::Weight,
    pub eps: f32,
}

impl<B: Backend> RmsNorm<B> {
    pub fn load(w: &Weights<B>, d: usize, eps: f32) -> Result<Self> {
        Ok(RmsNorm {
            weight: w.get("weight", &[d])?,
            eps,
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.rms_norm(x, &self.weight, self.eps)
    }
}

/// `fc2(gelu(fc1(x)))`, both linears with biases.
pub struct GeluMlp<B: Backend> {
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
    pub gelu: Gelu,
}

impl<B: Backend> GeluMlp<B> {
    /// `fc1` `[hidden, inp]` and `fc2` `[out, hidden]` under the checkpoint's names for them.
    pub fn load(
        w: &Weights<B>,
        names: [&str; 2],
        [inp, hidden, out]: [usize; 3],
        gelu: Gelu,
    ) -> Result<Self> {
        Ok(GeluMlp {
            fc1: Linear::load(&w.pp(names[0]), hidden, inp, true)?,
            fc2: Linear::load(&w.pp(names[1]), out, hidden, true)?,
            gelu,
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let h = be.gelu_owned(self.fc1.forward(be, x)?, self.gelu)?;
        self.fc2.forward(be, &h)
    }
}

/// SwiGLU: `down(silu(gate(x)) · up(x))`.
pub struct SwiGlu<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: Backend> SwiGlu<B> {
    /// `gate_proj`, `up_proj` `[inter, d]` and `down_proj` `[d, inter]`, with biases or without.
    pub fn load(w: &Weights<B>, d: usize, inter: usize, bias: bool) -> Result<Self> {
        Ok(SwiGlu {
            gate_proj: Linear::load(&w.pp("gate_proj"), inter, d, bias)?,
            up_proj: Linear::load(&w.pp("up_proj"), inter, d, bias)?,
            down_proj: Linear::load(&w.pp("down_proj"), d, inter, bias)?,
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let (gate, up) = (&self.gate_proj, &self.up_proj);
        let g = be.swiglu(
            x,
            (&gate.weight, gate.bias.as_ref()),
            (&up.weight, up.bias.as_ref()),
        )?;
        self.down_proj.forward(be, &g)
    }
}
