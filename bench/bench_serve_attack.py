"""What the worst request bodies under the size limit cost `meshpar serve`, and what clients looping
the worst one do to a normal stream (issue 73). Loopback only; every loop and wait is bounded.

    python bench/bench_serve_attack.py                      # serve.parse_workers=1 (the default)
    python bench/bench_serve_attack.py serve.parse_workers=0   # bodies read on a thread of the server
    PYTHONPATH=/path/to/other/checkout python bench/bench_serve_attack.py --bodies issue   # another server

The server: `meshpar serve` on 1 fake CPU device, a random 2-layer byte-level model (vocab 256), a
character tokenizer with a ChatML template, `serve.cache_length=256` (so a text longer than 6,144
characters is refused unread), the default body limit (4 MiB). Measured:

1. Each body below, alone, --runs times (3): its answer, seconds to answer, and the server's CPU seconds for
   it (its own process and its children, the request parsers: /proc's utime + stime), the median.
     issue     6,000 one-character messages and 60,000 empty ones (2.2 MB; the issue's)
     empty     as many empty messages as fit in 4 MiB (about 131,000)
     longest   serve.max_messages messages whose content totals just under the text bound: read,
               rendered and tokenized, then refused for their tokens
     nested    no messages, and an unknown field holding 4 MiB of nested empty arrays and objects
     text      a 4 MiB text prompt
2. Inter-token latency of normal streams (--streams of 200 tokens one after the other, `stream:
   true`, greedy among the letters, which logit_bias lifts: a chunk per token; the arrival times of
   the chunks at the client, pooled), p50/p99, and their time to first token: idle, then with
   --clients clients (threads of a second process, at nice +19 as remote clients would not share
   the server's CPU) each posting the most expensive body of 1 in a loop (at most --loops each)
   until the streams end; --rounds times in turn (the machine's own drift falls on both). Prints one
   JSON object, Markdown tables and the median over the rounds of attacked / idle ITL p99.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODEL = ["model.vocab=256", "model.layers=2", "model.embed=64", "model.heads=4", "model.kv_heads=4", "model.mlp=128"]
LIMIT = 4 * 2**20


def char_tokenizer(d: Path) -> Path:
    """Single ASCII characters (ids = their bytes) and the ChatML markers as ids 1 and 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10, "<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def bodies(max_messages: int) -> dict:
    """name -> (path, body bytes), each under the 4 MiB limit."""
    chat = {"model": "m", "max_tokens": 1}
    one = len(json.dumps({"role": "user", "content": ""})) + 2
    out = {
        "issue": (
            "/v1/chat/completions",
            chat | {"messages": [{"role": "user", "content": "a"}] * 6000 + [{"role": "user", "content": ""}] * 60000},
        ),
        "empty": (
            "/v1/chat/completions",
            chat | {"messages": [{"role": "user", "content": ""}] * ((LIMIT - 200) // one)},
        ),
        "longest": (
            "/v1/chat/completions",
            chat | {"messages": [{"role": "user", "content": "ab" * (6144 // (2 * max_messages))}] * max_messages},
        ),
        "nested": ("/v1/chat/completions", {"model": "m", "messages": [], "x": [[{}], [[]]] * ((LIMIT - 200) // 11)}),
        "text": ("/v1/completions", {"model": "m", "prompt": "a" * (LIMIT - 200), "max_tokens": 1}),
    }
    return {k: (p, json.dumps(b, separators=(",", ":")).encode()) for k, (p, b) in out.items()}


def cpu_s(pid: int) -> float:
    """utime + stime of `pid` and its living children (the request parsers), seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total, children = 0.0, []
    for task in Path(f"/proc/{pid}/task").iterdir():  # a child is listed under the thread that started it
        try:
            children += (task / "children").read_text().split()
        except OSError:
            pass
    for p in [pid, *map(int, children)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024)
    return float("nan")


def post(url: str, path: str, data: bytes, timeout: float = 300):
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def streams(url: str, tokens: int, n: int) -> dict:
    """`n` streamed completions of `tokens` tokens, one after the other -> their inter-token latency
    p50/p99 (ms, the gaps of all of them pooled), time to first token (median and most, s), seconds."""
    body = {"model": "m", "prompt": "abcd", "max_tokens": tokens, "temperature": 0, "stream": True}
    body["logit_bias"] = {str(i): 100 for i in range(97, 123)}  # a letter each token: a chunk per token, no end
    data = json.dumps(body).encode()
    gaps, ttft, t0 = [], [], time.perf_counter()
    for _ in range(n):
        req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
        times, start = [], time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: {") and b'"text":""' not in line:
                    times.append(time.perf_counter())
        ttft.append(times[0] - start)
        gaps += [1000 * (b - a) for a, b in zip(times, times[1:])]
    gaps.sort()
    return {
        "streams": n,
        "tokens": len(gaps) + n,
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_max_s": round(max(ttft), 3),
        "itl_p50_ms": round(statistics.median(gaps), 2),
        "itl_p99_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def attack(host: str, port: int, path: str, file: str, clients: int, loops: int) -> None:
    """The attacking clients (`--attack`, a process of their own at nice +19): `clients` threads each
    posting the body in `file` at most `loops` times, until `file`.stop exists; prints how many."""
    import socket

    os.nice(19)  # remote clients would not take the server's CPU: these take as little as the kernel gives
    data = Path(file).read_bytes()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    sent = [0] * clients

    def one(i):
        for _ in range(loops):
            if os.path.exists(file + ".stop"):
                return
            try:
                with socket.create_connection((host, port), timeout=600) as s:
                    s.sendall(head.encode() + data)
                    while s.recv(65536):
                        pass
            except OSError:  # a server that took too long, or closed on it: the next one
                continue
            sent[i] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(sum(sent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--loops", type=int, default=200, help="bodies each attacking client sends at most")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--streams", type=int, default=10, help="normal streams measured one after the other, each time")
    ap.add_argument("--rounds", type=int, default=3, help="idle, then attacked, this many times")
    ap.add_argument("--bodies", default="issue,empty,longest,nested,text")
    ap.add_argument("--runs", type=int, default=3, help="times each body is sent alone (the median is kept)")
    ap.add_argument(
        "--attack", nargs=6, metavar=("HOST", "PORT", "PATH", "FILE", "CLIENTS", "LOOPS"), help=argparse.SUPPRESS
    )
    ap.add_argument("settings", nargs="*", help="KEY=VALUE for the server")
    args = ap.parse_args()
    if args.attack:
        h, p, path, file, clients, loops = args.attack
        return attack(h, int(p), path, file, int(clients), int(loops))
    work = Path(tempfile.mkdtemp(prefix="meshpar-bench-attack-"))
    tok = char_tokenizer(work / "tok")
    cmd = [sys.executable, "-m", "meshpar.cli", "serve", "--devices", "1", "--port", "0", "--model-name", "m"]
    cmd += [*MODEL, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "serve.slots=4", "serve.cache_length=256"]
    cmd += [f"data.tokenizer={tok}", *args.settings]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit("the server ended before listening")
        if " on http://" in line:
            url = line.split(" on ")[1].split()[0]
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    host, port = url.split("//")[1].split(":")
    max_messages = next((int(s.split("=")[1]) for s in args.settings if s.startswith("serve.max_messages=")), 2048)
    result = {"command": " ".join(sys.argv), "server": url, "bodies": {}}
    try:
        streams(url, args.tokens, 1)  # compiles what a stream needs
        result["rss_before_mib"] = rss_mib(proc.pid)
        for name, (path, data) in bodies(max_messages).items():
            if name not in args.bodies.split(","):
                continue
            runs = []
            for _ in range(args.runs):
                c0, t0 = cpu_s(proc.pid), time.perf_counter()
                status, answer = post(url, path, data)
                seconds = time.perf_counter() - t0
                time.sleep(0.3)  # the parser's last work counted too
                runs.append((cpu_s(proc.pid) - c0, seconds, status, answer))
            cpu = statistics.median(r[0] for r in runs)
            result["bodies"][name] = {
                "bytes": len(data),
                "status": runs[0][2],
                "answer": json.loads(runs[0][3]).get("error", {}).get("message", "")[:90]
                if runs[0][2] != 200
                else "200",
                "server_cpu_s": round(cpu, 3),
                "seconds": round(statistics.median(r[1] for r in runs), 3),
            }
            print(name, result["bodies"][name], file=sys.stderr, flush=True)
        worst = max(result["bodies"], key=lambda k: result["bodies"][k]["server_cpu_s"])
        result["worst"] = worst
        path, data = bodies(max_messages)[worst]
        file = work / "body.json"
        file.write_bytes(data)
        result["rounds"] = []
        for r in range(args.rounds):  # idle and attacked in turn: the machine's own drift falls on both
            idle = streams(url, args.tokens, args.streams)
            stop = Path(f"{file}.stop")
            stop.unlink(missing_ok=True)
            clients = subprocess.Popen(
                [sys.executable, __file__, "--attack", host, port, path, str(file), str(args.clients), str(args.loops)],
                stdout=subprocess.PIPE,
                text=True,
            )
            time.sleep(1.0)  # the clients at it
            c0 = cpu_s(proc.pid)
            attacked = streams(url, args.tokens, args.streams)
            attacked["server_cpu_s"] = round(cpu_s(proc.pid) - c0, 2)
            stop.write_text("")
            try:
                attacked["bodies_sent"] = int(clients.communicate(timeout=300)[0].strip() or 0)
            except subprocess.TimeoutExpired:  # a server that takes minutes a body (before issue 73)
                clients.kill()
                attacked["bodies_sent"] = "killed after 300 s"
            result["rounds"].append({"idle": idle, "attacked": attacked})
            print(f"round {r}", result["rounds"][-1], file=sys.stderr, flush=True)
        ratios = [x["attacked"]["itl_p99_ms"] / x["idle"]["itl_p99_ms"] for x in result["rounds"]]
        result["itl_p99_ratio_median"] = round(statistics.median(ratios), 2)
        t = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            r.read()
        result["health_after_s"] = round(time.perf_counter() - t, 3)
        result["rss_after_mib"] = rss_mib(proc.pid)  # the serving process's (the parsers' are their own)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:  # a server still busy with the bodies it took (before issue 73)
            proc.kill()
            result["killed"] = "the server did not stop within 60 s of SIGTERM"
    print(json.dumps(result))
    print("\n| body | bytes | answer | server CPU s | seconds |\n|---|---:|---|---:|---:|")
    for name, b in result["bodies"].items():
        print(f"| {name} | {b['bytes']:,} | {b['status']} {b['answer'][:60]} | {b['server_cpu_s']} | {b['seconds']} |")
    print("\n| round | streams | TTFT p50 / max s | ITL p50 ms | ITL p99 ms | seconds |\n|---|---|---:|---:|---:|---:|")
    for i, x in enumerate(result["rounds"]):
        for k in ("idle", "attacked"):
            v = x[k]
            ttft = f"{v['ttft_p50_s']} / {v['ttft_max_s']}"
            print(f"| {i} | {k} | {ttft} | {v['itl_p50_ms']} | {v['itl_p99_ms']} | {v['seconds']} |")
    print(f"\nattacked / idle ITL p99, median of the rounds: {result['itl_p99_ratio_median']}")
    print(f"serving process RSS: {result['rss_before_mib']} -> {result['rss_after_mib']} MiB")


if __name__ == "__main__":
    main()
