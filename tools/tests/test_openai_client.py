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
import pathlib
import subprocess

import openai
import pytest
from recall_server import BIN, serve

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures" / "tiny-qwen3-vl"
SCREEN = ROOT / "tests" / "fixtures" / "vl-images" / "screen.png"
KEY = "test-key"


@pytest.fixture(scope="module")
def url():
    with serve("--model", str(MODEL), "--served-model-name", "tiny", "--api-key", KEY) as u:
        yield u


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


def test_penalties_and_choices(url):
    c = client(url)
    msgs = [{"role": "user", "content": "Open the settings app and turn on Wi-Fi, then go back."}]
    plain = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    penalised = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                          frequency_penalty=1.0, presence_penalty=1.5,
                                          extra_body={"repetition_penalty": 1.3})
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    n = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=1.0, seed=5, n=3)
    assert [ch.index for ch in n.choices] == [0, 1, 2]
    assert n.usage.prompt_tokens == plain.usage.prompt_tokens


def test_completions_and_responses(url):
    c = client(url)
    r = c.completions.create(model="tiny", prompt="Open the settings app", max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "Open the settings app"
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.text_offset) == r.usage.prompt_tokens
    g = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=0)
    assert g.usage.completion_tokens <= 5 and g.choices[0].finish_reason in ("stop", "length")
    resp = c.responses.create(model="tiny", input="Where is the menu?", max_output_tokens=8, temperature=0)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Where is the menu?"}],
                                     max_tokens=8, temperature=0)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


AGENT = ROOT / "tests" / "fixtures" / "agent-qwen3-vl"
TOOLS = [{"type": "function", "function": {"name": "mobile_use", "description": "Use the phone.",
          "parameters": {"type": "object", "properties": {"action": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def agent_url():
    with serve("--model", str(AGENT), "--served-model-name", "agent") as u:
        yield u


def test_tool_calls_through_the_official_client(agent_url):
    c = openai.OpenAI(base_url=agent_url + "/v1", api_key="none", max_retries=0)
    msgs = image_message("Search for cats.")
    r = c.chat.completions.create(model="agent", messages=msgs, tools=TOOLS, temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.content.startswith("Action: ") and m.tool_calls[0].function.name == "mobile_use"
    assert json.loads(m.tool_calls[0].function.arguments) == {"action": "click", "coordinate": [540, 120]}
    # The client's stream helper accumulates the tool-call deltas into the same message.
    with c.chat.completions.stream(model="agent", messages=msgs, tools=TOOLS, temperature=0) as s:
        final = s.get_final_completion()
    fm = final.choices[0].message
    assert fm.content == m.content
    assert [(t.function.name, t.function.arguments) for t in fm.tool_calls] == \
           [(t.function.name, t.function.arguments) for t in m.tool_calls]
    # Fed back as the client writes it.
    msgs += [m.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "Searched."}]
    again = c.chat.completions.create(model="agent", messages=msgs, tools=TOOLS, temperature=0)
    assert again.choices[0].message.tool_calls
    assert again.usage.prompt_tokens_details.cached_tokens > 0
