#!/usr/bin/env python3
"""Seed corpora for the fuzz targets in fuzz/ (docs/RELIABILITY.md "Fuzzing"), taken from the test fixtures.

Writes fuzz/corpus/<target>/<name> for every target: small valid inputs (and a few near misses) that let
the coverage-guided fuzzer start inside each parser instead of at its first byte. Standard library only.

    python3 tools/gen_fuzz_corpus.py
"""

import base64
import json
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(ROOT, "fuzz", "corpus")


def read(*parts, mode="rb"):
    with open(os.path.join(FIX, *parts), mode) as f:
        return f.read()


def safetensors(tensors: dict, metadata: dict | None = None) -> bytes:
    """name -> (dtype, shape, raw bytes), laid out one after another."""
    header, data = ({"__metadata__": metadata} if metadata else {}), b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def first_lines(text: str, n: int) -> str:
    return "".join(text.splitlines(keepends=True)[:n])


def seeds() -> dict:
    f32 = lambda *v: struct.pack(f"<{len(v)}f", *v)  # noqa: E731
    response = ("Action: Click the search box.\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": "
                "{\"action\": \"click\", \"coordinate\": [540, 120]}}\n</tool_call>")
    cases = json.loads(read("chat", "cases.json"))["cases"]
    return {
        "safetensors": {
            "f32_bf16": safetensors({"a": ("F32", [2, 2], f32(1, 2, 3, 4)), "b": ("BF16", [3], b"\x80\x3f" * 3)}),
            "no_tensors": struct.pack("<Q", 2) + b"{}",
            "metadata": safetensors({"w": ("F16", [1], b"\x00\x3c")}, {"format": "pt"}),
            "truncated": safetensors({"a": ("F32", [4], f32(1, 2, 3, 4))})[:-5],
        },
        "shard_index": {
            "valid": json.dumps({"metadata": {"total_size": 8},
                                 "weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode(),
            "missing_shards": read("tiny-qwen3-vl-sharded", "model.safetensors.index.json"),
            "traversal": json.dumps({"weight_map": {"w": "../model-00001-of-00001.safetensors"}}).encode(),
        },
        "model_config": {"qwen3": read("tiny-qwen3-vl", "config.json"),
                         "qwen25": read("tiny-qwen2.5-vl", "config.json")},
        "preprocess_config": {"qwen3": read("tiny-qwen3-vl", "preprocessor_config.json")},
        "tokenizer_file": {"tiny": read("tiny-qwen3-vl", "tokenizer.json")},
        "tokenize": {"ascii": response.encode(), "cjk": "你好，世界 🌍 naïve café\u0301".encode(),
                     "special": b"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>"},
        "chat_messages": {c["name"].replace("/", "_"): json.dumps(c["messages"]).encode() for c in cases[:8]},
        "image": {n: read("vl-images", n) for n in ("icon.png", "banner.png", "screen.png", "square.webp",
                                                     "portrait.jpg")},
        "episode": {"sample": read("episode-sample", "episode.json")},
        "step_dataset": {n: first_lines(read("eval", f"{n}_steps.jsonl", mode="r"), 4).encode()
                         for n in ("aitw", "androidcontrol", "odyssey")},
        "labels": {"synthetic": first_lines(read("selector-train", "synthetic.jsonl", mode="r"), 12).encode()},
        "encoder_config": {"full": read("scopemem", "encoder", "scopemem_config.json"),
                           **{v: read("scopemem", "variants", v, "scopemem_config.json")
                              for v in ("one-pass", "task-only", "history-only", "fixed-query")}},
        "action": {"click": response.encode(),
                   "type": response.replace("click", "type").replace("\"coordinate\": [540, 120]",
                                                                     "\"text\": \"hi\"").encode(),
                   "desktop": ("Action: Scroll down.\n<tool_call>\n{\"name\": \"computer_use\", \"arguments\": "
                               "{\"action\": \"scroll\", \"pixels\": -300}}\n</tool_call>").encode()},
        "adapter": {"config": b"\x00" + read("hgkv-peft", "adapter_config.json"),
                    "weights": b"\x01" + read("hgkv-peft", "adapter_model.safetensors")},
        "selector_file": {"converted": read("selector", "converted.safetensors")},
        "policy_request": {"recent_b2": policy_request()},
        "chat_request": {
            "minimal": json.dumps({"model": "recall", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            "sampling": json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                    "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"],
                                    "stream": True, "seed": 3}).encode(),
        },
    }


def policy_request():
    """A `causalcache.mobileworld.policy_request.v2` body: two past steps, both restored."""
    png = base64.b64encode(read("vl-images", "icon.png")).decode()
    response = "Action: Tap.\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"click\", \"coordinate\": [1, 2]}}\n</tool_call>"
    step = lambda i: {"step_id": i, "action": {"action_type": "click", "x": 1, "y": 2}, "action_text": "Tap.",
                      "full_response": response, "policy_parsed": True, "screen_changed": True,
                      "restored_observation_screenshot_png_base64": png}
    return json.dumps({
        "schema_version": "causalcache.mobileworld.policy_request.v2",
        "task": {"instruction": "Open the clock"}, "step_id": 3, "screen_size": [24, 16],
        "current_screenshot_png_base64": png, "history": [step(1), step(2)], "selected_event_step_ids": [1, 2],
        "prompt_protocol": "mobile_agent_v3_5_gui_owl_official_faithful",
    }).encode()


def main():
    total = 0
    for target, files in seeds().items():
        d = os.path.join(OUT, target)
        os.makedirs(d, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
            total += len(data)
    print(f"wrote {sum(len(v) for v in seeds().values())} seeds ({total} bytes) under {OUT}")


if __name__ == "__main__":
    main()
