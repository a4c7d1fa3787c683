"""/health latency while `meshpar serve` refuses a long text prompt, and the server's RSS before and after.

    python bench/bench_serve_guard.py [--chars 3900000] [--work DIR]

Trains (once, in --work) a tiny byte-level checkpoint on the repeated alphabet, serves it on 8 fake CPU devices with
a Hugging Face tokenizer whose tokens are single characters (the `tokenizers` library: a 10 MB text takes seconds to
tokenize), then posts one completion whose prompt is `--chars` characters (under serve.max_body_bytes, so the body
is read) while a client polls GET /health every 10 ms. Prints the refusal's status and seconds, the slowest /health
answer during it, and the server's RSS before and after (MiB). The server is the `meshpar` importable here
(PYTHONPATH picks another checkout to compare).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def char_tokenizer(d: Path) -> Path:
    """A `tokenizers` WordLevel tokenizer of single ASCII characters (ids = their bytes)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if (d / "tokenizer.json").exists():
        return d
    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10, "<unk>": 0}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=3_900_000)
    ap.add_argument("--work", default="/tmp/meshpar-bench-guard")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ck = work / "ck"
    if not ck.exists():
        (work / "abc.txt").write_text("abcdefghijklmnopqrstuvwxyz" * 200)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "meshpar.cli",
                "train",
                "steps=20",
                "train.log_every=20",
                "data.kind=text",
                f"data.path={work / 'abc.txt'}",
                "model.vocab=256",
                "batch.length=32",
                f"checkpoint.dir={ck}",
            ],
            check=True,
            capture_output=True,
        )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshpar.cli",
            "serve",
            f"checkpoint.dir={ck}",
            "--devices",
            "8",
            "--port",
            "0",
            "--model-name",
            "abc",
            "serve.cache_length=256",
            f"data.tokenizer={char_tokenizer(work / 'tok')}",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit("the server ended before listening")
        if " on http://" in line:
            url = line.split(" on ")[1].split()[0]
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    try:
        before = rss_mib(proc.pid)
        body = json.dumps({"model": "abc", "prompt": "abcd" * (args.chars // 4), "max_tokens": 2}).encode()
        result = {}

        def send():
            t = time.perf_counter()
            req = urllib.request.Request(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    result["status"] = r.status
            except urllib.error.HTTPError as e:
                result["status"], result["error"] = e.code, json.loads(e.read())["error"]["message"][:100]
            result["seconds"] = time.perf_counter() - t

        sender = threading.Thread(target=send)
        sender.start()
        slowest, polls = 0.0, 0
        while sender.is_alive():
            t = time.perf_counter()
            with urllib.request.urlopen(url + "/health", timeout=600) as r:
                r.read()
            slowest, polls = max(slowest, time.perf_counter() - t), polls + 1
            time.sleep(0.01)
        sender.join()
        time.sleep(1.0)
        print(
            json.dumps(
                {
                    "chars": args.chars,
                    "body_bytes": len(body),
                    **result,
                    "health_polls": polls,
                    "health_slowest_s": round(slowest, 3),
                    "rss_before_mib": round(before),
                    "rss_after_mib": round(rss_mib(proc.pid)),
                }
            )
        )
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
