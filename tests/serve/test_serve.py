"""Sharded inference (meshpar/serve/engine.py): KV-cache decoding equals the full forward pass, on one device
and under the serving layout; compilations are bounded; continuous batching changes no output; the
decode step gathers no weights; bad requests get one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.core.batch import is_leaf
from meshpar.core.errors import ConfigError
from meshpar.core.precision import POLICIES, use_policy
from meshpar.serve.engine import Engine, sampling_rows
from meshpar.serve.placement import buckets
from meshpar.serve.requests import Request
from meshpar.serve.sampling import Sampling, sample
from tests.conftest import devices, make_cfg, usual_codegen

MODELS = {
    "mha": ["model.heads=8", "model.kv_heads=8"],
    "gqa": ["model.heads=8", "model.kv_heads=2", "serve.slots=8"],  # kv heads < tensor=4: the cache splits by slots
    "moe": ["model.name=moe", "moe.capacity_factor=null", "moe.num_experts=4"],
    "gpt2": ["model.name=examples.gpt2:gpt2", "batch.length=64"],  # a user's model (Flax built-ins, dropout)
}
MESHES = {
    "1": dict(data=1),
    "tensor4": dict(tensor=4),
    "data2_tensor4": dict(data=2, tensor=4),
    "context2_tensor4": dict(context=2, tensor=4),  # serving puts requests, not sequences, on context
    "pipeline2_tensor4": dict(pipeline=2, tensor=4),
}  # a layer per stage, 4 microbatches of one slot
SERVE = ["serve.slots=4", "serve.cache_length=64", "serve.min_bucket=16"]
PROMPTS = [[5, 9, 2], list(range(10, 19)), list(range(30, 44))]  # one bucket (16)
STEPS = 5

_engines: dict = {}
_forward: dict = {}


def engine(model: str, mesh: str) -> Engine:
    """One engine per (model, mesh) for the module; every mesh serves the 1-device engine's weights."""
    key = (model, mesh)
    if key not in _engines:
        n = int(np.prod(list(MESHES[mesh].values())))
        weights = None if mesh == "1" else jax.tree.map(np.asarray, engine(model, "1").weights)
        _engines[key] = Engine(make_cfg(*SERVE, *MODELS[model], mesh=MESHES[mesh]), devices=devices(n), weights=weights)
    return _engines[key]


def drive(e: Engine, prompts, steps: int):
    """Prefill + insert each prompt into its own slot, then `steps` generate calls (greedy).
    Returns per prompt (tokens: prompt + generated, logits of every generated position [n, V])."""
    state = e.new_state()
    toks, logits = [list(p) for p in prompts], [[] for _ in prompts]
    for i, p in enumerate(prompts):
        entry, tok, last = e.prefill(p)
        state = e.insert(entry, state, i)
        toks[i].append(int(tok))
        logits[i].append(np.asarray(last))
    for _ in range((steps + 1) * e.stages - 1):  # a pipeline in flight: a slot's token every P calls, -1 between
        state, nxt, lg = e.generate(state)
        nxt, lg = np.asarray(nxt), np.asarray(lg)
        for i in range(len(prompts)):
            if nxt[i] >= 0 and len(toks[i]) < len(prompts[i]) + 1 + steps:
                toks[i].append(int(nxt[i]))
                logits[i].append(lg[i])
    assert all(len(t) == len(p) + 1 + steps for p, t in zip(prompts, toks))
    return toks, [np.stack(lg) for lg in logits]


def full_forward(e: Engine, rows):
    """Logits [T, V] per row of one plain forward pass (jitted, one device) with the engine's weights.
    Rows are right-padded to one length: causal attention keeps padding out of the real positions."""
    n = max(map(len, rows))
    tokens = jnp.asarray([list(r) + [0] * (n - len(r)) for r in rows])
    spec = e.spec
    if id(spec.graphdef) not in _forward:

        def forward(w, t):
            model = spec.merge(w["params"], w["vars"])
            model.eval()  # dropout off, as when serving
            out = model(t)
            return out[0] if isinstance(out, tuple) else out  # the reference models add aux

        _forward[id(spec.graphdef)] = jax.jit(forward)
    with use_policy(POLICIES["fp32"]):
        logits = np.asarray(_forward[id(spec.graphdef)](jax.tree.map(np.asarray, e.weights), tokens))
    return [logits[i, : len(r)] for i, r in enumerate(rows)]


