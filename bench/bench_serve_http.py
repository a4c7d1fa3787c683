"""`meshpar serve` under load, from the official `openai` client on loopback (bounded: every client
sends one request of a fixed size, every wait has a timeout).

    python bench/bench_serve_http.py                 # 8 fake CPU devices, a 4-layer 256-wide model
    python bench/bench_serve_http.py --clients 64 --tokens 32 --prompt 100
    python bench/bench_serve_http.py --only load mesh.pipeline=4 mesh.tensor=2    # settings for every server

Two measurements, each from one run of this script:
1. Load: C concurrent streaming clients x N new tokens against a server with `serve.prefill_batch`
   = 8 (batched prefill) and one with 1 (one prompt per prefill call), everything else equal. Rounds
   of the C clients repeat until one compiles nothing new (the server's /health counts
   compilations: a round's arrivals may batch prompts in a shape no earlier round met); per
   server, for that round: requests completed / failed or garbled (a client checks its token count), p50/p99 time to
   first token and inter-token latency, total tokens/s.
2. Prefix caching: prompts of a ~1k-token shared prefix + a short suffix. A first request stores the
   prefix; TTFT of a second request with the same prefix (cached) vs one with a fresh prefix
   (uncached), alone on the server, median of R rounds; the cached requests' outputs are compared
   with the same prompts on a server without a prefix cache (identical greedy tokens).
3. Chunked prefill (`--only chunked`): C streaming clients decoding, then a burst of B long prompts
   (`--long` bytes each) arriving together; the same scenario against a server that prefills a
   tick's admissions whole (`serve.prefill_chunk` off) and one with a per-tick budget
   (`serve.prefill_chunk=K`, `--chunk`), everything else equal. Per server, for the first run of
   the scenario after the first that compiles nothing new: the streams' inter-token latency p50/p99
   (the stall a burst causes) and time to first token p99, of the streams and of all requests.
Prints one JSON object per measurement and a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

MODEL = [
    "model.layers=4",
    "model.embed=256",
    "model.heads=8",
    "model.kv_heads=4",
    "model.head_dim=32",
    "model.mlp=1024",
    "model.vocab=256",
    "precision=fp32",
]


def start(args: list[str], devices: int):
    """A `meshpar serve` subprocess -> (process, base URL)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshpar.cli",
            "serve",
            "--port",
            "0",
            "--model-name",
            "m",
            "--devices",
            str(devices),
            *MODEL,
            *args,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.time()
    while time.time() - t0 < 300:
        line = proc.stderr.readline()
        if not line:
            break
        if " on http://" in line:
            return proc, line.split(" on ")[1].split()[0]
    proc.kill()
    raise SystemExit(f"server did not start: {args}")


def stop(proc) -> None:
    proc.terminate()
    proc.wait(120)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


ASCII = {str(i): -100 for i in range(128, 256)}  # logit_bias: the random model's bytes stay ASCII


async def stream_one(client, prompt: str, tokens: int, **extra) -> dict:
    """One streaming completion -> {ttft, gaps between chunks, chunks, ok}."""
    t0 = time.perf_counter()
    times, text = [], ""
    stream = await client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            text += chunk.choices[0].text
    ok = usage is not None and usage.completion_tokens == tokens
    return {
        "ttft": times[0] - t0 if times else float("nan"),
        "gaps": [b - a for a, b in zip(times, times[1:])],
        "ok": ok,
        "text": text,
    }


def compilations(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())["compilations"]


