//! `recall demo`: the bundled CausalCache demo on the tiny model.

use std::path::PathBuf;

use anyhow::Result;
use recall::agent::causalcache::steps_table;
use recall::agent::demo::{demo_footer, run_demo, DemoPaths};
use recall::backend::BackendArgs;
use recall::engine::Pipeline;
use recall::with_backend;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// History screenshots per prompt (B).
    #[arg(long, default_value_t = 2)]
    budget: usize,
    /// Where to write the allocation chart.
    #[arg(long, default_value = "demo-allocation.png")]
    chart: PathBuf,
    #[command(flatten)]
    backend: BackendArgs,
}

pub fn run(a: DemoArgs) -> Result<()> {
    let root = std::env::current_dir()?;
    let root = if root.join("models/demo").exists() {
        root
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    };
    let paths = DemoPaths::bundled(&root);
    let reports = with_backend!(a.backend.open(false)?, be => {
        let p = Pipeline::load(be, &paths.model, None)?;
        run_demo(&p, &paths, a.budget, &a.chart)?
    });
    print!("{}", steps_table(&reports));
    print!("{}", demo_footer(&reports, &a.chart));
    Ok(())
}