@pytest.mark.parametrize(
    "model,mesh",
    [
        (m, g)
        for m in MODELS
        for g in MESHES
        if (m != "gpt2" or g != "tensor4")
        and (g != "context2_tensor4" or m == "gqa")
        and (g != "pipeline2_tensor4" or m in ("mha", "gqa"))
    ],
)
def test_incremental_decoding_equals_full_forward(model, mesh):
    e = engine(model, mesh)
    toks, logits = drive(e, PROMPTS, STEPS)
    refs = full_forward(e, [t[:-1] for t in toks])
    for p, _t, lg, ref in zip(PROMPTS, toks, logits, refs):
        ref = ref[len(p) - 1 :]  # the positions that predicted t[len(p):]
        assert lg.shape == ref.shape
        for pos, (a, b) in enumerate(zip(lg, ref)):
            err = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert err <= 1e-5, (model, mesh, len(p), pos, err)


@pytest.mark.parametrize("loop", ["serve.decode_loop=unrolled", "model.scan_layers=false"])
def test_unrolled_layers_decode_as_the_scan_does(loop):
    """The decode step's layers unrolled (`serve.decode_loop`'s choice on a GPU, where the scan copies
    each layer's weights every step; or the whole model unrolled) serve the same stacked weights and
    give the same tokens and logits as the scan, here under tensor parallelism."""
    scanned = engine("mha", "tensor4")
    ref_toks, ref_logits = drive(scanned, PROMPTS, STEPS)
    weights = jax.tree.map(np.asarray, engine("mha", "1").weights)
    cfg = make_cfg(*SERVE, *MODELS["mha"], loop, mesh=MESHES["tensor4"])
    eng = Engine(cfg, devices=devices(4), weights=weights)
    toks, logits = drive(eng, PROMPTS, STEPS)
    assert toks == ref_toks
    for lg, ref in zip(logits, ref_logits):
        assert np.linalg.norm(lg - ref) <= 1e-5 * np.linalg.norm(ref)
    # the step holds one copy of the layer program per layer: no scan over them (the reference's has one)
    assert " scan[" in str(scanned.programs.generate.trace(scanned.weights, scanned.new_state()).jaxpr)
    assert " scan[" not in str(eng.programs.generate.trace(eng.weights, eng.new_state()).jaxpr)


@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_continuations_identical_on_1_and_8_devices(model):
    reqs = [Request(p, 8) for p in PROMPTS]
    one = [c.tokens for c in engine(model, "1").run(reqs)]
    eight = [c.tokens for c in engine(model, "data2_tensor4").run(reqs)]
    assert one == eight


def test_gqa_cache_splits_by_slots_when_kv_heads_do_not_divide_tensor():
    e = engine("gqa", "data2_tensor4")
    assert any("kv_heads=2 cannot split over tensor=4" in n for n in e.notes)
    spec = e.state_shardings["cache"]["k"].spec  # [L, B, K, S, D]
    assert spec[1] == ("data", "fsdp", "expert", "tensor") or set(spec[1]) >= {"data", "tensor"}
    assert e.bytes_per_device()["cache"] * 8 == sum(
        a.size * a.dtype.itemsize for a in jax.tree.leaves(e.state_shapes()["cache"])
    )
    mha = engine("mha", "data2_tensor4").state_shardings["cache"]["k"].spec
    assert mha[1] == "data" and mha[2] == "tensor"  # slots over data, kv heads over tensor


def test_compiles_prefill_once_per_bucket_and_decode_once():
    e = engine("mha", "data2_tensor4")
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(20):
        n = int(rng.integers(1, 31))  # buckets 16 and 32
        samp = Sampling(
            temperature=float(rng.uniform(0, 1.5)),
            top_k=int(rng.integers(1, 128)),
            top_p=float(rng.uniform(0.05, 1.0)),
            seed=i,
        )
        reqs.append(Request(rng.integers(0, 128, n).tolist(), int(rng.integers(1, 6)), samp))
    reqs[0] = Request([1] * 20, 3)
    out = e.run(reqs)
    assert [len(c.tokens) for c in out] == [r.max_new_tokens for r in reqs]
    # one prefill per (rows: 1, 2 or 4 prompts batched, bucket: 16 or 32), whatever the sampling settings
    assert e.traces["prefill"] <= 6 and e.traces["generate"] == 1, dict(e.traces)


