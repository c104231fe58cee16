#!/usr/bin/env python3
"""recall's offline jobs sharded by episode over Ray: `recall episode label`, `recall episode eval` and
`recall scopemem dump` (docs/SCALING.md "Offline work on Ray").

    python tools/distributed/ray_run.py label --episode EP1,EP2,... --shards 16 --work runs/label \\
        --out labels.jsonl -- --model MODEL --budgets 1,2,4
    python tools/distributed/ray_run.py eval --episode EP1,EP2,... --shards 16 --work runs/eval \\
        --out report/ -- --model MODEL --budget 4 --policy selector --selector scorer.safetensors
    python tools/distributed/ray_run.py dump --dataset steps.jsonl --shards 16 --work runs/dump \\
        --out train.jsonl -- --model MODEL

Everything after `--` goes to every shard's recall command unchanged. The episodes (or, for `dump`, the
dataset's episodes, by their `episode` field) are cut into `--shards` contiguous groups of about equal
step count; shard k runs as one Ray task (`--num-cpus`, `--num-gpus` per task) writing under
WORK/shard-k, and is marked done (WORK/shard-k.done) only once its recall command has exited 0. The
merge then writes OUT: `label` concatenates the shards' files in order, `dump` orders the shards'
lines by dataset line, `eval` runs `recall episode merge-eval`. The merged output is bit for bit what
one recall process over every episode writes (tools/tests/test_distributed.py checks it).

Resumable: a re-run with the same WORK skips the shards marked done, resumes a `label` shard from its
partial file (`recall episode label --resume`) and reruns the others; WORK/plan.json records the
command and shards, and a re-run that would plan differently is refused.

Without Ray (a Slurm array, or any batch system), run the same plan one shard per job and merge last:

    python tools/distributed/ray_run.py label ... --only-shard $SLURM_ARRAY_TASK_ID -- ARGS   # array job
    python tools/distributed/ray_run.py label ... --merge-only -- ARGS                        # afterok

`--address` connects to a running cluster (default: RAY_ADDRESS, else a local Ray instance); every node
needs the recall binary (`--recall`, default target/release/recall) and the inputs at the same paths.
"""

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


class PlanError(Exception):
    pass


def parse_args(argv):
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    else:
        passthrough = []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", choices=["label", "eval", "dump"])
    p.add_argument("--episode", action="append", default=[],
                   help="episode directories (comma-separated or repeated; label and eval)")
    p.add_argument("--dataset", help="the step dataset (dump)")
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--work", type=pathlib.Path, required=True, help="shard outputs, markers and plan.json")
    p.add_argument("--out", type=pathlib.Path, required=True, help="the merged output")
    p.add_argument("--recall", default=str(ROOT / "target" / "release" / "recall"), help="the recall binary")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    p.add_argument("--num-cpus", type=float, default=1, help="CPUs per shard task")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per shard task")
    p.add_argument("--only-shard", type=int, help="run this one shard here, without Ray (a batch array job)")
    p.add_argument("--merge-only", action="store_true", help="merge the shards' outputs (all must be done)")
    a = p.parse_args(argv)
    a.passthrough = passthrough
    a.episode = [e for group in a.episode for e in group.split(",") if e]
    if a.shards < 1:
        p.error("--shards must be at least 1")
    if a.job == "dump" and (a.dataset is None or a.episode):
        p.error("dump takes --dataset, not --episode")
    if a.job != "dump" and (not a.episode or a.dataset):
        p.error(f"{a.job} takes --episode, not --dataset")
    for flag in ("--out", "--episode", "--dataset", "--lines", "--resume"):
        if flag in passthrough:
            p.error(f"{flag} is set per shard by this tool; leave it out of the arguments after --")
    return a


# ------------------------------------------------------------------------------------------- planning

def episode_steps(ep: str) -> int:
    doc = json.loads((pathlib.Path(ep) / "episode.json").read_text())
    return max(1, len(doc.get("steps", [])))


def dataset_groups(dataset: str):
    """[(episode, [1-based line numbers])] in order of first appearance."""
    groups, index = [], {}
    with open(dataset) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                ep = str(json.loads(line)["episode"])
            except (json.JSONDecodeError, KeyError) as e:
                raise PlanError(f"{dataset}:{n}: no `episode` field to shard by ({e})")
            if ep not in index:
                index[ep] = len(groups)
                groups.append((ep, []))
            groups[index[ep]][1].append(n)
    return groups


def split(weights, shards):
    """Contiguous groups of about equal total weight: [(start, end)] over the indices of `weights`."""
    shards = min(shards, len(weights))
    total, bounds, start, acc = sum(weights), [], 0, 0
    for k in range(shards):
        if k == shards - 1:
            bounds.append((start, len(weights)))
            break
        target = total * (k + 1) / shards
        end = start + 1
        acc += weights[start]
        while end < len(weights) - (shards - k - 1) and acc + weights[end] / 2 <= target:
            acc += weights[end]
            end += 1
        bounds.append((start, end))
        start = end
    return bounds


