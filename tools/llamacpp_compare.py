#!/usr/bin/env python3
"""recall's CPU backend against llama.cpp on the same weights and prompt length, in one run.

llama.cpp is what CPU users pick, so issue 29 measures against it as well as against HF. The script

1. fetches llama.cpp's source pinned through PyPI (the ``llama-cpp-python`` sdist vendors a whole
   llama.cpp tree; it is fetched once into ``--work`` from the URL PyPI's JSON API gives, checked
   against the sha256 PyPI publishes, so no build backend has to be installed), and builds
   ``llama-bench`` and ``llama-mtmd-cli`` with CMake (Release, ``GGML_NATIVE=ON``: it uses every
   instruction set this CPU has, AVX512-BF16 included);
2. converts each HF model directory to GGUF with llama.cpp's own ``convert_hf_to_gguf.py``
   (``--outtype f32`` for an f32 checkpoint, ``bf16`` for a bf16 one: the same values recall reads),
   the decoder and (``--mmproj``) the vision tower;
3. alternates ``recall generate --backend cpu --json --profile`` (the chat of ``tools/cpu_compare.py``,
   about --prompt-tokens text tokens; for a bf16 model also with ``--cpu-bf16-dot``, recall's bf16
   arithmetic, the like of llama.cpp's, and on AMX CPUs with ``--cpu-bf16-attention`` too) with ``llama-bench -p N -n 16 -d 0,N`` at recall's prompt
   length N, --repeats times, and prints medians: prefill seconds, decode ms/token (recall decodes
   after the prompt, so llama.cpp's decode is read at depth N too; depth 0 is shown beside it) and
   the ratios recall / llama.cpp;
4. the vision tower alone, the same way: one synthetic --image-size screenshot through
   ``recall generate`` (its ``vision_seconds``) and through ``llama-mtmd-cli`` (the encoding time
   it logs, the encoder alone), alternated, medians, with the merged-token count llama.cpp reports
   (its resizer could round a screenshot otherwise than recall's; at 640x360 both make 640x352,
   220 tokens);
5. with ``--served``, each text mode also as ``recall serve`` runs it: ``--cpu-decode-panels true``
   (serve's default), the weights packed once for decode at load, so its decode streams them
   contiguously; the table shows recall's load beside it (llama-bench's figures never include one).

    cargo build --release
    .venv-train/bin/pip install sentencepiece      # the converter imports it
    .venv-train/bin/python tools/llamacpp_compare.py --model /tmp/shape-l4 --model /tmp/shape-l4-bf16

Needs cmake and ninja (``pip install cmake ninja``), torch, transformers and sentencepiece.
"""

import argparse
import hashlib
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cpu_compare import ROOT, chat, run_recall, screenshots  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp 0c1e570, the first with Qwen3-VL conversion + bf16 GEMM


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True,
                    help="HF model directory; repeat for several (f32 and bf16 of the same shape)")
    ap.add_argument("--recall", default=str(ROOT / "target" / "release" / "recall"))
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/recall/llamacpp"),
                    help="where llama.cpp's source, build and the GGUF files go")
    ap.add_argument("--prompt-tokens", type=int, default=1278, help="about this many text tokens")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--image-size", default="640x360", help="WIDTHxHEIGHT of the vision comparison's screenshot")
    ap.add_argument("--warm", action="store_true",
                    help="each timed one-shot process (recall, llama-mtmd-cli) right after an identical untimed "
                         "one (see tools/cpu_compare.py --warm-recall); llama-bench warms up in its own process")
    ap.add_argument("--served", action="store_true",
                    help="also run each recall mode as `recall serve` does: --cpu-decode-panels true, the "
                         "weights packed for decode at load (its load then includes the packing)")
    ap.add_argument("--json", default=None, help="also write the report here")
    return ap.parse_args()


def run(cmd, **kw):
    print("+", " ".join(map(str, cmd)), file=sys.stderr)
    subprocess.run(list(map(str, cmd)), check=True, **kw)


def llama_cpp_source(work):
    """The vendored llama.cpp tree of the pinned sdist, fetched and extracted once."""
    src = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if src.is_dir():
        return src
    work.mkdir(parents=True, exist_ok=True)
    tarball = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not tarball.exists():
        fetch_sdist(tarball)
    with tarfile.open(tarball) as tar:
        tar.extractall(work, filter="data")
    return src


def fetch_sdist(tarball):
    """Downloads the pinned sdist, refusing it unless its sha256 is the one PyPI lists."""
    meta_url = "https://pypi.org/pypi/llama-cpp-python/json"
    with urllib.request.urlopen(meta_url) as r:
        meta = json.load(r)
    sdist = next(u for u in meta["releases"][LLAMA_CPP_PYTHON] if u["packagetype"] == "sdist")
    url = urllib.parse.urljoin(meta_url, sdist["url"])  # mirrors may list it relative to the API
    print("+ fetch", url, file=sys.stderr)
    with urllib.request.urlopen(url) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != sdist["digests"]["sha256"]:
        sys.exit(f"{url}: sha256 {got}, PyPI lists {sdist['digests']['sha256']}")
    tarball.write_bytes(data)


