//! The HGKV trainer (tools/hgkv_train.py, tools/tests/test_hgkv_train.py): on the tiny model with labels
//! of the sample episode made by this recall binary, a short run lowers the DiD objective within the
//! drift cap, and its exported PEFT directory loads in `recall logits` with ungated logits equal to
//! PEFT's and gated logits equal to the trainer's own gated forward (1e-4); no history image leaves the
//! frozen model bit for bit; plus unit tests of the objective, group mining and the dev split.
//!
//! Needs a Python with torch, transformers, peft and pytest (tools/tests/requirements-train.txt) in
//! RECALL_TRAIN_PYTHON; `.ci/run` installs them into .venv-train. Without it the test prints SKIP, except
//! under CI=true, where it fails.

mod common;

#[test]
fn the_hgkv_trainer_exports_an_adapter_recall_loads() {
    common::run_pytest(
        "RECALL_TRAIN_PYTHON",
        "tools/tests/test_hgkv_train.py",
        env!("CARGO_BIN_EXE_recall"),
        "tools/tests/requirements-train.txt",
    );
}
