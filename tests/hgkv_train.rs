//! The HGKV trainer (tools/hgkv_train.py, tools/tests/test_hgkv_train.py): on the tiny model with labels
//! of the sample episode made by this recall binary, a short run lowers the DiD objective within the
//! drift cap, and its exported PEFT directory loads in `recall logits` with ungated logits equal to
//! PEFT's and gated logits equal to the trainer's own gated forward (1e-4); no history image leaves the
//! frozen model bit for bit; plus unit tests of the objective, group mining and the dev split.
//!
//! Needs a Python with torch, transformers, peft and pytest (tools/tests/requirements-train.txt) in
//! RECALL_TRAIN_PYTHON; `.ci/run` installs them into .venv-train. Without it the test prints SKIP, except
//! under CI=true, where it fails.

use std::path::Path;
use std::process::Command;

#[test]
fn the_hgkv_trainer_exports_an_adapter_recall_loads() {
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
            "tools/tests/test_hgkv_train.py",
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
