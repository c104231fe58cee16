//! `recall serve`: the HTTP server (docs/SERVER.md).

use anyhow::Result;
use recall::server::{serve, ServeArgs};

#[derive(clap::Args)]
pub struct ServeCli {
    #[command(flatten)]
    args: ServeArgs,
}

pub fn run(a: ServeCli) -> Result<()> {
    Ok(serve(a.args)?)
}
