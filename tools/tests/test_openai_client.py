"""The official `openai` Python client against `recall serve` on the tiny Qwen3-VL fixture (CPU).

Run by tests/openai_client.rs (so `cargo test` runs it where a Python with `openai` and `pytest` is
given in RECALL_OPENAI_PYTHON; `.ci/run` installs them from PyPI into .venv-ci), or directly:

    python3 -m venv .venv-ci && .venv-ci/bin/pip install -r tools/tests/requirements.txt
    cargo build && RECALL_BIN=target/debug/recall .venv-ci/bin/python -m pytest -q tools/tests

Covers: a chat with an image as a data URL, streaming with usage, stop strings, logprobs, a 400 for a
bad request, a 401 without the key, `/v1/models`, the same greedy tokens as `recall generate`, and a
clean exit (status 0) on SIGTERM.
"""

import base64
import json
import os
import pathlib
import re
import signal
import subprocess
import threading

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("RECALL_BIN", str(ROOT / "target" / "debug" / "recall"))
MODEL = ROOT / "tests" / "fixtures" / "tiny-qwen3-vl"
SCREEN = ROOT / "tests" / "fixtures" / "vl-images" / "screen.png"
KEY = "test-key"


@pytest.fixture(scope="module")
def url():
    proc = subprocess.Popen(
        [BIN, "serve", "--model", str(MODEL), "--served-model-name", "tiny", "--backend", "cpu",
         "--port", "0", "--api-key", KEY],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "RUST_LOG": "recall=info"},
    )
    found = None
    log = []
    for line in proc.stderr:
        log.append(line)
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            found = m.group(1)
            break
    assert found, "recall serve did not start:\n" + "".join(log)
    # Keep draining the log so the server never blocks on a full pipe.
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    yield found
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "recall serve did not exit cleanly on SIGTERM:\n" + "".join(log)


def client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def image_message(text):
    data = base64.b64encode(SCREEN.read_bytes()).decode()
    return [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
    ]}]


def test_models(url):
    assert [m.id for m in client(url).models.list().data] == ["tiny"]


def test_chat_with_an_image(url):
    c = client(url)
    text_only = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What should I tap?"}], max_tokens=4, temperature=0)
    r = c.chat.completions.create(model="tiny", messages=image_message("What should I tap?"), max_tokens=8,
                                  temperature=0)
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    # The screenshot adds its merged image tokens (and the vision markers) to the prompt.
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + 10
    assert r.usage.completion_tokens <= 8


def test_streaming_with_usage(url):
    c = client(url)
    system = {"role": "system", "content": "You are a GUI agent. Look at the screen, then act. " * 6}
    messages = [system] + image_message("Describe the screen.")
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # The second request reused the first one's prefix (whole blocks before the screenshot).
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def test_stop_strings(url):
    c = client(url)
    messages = [{"role": "user", "content": "Count the icons on the home screen."}]
    full = c.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert len(text) >= 12, text
    stop = text[8:11]
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(url):
    r = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob


def test_bad_request_is_400(url):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=0)
    assert e.value.status_code == 400
    assert "max_tokens" in str(e.value)


def test_missing_or_wrong_key_is_401(url):
    for key in ("", "wrong"):
        with pytest.raises(openai.AuthenticationError):
            client(url, key=key or "none").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)


def test_greedy_tokens_equal_recall_generate(url):
    prompt = "Open the settings app and turn on Wi-Fi."
    out = subprocess.run([BIN, "generate", "--backend", "cpu", "--json", "--model", str(MODEL), "--prompt", prompt,
                          "--max-tokens", "16"], capture_output=True, text=True, check=True)
    want = json.loads(out.stdout)["tokens"]
    r = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True})
    got = [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]
    assert got == want