def plan(a):
    if a.job == "dump":
        groups = dataset_groups(a.dataset)
        if not groups:
            raise PlanError(f"{a.dataset}: no step")
        cuts = split([len(lines) for _, lines in groups], a.shards)
        shards = [{"episodes": [g[0] for g in groups[s:e]], "lines": [n for g in groups[s:e] for n in g[1]]}
                  for s, e in cuts]
    else:
        cuts = split([episode_steps(ep) for ep in a.episode], a.shards)
        shards = [{"episodes": a.episode[s:e]} for s, e in cuts]
    return {"job": a.job, "dataset": a.dataset, "args": a.passthrough, "shards": shards}


def shard_command(a, k: int, shard: dict):
    out = a.work / f"shard-{k}"
    if a.job == "label":
        return [a.recall, "episode", "label", "--episode", ",".join(shard["episodes"]), "--out",
                str(out.with_suffix(".jsonl")), "--resume", *a.passthrough]
    if a.job == "eval":
        return [a.recall, "episode", "eval", "--episode", ",".join(shard["episodes"]), "--out", str(out),
                *a.passthrough]
    return [a.recall, "scopemem", "dump", "--dataset", a.dataset, "--lines", ",".join(map(str, shard["lines"])),
            "--out", str(out.with_suffix(".jsonl")), *a.passthrough]


def load_plan(a):
    """This run's plan, written to WORK/plan.json; refused when WORK holds a different one."""
    new = plan(a)
    a.work.mkdir(parents=True, exist_ok=True)
    path = a.work / "plan.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != new:
            raise PlanError(f"{path} was planned for another run (job, inputs, shards or arguments differ); "
                            "use a fresh --work directory")
    else:
        write_atomic(path, json.dumps(new, indent=1) + "\n")
    return new


# ------------------------------------------------------------------------------------------- running

def write_atomic(path: pathlib.Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def marker(a, k: int) -> pathlib.Path:
    return a.work / f"shard-{k}.done"


def run_shard(argv, done: str, cwd: str):
    """Runs one shard's recall command in `cwd` (the driver's: relative paths mean the same on a worker);
    marks it done only on success. Returns its seconds."""
    t0 = time.time()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} exited {r.returncode}:\n{r.stderr[-4000:]}")
    write_atomic(pathlib.Path(done), json.dumps({"seconds": round(time.time() - t0, 3)}) + "\n")
    return time.time() - t0


def run_on_ray(a, todo):
    import ray
    ray.init(address=a.address or os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=a.num_cpus, num_gpus=a.num_gpus)(run_shard)
        pending = {task.remote(argv, str(marker(a, k)), os.getcwd()): k for k, argv in todo}
        done = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            k = pending.pop(ready[0])
            seconds = ray.get(ready[0])
            done += 1
            print(f"shard {k} done in {seconds:.1f} s ({done}/{len(todo)})", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------------------- merging

def merge(a, p):
    n = len(p["shards"])
    missing = [k for k in range(n) if not marker(a, k).exists()]
    if missing:
        raise PlanError(f"shards {missing} are not done; run them first")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if a.job == "eval":
        subprocess.run([a.recall, "episode", "merge-eval", "--out", str(a.out),
                        *[str(a.work / f"shard-{k}") for k in range(n)]], check=True, stdout=subprocess.DEVNULL)
        return
    texts = [(a.work / f"shard-{k}.jsonl").read_text() for k in range(n)]
    if a.job == "label":
        write_atomic(a.out, "".join(texts))
        return
    lines = [line for t in texts for line in t.splitlines(keepends=True)]
    lines.sort(key=lambda line: json.loads(line)["line"])  # the single run's dataset order
    write_atomic(a.out, "".join(lines))


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    p = load_plan(a)
    commands = [(k, shard_command(a, k, s)) for k, s in enumerate(p["shards"])]
    if a.only_shard is not None:
        if not 0 <= a.only_shard < len(commands):
            raise PlanError(f"--only-shard {a.only_shard}: the plan has shards 0..{len(commands) - 1}")
        k, argv = commands[a.only_shard]
        if not marker(a, k).exists():
            run_shard(argv, str(marker(a, k)), os.getcwd())
        return
    if not a.merge_only:
        todo = [(k, argv) for k, argv in commands if not marker(a, k).exists()]
        print(f"{a.job}: {len(commands)} shards, {len(commands) - len(todo)} already done", file=sys.stderr)
        if todo:
            run_on_ray(a, todo)
    merge(a, p)
    digest = hashlib.sha256(a.out.read_bytes() if a.out.is_file() else (a.out / "eval.json").read_bytes())
    print(f"wrote {a.out} (sha256 {digest.hexdigest()[:16]})", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except PlanError as e:
        sys.exit(f"ray_run: {e}")
