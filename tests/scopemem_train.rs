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

mod common;

#[test]
fn the_scopemem_trainer_reads_the_dump_and_exports_an_encoder_recall_serves() {
    common::run_pytest(
        "RECALL_TRAIN_PYTHON",
        "tools/tests/test_scopemem_train.py",
        env!("CARGO_BIN_EXE_recall"),
        "tools/tests/requirements-train.txt",
    );
}
