//! GUI-agent front ends replayed against `recall serve` (tools/clients/, checked by
//! tools/tests/test_clients.py): GUI-Owl-1.5's AndroidWorld, PC and OSWorld agents, GUI-Owl's
//! OSWorld agent, OSWorld's Qwen3-VL and UI-TARS-1.5 agents, the UI-TARS-desktop SDK, Qwen-Agent in
//! raw function-calling mode, Agent-S, and the CausalCache authors' MobileWorld harness — each with
//! its exact request shape, the answers fed back; every request succeeds, the prefix cache is found
//! step to step, and greedy answers equal `recall generate` bitwise.
//!
//! Needs a Python with `openai` and `pytest` in RECALL_OPENAI_PYTHON (`.ci/run` installs them into
//! .venv-ci); without it the test prints SKIP, except under CI=true, where it fails.

mod common;

#[test]
fn agent_front_ends_run_unchanged_against_recall_serve() {
    common::run_pytest(
        "RECALL_OPENAI_PYTHON",
        "tools/tests/test_clients.py",
        env!("CARGO_BIN_EXE_recall"),
        "tools/tests/requirements.txt",
    );
}