def test_prefix_cache_computes_only_the_tail_and_changes_no_output():
    """A prompt sharing 32 tokens (2 blocks of 16) with one served before it is extended from them:
    the same tokens and logits as prefilled whole; a prompt sharing less than a block is not."""
    from meshpar.serve.prefix import PrefixCache
    from meshpar.serve.scheduler import Scheduler

    e = engine("gqa", "data2_tensor4")
    system = list(range(3, 35))  # 32 shared tokens
    a, b, c = system + [40, 41, 42], system + [50, 51, 52, 53, 54], system[:10] + [60, 61]

    def serve(prefix, prompts):
        sched = Scheduler(e, prefill_batch=1, prefix=prefix)
        tickets = [sched.submit(Request(prompts[0], 6))]
        sched.step()  # the first is prefilled (and kept)
        tickets += [sched.submit(Request(p, 6)) for p in prompts[1:]]
        while sched.step():
            pass
        return [t.completion.tokens for t in tickets], sched

    whole, plain = serve(None, [a, b, c])
    before = e.traces["extend"]
    cached, sched = serve(PrefixCache(4, 16), [a, b, c])
    assert cached == whole
    assert (sched.prefix.hits, sched.prefix.reused, sched.prefix.misses) == (1, 32, 2)
    assert (plain.prefill_calls, sched.prefill_calls) == (3, 2)  # b was extended, not prefilled
    assert e.traces["extend"] - before <= 1  # one tail bucket (16)
    # logits of the first new token: extended from the cached prefix vs prefilled whole
    entry, _, _ = e.prefill(a)
    _, tok, last = e.extend(e.full(entry), b, 32)
    _, tok2, last2 = e.prefill(b)
    assert int(tok) == int(tok2) and np.allclose(np.asarray(last), np.asarray(last2), atol=1e-4)


def test_chunked_prefill_keeps_decoding_while_a_long_prompt_fills_and_changes_no_output():
    """serve.prefill_chunk=8: two 40-token prompts arriving while two requests decode share the 8
    tokens of each tick (4 each: one batched prefill, then batched extends of their own caches), and
    every one of those ticks still decodes a token for each stream; every output equals prefilling
    whole."""
    from meshpar.serve.scheduler import Scheduler

    e = engine("mha", "data2_tensor4")
    short, longs = [[5, 9, 2], [7, 7, 1]], [list(range(3, 43)), list(range(50, 90))]

    def serve(chunk):
        sched = Scheduler(e, prefill_batch=2, prefill_chunk=chunk)
        tickets = [sched.submit(Request(p, 12)) for p in short]
        sched.step()  # the streams are decoding
        tickets += [sched.submit(Request(p, 4)) for p in longs]
        ticks = [(0, [len(t.completion.tokens) for t in tickets[:2]])]
        while sched.step():
            ticks.append((len(sched.partial), [len(t.completion.tokens) for t in tickets[:2]]))
        return [t.completion.tokens for t in tickets], ticks, sched.prefill_calls

    whole, _, _ = serve(None)
    chunked, ticks, prefills = serve(8)
    assert chunked == whole
    filling = [i for i, (p, _) in enumerate(ticks) if p]
    assert len(filling) == 9 and prefills == 2  # 40 tokens: 4 a tick; the 10th places them
    for i in filling + [filling[-1] + 1]:  # each of those ticks decoded both streams
        assert [b - a for a, b in zip(ticks[i - 1][1], ticks[i][1])] == [1, 1], ticks


def test_continuous_batching_matches_each_request_alone():
    e = engine("mha", "data2_tensor4")  # 4 slots, 7 requests: later ones enter
    reqs = [Request(list(range(1 + i, 4 + 2 * i)), 2 + (i * 3) % 7) for i in range(7)]
    together = e.run(reqs)
    assert {c.finish for c in together} == {"max_tokens"}
    ttft = [c.ttft_s for c in together]
    assert max(ttft[4:]) > max(ttft[:4])  # the last three waited for free slots
    for r, c in zip(reqs, together):
        assert e.run([r])[0].tokens == c.tokens


