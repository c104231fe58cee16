//! `recall loadgen`: concurrent agent-shaped clients against an OpenAI-compatible server.

use anyhow::Result;
use recall::loadgen::{run_loadgen, LoadgenArgs};

use super::write_file;

pub fn run(a: LoadgenArgs) -> Result<()> {
    let report = run_loadgen(&a)?;
    print!("{}", report.to_table());
    if let Some(e) = &report.first_error {
        eprintln!("first error: {e}");
    }
    if let Some(path) = &a.json {
        write_file(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