def llama_bench(work, src):
    """llama-bench (and llama-mtmd-cli beside it), built once."""
    binary = work / "build" / "bin" / "llama-bench"
    if not binary.exists() or not (binary.parent / "llama-mtmd-cli").exists():
        cmake = shutil.which("cmake") or sys.exit("cmake not found (pip install cmake ninja)")
        run([cmake, "-S", src, "-B", work / "build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=OFF"])
        run([cmake, "--build", work / "build", "-j", os.cpu_count(), "--target", "llama-bench", "llama-mtmd-cli"])
    return binary


def checkpoint_dtype(model_dir):
    cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    dtype = cfg.get("text_config", {}).get("dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return {"bfloat16": "bf16", "float16": "f16"}.get(dtype, "f32")


def gguf(work, src, model_dir, outtype, mmproj=False):
    """The decoder's GGUF, or with `mmproj` the vision tower's, converted once."""
    part = "-mmproj" if mmproj else ""
    out = work / f"{pathlib.Path(model_dir).name}-{outtype}{part}.gguf"
    if not out.exists():
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        run([sys.executable, src / "convert_hf_to_gguf.py", model_dir, "--outtype", outtype, "--outfile", out,
             *(["--mmproj"] if mmproj else [])], env=env)
    return out


def run_mtmd(cli, model, mmproj, image, threads, warm=False):
    """The vision encoder's milliseconds for one screenshot ("mtmd batch encoding done in N ms", or
    older builds' "image slice encoded in N ms"), and the merged-token grid llama.cpp made of it
    (its debug log, hence -v)."""
    cmd = [str(cli), "-m", str(model), "--mmproj", str(mmproj), "--image", str(image),
           "-p", "Describe the screen.", "-n", "1", "-t", str(threads), "--temp", "0", "-v"]
    if warm:
        subprocess.run(cmd, capture_output=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    log = out.stdout + out.stderr
    encoded = re.findall(r"(?:mtmd batch encoding done|image slice encoded) in (\d+) ms", log)
    if out.returncode != 0 or not encoded:
        sys.exit(f"llama-mtmd-cli failed (rc {out.returncode}):\n{log[-3000:]}")
    grid = [re.search(rf"image_tokens->{a} = (\d+)", log) for a in ("nx", "ny")]
    return {"vision_ms": float(encoded[0]),
            "image_tokens": int(grid[0][1]) * int(grid[1][1]) if all(grid) else None}


def run_llama_bench(binary, model, prompt, new_tokens, threads):
    """Prefill seconds for `prompt` tokens, decode ms/token at depth 0 and at depth `prompt`."""
    out = subprocess.run([str(binary), "-m", str(model), "-p", str(prompt), "-n", str(new_tokens),
                          "-d", f"0,{prompt}", "-t", str(threads), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    pick = {(r["n_prompt"], r["n_gen"], r["n_depth"]): r["avg_ts"] for r in rows}
    return {
        "prefill_seconds": prompt / pick[(prompt, 0, 0)],
        "decode_ms_per_token": 1e3 / pick[(0, new_tokens, prompt)],
        "decode_ms_per_token_depth0": 1e3 / pick[(0, new_tokens, 0)],
        "build_commit": rows[0].get("build_commit"),
    }


def recall_modes(outtype):
    """recall's arithmetic modes for a checkpoint: exact; for bf16 also --cpu-bf16-dot, and with
    --cpu-bf16-attention as well where the CPU has AMX-BF16."""
    modes = [[]]
    if outtype == "bf16":
        modes.append(["--cpu-bf16-dot"])
        flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
        if " amx_bf16" in flags:
            modes.append(["--cpu-bf16-dot", "--cpu-bf16-attention"])
    return modes


def compare(args, work, src, bench, model_dir, messages_path):
    """One row per recall mode (`recall_modes`) against llama.cpp, all interleaved."""
    outtype = checkpoint_dtype(model_dir)
    model = gguf(work, src, model_dir, outtype)
    modes = recall_modes(outtype)
    if args.served:
        modes += [mode + ["--cpu-decode-panels", "true"] for mode in modes]
    recs, lcps = [[] for _ in modes], []
    for _ in range(args.repeats):
        for mode, runs in zip(modes, recs):
            runs.append(run_recall(args.recall, model_dir, messages_path, args.new_tokens, mode,
                                   warm=args.warm))
        lcps.append(run_llama_bench(bench, model, recs[0][0]["prompt_tokens"], args.new_tokens, args.threads))
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    lcp = {k: med(lcps, k) for k in ("prefill_seconds", "decode_ms_per_token", "decode_ms_per_token_depth0")}
    rows = []
    for mode, runs in zip(modes, recs):
        rec = {k: med(runs, k) for k in ("load_seconds", "prefill_seconds", "decode_ms_per_token")}
        rows.append({"model": model_dir, "dtype": outtype, "recall_args": mode,
                     "prompt_tokens": runs[0]["prompt_tokens"], "tokens": runs[0]["tokens"],
                     "llama_cpp_commit": lcps[0]["build_commit"], "recall": rec, "llama_cpp": lcp,
                     "prefill_ratio": rec["prefill_seconds"] / lcp["prefill_seconds"],
                     "decode_ratio": rec["decode_ms_per_token"] / lcp["decode_ms_per_token"]})
    return rows


def compare_vision(args, work, src, bench, model_dir, messages_path):
    """recall's vision tower (per mode, as in `compare`) against llama.cpp's mmproj encoder on one
    screenshot, interleaved."""
    outtype = checkpoint_dtype(model_dir)
    model, mmproj = gguf(work, src, model_dir, outtype), gguf(work, src, model_dir, outtype, mmproj=True)
    cli = bench.parent / "llama-mtmd-cli"
    image = json.loads(pathlib.Path(messages_path).read_text())[0]["content"][0]["image"]
    modes = recall_modes(outtype)
    recs, lcps = [[] for _ in modes], []
    for _ in range(args.repeats):
        for mode, runs in zip(modes, recs):
            runs.append(run_recall(args.recall, model_dir, messages_path, 1, mode, warm=args.warm))
        lcps.append(run_mtmd(cli, model, mmproj, image, args.threads, warm=args.warm))
    lcp_ms = statistics.median(r["vision_ms"] for r in lcps)
    rows = []
    for mode, runs in zip(modes, recs):
        rec_ms = statistics.median(r["vision_seconds"] for r in runs) * 1e3
        rows.append({"model": model_dir, "dtype": outtype, "recall_args": mode, "recall_vision_ms": rec_ms,
                     "llama_cpp_vision_ms": lcp_ms, "ratio": rec_ms / lcp_ms,
                     "llama_cpp_image_tokens": lcps[0]["image_tokens"]})
    return rows


def main():
    args = parse()
    work = pathlib.Path(args.work)
    src = llama_cpp_source(work)
    bench = llama_bench(work, src)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model[0])
    reports, visions = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "messages.json")
        with open(path, "w") as f:
            json.dump(chat(tokenizer, args.prompt_tokens, []), f)
        shot = screenshots(1, args.image_size, tmp)[0]
        vision_path = os.path.join(tmp, "vision.json")
        with open(vision_path, "w") as f:
            json.dump([{"role": "user", "content": [{"type": "image", "image": shot},
                                                    {"type": "text", "text": "Describe the screen."}]}], f)
        for model_dir in args.model:
            reports.extend(compare(args, work, src, bench, model_dir, path))
            visions.extend(compare_vision(args, work, src, bench, model_dir, vision_path))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"text": reports, "vision": visions}, indent=2))
    print(f"\n{args.threads} threads, medians of {args.repeats}, llama.cpp {reports[0]['llama_cpp_commit']}"
          f"{', one-shot processes warm' if args.warm else ''}")
    print("| model | recall mode | tokens | recall load s | prefill s recall / llama.cpp | ratio | decode ms/token "
          "recall / llama.cpp (depth N; depth 0) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in reports:
        rec, lcp = r["recall"], r["llama_cpp"]
        mode = " ".join(r["recall_args"]) or "exact"
        print(f"| {r['dtype']} | {mode} | {r['prompt_tokens']} | {rec['load_seconds']:.3f} | "
              f"{rec['prefill_seconds']:.3f} / {lcp['prefill_seconds']:.3f} | "
              f"{r['prefill_ratio']:.2f} | {rec['decode_ms_per_token']:.1f} / {lcp['decode_ms_per_token']:.1f}; "
              f"{lcp['decode_ms_per_token_depth0']:.1f} | {r['decode_ratio']:.2f} |")
    print(f"\nvision tower, one {args.image_size} screenshot")
    print("| model | recall mode | recall ms | llama.cpp ms (its image tokens) | ratio |")
    print("|---|---|---|---|---|")
    for v in visions:
        mode = " ".join(v["recall_args"]) or "exact"
        print(f"| {v['dtype']} | {mode} | {v['recall_vision_ms']:.0f} | {v['llama_cpp_vision_ms']:.0f} "
              f"({v['llama_cpp_image_tokens']}) | {v['ratio']:.2f} |")


if __name__ == "__main__":
    main()