def test_decode_step_gathers_no_weights_and_holds_what_the_rules_say():
    from meshpar.plan.inspect import collectives, memory

    e = engine("mha", "data2_tensor4")
    compiled = e.compiled_generate()
    ops = collectives(compiled.as_text(), dict(zip(e.mesh.axis_names, e.mesh.devices.shape)))
    weights = jax.tree.leaves(e.weights["params"])
    total = sum(w.nbytes for w in weights)
    names = jax.tree.leaves(e.spec.logical, is_leaf=lambda x: isinstance(x, tuple))
    slices = [w.shape[1:] if n[0] == "layers" else w.shape for w, n in zip(weights, names)]  # one layer's
    smallest = min(np.prod(s) * 4 for s in slices if len(s) >= 2)  # the smallest weight matrix (fp32)
    gathers = [op for op in ops if op["kind"] in ("all-gather", "collective-permute")]
    assert all(op["bytes"] < smallest for op in gathers), (smallest, gathers)
    assert sum(op["bytes"] * op["times"] for op in gathers) < 0.1 * total
    per_device = e.bytes_per_device()
    assert per_device["cache"] * 8 == 2 * 2 * 4 * 64 * 8 * 8 * 4  # K and V [L=2, B=4, K=8, S=64, D=8] fp32 / 8
    assert abs(per_device["weights"] - total / 4) < 0.05 * total / 4  # TP over 4 (norms replicated)
    arg = memory(compiled)["argument"]
    assert abs(arg - (per_device["weights"] + per_device["cache"] + per_device["slot_state"])) < 0.02 * arg
    # the contrast: serving an FSDP layout gathers weights every token (and says so)
    fsdp = Engine(make_cfg(*MODELS["mha"], *SERVE, "serve.strategy=fsdp", mesh=MESHES["data2_tensor4"]))
    assert any("all-gathers them" in n for n in fsdp.notes)
    ops = collectives(fsdp.compiled_generate().as_text())
    moved = sum(op["bytes"] * op["times"] for op in ops if op["kind"] in ("all-gather", "collective-permute"))
    assert moved > 0.5 * total


def test_a_failing_tick_fails_its_requests_and_serving_goes_on():
    """A step that raises (a shape that cannot compile, a device out of memory) finishes the requests
    it held with the error; the next requests are served as before."""
    from meshpar.serve.scheduler import Scheduler

    e = engine("mha", "1")
    sched = Scheduler(e, prefill_batch=2)
    real = e.generate
    e.generate = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("RESOURCE_EXHAUSTED: out of memory"))
    try:
        bad = sched.submit(Request([5, 9, 2], 4))
        sched.safe_step()
    finally:
        e.generate = real
    assert bad.completion.finish == "error" and "RESOURCE_EXHAUSTED" in bad.completion.error and sched.errors == 1
    real = e.prefill_batch  # a failing prefill: its requests were admitted, not placed
    e.prefill_batch = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("UNIMPLEMENTED: no such kernel"))
    try:
        lost = [sched.submit(Request([5, 9, 2], 4)) for _ in range(2)]
        sched.safe_step()
    finally:
        e.prefill_batch = real
    assert [t.completion.finish for t in lost] == ["error"] * 2 and sched.errors == 2
    assert sorted(sched.free) == list(range(e.slots)) and not sched.active
    good = sched.submit(Request([5, 9, 2], 4))
    while sched.safe_step():
        pass
    assert good.completion.finish == "max_tokens" and good.completion.tokens == e.run([Request([5, 9, 2], 4)])[0].tokens


