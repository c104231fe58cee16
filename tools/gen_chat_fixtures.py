#!/usr/bin/env python3
"""Generate `tests/fixtures/chat/cases.json` and `tool_cases.json`: chat renderings by Hugging Face's
Jinja chat templates (the second with function tools and tool calls, normalised as vLLM does).

Each case is rendered by `transformers` (`apply_chat_template`, the official Jinja template read from
`models/<model>/chat_template.json`) and tokenized by the Qwen tokenizer in `models/qwen-vl-tokenizer/`.
`tests/chat.rs` checks that recall's native renderer (`recall::tokenize::chat`) reproduces every text
byte for byte, and that recall's tokenizer gives the same ids.

Families and template sources:

* `qwen3_vl`: `models/qwen3-vl-8b-instruct/chat_template.json` (Qwen3-VL Instruct, also GUI-Owl-1.5).
* `qwen2_5_vl`: `models/qwen2.5-vl-7b-instruct/chat_template.json` (adds the default system prompt).

Usage (from the repository root):

    .venv-tools/bin/python tools/gen_chat_fixtures.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TEMPLATES = {
    "qwen3_vl": ROOT / "models/qwen3-vl-8b-instruct/chat_template.json",
    "qwen2_5_vl": ROOT / "models/qwen2.5-vl-7b-instruct/chat_template.json",
}

SYSTEM_GUI = (
    "You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n"
    "\nThe screen's resolution is 1000x1000."
)
RESPONSE = (
    'Action: Tap the search bar.\n<tool_call>\n{"name": "mobile_use", "arguments": '
    '{"action": "click", "coordinate": [540, 120]}}\n</tool_call>'
)


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def image(path: str) -> dict:
    return {"type": "image", "image": path}


# (name, messages, add_generation_prompt); every case is rendered for both families.
CASES: list[tuple[str, list[dict], bool]] = [
    (
        "system_user",
        [
            {"role": "system", "content": "You are a careful GUI agent."},
            {"role": "user", "content": "Open the settings app."},
        ],
        True,
    ),
    ("no_system", [{"role": "user", "content": "Hello!"}], True),
    (
        "multi_turn",
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And times 3?"},
        ],
        True,
    ),
    (
        "text_parts",
        [{"role": "user", "content": [text("First part. "), text("Second part.")]}],
        True,
    ),
    (
        "images_two_user_turns",
        [
            {"role": "system", "content": "Describe screenshots."},
            {"role": "user", "content": [image_url("file:///tmp/a.png"), text("What is shown?")]},
            {"role": "assistant", "content": "A home screen."},
            {"role": "user", "content": [text("And now?"), image("/tmp/b.png")]},
        ],
        True,
    ),
    (
        "assistant_list_content",
        [
            {"role": "user", "content": [image("screen.png"), text("Next move?")]},
            {"role": "assistant", "content": [text("Action: Tap."), text(" Done.")]},
            {"role": "user", "content": "Thanks"},
        ],
        True,
    ),
    (
        "assistant_list_with_image",
        [
            {"role": "user", "content": "Show me."},
            {"role": "assistant", "content": [text("Here:"), image_url("https://example.com/x.png")]},
        ],
        False,
    ),
    (
        "cjk_emoji",
        [
            {"role": "system", "content": "请用中文回答。"},
            {"role": "user", "content": [text("你好，世界 🌍🚀 こんにちは 한국어 — naïve café"), image("图.png")]},
        ],
        True,
    ),
    (
        "no_generation_prompt",
        [
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi!"},
        ],
        False,
    ),
    (
        "system_list_content",
        [
            {"role": "system", "content": [text("Line one.\n"), text("Line two.")]},
            {"role": "user", "content": [image_url("data:image/png;base64,AAAA"), image("b.png"), text("Compare.")]},
        ],
        True,
    ),
    (
        "late_system",
        [
            {"role": "user", "content": "u1"},
            {"role": "system", "content": "late system"},
            {"role": "user", "content": "u2"},
        ],
        True,
    ),
    (
        "tool_messages",
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Calling the tool."},
            {"role": "tool", "content": "{\"temp\": 21}"},
            {"role": "tool", "content": [text("sunny")]},
            {"role": "user", "content": "Thanks."},
        ],
        True,
    ),
    (
        "gui_owl_like",
        [
            {"role": "system", "content": SYSTEM_GUI},
            {
                "role": "user",
                "content": [
                    text(
                        "Please generate the next move according to the UI screenshot, instruction and previous "
                        "actions.\n\nInstruction: Search for cats.\n\nPrevious actions:\nNo previous action."
                    ),
                    image("step0.png"),
                ],
            },
            {"role": "assistant", "content": RESPONSE},
            {"role": "user", "content": [image("step1.png")]},
        ],
        True,
    ),
    (
        "whitespace_and_empty",
        [
            {"role": "user", "content": "  leading and trailing  \n\n"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": []},
        ],
        True,
    ),
]


# Function calling: (name, request, add_generation_prompt). Each `request` is what an OpenAI client
# sends (`tools` in the client's form, `content: null`, `arguments` as compact JSON strings); it is
# normalised as vLLM does before templating (`vllm_tools`, `vllm_messages`) and rendered by the HF
# template; tests/chat.rs checks that recall's request parsing plus native renderer give the same text.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city. Temperatures in °C.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer",
                       "minimum": 1, "default": 1.0, "multipleOf": 1e-05}}, "required": ["city"]},
    },
}
MOBILE_USE = {
    "type": "function",
    "function": {
        "parameters": {"properties": {"action": {"enum": ["click", "swipe"], "type": "string"},
                                      "coordinate": {"type": "array"}}, "required": ["action"], "type": "object"},
        "name": "mobile_use",
        "strict": False,
    },
}
BARE = {"type": "function", "function": {"name": "noop"}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2,"note":"ça va\\n"}'}}
CLICK = {"id": "call_2", "type": "function",
         "function": {"name": "mobile_use", "arguments": '{"action":"click","coordinate":[540,120],"scale":0.5}'}}
EMPTY_ARGS = {"type": "function", "function": {"name": "noop", "arguments": ""}}

TOOL_CASES: list[tuple[str, dict, bool]] = [
    ("tools_no_system", {"tools": [WEATHER], "messages": [{"role": "user", "content": "Weather in Paris?"}]}, True),
    (
        "tools_with_system",
        {"tools": [WEATHER, MOBILE_USE, BARE],
         "messages": [{"role": "system", "content": "You are a GUI agent."}, {"role": "user", "content": "Go."}]},
        True,
    ),
    (
        "tools_list_system",
        {"tools": [MOBILE_USE],
         "messages": [{"role": "system", "content": [{"type": "text", "text": "Line one. "}, {"type": "text", "text": "Two."}]},
                      {"role": "user", "content": [{"type": "text", "text": "Tap it."}, image_url("data:image/png;base64,AAAA")]}]},
        True,
    ),
    (
        "call_and_result",
        {"tools": [WEATHER],
         "messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                      {"role": "user", "content": "Thanks."}]},
        True,
    ),
    (
        "calls_without_content",
        {"tools": [WEATHER, MOBILE_USE, BARE],
         "messages": [{"role": "user", "content": "Do both."},
                      {"role": "assistant", "content": None, "tool_calls": [CALL, CLICK, EMPTY_ARGS]},
                      {"role": "tool", "content": "sunny"},
                      {"role": "tool", "content": [{"type": "text", "text": "clicked"}]},
                      {"role": "tool", "content": ""}]},
        True,
    ),
    (
        "empty_content_and_call",
        {"messages": [{"role": "user", "content": "Go."},
                      {"role": "assistant", "content": "", "tool_calls": [CLICK]},
                      {"role": "user", "content": [image_url("data:image/png;base64,AAAA")]}]},
        True,
    ),
]


def vllm_tools(tools: list[dict]) -> list[dict]:
    """`[tool.model_dump() for tool in request.tools]`: type, then function's name, description and
    parameters (None when absent), then any other member."""
    out = []
    for t in tools:
        f = t["function"]
        fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
        fn.update({k: v for k, v in f.items() if k not in fn})
        tool = {"type": "function", "function": fn}
        tool.update({k: v for k, v in t.items() if k not in tool})
        out.append(tool)
    return out


def vllm_messages(messages: list[dict]) -> list[dict]:
    """vLLM's `parse_chat_messages` for an "openai"-format template: content as a list of parts (None
    becomes []), tool-call arguments `json.loads`-ed (empty becomes {})."""
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        msg = {"role": m["role"], "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {**c, "function": {**c["function"],
                                   "arguments": json.loads(c["function"]["arguments"]) if c["function"].get("arguments") else {}}}
                for c in m["tool_calls"]
            ]
        out.append(msg)
    return out


def tool_cases(tokenizer, templates) -> list[dict]:
    cases = []
    for family, template in templates.items():
        for name, request, add_generation_prompt in TOOL_CASES:
            rendered = tokenizer.apply_chat_template(
                vllm_messages(request["messages"]),
                tools=vllm_tools(request.get("tools", [])) or None,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
            cases.append({
                "name": f"{family}/{name}",
                "family": family,
                "request": request,
                "add_generation_prompt": add_generation_prompt,
                "text": rendered,
                "ids": tokenizer.encode(rendered, add_special_tokens=False),
            })
    return cases


def load_tokenizer(tokenizer_dir: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=ROOT / "models/qwen-vl-tokenizer")
    parser.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/chat/cases.json")
    args = parser.parse_args()

    import transformers

    tokenizer = load_tokenizer(args.tokenizer)
    templates = {family: json.loads(path.read_text())["chat_template"] for family, path in TEMPLATES.items()}

    cases = []
    for family, template in templates.items():
        for name, messages, add_generation_prompt in CASES:
            rendered = tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
            ids = tokenizer.encode(rendered, add_special_tokens=False)
            cases.append(
                {
                    "name": f"{family}/{name}",
                    "family": family,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "text": rendered,
                    "ids": ids,
                }
            )

    doc = {
        "generator": "tools/gen_chat_fixtures.py",
        "transformers_version": transformers.__version__,
        "tokenizer": str(args.tokenizer.relative_to(ROOT)),
        "templates": {family: str(path.relative_to(ROOT)) for family, path in TEMPLATES.items()},
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")
    tools = dict(doc, cases=tool_cases(tokenizer, templates))
    tools_out = args.out.with_name("tool_cases.json")
    tools_out.write_text(json.dumps(tools, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(tools['cases'])} cases to {tools_out}")


if __name__ == "__main__":
    main()
