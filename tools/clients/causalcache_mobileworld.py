#!/usr/bin/env python3
"""The CausalCache authors' MobileWorld harness, talking its stateless policy protocol.

Source: luojiaxuan/CausalCache @ 71caac97, `code/causalcache/mobileworld.py` (`build_mobileworld_policy_request`,
`HTTPMobileWorldPolicy`, `MobileWorldHistoryEvent.summary`, `select_mobileworld_memory`) and
`code/integrations/mobileworld_gui_owl_agent.py` (the agent shim: base URL + `/act`, the history it keeps).

* `POST {base}/act`, `Content-Type: application/json`, the body `json.dumps(request, ensure_ascii=False)`
  (urllib, not the openai client), schema `causalcache.mobileworld.policy_request.v2`.
* Every completed step goes back as a history event (the server's own `action`, `action_text`,
  `full_response`, `policy_parsed`, screen hashes); the pre-action screenshot of the selected events
  is restored as bare base64 PNG: `recent` keeps the last B = 4, `full` sends all (for a server-side
  selector), `summary` none.
* The response must be `causalcache.mobileworld.policy_response.v2` with a MobileWorld action.

    python tools/clients/causalcache_mobileworld.py --base-url http://127.0.0.1:8000/v1/causalcache/policy --steps 6
"""

import argparse
import base64
import hashlib
import json
import sys
import urllib.request

from common import TASKS, png_bytes, screenshot

SIZE = (1080, 2400)
TYPES = ["answer", "click", "drag", "finished", "input_text", "keyboard_enter", "long_press", "navigate_back",
         "navigate_home", "open_app", "wait"]


def select(arm: str, budget: int, ids: list[int]) -> list[int]:
    if arm == "summary" or budget == 0:
        return []
    if arm == "full":
        return ids
    return ids[-min(budget, len(ids)):]


def request(task: str, step_id: int, current: bytes, history: list[dict], selected: list[int]) -> dict:
    return {
        "schema_version": "causalcache.mobileworld.policy_request.v2",
        "task": {"instruction": task, "instruction_sha256": hashlib.sha256(task.encode()).hexdigest()},
        "step_id": step_id,
        "screen_size": list(SIZE),
        "current_screenshot_png_base64": base64.b64encode(current).decode("ascii"),
        "history": [{**{k: v for k, v in e.items() if k != "observation"},
                     "restored_observation_screenshot_png_base64":
                         base64.b64encode(e["observation"]).decode("ascii") if e["step_id"] in selected else None}
                    for e in history],
        "selected_event_step_ids": selected,
        "action_schema": {"supported_action_types": TYPES, "contract": "Return exactly one MobileWorld JSONAction mapping."},
        "prompt_protocol": "mobile_agent_v3_5_gui_owl_official_faithful",
    }


def post(endpoint: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(endpoint, data=json.dumps(body, ensure_ascii=False).encode("utf-8"),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def replay(base_url: str, steps: int, arm: str = "recent", budget: int = 4) -> list[dict]:
    endpoint = base_url.rstrip("/")
    if not endpoint.endswith("/act"):
        endpoint += "/act"
    history, out = [], []
    previous = None
    for t in range(1, steps + 1):
        current = png_bytes(screenshot(*SIZE, t, seed=9))
        if previous is not None:
            obs, resp = previous
            history.append({
                "step_id": len(history) + 1, "action": resp["action"], "action_text": resp["action_text"],
                "full_response": resp["full_response"], "policy_parsed": resp["policy_parsed"],
                "screen_changed": hashlib.sha256(current).digest() != hashlib.sha256(obs).digest(),
                "observation_screenshot_sha256": hashlib.sha256(obs).hexdigest(),
                "post_screenshot_sha256": hashlib.sha256(current).hexdigest(),
                "observation": obs,
            })
        selected = select(arm, budget, [e["step_id"] for e in history])
        status, resp = post(endpoint, request(TASKS[0], t, current, history, selected))
        out.append({"status": status, "selected": selected, "response": resp})
        if status != 200:
            break
        assert resp["schema_version"] == "causalcache.mobileworld.policy_response.v2", resp
        assert resp["action"]["action_type"] in TYPES, resp
        previous = (current, resp)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1/causalcache/policy")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--memory-arm", choices=["recent", "full", "summary"], default="recent")
    ap.add_argument("--budget", type=int, default=4)
    a = ap.parse_args()
    steps = replay(a.base_url, a.steps, a.memory_arm, a.budget)
    for i, s in enumerate(steps, 1):
        r = s["response"]
        print(f"step {i}: status {s['status']} selected {s['selected']} action {r.get('action')} "
              f"reused {r.get('generation', {}).get('reused_tokens')}")
    sys.exit(0 if all(s["status"] == 200 for s in steps) else 1)
