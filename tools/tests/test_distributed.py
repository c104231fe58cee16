"""tools/distributed/ray_run.py on a local Ray instance (and its batch-array path without Ray): `recall
episode label`, `recall episode eval` and `recall scopemem dump` sharded by episode merge to exactly the
bytes one recall process over every episode writes, a label run killed mid-shard resumes to the same
bytes without redoing finished shards, and a WORK directory planned for another run is refused.

Run by tests/distributed.rs (RECALL_OPENAI_PYTHON must hold tools/tests/requirements.txt, which brings
`ray`), or directly:

    cargo build && RECALL_BIN=target/debug/recall .venv-ci/bin/python -m pytest -q tools/tests/test_distributed.py
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from recall_server import BIN

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures" / "tiny-qwen3-vl"
TOOL = ROOT / "tools" / "distributed" / "ray_run.py"
DATASET = ROOT / "tests" / "fixtures" / "eval" / "aitw_steps.jsonl"
COMMON = ["--model", str(MODEL), "--backend", "cpu"]

try:
    import ray  # noqa: F401
    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False


@pytest.fixture(autouse=True)
def needs_ray():
    if not HAVE_RAY:
        if os.environ.get("CI") == "true":
            raise AssertionError("CI must install ray (tools/tests/requirements.txt)")
        pytest.skip("ray is not installed")


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    """Three episodes (copies of the demo episode under their own names)."""
    d = tmp_path_factory.mktemp("episodes")
    out = []
    for name in ("ep-a", "ep-b", "ep-c"):
        shutil.copytree(ROOT / "models" / "demo" / "episode", d / name)
        out.append(str(d / name))
    return out


def recall(*args):
    subprocess.run([BIN, *args], check=True, capture_output=True, text=True)


def ray_run(*args, check=True):
    r = subprocess.run([sys.executable, str(TOOL), *args[:-1], "--recall", BIN, "--", *args[-1]],
                       capture_output=True, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def test_label_shards_merge_to_the_single_run_and_resume(episodes, tmp_path):
    args = [*COMMON, "--budgets", "1,2"]
    single = tmp_path / "single.jsonl"
    recall("episode", "label", "--episode", ",".join(episodes), "--out", str(single), *args)
    work, merged = tmp_path / "work", tmp_path / "merged.jsonl"
    ray_run("label", "--episode", ",".join(episodes), "--shards", "2", "--work", str(work), "--out", str(merged),
            args)
    assert merged.read_bytes() == single.read_bytes()

    # A kill in the middle of shard 1: its output is a partial file cut mid-line, no marker.
    shard = work / "shard-1.jsonl"
    text = shard.read_bytes()
    (work / "shard-1.jsonl.partial").write_bytes(text[: len(text) * 2 // 5])
    shard.unlink()
    (work / "shard-1.done").unlink()
    merged.unlink()
    first = (work / "shard-0.jsonl").stat().st_mtime_ns
    r = ray_run("label", "--episode", ",".join(episodes), "--shards", "2", "--work", str(work), "--out",
                str(merged), args)
    assert "1 already done" in r.stderr
    assert (work / "shard-0.jsonl").stat().st_mtime_ns == first, "a finished shard was redone"
    assert merged.read_bytes() == single.read_bytes()

    # The same WORK for another plan is refused, naming the file.
    r = ray_run("label", "--episode", ",".join(episodes), "--shards", "3", "--work", str(work), "--out",
                str(merged), args, check=False)
    assert r.returncode != 0 and "plan.json was planned for another run" in r.stderr, r.stderr


def test_eval_shards_merge_to_the_single_run(episodes, tmp_path):
    args = [*COMMON, "--budget", "2", "--policy", "random", "--seed", "3", "--max-tokens", "12",
            "--resamples", "200"]
    single = tmp_path / "single"
    recall("episode", "eval", "--episode", ",".join(episodes), "--out", str(single), *args)
    merged = tmp_path / "merged"
    ray_run("eval", "--episode", ",".join(episodes), "--shards", "3", "--work", str(tmp_path / "work"), "--out",
            str(merged), args)
    for name in ("eval.json", "eval.md", "margins.png"):
        assert (merged / name).read_bytes() == (single / name).read_bytes(), name


def test_dump_shards_merge_to_the_single_run_as_a_batch_array_and_on_ray(tmp_path):
    """The Slurm-array path: one shard per job (`--only-shard`), then `--merge-only`, no Ray; then Ray."""
    args = [*COMMON, "--max-tokens", "12"]
    single = tmp_path / "single.jsonl"
    recall("scopemem", "dump", "--dataset", str(DATASET), "--out", str(single), *args)
    work, merged = tmp_path / "work", tmp_path / "merged.jsonl"
    base = ["dump", "--dataset", str(DATASET), "--shards", "2", "--work", str(work), "--out", str(merged)]
    r = ray_run(*base, "--merge-only", args, check=False)
    assert r.returncode != 0 and "are not done" in r.stderr, r.stderr
    for k in (1, 0):  # any order
        ray_run(*base, "--only-shard", str(k), args)
    ray_run(*base, "--merge-only", args)
    assert merged.read_bytes() == single.read_bytes()
    # And the same plan on Ray.
    on_ray = tmp_path / "ray.jsonl"
    ray_run("dump", "--dataset", str(DATASET), "--shards", "2", "--work", str(tmp_path / "ray-work"), "--out",
            str(on_ray), args)
    assert on_ray.read_bytes() == single.read_bytes()
