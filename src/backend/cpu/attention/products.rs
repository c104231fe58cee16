//! How attention multiplies: exactly in f32 (the default), or in bf16 on AMX tiles
//! (`--cpu-bf16-attention`), a process-wide switch.

use std::sync::atomic::{AtomicBool, Ordering};

use super::TASK_ROWS;
use crate::backend::cpu::gemm::{Bf16Kernel, Isa};
use crate::{Error, Result};

/// Whether attention multiplies in bf16 on AMX (see [`set_bf16_attention`]).
static BF16_ATTENTION: AtomicBool = AtomicBool::new(false);

/// Runs every attention call — prefill, decode and the vision tower's — with its two products in
/// bf16 on AMX tiles (`TDPBF16PS`, as PyTorch's bf16 attention runs on such CPUs), the softmax in
/// f32. Not HF's float32 result, which the default gives bit for bit; its error against HF is in
/// docs/PERFORMANCE.md. Process-wide, so every call switches together: a query row still has the
/// same bits alone, in a chunk or in a whole prefill.
///
/// # Errors
/// [`Error::CpuFeatureMissing`] when `on` and the CPU (or the OS) lacks AMX-BF16; the setting is
/// left off.
///
/// ```
/// // Off is always accepted; on needs AMX-BF16 (Sapphire Rapids and later).
/// recall::backend::cpu::set_bf16_attention(false).unwrap();
/// assert!(!recall::backend::cpu::bf16_attention());
/// ```
pub fn set_bf16_attention(on: bool) -> Result<()> {
    if on && !Bf16Kernel::Amx.available() {
        return Err(Error::CpuFeatureMissing {
            option: "--cpu-bf16-attention",
            feature: "AMX-BF16",
            flag: "amx_bf16",
        });
    }
    BF16_ATTENTION.store(on, Ordering::Relaxed);
    Ok(())
}

/// Whether [`set_bf16_attention`] is on.
pub fn bf16_attention() -> bool {
    BF16_ATTENTION.load(Ordering::Relaxed)
}

/// How attention multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::backend::cpu) enum Products {
    /// In f32, exactly as the module docs define (the default).
    F32(Isa),
    /// In bf16 on AMX tiles (`bf16.rs`).
    #[cfg(target_arch = "x86_64")]
    Bf16,
}

impl Products {
    /// What the process-wide switch ([`set_bf16_attention`]) selects.
    pub(in crate::backend::cpu) fn current() -> Products {
        #[cfg(target_arch = "x86_64")]
        if bf16_attention() {
            return Products::Bf16;
        }
        Products::F32(Isa::detect())
    }

    /// Query positions per task for a group of `group` query heads: about [`TASK_ROWS`] rows; in
    /// bf16, a power of two, so that tiles aligned to it never cross a step of keys.
    pub(super) fn tile(self, group: usize) -> usize {
        let tile = (TASK_ROWS / group).max(1);
        match self {
            Products::F32(_) => tile,
            #[cfg(target_arch = "x86_64")]
            Products::Bf16 => 1 << tile.ilog2(),
        }
    }
}
