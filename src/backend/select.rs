//! Choosing the backend at run time: `--backend auto|cpu|cuda` on every command.
//!
//! [`Backend`](super::Backend) has generic methods, so it is not a trait object; a command is written
//! once as a generic function and [`with_backend!`](crate::with_backend) instantiates it for the
//! backend [`select`] opened.

use super::cpu::CpuBackend;
use crate::error::{Error, Result};

/// Which backend a command runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BackendChoice {
    /// CUDA when a usable GPU is found, else the CPU (one log line says which).
    #[default]
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend on GPU 0; fails when there is none.
    Cuda,
}

/// The backend flags every command flattens in.
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct BackendArgs {
    /// auto (CUDA when a usable GPU is found, else CPU), cpu or cuda.
    #[arg(long, value_enum, env = "RECALL_BACKEND", default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// On a GPU: the fraction of device memory recall may use in all (weights, activations and the
    /// KV pool, which gets what is left), as vLLM's --gpu-memory-utilization.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// On the CPU: also pack the decoder's weights at load into decode panels (true) or read the
    /// checkpoint's mapping only (false). Panels make decode faster and cost a second copy of the
    /// decoder and the load time [default: true for serve, false for one-shot commands].
    #[arg(long, value_name = "BOOL")]
    pub cpu_decode_panels: Option<bool>,
    /// On the CPU, for bf16 checkpoints: round each product's input to bf16 and multiply with
    /// AVX512-BF16 (as PyTorch and llama.cpp run bf16 on a CPU), about twice the arithmetic rate,
    /// where the default reproduces HF's float32 result bit for bit. Every row count switches
    /// together, so a row still has the same bits alone or in a batch. Needs avx512_bf16.
    #[arg(long)]
    pub cpu_bf16_dot: bool,
    /// On the CPU: attention's two products (`Q·Kᵀ`, `P·V`) in bf16 on AMX tiles, as PyTorch's
    /// bf16 attention, the softmax in f32, where the default is HF's float32 attention bit for
    /// bit. Prefill, decode and the vision tower switch together, so a row still has the same
    /// bits alone or in a batch. Needs amx_bf16 (Sapphire Rapids and later).
    #[arg(long)]
    pub cpu_bf16_attention: bool,
}

impl Default for BackendArgs {
    fn default() -> Self {
        BackendArgs {
            backend: BackendChoice::Auto,
            gpu_memory_utilization: 0.9,
            cpu_decode_panels: None,
            cpu_bf16_dot: false,
            cpu_bf16_attention: false,
        }
    }
}

impl BackendArgs {
    /// Applies the CPU options (`serving`: the command serves for long, so decode panels are
    /// on unless the flag says otherwise) and opens the backend.
    pub fn open(&self, serving: bool) -> Result<Selected> {
        self.apply_cpu(serving)?;
        select(self.backend)
    }

    /// Sets the CPU backend's process-wide options ([`super::cpu::set_decode_panels`],
    /// [`super::cpu::gemm::set_bf16_dot`], [`super::cpu::set_bf16_attention`]).
    ///
    /// # Errors
    /// When `--cpu-bf16-dot` is asked for on a CPU without AVX512-BF16, or
    /// `--cpu-bf16-attention` on one without AMX-BF16.
    pub fn apply_cpu(&self, serving: bool) -> Result<()> {
        super::cpu::gemm::set_bf16_dot(self.cpu_bf16_dot)?;
        super::cpu::set_bf16_attention(self.cpu_bf16_attention)?;
        super::cpu::set_decode_panels(self.cpu_decode_panels.unwrap_or(serving));
        Ok(())
    }

    /// Only the CPU backend.
    pub fn cpu() -> Self {
        BackendArgs {
            backend: BackendChoice::Cpu,
            ..Self::default()
        }
    }
}

/// An opened backend.
pub enum Selected {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(Box<super::cuda::CudaBackend>),
}

impl Selected {
    /// `"cpu"` or `"cuda"`.
    pub fn name(&self) -> &'static str {
        match self {
            Selected::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            Selected::Cuda(_) => "cuda",
        }
    }
}

/// Opens the backend `choice` asks for. `Cuda` fails with one line saying why when no GPU is
/// usable; `Auto` then falls back to the CPU and logs why.
///
/// ```
/// use recall::backend::{select, BackendChoice};
/// assert_eq!(select(BackendChoice::Cpu)?.name(), "cpu");
/// # Ok::<(), recall::Error>(())
/// ```
pub fn select(choice: BackendChoice) -> Result<Selected> {
    match choice {
        BackendChoice::Cpu => {
            tracing::info!("backend: cpu ({} threads)", rayon::current_num_threads());
            Ok(Selected::Cpu(CpuBackend))
        }
        BackendChoice::Cuda => open_cuda().map_err(|e| match e {
            Error::Cuda(m) => Error::Cuda(format!("--backend cuda: no usable GPU: {m}")),
            other => other,
        }),
        BackendChoice::Auto => match open_cuda() {
            Ok(be) => Ok(be),
            Err(e) => {
                tracing::info!(
                    "backend: cpu ({} threads; no usable GPU: {e})",
                    rayon::current_num_threads()
                );
                Ok(Selected::Cpu(CpuBackend))
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Selected> {
    let be = super::cuda::CudaBackend::new(0)?;
    tracing::info!("backend: cuda on {} ({})", be.device_name(), be.arch());
    Ok(Selected::Cuda(Box::new(be)))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Selected> {
    Err(Error::Cuda(
        "this build of recall has no CUDA support (built without the `cuda` feature)".into(),
    ))
}

/// Runs `$body` with `$be` bound to the backend inside a [`Selected`]; the body is compiled once
/// per backend.
///
/// ```
/// use recall::backend::{select, Backend, BackendChoice};
/// let name = recall::with_backend!(select(BackendChoice::Cpu)?, be => be.name());
/// assert_eq!(name, "cpu");
/// # Ok::<(), recall::Error>(())
/// ```
#[macro_export]
macro_rules! with_backend {
    ($selected:expr, $be:ident => $body:expr) => {
        match $selected {
            $crate::backend::Selected::Cpu($be) => $body,
            #[cfg(feature = "cuda")]
            $crate::backend::Selected::Cuda(boxed) => {
                let $be = *boxed;
                $body
            }
        }
    };
}
