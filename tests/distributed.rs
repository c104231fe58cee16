//! recall's offline jobs sharded by episode over Ray (tools/distributed/ray_run.py, run by
//! tools/tests/test_distributed.py): label, eval and dump shards merge to exactly the bytes of one
//! process over every episode, a killed label shard resumes to the same bytes, and the batch-array
//! path (`--only-shard`, `--merge-only`) needs no Ray (docs/SCALING.md).
//!
//! Needs a Python with tools/tests/requirements.txt (`ray`, `pytest`) in RECALL_OPENAI_PYTHON
//! (`.ci/run` installs it into .venv-ci); without it the test prints SKIP, except under CI=true,
//! where it fails.

mod common;

#[test]
fn episode_shards_on_ray_merge_to_the_single_process_output() {
    common::run_pytest(
        "RECALL_OPENAI_PYTHON",
        "tools/tests/test_distributed.py",
        env!("CARGO_BIN_EXE_recall"),
        "tools/tests/requirements.txt",
    );
}
