"""Two `recall serve` replicas behind sglang-router (PyPI) on loopback, CPU, the tiny model.

Run by tests/router.rs (RECALL_OPENAI_PYTHON must hold tools/tests/requirements.txt, which brings
`sglang-router` and `prometheus-client`), or directly:

    cargo build && RECALL_BIN=target/debug/recall .venv-ci/bin/python -m pytest -q tools/tests/test_router.py

The router runs its manual policy (`--policy manual --assignment-mode min_group`): a request's
`x-smg-routing-key` header (the episode id) is pinned to one replica, new keys go to the replica with
the fewest. Checked, with the router and Prometheus's own parser as the oracles:

* `recall loadgen` through the router: no error, the prefix cache hit, every episode answered by one
  replica, both replicas used;
* the router's `/engine_metrics` aggregates both replicas' `/metrics` (Prometheus text 0.0.4, which
  `prometheus_client` parses; OpenMetrics to a scraper that asks for it), each sample labelled with its
  replica and equal to what the replica itself reports;
* the episode API through the router (episode steps as chat completions, `metadata.recall_episode`):
  every step of an episode lands on one replica, which holds the whole episode, and its answers are
  bitwise those of the plain episode API on a fresh replica;
* a replica killed mid-run: its episodes' next steps fail with clear errors (the router's upstream error,
  then the surviving replica's 404 naming itself), the other episodes go on, and nothing is served
  twice: every answered request is counted by exactly one replica, the killed one's episode directory
  holds exactly the steps it answered.
"""

import base64
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus
from recall_server import BIN, start

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures" / "tiny-qwen3-vl"
DEMO = ROOT / "models" / "demo" / "episode"
ROUTER = pathlib.Path(sys.executable).parent / "sglang-router"
ROUTING_HEADER = "x-smg-routing-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """`recall serve` on a free port; `kill()` ends it with SIGKILL (a crash, not a shutdown)."""

    def __init__(self, name: str, episode_dir: pathlib.Path):
        self.name = name
        self.episode_dir = episode_dir
        self.proc, self.url, self.log = start("--model", str(MODEL), "--served-model-name", "tiny",
                                              "--replica-id", name, "--episode-dir", str(episode_dir))

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(timeout=60) == 0, "".join(self.log[-30:])


def http(method: str, url: str, body=None, headers=None):
    """(status, headers, parsed JSON or text) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, hdrs, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, dict(e.headers), e.read()
    text = raw.decode()
    try:
        return status, {k.lower(): v for k, v in hdrs.items()}, json.loads(text)
    except json.JSONDecodeError:
        return status, {k.lower(): v for k, v in hdrs.items()}, text


def served_chat(replica: Replica) -> float:
    """Chat completions the replica answered with 200, from its own /metrics."""
    _, _, text = http("GET", replica.url + "/metrics")
    for fam in parse_prometheus(text):
        for s in fam.samples:
            if s.name == "recall_requests_total" and s.labels == {"route": "/v1/chat/completions",
                                                                   "status": "200"}:
                return s.value
    return 0.0