async def load(url: str, clients: int, tokens: int, prompts: list[str], rounds: int) -> dict:
    """Rounds of C concurrent clients until one compiles nothing new (at most `rounds`): arrivals differ
    per round, and a round that meets a new (rows, bucket) prefill shape pays its compilation."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        for r in range(rounds):
            before, t0 = compilations(url), time.perf_counter()
            out = await asyncio.gather(
                *(stream_one(client, prompts[i % len(prompts)], tokens) for i in range(clients)), return_exceptions=True
            )
            wall = time.perf_counter() - t0
            compiled = compilations(url) - before
            if r and not compiled:
                break
    good = [o for o in out if isinstance(o, dict) and o["ok"]]
    ttft = [o["ttft"] for o in good]
    gaps = [g for o in good for g in o["gaps"]]
    return {
        "completed": len(good),
        "failed": clients - len(good),
        "ttft_min_s": min(ttft, default=float("nan")),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(gaps, 50),
        "itl_p99_s": pct(gaps, 99),
        "tokens_per_s": len(good) * tokens / wall,
        "wall_s": wall,
        "round": r + 1,
        "compiled_in_round": compiled,
    }


async def burst(url: str, clients: int, tokens: int, prompts: list[str], long: list[str], after_s: float) -> dict:
    """C streams, and `long` prompts sent together `after_s` seconds after them (module docstring, 3)."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:

        async def late(prompt):
            await asyncio.sleep(after_s)
            return await stream_one(client, prompt, 8, logit_bias=ASCII)

        # ASCII only: every token is a whole character, so each arrives as a chunk of its own (a byte of
        # a multi-byte character would be held back until the character is whole, and read as a stall)
        streams = [stream_one(client, prompts[i % len(prompts)], tokens, logit_bias=ASCII) for i in range(clients)]
        out = await asyncio.gather(*streams, *(late(p) for p in long), return_exceptions=True)
    good = [o for o in out[:clients] if isinstance(o, dict) and o["ok"]]
    longs = [o for o in out[clients:] if isinstance(o, dict) and o["ok"]]
    gaps = [g for o in good for g in o["gaps"]]
    return {
        "completed": len(good) + len(longs),
        "failed": len(out) - len(good) - len(longs),
        "itl_p50_s": pct(gaps, 50),
        "itl_p99_s": pct(gaps, 99),
        "itl_max_s": max(gaps, default=float("nan")),
        "ttft_streams_p99_s": pct([o["ttft"] for o in good], 99),
        "ttft_long_p99_s": pct([o["ttft"] for o in longs], 99),
        "ttft_all_p99_s": pct([o["ttft"] for o in good + longs], 99),
    }


def chunked(args, prompts, rnd, letters) -> list[dict]:
    """Measurement 3 of the module docstring: prefill_chunk off, then on, the same scenario."""
    long = ["".join(rnd.choice(letters) for _ in range(args.long)) for _ in range(args.burst)]
    rows = []
    for chunk in (None, args.chunk):
        setting = [f"serve.prefill_chunk={chunk}"] if chunk else []
        proc, url = start(
            [
                f"serve.slots={args.clients + args.burst}",
                "serve.prefill_batch=8",
                "serve.prefix_cache=0",
                "serve.cache_length=2048",
                *setting,
                *args.settings,
            ],
            args.devices,
        )
        try:  # runs repeat until one compiles nothing new (arrivals group prompts differently)
            for r in range(args.load_rounds):
                before = compilations(url)
                rec = asyncio.run(burst(url, args.clients, args.tokens, prompts, long, args.after))
                compiled = compilations(url) - before
                if r and not compiled:
                    break
        finally:
            stop(proc)
        rec["round"], rec["compiled_in_round"] = r + 1, compiled
        rec = {
            "bench": "chunked",
            "prefill_chunk": chunk,
            "clients": args.clients,
            "burst": args.burst,
            "long_bytes": args.long,
            **rec,
        }
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    off, on = rows
    print(
        "\n| prefill_chunk | completed | failed | ITL p50 s | ITL p99 s | ITL max s | TTFT p99 streams s | "
        "TTFT p99 long s | TTFT p99 all s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prefill_chunk'] or 'off'} | {r['completed']} | {r['failed']} | {r['itl_p50_s']:.4f} | "
            f"{r['itl_p99_s']:.4f} | {r['itl_max_s']:.3f} | {r['ttft_streams_p99_s']:.3f} | "
            f"{r['ttft_long_p99_s']:.3f} | "
            f"{r['ttft_all_p99_s']:.3f} |"
        )
    print(
        f"\nITL p99 off / on: {off['itl_p99_s'] / on['itl_p99_s']:.2f}x; TTFT p99 (all) on / off: "
        f"{on['ttft_all_p99_s'] / off['ttft_all_p99_s']:.2f}x"
    )
    return rows


