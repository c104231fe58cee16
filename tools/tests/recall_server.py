"""`recall serve` for the Python-side tests: started on a free loopback port, its URL read from the log,
the log kept draining (so the server never blocks on a full pipe), and SIGTERM at the end, which must
exit it with status 0."""

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import threading

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("RECALL_BIN", str(ROOT / "target" / "debug" / "recall"))


def start(*args: str):
    """Starts `recall serve --backend cpu --port 0 ARGS...`; (the process, its base URL
    `http://127.0.0.1:N`, its log so far, kept growing by a thread)."""
    proc = subprocess.Popen([BIN, "serve", "--backend", "cpu", "--port", "0", *args], stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "RUST_LOG": "recall=info"})
    log, found = [], None
    for line in proc.stderr:
        log.append(line)
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            found = m.group(1)
            break
    assert found, "recall serve did not start:\n" + "".join(log)
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    return proc, found, log


@contextlib.contextmanager
def serve(*args: str):
    """Runs `recall serve --backend cpu --port 0 ARGS...`; yields its base URL (`http://127.0.0.1:N`)."""
    proc, found, log = start(*args)
    try:
        yield found
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, "recall serve did not exit cleanly on SIGTERM:\n" + "".join(log[-50:])
