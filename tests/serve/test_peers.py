"""`meshpar launch 2 serve` when one of its processes is killed (kill -9), on a tiny random model (2
processes x 1 fake CPU device): process 1 killed, every request open or new is answered 503 in
OpenAI's shape within 15 s and process 0 exits 3 with one line naming the lost process; process 0
killed (its clients' connections go with it), process 1 exits 3 with one line naming the
coordinator, where JAX aborted it (SIGABRT). No tracebacks either way. Every wait is bounded.
"""

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.serve.test_http import post, start

SERVER = [
    "launch",
    "2",
    "serve",
    "--devices",
    "2",
    "--port",
    "0",
    "--model-name",
    "m",
    "model.vocab=256",
    "model.layers=1",
    "model.embed=32",
    "model.heads=2",
    "model.kv_heads=2",
    "model.mlp=64",
    "mesh.data=2",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "serve.slots=2",
    "serve.cache_length=256",
    "serve.prefix_cache=0",
]
ENV = {"MESHPAR_PEER_TIMEOUT": "5"}  # the watchdog's verdict: 5 s without a heartbeat


def launched():
    """(launcher process, URL, its stderr lines, the pids of processes 0 and 1) of SERVER."""
    proc, url, lines = start(SERVER, env=ENV)
    pids = next([int(p) for p in line.split("pids")[1].split()] for line in lines if " pids " in line)
    return proc, url, lines, pids


def answered(url, body, out):
    t = time.monotonic()
    out["r"], out["s"] = post(url, "/v1/completions", body), time.monotonic() - t


def ended(proc, lines, timeout=90) -> str:
    """The launcher's exit, then all its stderr (the pipe's reader given a moment)."""
    proc.wait(timeout)
    time.sleep(0.5)
    return "".join(lines)


def test_process_1_killed_every_request_is_answered_503_and_process_0_exits_3():
    proc, url, lines, pids = launched()
    try:
        assert post(url, "/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2})[0] == 200
        running, late = {}, {}
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0}
        threading.Thread(target=answered, args=(url, body, running), daemon=True).start()
        for _ in range(200):  # until it decodes
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if json.loads(r.read())["active"]:
                    break
            time.sleep(0.05)
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(2)  # a request that comes after the loss
        answered(url, {"model": "m", "prompt": [5, 6], "max_tokens": 4}, late)
        for _ in range(150):
            if "r" in running:
                break
            time.sleep(0.1)
        assert time.monotonic() - killed < 15
        for out in (running, late):
            code, err, _ = out["r"]
            assert code == 503 and err["error"]["code"] == "peer_lost", err
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert health.value.code == 503
        text = ended(proc, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"process 0 (pid {pids[0]}) ended with exit status 3" in text, text
    lost = [line for line in text.splitlines() if line.startswith("meshpar: error: lost a peer")]
    assert len(lost) == 1 and "process 1 stopped responding" in lost[0] and "process 0 stops serving" in lost[0], text
    assert "Traceback" not in text, text


def test_process_0_killed_process_1_exits_3_in_one_line():
    proc, url, lines, pids = launched()
    try:
        assert post(url, "/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2})[0] == 200
        os.kill(pids[0], signal.SIGKILL)
        text = ended(proc, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"process 1 (pid {pids[1]}) ended with exit status 3" in text, text
    said = [line for line in text.splitlines() if line.startswith("[process 1]")]
    assert len(said) == 1 and said[0].startswith("[process 1] meshpar: error: lost a peer: process 0"), text
    assert "SIGABRT" not in text and "Traceback" not in text and "Check failure" not in text, text