def test_a_lost_process_answers_every_request_and_a_failed_step_is_told_from_it(capsys):
    """Several processes (a stand-in for `Replicas`): a share that fails (a process gone) finishes the
    requests it was handing over (they were swapped out of the inbox: once never answered), the
    queued and the running ones, all `lost`, and refuses new ones; no traceback. A step that fails
    is probed with one intake more: shared, it was the step's own error (its requests get it, those
    the probe took stay queued); not shared, the server is lost."""
    from meshpar.serve.failures import PeerLost, Unavailable
    from meshpar.serve.scheduler import Scheduler

    class Replicas:  # process 0's side: shares pass through until `gone`
        gone = False

        def share(self, new, cancels, stop):
            if self.gone:
                raise PeerLost("Gloo all-reduce failed: Connection reset by peer")
            return new, cancels, stop

    e = engine("mha", "1")
    replicas = Replicas()
    sched = Scheduler(e, prefill_batch=2, replicas=replicas)
    running = sched.submit(Request([5, 9, 2], 40))
    sched.safe_step()
    assert running.id in {t.id for t in sched.active.values()}
    waiting = [sched.submit(Request([5, 9, 2], 4)) for _ in range(e.slots)]
    replicas.gone = True
    assert sched.safe_step() is False
    assert [t.completion.finish for t in (running, *waiting)] == ["lost"] * (1 + e.slots)
    assert "send the request again" in waiting[0].completion.error and "Gloo" in waiting[0].completion.error
    with pytest.raises(Unavailable):
        sched.submit(Request([5, 9, 2], 4))
    assert "Traceback" not in capsys.readouterr().err

    replicas.gone = False
    sched = Scheduler(e, prefill_batch=2, replicas=replicas)
    real, newcomer = e.generate, []

    def failing(*a, **k):  # the step fails; meanwhile a request comes in (the probe takes it)
        newcomer.append(sched.submit(Request([7, 7], 4)))
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    def dying(*a, **k):  # the step fails as a process dies: the probe cannot be shared
        replicas.gone = True
        raise RuntimeError("Gloo all-reduce failed")

    try:
        e.generate = failing
        bad = sched.submit(Request([5, 9, 2], 4))
        sched.safe_step()
        assert bad.completion.finish == "error" and "RESOURCE_EXHAUSTED" in bad.completion.error
        assert newcomer[0].completion.finish == "" and newcomer[0] in sched.waiting and not sched.lost
        capsys.readouterr()
        e.generate = dying
        sched.safe_step()  # admits the newcomer and fails
    finally:
        e.generate = real
    assert sched.lost and newcomer[0].completion.finish == "lost" and "Traceback" not in capsys.readouterr().err


def test_text_streams_whole_characters_and_stops_across_tokens():
    """The API's detokenizer: a character split over byte tokens (UTF-8 as one replacement character,
    a byte-fallback tokenizer as one per pending byte) is held back until whole, never sent broken;
    a stop string split over tokens cuts the text; the streamed pieces add up to the whole text; the
    decoding work grows linearly with the completion."""
    from meshpar.io.tokenizer import ByteTokenizer
    from meshpar.serve.detokenizer import Detokenizer

    class Fallback(ByteTokenizer):
        """Decodes as a byte-fallback (SentencePiece) tokenizer: a U+FFFD per byte of an unfinished character."""

        def decode(self, ids):
            data = bytes(ids)
            for cut in range(len(data), max(-1, len(data) - 4), -1):
                try:
                    return data[:cut].decode("utf-8") + "\ufffd" * (len(data) - cut)
                except UnicodeDecodeError:
                    continue
            return data.decode("utf-8", errors="replace")

    class Run(ByteTokenizer):
        """Decodes as Hugging Face's ByteFallback decoder a run of byte tokens: invalid UTF-8 -> a U+FFFD per byte."""

        def decode(self, ids):
            try:
                return bytes(ids).decode("utf-8")
            except UnicodeDecodeError:
                return "\ufffd" * len(ids)

    text = "a😀b ü c テキスト"
    for tok in (ByteTokenizer(256), Fallback(256), Run(256)):
        d = Detokenizer(tok, list(b"say: "), [], [])
        pieces = [d.add(t)[0] for t in text.encode()] + [d.flush()]
        assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces), pieces
        d = Detokenizer(tok, list(b"say: "), [], ["b ü"])
        out = [d.add(t) for t in text.encode()]
        stopped = [i for i, (_, s) in enumerate(out) if s]
        assert "".join(p for p, _ in out[: stopped[0] + 1]) == "a😀" and d.flush() == ""
        d = Detokenizer(tok, list(b"say: "), [], ["\u00fcber"])  # a stop string longer than the text so far
        assert [d.add(t)[0] for t in "über".encode()] + [d.flush()] == [""] * 6 and d.stopped

    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids):
            Counting.decoded += len(ids)
            return super().decode(ids)

    long = ("word ü😀 " * 400).encode()
    d = Detokenizer(Counting(256), list(b"say: "), [], ["never"])
    pieces = [d.add(t)[0] for t in long] + [d.flush()]
    assert "".join(pieces) == long.decode() and Counting.decoded < 30 * len(long)  # linear, not quadratic


