//! The official `openai` Python client against `recall serve` (tools/tests/test_openai_client.py):
//! a chat with an image as a data URL, streaming with usage, stop strings, logprobs, a 400, a 401,
//! the same greedy tokens as `recall generate`, and exit status 0 on SIGTERM.
//!
//! Needs a Python with `openai` and `pytest` (tools/tests/requirements.txt) in RECALL_OPENAI_PYTHON;
//! `.ci/run` installs them into .venv-ci. Without it the test prints SKIP, except under CI=true,
//! where it fails.

mod common;

#[test]
fn the_official_openai_client_talks_to_recall_serve() {
    common::run_pytest(
        "RECALL_OPENAI_PYTHON",
        "tools/tests/test_openai_client.py",
        env!("CARGO_BIN_EXE_recall"),
        "tools/tests/requirements.txt",
    );
}