class Cluster:
    def __init__(self, tmp: pathlib.Path):
        self.replicas = [Replica(n, tmp / n) for n in ("replica-a", "replica-b")]
        self.port = free_port()
        self.router = subprocess.Popen(
            [str(ROUTER), "launch", "--host", "127.0.0.1", "--port", str(self.port), "--policy", "manual",
             "--assignment-mode", "min_group", "--prometheus-host", "127.0.0.1", "--prometheus-port",
             str(free_port()), "--log-level", "warn", "--worker-urls", *[r.url for r in self.replicas]],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 60
        while True:
            try:
                status, _, body = http("GET", self.url + "/workers")
                if status == 200 and sum(w["is_healthy"] for w in body["workers"]) == 2:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert self.router.poll() is None, "sglang-router exited:\n" + self.router.stderr.read()
            assert time.time() < deadline, "sglang-router never saw two healthy replicas"
            time.sleep(0.2)
        self.by_name = {r.name: r for r in self.replicas}

    def close(self):
        self.router.terminate()
        self.router.wait(timeout=30)
        for r in self.replicas:
            r.stop()


@pytest.fixture()
def cluster(tmp_path):
    if not ROUTER.exists():
        if os.environ.get("CI") == "true":
            raise AssertionError(f"CI must install sglang-router (tools/tests/requirements.txt): no {ROUTER}")
        pytest.skip(f"no sglang-router next to {sys.executable}")
    c = Cluster(tmp_path)
    yield c
    c.close()


def loadgen(url: str, out: pathlib.Path, *extra: str) -> dict:
    subprocess.run([BIN, "loadgen", "--url", url, "--model", "tiny", "--clients", "4", "--steps", "3",
                    "--max-tokens", "8", "--image-size", "64x128", "--label", "router", "--json", str(out),
                    *extra], check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def test_loadgen_through_the_router_keeps_each_episode_on_one_replica(cluster, tmp_path):
    r = loadgen(cluster.url, tmp_path / "load.json")
    print(f"through the router: prefix hit {r['prefix_cache_hit_rate']:.3f}, replicas {r['replicas']}")
    assert r["errors"] == 0, r["first_error"]
    assert r["episodes_on_one_replica"] == 4
    assert sorted(r["replicas"]) == ["replica-a", "replica-b"]
    assert sum(r["replicas"].values()) == 12
    # Steps 2 and 3 of every episode extend step 1's prompt on the same replica.
    assert r["prefix_cache_hit_rate"] > 0.5
    # Every answered request was counted by the replica that answered it, and by no other.
    assert {n: served_chat(rep) for n, rep in cluster.by_name.items()} == {
        n: float(k) for n, k in r["replicas"].items()}


def test_the_router_aggregates_both_replicas_metrics(cluster, tmp_path):
    loadgen(cluster.url, tmp_path / "load.json")
    _, _, text = http("GET", cluster.url + "/engine_metrics")
    got = {}
    for fam in parse_prometheus(text):
        for s in fam.samples:
            labels = dict(s.labels)
            got[(s.name, labels.pop("worker_addr"), tuple(sorted(labels.items())))] = s.value
    for rep in cluster.replicas:
        # The replica's own text, in both formats, parsed by Prometheus's client library.
        _, hdrs, prom = http("GET", rep.url + "/metrics")
        assert hdrs["content-type"].startswith("text/plain; version=0.0.4")
        _, hdrs, om = http("GET", rep.url + "/metrics", headers={"accept": "application/openmetrics-text"})
        assert hdrs["content-type"].startswith("application/openmetrics-text")
        # (The scrapes themselves count as requests to /metrics.)
        prom_samples = {(s.name, tuple(sorted(s.labels.items())), s.value)
                        for f in parse_prometheus(prom) for s in f.samples if s.labels.get("route") != "/metrics"}
        om_samples = {(s.name, tuple(sorted(s.labels.items())), s.value)
                      for f in parse_openmetrics(om) for s in f.samples if s.labels.get("route") != "/metrics"}
        assert prom_samples == om_samples
        for name in ("recall_prompt_tokens_total", "recall_prefix_cache_hit_tokens_total",
                     "recall_generation_tokens_total"):
            mine = next(v for (n, _, v) in prom_samples if n == name)
            assert got[(name, rep.url, ())] == mine, name
        assert mine > 0


def data_url(path: pathlib.Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


OPEN = {"instruction": json.load(open(DEMO / "episode.json"))["instruction"], "budget": 2, "max_tokens": 12}
SHOTS = [DEMO / f"step0{i}.png" for i in range(1, 4)]


def chat_step(url: str, episode: str, shot: pathlib.Path, first: bool):
    meta = {"recall_episode": episode}
    if first:
        meta["recall_open"] = json.dumps(OPEN)
    body = {"model": "tiny", "max_tokens": 12, "metadata": meta,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(shot)}}]}]}
    return http("POST", url + "/v1/chat/completions", body, headers={ROUTING_HEADER: episode})


def open_on_both(cluster) -> dict:
    """Opens episodes through the router (first steps) until each replica holds one: {episode: replica}.
    (The router assigns a new key to a replica of its choosing; a dozen keys all on one is a bug.)"""
    homes = {}
    for i in range(12):
        ep = f"ep-{i}"
        status, hdrs, body = chat_step(cluster.url, ep, SHOTS[0], first=True)
        assert status == 200, body
        assert body["recall_episode_step"]["t"] == 1
        homes[ep] = hdrs["x-recall-replica"]
        if len(set(homes.values())) == 2:
            break
    assert sorted(set(homes.values())) == ["replica-a", "replica-b"], homes
    return homes


