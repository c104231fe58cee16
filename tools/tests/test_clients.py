"""The GUI-agent front ends of tools/clients/ against `recall serve` on the tiny agent model (CPU).

Run by tests/clients.rs (so `cargo test` runs it where a Python with `openai` and `pytest` is given in
RECALL_OPENAI_PYTHON), or directly:

    cargo build && RECALL_BIN=target/debug/recall .venv-ci/bin/python -m pytest -q tools/tests/test_clients.py

Each replay sends its front end's exact request shape for seven steps (past every sliding window),
feeding the answers back as the front end does. Checked for every front end:

* every request succeeds (GUI-Owl-1.5's AndroidWorld agent sends bare base64, which recall, like vLLM,
  refuses: with a short 400 that says to add the `data:` prefix; with that one-line fix it runs);
* the prefix cache: from the second step on the request finds cached tokens, and while the prompt
  only grows (the messages extend the previous request's) the cached tokens rise step to step;
* greedy answers (every front end here decodes greedily on this model) are bitwise `recall generate`'s
  on the same messages, tools and penalties: the first and the last step are re-sent with
  `logprobs` to read their token ids and compared with the CLI's.

The tiny agent model (tests/fixtures/agent-qwen3-vl, tools/gen_agent_model.py) answers every chat
with one GUI-Owl tool call, so tool-calling front ends see real `tool_calls`.
"""

import importlib
import json
import pathlib
import subprocess
import sys
import tempfile

import openai
import pytest
from recall_server import BIN, serve

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures" / "agent-qwen3-vl"
SELECTOR = ROOT / "models" / "demo" / "selector.safetensors"
sys.path.insert(0, str(ROOT / "tools" / "clients"))

STEPS = 7
FRONT_ENDS = ["gui_owl_pc", "gui_owl_osworld", "gui_owl_v1_osworld", "osworld_qwen3vl", "osworld_uitars15",
              "uitars_desktop", "qwen_agent_raw", "agent_s"]


@pytest.fixture(scope="module")
def url():
    with serve("--model", str(MODEL), "--served-model-name", "gui-owl", "--selector", str(SELECTOR)) as u:
        yield u


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=600)


def token_ids(r) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]


def generate_cli(body: dict, max_tokens: int) -> list[int]:
    """`recall generate --json` on a request's messages, tools and penalties."""
    extra = body.get("extra_body") or {}
    with tempfile.TemporaryDirectory() as d:
        messages = pathlib.Path(d) / "messages.json"
        messages.write_text(json.dumps(body["messages"]))
        args = [BIN, "generate", "--backend", "cpu", "--json", "--model", str(MODEL), "--messages", str(messages),
                "--max-tokens", str(max_tokens)]
        if body.get("tools"):
            tools = pathlib.Path(d) / "tools.json"
            tools.write_text(json.dumps(body["tools"]))
            args += ["--tools", str(tools)]
        for key in ["repetition_penalty", "frequency_penalty", "presence_penalty"]:
            value = body.get(key, extra.get(key))
            if value is not None:
                args += [f"--{key.replace('_', '-')}", str(value)]
        out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["tokens"]


def check_equal_to_generate(c, step):
    """Re-sends a greedy step without streaming, with log-probs, and compares its tokens with the CLI's."""
    body = {k: v for k, v in step.body.items() if k not in ("stream", "stream_options", "seed")}
    body["extra_body"] = {**(body.get("extra_body") or {}), "return_tokens_as_token_ids": True}
    r = c.chat.completions.create(logprobs=True, **body)
    served = token_ids(r)
    assert served, "no tokens"
    text = r.choices[0].message.content
    if step.content is not None and not step.tool_calls:
        assert text == step.content, "the re-sent request answered differently"
    assert generate_cli(step.body, len(served) + 1) == served


def check_cache(steps):
    for k in range(1, len(steps)):
        s, prev = steps[k], steps[k - 1]
        assert s.cached_tokens > 0, f"step {k + 1} found nothing in the prefix cache"
        if s.appends:
            assert s.cached_tokens > prev.cached_tokens, (
                f"step {k + 1} extends step {k}'s prompt but reused {s.cached_tokens} <= {prev.cached_tokens} tokens")


@pytest.mark.parametrize("name", FRONT_ENDS)
def test_front_end(url, name):
    mod = importlib.import_module(name)
    c = client(url)
    steps = mod.replay(c, "gui-owl", STEPS)
    assert [s.status for s in steps] == [200] * STEPS, [(s.status, s.error) for s in steps]
    assert all(s.content or s.tool_calls for s in steps)
    check_cache(steps)
    for s in (steps[0], steps[-1]):
        check_equal_to_generate(c, s)


def test_gui_owl_androidworld_needs_the_data_prefix_and_then_runs(url):
    mod = importlib.import_module("gui_owl_androidworld")
    c = client(url)
    exact = mod.replay(c, "gui-owl", STEPS)
    assert [s.status for s in exact] == [400]
    assert "data:image/png;base64," in exact[0].error and len(exact[0].error) < 400, exact[0].error
    steps = mod.replay(c, "gui-owl", STEPS, data_url=True)
    assert [s.status for s in steps] == [200] * STEPS
    check_cache(steps)
    for s in (steps[0], steps[-1]):
        check_equal_to_generate(c, s)


def test_qwen_agent_sees_streamed_tool_calls(url):
    mod = importlib.import_module("qwen_agent_raw")
    steps = mod.replay(client(url), "gui-owl", 3)
    for s in steps:
        assert s.tool_calls and s.tool_calls[0]["function"]["name"] == "mobile_use", s
        json.loads(s.tool_calls[0]["function"]["arguments"])


def test_causalcache_harness(url):
    mod = importlib.import_module("causalcache_mobileworld")
    base = url + "/v1/causalcache/policy"
    steps = mod.replay(base, STEPS, arm="recent", budget=4)
    assert [s["status"] for s in steps] == [200] * STEPS, steps[-1]
    reused = [s["response"]["generation"]["reused_tokens"]["pass1"] for s in steps]
    assert all(r > 0 for r in reused[1:]), reused
    # Until the window slides (history of at most B = 4 steps) the prompt only grows.
    assert all(a < b for a, b in zip(reused[:5], reused[1:5])), reused
    assert all(s["response"]["policy_parsed"] for s in steps), steps[0]["response"]
    # Every screenshot sent: the server's selector chooses.
    full = mod.replay(base, 6, arm="full", budget=4)
    assert all(s["status"] == 200 for s in full)
    assert full[-1]["response"]["selection"]["chosen"] is not None
