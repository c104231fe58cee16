//! The `recall` command line: parses arguments and calls the library (the commands are in `cli/`).

mod cli;

/// mimalloc keeps freed memory for reuse: the CPU backend's activations are tens of megabytes per
/// op, which glibc's allocator would map and unmap (and page-fault in) on every forward.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

unsafe extern "C" {
    /// mimalloc's option setter (linked with the allocator itself).
    fn mi_option_set(option: i32, value: std::ffi::c_long);
}

/// `mi_option_purge_delay` in mimalloc's option enum (v2 and v3).
const MI_OPTION_PURGE_DELAY: i32 = 15;

/// Freed memory stays committed (as PyTorch's caching allocators keep theirs): returned to the OS,
/// every large activation would fault in freshly zeroed pages again, which cost a sixth of the vision
/// tower's time. Memory use stays at the peak of what was live. `MIMALLOC_PURGE_DELAY` still wins.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: a plain option store in the allocator that is linked in; -1 means "never purge".
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

fn main() {
    keep_freed_memory();
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
