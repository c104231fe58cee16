//! The `recall` command line: parses arguments and calls the library (the commands are in `cli/`).

mod cli;

/// mimalloc keeps freed memory for reuse: the CPU backend's activations are tens of megabytes per
/// op, which glibc's allocator would map and unmap (and page-fault in) on every forward.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "recall=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = cli::run() {
        // One line, the whole chain of causes.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
