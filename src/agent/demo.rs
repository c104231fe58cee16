//! `recall demo`: the bundled synthetic cross-app episode (models/demo/episode, 12 steps drawn by
//! tools/gen_demo_episode.py) replayed end to end with the two-pass CausalCache step on the tiny
//! fixture model, with the bundled (randomly initialised) selector.

use std::path::{Path, PathBuf};

use crate::agent::causalcache::{make_policy, run_episode, PolicyChoice, StepReport, TwoPassConfig};
use crate::agent::chart::{write_allocation_chart, AllocationRow};
use crate::backend::Backend;
use crate::engine::{EngineConfig, Pipeline};
use crate::error::Result;
use crate::memory::episode::Episode;
use crate::memory::selector::Mode;

/// Where the demo's inputs live, relative to the repository root.
pub struct DemoPaths {
    pub model: PathBuf,
    pub episode: PathBuf,
    pub selector: PathBuf,
}

impl DemoPaths {
    /// The bundled inputs under `root` (the repository).
    pub fn bundled(root: &Path) -> Self {
        DemoPaths {
            model: root.join("tests/fixtures/tiny-qwen3-vl"),
            episode: root.join("models/demo/episode"),
            selector: root.join("models/demo/selector.safetensors"),
        }
    }
}

/// Runs the demo on `p` (the model of `paths`, loaded on any backend); returns the per-step reports
/// and writes the allocation chart to `chart`.
pub fn run_demo<B: Backend>(
    p: &Pipeline<B>,
    paths: &DemoPaths,
    budget: usize,
    chart: &Path,
) -> Result<Vec<StepReport>> {
    let episode = Episode::load(&paths.episode)?;
    let choice = PolicyChoice {
        name: "selector".into(),
        selector: Some(paths.selector.clone()),
        mode: Mode::Paper,
        max_replacements: None,
        seed: 0,
        indexing: None,
    };
    let mut policy = make_policy(&choice)?;
    let cfg = TwoPassConfig {
        budget,
        max_tokens: 64,
        ..TwoPassConfig::default()
    };
    let mut engine = p.engine(EngineConfig::default())?;
    let reports = run_episode(&mut p.session(&mut engine), &episode, policy.as_mut(), &cfg)?;
    let rows: Vec<AllocationRow> = reports.iter().map(AllocationRow::from).collect();
    write_allocation_chart(&rows, chart)?;
    Ok(reports)
}

/// The text printed after the demo's table.
pub fn demo_footer(reports: &[StepReport], chart: &Path) -> String {
    let passes = reports.iter().filter(|r| r.pass2).count();
    format!(
        "\n{} steps, pass 2 ran on {passes}; allocation chart: {}\n\
         (blue = Recent-B screenshot, orange = promoted older screenshot, light blue = evicted recent, \
         grey = one-line summary, green = current screen)\n\n\
         The model here is a tiny random Qwen3-VL and the selector is randomly initialised: the actions \
         and swaps are meaningless; the numbers only show the machinery (allocation, reuse, drafting).\n\
         With a real checkpoint: recall episode run --model ~/models/GUI-Owl-1.5-8B-Instruct \
         --episode models/demo/episode --budget 4 --policy selector --selector marginal_scorer.safetensors \
         [--adapter hgkv/]\n",
        reports.len(),
        chart.display()
    )
}