def test_pipelined_decoding_cuts_the_layers_over_stages_and_changes_no_token():
    """mesh.pipeline=2: each stage holds half the layers and half the cache layers, a decode step
    passes activations between stages (collective-permute) and never gathers a weight; the MoE
    decoder (4 layers, dropless at decode) serves a stream of greedy and sampled requests, more than
    the slots (so slots are refilled while their last token is still in the pipe), as on one device:
    with the pipe kept full across ticks, one tick per call, on pipeline x data x tensor (where
    neither a decode tick nor a prefill in 2 microbatches gathers the KV cache over data; each stage's
    layers unrolled, as on a GPU), and filled and drained per call (4 microbatches); the other
    tests' pipelined engine runs P ticks per call; a model without the LM cut (the GPT-2 example) is
    refused in one line."""
    from meshpar.plan.inspect import collectives

    e = engine("mha", "pipeline2_tensor4")
    flat = engine("mha", "tensor4")
    assert e.bytes_per_device()["cache"] * 2 == flat.bytes_per_device()["cache"]
    assert (
        abs(e.bytes_per_device()["weights"] * 2 - flat.bytes_per_device()["weights"])
        < 0.3 * flat.bytes_per_device()["weights"]
    )
    ops = collectives(e.compiled_generate().as_text())
    assert any(op["kind"] == "collective-permute" for op in ops)
    assert not any(op["kind"] == "all-gather" and op["bytes"] >= 8 * 8 * 64 * 4 for op in ops), ops
    moe = ["model.name=moe", "moe.capacity_factor=1.0", "moe.num_experts=4", "model.layers=4", *SERVE]
    one = Engine(make_cfg(*moe, mesh=MESHES["1"]), devices=devices(1))
    reqs = [
        Request(p[i % 3 :], 2 + i % 4, Sampling(temperature=0.8 * (i % 2), seed=i)) for i, p in enumerate(PROMPTS * 3)
    ]
    want = [c.tokens for c in one.run(reqs)]
    w = jax.tree.map(np.asarray, one.weights)
    for mb, mesh, kw, loop in (
        (2, dict(pipeline=2, data=2, tensor=2), {"ticks": 1}, "unrolled"),  # each stage's layers unrolled (a GPU's)
        (4, MESHES["pipeline2_tensor4"], {"flush": True}, "scan"),
    ):
        cfg = make_cfg(*moe, f"pipeline.microbatches={mb}", f"serve.decode_loop={loop}", mesh=mesh)
        piped = Engine(cfg, devices=devices(8), weights=w, **kw)
        assert piped.in_flight != bool(kw.get("flush"))
        assert [c.tokens for c in piped.run(reqs)] == want, kw
        if "data" in mesh:  # slots split over data: a group (a microbatch) of them is strided, no cache gathered
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), piped.weights)
            prefill = piped.programs.prefill.lower(
                shapes,
                np.zeros((4, 16), np.int32),
                np.full((4,), 3, np.int32),
                sampling_rows([Sampling()] * 4, 4, piped.vocab),
            ).compile()
            for compiled in (piped.compiled_generate(), prefill):
                gathers = [op["bytes"] for op in collectives(compiled.as_text()) if op["kind"] == "all-gather"]
                assert max(gathers, default=0) < piped.bytes_per_device()["cache"] / 4, gathers
    with pytest.raises(ConfigError, match="cannot be pipelined: the built-in LM loss needs .embed"):
        Engine(make_cfg(*MODELS["gpt2"], *SERVE, mesh=MESHES["pipeline2_tensor4"]), devices=devices(8))


def test_bad_requests_get_one_line():
    e = engine("mha", "1")
    cases = [
        (Request(list(range(65))), "longer than the KV cache"),
        (Request([]), "empty prompt"),
        (Request([1], sampling=Sampling(top_p=0.0)), "top-p must be in (0, 1], got 0.0"),
        (Request([1], sampling=Sampling(top_p=1.5)), "got 1.5"),
        (Request([1], sampling=Sampling(top_k=0)), "top-k must be >= 1, got 0"),
        (Request([1], sampling=Sampling(top_k=129)), "top-k must be between 1 and the vocabulary size 128, got 129"),
        (Request([1], sampling=Sampling(temperature=-1.0)), "temperature must be >= 0"),
        (Request([128]), "token id 128 is outside the vocabulary"),
    ]
    for req, msg in cases:
        with pytest.raises(ConfigError) as info:
            e.run([req])
        assert msg in str(info.value) and "\n" not in str(info.value)


