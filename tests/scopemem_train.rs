//! The ScopeMem trainer (tools/scopemem_train.py, tools/tests/test_scopemem_train.py) reads only
//! `recall scopemem dump` lines: on four steps of the AITW fixture dumped by this recall binary, a short
//! CPU run on the tiny model lowers the objective, and the exported encoder loads in
//! `recall scopemem dump --encoder`, whose `prefix` equals the trainer's own encoder output (1e-5); the
//! trainer's embedding-run forward (prepend and append) equals transformers' input_ids forward; a dump
//! line lacking a field is a clear error; plus unit tests of the objective.
//!
//! Needs a Python with torch, transformers and pytest (tools/tests/requirements-train.txt) in
//! RECALL_TRAIN_PYTHON; `.ci/run` installs them into .venv-train. Without it the test prints SKIP, except
//! under CI=true, where it fails.

use std::path::Path;
use std::process::Command;

#[test]
fn the_scopemem_trainer_reads_the_dump_and_exports_an_encoder_recall_serves() {
    let Some(python) = std::env::var_os("RECALL_TRAIN_PYTHON") else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must set RECALL_TRAIN_PYTHON to a Python with torch, transformers, peft and pytest (see .ci/run)"
        );
        eprintln!(
            "SKIP: set RECALL_TRAIN_PYTHON to a Python with tools/tests/requirements-train.txt installed"
        );
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
            "tools/tests/test_scopemem_train.py",
        ])
        .env("RECALL_BIN", env!("CARGO_BIN_EXE_recall"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
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
