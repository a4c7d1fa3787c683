"""The serving step's newer parts on whatever device jax sees: logprobs, logit bias and penalties,
`n` siblings, and chunked prefill against whole (same tokens), one request's logprob against the
model's own logits. `python bench/check_serve_device.py` (it runs on CPU too; on a lent H100 with
jax 0.11.2 it gave the same tokens as this VM's CPU, bench/RESULTS.md)."""

import jax
import numpy as np

from meshpar.core.config import load_config
from meshpar.serve.engine import Engine
from meshpar.serve.requests import Request
from meshpar.serve.sampling import Sampling
from meshpar.serve.scheduler import Scheduler

print(jax.__version__, jax.devices())
cfg = load_config(
    None,
    [
        "model.size=tiny",
        "model.vocab=256",
        "serve.slots=4",
        "serve.cache_length=256",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "devices=1",
    ],
)
e = Engine(cfg, devices=jax.devices()[:1], info=print)


def serve(chunk):
    s = Scheduler(e, prefill_batch=2, prefill_chunk=chunk)
    reqs = [
        Request(list(range(5, 9)), 8, Sampling(0.0), logprobs=3),
        Request(list(range(3, 120)), 6, Sampling(1.0, seed=3, presence=1.0, frequency=0.5, bias=((7, -100.0),))),
        Request(list(range(10, 14)), 6, Sampling(0.0), share="a"),
        Request(list(range(10, 14)), 6, Sampling(0.0), share="a"),
    ]
    ts = [s.submit(r) for r in reqs]
    while s.step():
        pass
    return [t.completion.tokens for t in ts], ts[0].completion.logprobs[:2], s.prefill_calls


a = serve(None)
b = serve(16)
print("whole  ", a[0], a[2])
print("chunked", b[0], b[2])
print("logprobs", a[1])
assert a[0] == b[0] and 7 not in a[0][1] and a[0][2] == a[0][3]
lg = np.asarray(e.prefill(list(range(5, 9)))[2], np.float64)
lp = lg - lg.max() - np.log(np.exp(lg - lg.max()).sum())
assert abs(a[1][0][0] - lp[a[0][0][0]]) < 0.05, (a[1][0][0], lp[a[0][0][0]])
print("OK serving on", jax.devices()[0].device_kind)
