//! `recall loadgen`: concurrent agent-shaped clients against an OpenAI-compatible server.

use anyhow::Result;
use recall::loadgen::{run_loadgen, LoadgenArgs};

use super::write_file;

pub fn run(a: LoadgenArgs) -> Result<()> {
    let report = run_loadgen(&a)?;
    print!("{}", report.to_table());
    if let Some(one) = report.episodes_on_one_replica {
        let per: Vec<String> = report.replicas.iter().map(|(r, n)| format!("{r}: {n}")).collect();
        println!(
            "replicas: {} ({one} of {} episodes answered by one replica)",
            per.join(", "),
            report.clients
        );
    }
    if let Some(e) = &report.first_error {
        eprintln!("first error: {e}");
    }
    if let Some(path) = &a.json {
        write_file(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
