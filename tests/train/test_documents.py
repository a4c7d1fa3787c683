"""Packed documents (meshpar/train/data.py, meshpar/train/loss.py): token and text sources mark
document boundaries with segment ids and per-document positions; a packed row A|B gives each token
the loss it has in A or B alone (attention never crosses the boundary, RoPE restarts), with the xla
and flash kernels; the loss drops the target that crosses a boundary; a model that cannot take the
packing's arguments fails in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshpar.core.config import load_config
from meshpar.core.errors import ConfigError
from meshpar.core.precision import get_policy, use_policy
from meshpar.core.registry import default_model
from meshpar.train.data import TextFiles, TokenFile, documents_of, eos_starts, make_source, packs_documents
from meshpar.train.loss import lm_loss


def test_segment_ids_and_positions_of_windows():
    starts = np.array([0, 5, 12])
    seg, pos = documents_of(starts, np.array([3, 0]), 10)
    assert seg[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 2] and pos[0].tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 6, 0]
    assert seg[1].tolist() == [0] * 5 + [1] * 5 and pos[1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert eos_starts(np.array([4, 9, 2, 9, 9, 1]), 9).tolist() == [0, 2, 4, 5]


def test_sources_yield_documents(tmp_path):
    """A token file with data.eos_id, a folder of text files (one document each); the batch spec
    declares the three leaves; without documents the rows stay one token array."""
    ids = np.array([5, 6, 7, 1, 8, 9, 1, 10, 11, 12, 13, 1] * 8, np.uint16)
    ids.tofile(tmp_path / "t.bin")
    src = TokenFile(str(tmp_path / "t.bin"), "uint16", vocab=64, eos_id=1)
    rows = src.rows(seed=0, step=0, rows=range(4), length=15)
    assert set(rows) == {"tokens", "segment_ids", "positions"} and rows["tokens"].shape == (4, 16)
    for t, s, p in zip(rows["tokens"], rows["segment_ids"], rows["positions"]):
        after_eos = np.flatnonzero(t[:-1] == 1) + 1
        assert all(s[i] == s[i - 1] + 1 and p[i] == 0 for i in after_eos)
    assert set(src.batch_spec(4, 15)) == {"tokens", "segment_ids", "positions"}
    assert isinstance(TokenFile(str(tmp_path / "t.bin"), "uint16", vocab=64).rows(0, 0, range(2), 15), np.ndarray)
    (tmp_path / "docs").mkdir()
    for name, text in (("a.txt", "first document " * 4), ("b.txt", "second one " * 5)):
        (tmp_path / "docs" / name).write_text(text)
    text = TextFiles(str(tmp_path / "docs"), vocab=256, documents=True)
    assert text.starts.tolist() == [0, len("first document " * 4)]
    cfg = load_config(None, ["data.kind=text", f"data.path={tmp_path / 'docs'}", "model.vocab=256", "eval.every=0"])
    assert packs_documents(cfg.data) and make_source(cfg.data, cfg.batch, cfg.eval, 256).starts is not None
    assert not packs_documents(load_config(None, ["data.kind=text", "data.path=x", "data.documents=false"]).data)
    with pytest.raises(ConfigError, match="data.eos_id=70 is not a token id"):
        TokenFile(str(tmp_path / "t.bin"), "uint16", vocab=64, eos_id=70)


@pytest.fixture(scope="module")
def model():
    cfg = load_config(None, ["precision=fp32", "model.layers=2"])
    with use_policy(get_policy("fp32")):
        return default_model(cfg)(nnx.Rngs(0)), cfg


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_a_packed_row_gives_each_document_its_own_losses(model, impl):
    """Row A|B (|A| = 11, |B| = 21) with segment ids and restarting positions: every token's logits
    and next-token loss inside A and inside B equal those of A and of B run alone (1e-6, fp32)."""
    m, cfg = model
    m.cfg = m.cfg.replace(attention=impl)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, m.cfg.vocab, 11), rng.integers(0, m.cfg.vocab, 21)
    row = jnp.asarray(np.concatenate([a, b]))[None]
    seg = jnp.asarray([0] * 11 + [1] * 21)[None]
    pos = jnp.asarray(list(range(11)) + list(range(21)))[None]

    def per_token(tokens, **kw):
        with use_policy(get_policy("fp32")):
            logits, _ = m(tokens[:, :-1], **kw)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[0, :, 0]

    packed = per_token(row, positions=pos[:, :-1], segment_ids=seg[:, :-1])
    alone_a, alone_b = per_token(jnp.asarray(a)[None]), per_token(jnp.asarray(b)[None])
    assert float(jnp.abs(packed[:10] - alone_a).max()) <= 1e-6
    assert float(jnp.abs(packed[11:] - alone_b).max()) <= 1e-6
    batch = {"tokens": row, "segment_ids": seg, "positions": pos}
    with use_policy(get_policy("fp32")):
        loss, _ = lm_loss(m, batch)  # the A -> B target (index 10) is not counted
    assert float(loss) == pytest.approx(float(jnp.concatenate([alone_a, alone_b]).mean()), rel=1e-6)


def test_a_model_without_the_packing_arguments_is_one_line():
    class Plain(nnx.Module):
        def __call__(self, tokens):
            return jnp.zeros(tokens.shape + (8,))

    batch = {k: jnp.zeros((1, 9), jnp.int32) for k in ("tokens", "segment_ids", "positions")}
    with pytest.raises(
        ConfigError, match=r"model Plain takes no positions=, segment_ids= argument.*data.documents=false"
    ):
        lm_loss(Plain(), batch)


def test_a_prefill_that_fills_its_cache_attends_through_flash(model):
    """Decoding a whole prompt into an empty cache of its length (the engine's prefill) goes through
    `meshpar.attention`: flash gives xla's logits and the same cache."""
    m, _ = model
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, m.cfg.vocab, (1, 16)))
    positions = jnp.arange(16)[None]
    out = {}
    for impl in ("xla", "flash"):
        m.cfg = m.cfg.replace(attention=impl)
        spec = m.cache_spec(1, 16, jnp.float32)
        cache = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), spec, is_leaf=lambda x: hasattr(x, "axes"))
        with use_policy(get_policy("fp32")):
            out[impl] = m.decode(tokens, positions, cache)
    assert float(jnp.abs(out["xla"][0] - out["flash"][0]).max()) <= 1e-5
    assert all(
        float(jnp.abs(a - b).max()) == 0
        for a, b in zip(jax.tree.leaves(out["xla"][1]), jax.tree.leaves(out["flash"][1]))
    )