def test_a_model_without_the_protocol_is_refused_in_one_line():
    from flax import nnx

    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones((4, 4)))

        def __call__(self, x):
            return x @ self.w

    with pytest.raises(ConfigError, match="model Plain cannot be served: it needs decode"):
        Engine(make_cfg(*SERVE, mesh=dict(data=1)), model=lambda rngs: Plain(rngs), devices=devices(1))


def test_buckets_are_powers_of_two_up_to_the_cache():
    assert buckets(64, 16) == [16, 32, 64]
    assert buckets(100, 16) == [16, 32, 64, 100]
    assert buckets(8, 16) == [8]


def test_cache_length_fits_the_slots_and_whole_prefix_entries_in_half_the_free_memory(monkeypatch):
    """Without serve.cache_length, S is capped so that the slots' caches (split over data) and the
    prefix cache's entries (one row each: whole on every data shard) take at most half of a
    device's memory beside the weights, and not much less."""
    from meshpar.serve import placement

    monkeypatch.setattr(placement, "device_bytes", lambda: 60_000_000)
    e = Engine(
        make_cfg("serve.slots=8", "serve.prefix_cache=64", mesh=dict(data=8)), devices=devices(8), info=lambda m: None
    )
    row = sum(
        np.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(e.entry_spec(1, e.length), is_leaf=is_leaf)
    )
    used = e.bytes_per_device()["cache"] + 64 * row
    half = (60_000_000 - e.bytes_per_device()["weights"]) / 2
    assert e.length < 4096 and 0.99 * half <= used <= half, (e.length, used, half)


# -- sampling --------------------------------------------------------------------------------------
_sample = jax.jit(sample)


def _rows(logits, seed=0, n=2048, **kw):
    """n draws (one compiled call whatever the settings: they are traced) from one row of logits."""
    args = {"temperature": 1.0, "top_k": logits.shape[1], "top_p": 1.0, **kw}
    keys = jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(jnp.arange(n) + seed * n)
    rep = jnp.repeat(jnp.asarray(logits, jnp.float32), n, axis=0)
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return np.asarray(
        _sample(
            rep,
            full(args["temperature"], jnp.float32),
            full(args["top_k"], jnp.int32),
            full(args["top_p"], jnp.float32),
            keys,
        )
    )


