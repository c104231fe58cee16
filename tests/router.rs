//! Two `recall serve` replicas behind sglang-router on loopback (tools/tests/test_router.py):
//! `recall loadgen` and the episode API through the router keep every episode on one replica, the
//! router aggregates both replicas' metrics, and a replica killed mid-run fails over with clear
//! errors and serves nothing twice (docs/SCALING.md).
//!
//! Needs a Python with tools/tests/requirements.txt (`sglang-router`, `prometheus-client`, `pytest`)
//! in RECALL_OPENAI_PYTHON (`.ci/run` installs it into .venv-ci); without it the test prints SKIP,
//! except under CI=true, where it fails.

mod common;

#[test]
fn replicas_behind_sglang_router_keep_episodes_together_and_fail_over_cleanly() {
    common::run_pytest(
        "RECALL_OPENAI_PYTHON",
        "tools/tests/test_router.py",
        env!("CARGO_BIN_EXE_recall"),
        "tools/tests/requirements.txt",
    );
}
