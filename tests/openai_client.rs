//! The official `openai` Python client against `recall serve` (tools/tests/test_openai_client.py):
//! a chat with an image as a data URL, streaming with usage, stop strings, logprobs, a 400, a 401,
//! the same greedy tokens as `recall generate`, and exit status 0 on SIGTERM.
//!
//! Needs a Python with `openai` and `pytest` (tools/tests/requirements.txt) in RECALL_OPENAI_PYTHON;
//! `.ci/run` installs them into .venv-ci. Without it the test prints SKIP, except under CI=true,
//! where it fails.

use std::path::Path;
use std::process::Command;

#[test]
fn the_official_openai_client_talks_to_recall_serve() {
    let Some(python) = std::env::var_os("RECALL_OPENAI_PYTHON") else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must set RECALL_OPENAI_PYTHON to a Python with openai and pytest (see .ci/run)"
        );
        eprintln!("SKIP: set RECALL_OPENAI_PYTHON to a Python with tools/tests/requirements.txt installed");
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python)
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tools/tests/test_openai_client.py",
        ])
        .env("RECALL_BIN", env!("CARGO_BIN_EXE_recall"))
        .current_dir(root)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "pytest failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