async def ttft_alone(url: str, prompt: str) -> tuple[float, str]:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        o = await stream_one(client, prompt, 8)
    return o["ttft"], o["text"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per client")
    p.add_argument("--prompt", type=int, default=100, help="prompt length (bytes) of the load test")
    p.add_argument("--prefix", type=int, default=1000, help="shared prefix length (bytes) of the prefix test")
    p.add_argument("--rounds", type=int, default=5, help="prefix-test rounds (median)")
    p.add_argument("--only", choices=["load", "prefix", "chunked"], help="one measurement only")
    p.add_argument("--burst", type=int, default=8, help="long prompts arriving together (chunked test)")
    p.add_argument("--long", type=int, default=1500, help="bytes of each long prompt (chunked test)")
    p.add_argument("--chunk", type=int, default=4096, help="serve.prefill_chunk of the chunked server")
    p.add_argument("--after", type=float, default=1.0, help="seconds after the streams the burst arrives")
    p.add_argument(
        "--load-rounds",
        type=int,
        default=8,
        help="load rounds at most: the first that compiles nothing new (after the first) is measured",
    )
    p.add_argument("settings", nargs="*", help="KEY=VALUE for every server, e.g. mesh.pipeline=4 mesh.tensor=2")
    args = p.parse_args()
    rnd = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    prompts = ["".join(rnd.choice(letters) for _ in range(args.prompt)) for _ in range(16)]
    if args.only == "chunked":
        chunked(args, prompts, rnd, letters)
        return
    rows = []
    slots = f"serve.slots={args.clients}"
    for batch in (8, 1) if args.only != "prefix" else ():
        proc, url = start(
            [slots, f"serve.prefill_batch={batch}", "serve.prefix_cache=0", "serve.cache_length=256", *args.settings],
            args.devices,
        )
        try:
            rec = {
                "bench": "load",
                "prefill_batch": batch,
                "clients": args.clients,
                "tokens": args.tokens,
                **asyncio.run(load(url, args.clients, args.tokens, prompts, args.load_rounds)),
            }
        finally:
            stop(proc)
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    if args.only == "load":
        return table(rows, None, args)
    prefixes = ["".join(rnd.choice(letters) for _ in range(args.prefix)) for _ in range(2 * args.rounds + 1)]
    suffix = lambda i: f" question {i}: " + "".join(rnd.choice(letters) for _ in range(12))  # noqa: E731
    cache = ["serve.slots=8", "serve.cache_length=2048", "serve.prefill_batch=8"]
    proc, url = start([*cache, "serve.prefix_cache=8", *args.settings], args.devices)
    cached, uncached, texts = [], [], {}
    try:
        asyncio.run(ttft_alone(url, prefixes[-1] + suffix(0)))  # compiles prefill and extend
        asyncio.run(ttft_alone(url, prefixes[-1] + suffix(1)))
        for r in range(args.rounds):
            a, b = prefixes[2 * r], prefixes[2 * r + 1]
            asyncio.run(ttft_alone(url, a + suffix(2)))  # stores prefix a
            prompt = a + suffix(3)
            t, texts[prompt] = asyncio.run(ttft_alone(url, prompt))  # prefix a cached
            cached.append(t)
            uncached.append(asyncio.run(ttft_alone(url, b + suffix(4)))[0])  # prefix b: never seen
    finally:
        stop(proc)
    proc, url = start([*cache, "serve.prefix_cache=0", *args.settings], args.devices)
    try:
        same = all(asyncio.run(ttft_alone(url, prompt))[1] == text for prompt, text in texts.items())
    finally:
        stop(proc)
    rec = {
        "bench": "prefix",
        "prefix_bytes": args.prefix,
        "rounds": args.rounds,
        "ttft_cached_s": statistics.median(cached),
        "ttft_uncached_s": statistics.median(uncached),
        "speedup": statistics.median(uncached) / statistics.median(cached),
        "outputs_identical": same,
    }
    print(json.dumps(rec), flush=True)
    table(rows, rec, args)


def table(rows, rec, args) -> None:
    print("\n| prefill batch | completed | failed | TTFT p50 s | TTFT p99 s | ITL p50 s | ITL p99 s | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prefill_batch']} | {r['completed']} | {r['failed']} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p99_s']:.3f} "
            f"| {r['itl_p50_s']:.4f} | {r['itl_p99_s']:.4f} | {r['tokens_per_s']:.0f} |"
        )
    if len(rows) == 2:
        print(f"\np99 TTFT one-at-a-time / batched: {rows[1]['ttft_p99_s'] / rows[0]['ttft_p99_s']:.2f}x")
    if rec:
        print(
            f"prefix of {args.prefix} bytes: TTFT cached {rec['ttft_cached_s']:.4f} s vs uncached "
            f"{rec['ttft_uncached_s']:.4f} s ({rec['speedup']:.1f}x), outputs identical: {rec['outputs_identical']}"
        )


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
