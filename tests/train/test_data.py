"""Data sources: the Markov language's entropy rate is its true per-token loss floor; batches are
a pure function of (seed, step, row), so any process split and any resume sees the same tokens."""

import numpy as np
import pytest

from meshpar.core.config import top_k
from meshpar.core.errors import ConfigError
from meshpar.train.batches import Batches
from meshpar.train.data import MarkovLanguage, TextFiles, TokenFile
from tests.conftest import devices


def test_entropy_rate_matches_the_empirical_negative_log_likelihood():
    lang = MarkovLanguage(vocab=64, branching=4, seed=3)
    rows = lang.sample(seed=0, step=0, rows=range(64), length=400)
    prob = {(int(s), int(t)): p for s in range(64) for t, p in zip(lang.succ[s], lang.probs[s])}
    nll = -np.mean([np.log(prob[(int(a), int(b))]) for r in rows for a, b in zip(r[:-1], r[1:])])
    assert nll == pytest.approx(lang.entropy_rate, rel=0.05)
    assert 0 < lang.entropy_rate < np.log(4)


def test_rows_do_not_depend_on_which_rows_a_process_asks_for():
    lang = MarkovLanguage(vocab=32, branching=3, seed=0)
    full = lang.rows(seed=5, step=7, rows=range(8), length=20)
    np.testing.assert_array_equal(lang.rows(seed=5, step=7, rows=range(4, 8), length=20), full[4:])
    assert not np.array_equal(lang.rows(seed=5, step=8, rows=range(8), length=20), full)


def test_batches_are_sharded_and_resume_exactly():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(devices(8)), ("data",))
    lang = MarkovLanguage(vocab=32, branching=3, seed=0)
    it = Batches(lang, NamedSharding(mesh, P("data")), global_size=16, length=8, seed=1)
    first, second = next(it), next(it)
    assert first.shape == (16, 9) and first.sharding.spec == P("data")
    it2 = Batches(lang, NamedSharding(mesh, P("data")), global_size=16, length=8, seed=1)
    it2.restore({"step": 1})
    np.testing.assert_array_equal(np.asarray(next(it2)), np.asarray(second))


def test_token_file_and_text_sources(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 50
    tokens.tofile(tmp_path / "t.bin")
    src = TokenFile(str(tmp_path / "t.bin"), "uint16", vocab=64)
    rows = src.rows(seed=0, step=0, rows=range(3), length=17)  # an LM source: length + 1 tokens a row
    assert rows.shape == (3, 18) and all(np.all(np.diff(r) % 50 == 1) for r in rows)
    with pytest.raises(ConfigError, match="holds token id 32 >= model.vocab=32 at position 32"):
        TokenFile(str(tmp_path / "t.bin"), "uint16", vocab=32)
    (tmp_path / "a.txt").write_text("hello meshpar " * 20)
    text = TextFiles(str(tmp_path / "a.txt"), vocab=256).rows(seed=0, step=0, rows=range(2), length=8)
    assert bytes(text[0].astype(np.uint8)).decode() in ("hello meshpar " * 3)
    with pytest.raises(ConfigError, match="needs model.vocab >= 256"):
        TextFiles(str(tmp_path / "a.txt"), vocab=128)


def test_token_file_is_checked_to_its_last_token(tmp_path, monkeypatch):
    """A bad id far past the first 2^20 tokens (and past the first chunk) still stops the run at start."""
    tokens = np.zeros((1 << 20) + 1000, np.uint16)
    tokens[-3] = 70
    tokens.tofile(tmp_path / "t.bin")
    monkeypatch.setattr(TokenFile, "CHUNK", 1 << 16)
    with pytest.raises(ConfigError, match=f"holds token id 70 >= model.vocab=64 at position {len(tokens) - 3}"):
        TokenFile(str(tmp_path / "t.bin"), "uint16", vocab=64)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ConfigError, match="not a whole number of uint16 tokens"):
        TokenFile(str(tmp_path / "odd.bin"), "uint16", vocab=64)


def test_active_params_count_matmul_weights_and_routed_experts_only():
    from meshpar.core.registry import default_model
    from meshpar.core.sharding import model_spec
    from meshpar.train.flops import active_params
    from tests.conftest import make_cfg

    dense = make_cfg()
    spec = model_spec(default_model(dense))
    emb = spec.shapes["embedding"].shape
    assert active_params(spec, top_k(dense.moe)) == spec.num_params - emb[0] * emb[1]
    moe = make_cfg("model.name=moe", "moe.num_experts=4", "moe.routing=top1")
    mspec = model_spec(default_model(moe))
    experts = sum(
        np.prod(s.shape) for s, n in zip(jax_leaves(mspec.shapes), jax_leaves(mspec.logical)) if "expert" in n
    )
    assert active_params(mspec, top_k(moe.moe)) == pytest.approx(mspec.num_params - emb[0] * emb[1] - experts * 3 / 4)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))