def one_each(homes: dict) -> dict:
    """One episode per replica of `open_on_both`'s: {episode: replica}."""
    return {next(ep for ep, r in homes.items() if r == name): name for name in ("replica-a", "replica-b")}


def test_episode_steps_through_the_router_stay_on_one_replica(cluster):
    served = {}
    for ep, home in one_each(open_on_both(cluster)).items():
        _, _, first = http("GET", f"{cluster.by_name[home].url}/v1/episodes/{ep}")
        replicas, answers = {home}, [first["steps"][0]["response"]]
        for i, shot in enumerate(SHOTS[1:], start=2):
            status, hdrs, body = chat_step(cluster.url, ep, shot, first=False)
            assert status == 200, body
            replicas.add(hdrs["x-recall-replica"])
            step = body["recall_episode_step"]
            assert step["t"] == i and body["choices"][0]["message"]["content"] == step["response"]
            answers.append(step["response"])
        assert len(replicas) == 1, f"{ep} was served by {replicas}"
        served[ep] = (home, answers)
    for ep, (name, answers) in served.items():
        for rep in cluster.replicas:
            status, _, body = http("GET", f"{rep.url}/v1/episodes/{ep}")
            if rep.name == name:
                assert status == 200 and [s["response"] for s in body["steps"]] == answers
            else:
                assert status == 404, body
    # The plain episode API on one replica decides the same steps bitwise.
    rep = cluster.replicas[0]
    status, _, opened = http("POST", rep.url + "/v1/episodes", OPEN)
    assert status == 201, opened
    plain = []
    for shot in SHOTS:
        status, _, step = http("POST", f"{rep.url}/v1/episodes/{opened['id']}/steps",
                               {"image_url": {"url": data_url(shot)}})
        assert status == 200, step
        plain.append(step["response"])
    assert all(answers == plain for _, answers in served.values())


def test_a_replica_killed_mid_run_fails_over_with_clear_errors_and_serves_nothing_twice(cluster):
    homes_all = open_on_both(cluster)
    homes = one_each(homes_all)
    doomed_ep = next(ep for ep, r in homes.items() if r == "replica-a")
    alive_ep = next(ep for ep, r in homes.items() if r == "replica-b")
    a, b = cluster.by_name["replica-a"], cluster.by_name["replica-b"]
    a_served = served_chat(a)
    a.kill()
    # The killed replica's episode: every later step is refused with an error that says why; none is
    # decided without its history.
    errors, deadline = [], time.time() + 60
    while not errors or errors[-1][0] != 404:
        assert time.time() < deadline, f"the router never failed over: {errors}"
        status, _, body = chat_step(cluster.url, doomed_ep, SHOTS[1], first=False)
        assert status >= 400, body
        errors.append((status, body["error"]["message"]))
        time.sleep(0.2)
    print("failover errors:", errors)
    assert all("127.0.0.1" in m or "replica-b" in m for _, m in errors), errors
    status, message = errors[-1]
    assert status == 404 and "not open on this replica (replica-b)" in message, errors
    # The other episode goes on where it lives.
    for shot in SHOTS[1:]:
        status, hdrs, body = chat_step(cluster.url, alive_ep, shot, first=False)
        assert status == 200, body
        assert hdrs["x-recall-replica"] == "replica-b"
    # Nothing served twice: the dead replica recorded exactly the one step it answered of its
    # episode, the survivor never saw that episode, and the survivor's count is its own steps.
    recorded = json.loads((a.episode_dir / doomed_ep / "episode.json").read_text())
    assert len(recorded["steps"]) == 1
    assert http("GET", f"{b.url}/v1/episodes/{doomed_ep}")[0] == 404
    status, _, body = http("GET", f"{b.url}/v1/episodes/{alive_ep}")
    assert status == 200 and len(body["steps"]) == 3
    opened = {r: sum(1 for h in homes_all.values() if h == r) for r in ("replica-a", "replica-b")}
    assert a_served == opened["replica-a"] and served_chat(b) == opened["replica-b"] + 2
