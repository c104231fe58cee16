"""What the front-end replays in tools/clients/ share.

Each replay script rebuilds, with the official `openai` Python client, the request bodies one GUI-agent
front end sends to an OpenAI-compatible server (vLLM) step after step: its message layout, image
encoding and sizes, sampling parameters, sliding image window, and the model's answers fed back as it
feeds them. The sources are cited in each script (repository, file, commit). Screenshots are synthetic
(drawn here, deterministic per step) at the sizes the front end sends.

Every script has `replay(client, model, steps) -> list[Step]` and a command line:

    python tools/clients/<front_end>.py --base-url http://127.0.0.1:8000/v1 --model NAME --steps 6

`tools/tests/test_clients.py` (run by `cargo test`, tests/clients.rs) replays each against
`recall serve` and checks the answers, the prefix cache and bitwise equality with `recall generate`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import pathlib
import random
import sys
from dataclasses import asdict, dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[2]
MOBILE_SYSTEM = (ROOT / "src/memory/prompts/gui_owl_mobile_system.txt").read_text()
DESKTOP_SYSTEM = (ROOT / "src/memory/prompts/gui_owl_desktop_system.txt").read_text()

TASKS = ["Turn on dark mode in Settings", "Add a note 'café ☕' and go back", "Find the weather in Paris"]


@dataclass
class Step:
    """One request of a replay and what the server answered."""

    body: dict  # the keyword arguments given to the client (what goes on the wire, extra_body merged by the SDK)
    content: str | None = None
    tool_calls: list = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    status: int = 200
    error: str | None = None
    # The messages of this request extend those of the one before (the prompt only grew).
    appends: bool = False


def screenshot(width: int, height: int, step: int, seed: int = 0):
    """A synthetic GUI screen: a status bar, a title bar, a list of rows whose content moves with the step."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed * 1000 + step)
    img = Image.new("RGB", (width, height), (245, 245, 247))
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, width, height // 30], fill=(30, 30, 30))
    d.rectangle([0, height // 30, width, height // 10], fill=(rng.randrange(256), 120, 200))
    rows = 8
    for r in range(rows):
        y = height // 10 + r * (height - height // 10) // rows
        shade = 255 - (r * 7 + step * 13) % 60
        d.rectangle([width // 20, y + 4, width - width // 20, y + (height // 10) - 8], fill=(shade, shade, 255))
        d.ellipse([width // 16, y + 12, width // 16 + height // 30, y + 12 + height // 30], fill=(rng.randrange(256), 80, 80))
    return img


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's `smart_resize` (qwen_vl_utils): both sides multiples of `factor`, pixels in range."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized(img, factor: int, min_pixels: int, max_pixels: int):
    h, w = smart_resize(img.height, img.width, factor, min_pixels, max_pixels)
    return img.resize((w, h))


def action_line(response: str) -> str:
    """`response.split("Action:")[-1].split("<tool_call>")[0].strip()`, the GUI-Owl summary line."""
    return response.split("Action:")[-1].split("<tool_call>")[0].strip()


def previous_actions(responses: list[str], upto: int, line: str = "Step {i}: {a}", empty: str = "None") -> str:
    """The folded history of steps 1..upto: one action line each, or `empty`."""
    return "\n".join(line.format(i=i + 1, a=action_line(r)) for i, r in enumerate(responses[:max(0, upto)])) or empty


def instruction_prompt(task: str, previous: str, lead: str = "") -> str:
    """GUI-Owl's instruction turn (`lead` is the leading newline some front ends put first)."""
    return (f"{lead}Please generate the next move according to the UI screenshot, instruction and previous actions."
            f"\n\nInstruction: {task}\n\nPrevious actions:\n{previous}")


def run(client, model: str, steps: int, request) -> list["Step"]:
    """The replay loop: `request(responses, t)` gives the keyword arguments of step t's request; each
    answer is fed back; a refused request ends the replay (the agent would retry it, then fail)."""
    rec = Recorder(client, model)
    responses = []
    for t in range(steps):
        s = rec.chat(**request(responses, t))
        if s.status != 200:
            break
        responses.append(s.content)
    return rec.steps


class Recorder:
    """Sends requests through the client and records them as `Step`s."""

    def __init__(self, client, model: str):
        self.client, self.model, self.steps = client, model, []

    def chat(self, **kwargs) -> Step:
        """`client.chat.completions.create(model=..., **kwargs)`, streamed when `stream=True` is among them."""
        import openai

        body = dict(model=self.model, **kwargs)
        step = Step(body=body)
        prev = self.steps[-1].body.get("messages") if self.steps else None
        msgs = body.get("messages")
        step.appends = prev is not None and msgs is not None and len(msgs) > len(prev) and msgs[: len(prev)] == prev
        try:
            if body.get("stream") is True:
                self._stream(step, body)
            else:
                r = self.client.chat.completions.create(**body)
                m = r.choices[0].message
                step.content = m.content
                step.tool_calls = [tc.model_dump() for tc in (m.tool_calls or [])]
                step.prompt_tokens = r.usage.prompt_tokens
                details = r.usage.prompt_tokens_details
                step.cached_tokens = details.cached_tokens if details else 0
        except openai.APIStatusError as e:
            step.status, step.error = e.status_code, str(e.message)
        self.steps.append(step)
        return step

    def _stream(self, step: Step, body: dict):
        """A streamed request, accumulated as the client would (content and tool-call deltas). The
        front end asks for no usage, so the prefix-cache hits come from the server's /metrics."""
        before = self._cache_hits()
        chunks = self.client.chat.completions.create(**body)
        content, calls = [], {}
        for ch in chunks:
            for c in ch.choices:
                if c.delta.content:
                    content.append(c.delta.content)
                for tc in c.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    slot["id"] = tc.id or slot["id"]
                    if tc.function:
                        slot["function"]["name"] += tc.function.name or ""
                        slot["function"]["arguments"] += tc.function.arguments or ""
        step.content = "".join(content)
        step.tool_calls = [calls[i] for i in sorted(calls)]
        after = self._cache_hits()
        if before is not None and after is not None:
            step.cached_tokens = int(after - before)

    def _cache_hits(self) -> float | None:
        """`recall_prefix_cache_hit_tokens_total` of the server (None when it has no such metric)."""
        import urllib.request

        url = str(self.client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
        try:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("recall_prefix_cache_hit_tokens_total "):
                return float(line.split()[-1])
        return None


def main(replay, description: str) -> None:
    """The command line of a replay script: run it, print one line per step, write a JSON report."""
    import openai

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=pathlib.Path)
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0)
    steps = replay(client, a.model, a.steps)
    for i, s in enumerate(steps, 1):
        print(f"step {i}: status {s.status} prompt {s.prompt_tokens} cached {s.cached_tokens} "
              f"{(s.content or s.error or '')[:60]!r}")
    if a.out:
        a.out.write_text(json.dumps([asdict(s) for s in steps], ensure_ascii=False))
    sys.exit(0 if all(s.status == 200 for s in steps) else 1)