def test_sampling_greedy_top_k_top_p_and_seeds():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    assert set(_rows(logits, temperature=0.0)) == {0}  # greedy
    assert set(_rows(logits, top_k=1)) == {0}  # top-1 is greedy at any temperature
    assert set(_rows(logits, top_k=2)) == {0, 1}  # only the 2 most likely
    assert set(_rows(logits, top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.8: nucleus {0, 1}
    assert set(_rows(logits, top_p=0.4)) == {0}
    assert set(_rows(logits, top_p=1e-46)) == set(_rows(logits, top_p=1e-30)) == {0}  # 0 in float32: the most likely
    draws = _rows(logits)  # plain sampling follows the softmax
    assert np.allclose(np.bincount(draws, minlength=4) / len(draws), [0.5, 0.3, 0.15, 0.05], atol=0.03)
    hot = np.bincount(_rows(logits, temperature=0.25), minlength=4) / len(draws)  # T < 1 sharpens
    assert hot[0] > 0.85
    assert (_rows(logits) == _rows(logits)).all() and (_rows(logits) != _rows(logits, seed=1)).any()


# -- end to end: meshpar train -> meshpar generate -------------------------------------------------
@pytest.mark.slow
def test_trained_checkpoint_continues_the_alphabet_and_other_shapes_are_refused(tmp_path, capsys):
    import json

    from meshpar.cli import main

    (tmp_path / "abc.txt").write_text("abcdefghijklmnopqrstuvwxyz" * 200)
    common = [
        "data.kind=text",
        f"data.path={tmp_path / 'abc.txt'}",
        "model.vocab=256",
        "batch.length=32",
        f"checkpoint.dir={tmp_path / 'ck'}",
    ]
    # trained with fsdp_tp on data=2 x fsdp=2 x tensor=2 (the default mesh), bf16
    with usual_codegen():  # 30 steps: XLA:CPU's usual code runs them faster than the suite's
        assert main(["train", "steps=30", "train.log_every=30", *common]) == 0
    capsys.readouterr()
    # served on data=2 x tensor=4 with serve_tp: weights read straight into the serving layout
    code = main(
        [
            "generate",
            "--prompt",
            "abcd",
            "--prompt",
            "mnop",
            *common,
            "mesh.data=2",
            "mesh.fsdp=1",
            "mesh.tensor=4",
            "--json",
            "--max-new-tokens",
            "8",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    rec = json.loads(out.out)
    assert rec["text"] == ["efghijkl", "qrstuvwx"]
    assert rec["ttft_s"] > 0 and rec["decode_tokens_per_s"] > 0 and rec["finish"] == ["max_tokens"] * 2
    assert "checkpoint step 30" in out.err
    # streaming without --json: prompt then its continuation on stdout
    assert main(["generate", "--prompt", "uvw", *common, "--max-new-tokens", "5", "--devices", "8"]) == 0
    assert capsys.readouterr().out.strip() == "uvwxyzab"
    # the model settings come from the checkpoint's saved config: checkpoint.dir is enough
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    assert (
        main(
            ["generate", ck, "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "--prompt", "abcd", "--max-new-tokens", "8"]
        )
        == 0
    )  # the README's command
    out = capsys.readouterr()
    assert out.out.strip() == "abcdefghijkl" and "with the settings it was trained with" in out.err
    assert main(["export", "--out", str(tmp_path / "hf"), ck]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 256
    # a prompt that fills the cache (32 positions): the output says it stopped
    assert (
        main(
            [
                "generate",
                "--prompt",
                "abcdefghijklmnopqrstuvwxyzabc",
                ck,
                "--max-new-tokens",
                "8",
                "serve.cache_length=32",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert out.out.strip() == "abcdefghijklmnopqrstuvwxyzabcdefg"  # 29 + 4 tokens, 32 positions
    assert "note: prompt 1 stopped after 4 tokens: the KV cache holds 32 positions" in out.err
    # a mistyped or empty checkpoint.dir is an error, not a random model
    (tmp_path / "empty").mkdir()
    for cmd in ("generate", "export"):
        for d, msg in ((tmp_path / "ckk", "does not exist"), (tmp_path / "empty", "holds no checkpoint")):
            args = ["--prompt", "ab"] if cmd == "generate" else ["--out", str(tmp_path / "x")]
            assert main([cmd, *args, f"checkpoint.dir={d}"]) == 2
            err = capsys.readouterr().err
            assert msg in err and f"checkpoint.dir '{d}'" in err and err.count("\n") == 1, err
    # a checkpoint of another model: one line naming the leaf and the shapes
    assert main(["generate", "--prompt", "abc", *common, "model.embed=32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds another model" in err and "['params']" in err and "[256, 64]" in err
    for bad, msg in [
        (["--top-p", "0"], "top-p must be in (0, 1], got 0.0"),
        (["--top-k", "0"], "got 0"),
        (["--prompt", "x" * 40, "serve.cache_length=32"], "longer than the KV cache"),
        (["--prompt", ""], "empty prompt"),
        (["--prompt-ids", "1,x"], "--prompt-ids '1,x'"),
    ]:
        args = bad if "--prompt" in bad[0] else ["--prompt", "ab", *bad]
        assert main(["generate", *args, *common]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err


def test_prefill_takes_padded_tokens_with_their_true_length_and_other_weights():
    e = engine("mha", "1")
    _, tok, logits = e.prefill([5, 9, 2])
    _, tok2, logits2 = e.prefill([5, 9, 2] + [7] * 13, true_length=3)  # padded to the 16 bucket
    assert int(tok) == int(tok2) and np.array_equal(np.asarray(logits), np.asarray(logits2))
    zeros = jax.tree.map(jnp.zeros_like, e.weights)  # params= serves other weights
    _, _, flat = e.prefill([5, 9, 2], params=zeros)
    assert np.allclose(np.asarray(flat), 0.0)
