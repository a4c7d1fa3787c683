"""The reference decoder's parameters <-> Hugging Face Llama-family tensor names, as `Source`s that
read each block straight from the safetensors files (`meshpar.io.hf`): the table in
`meshpar.models.hf_llama`'s docstring, for every layer stacking (plain, Gemma's local/global groups, a
MoE model's blocks, `meshpar.models.hf_moe`)."""

from __future__ import annotations

import numpy as np

from meshpar.io.hf import Source


def span(a, b):
    return range(a, b)


LAYER = "model.layers.{}."


def layered(ids, shapes: dict, read_one, write_one) -> Source:
    """A parameter stacked over the HF layers `ids` (its first dimension), each layer's block read
    from that layer's tensors `shapes` ({suffix after model.layers.i.: shape}).
    read_one(get_l, box) -> one layer's block, get_l(suffix, *ranges); write_one(a) -> {suffix: array}."""
    ids = list(ids)
    names = {s: [LAYER.format(i) + s for i in ids] for s in shapes}

    def read(get, box):
        return np.stack([read_one(lambda s, *r, i=i: get(names[s][i], *r), box[1:]) for i in span(*box[0])])

    def write(a):
        out = {}
        for i in range(len(ids)):
            out.update({names[s][i]: t for s, t in write_one(a[i]).items()})
        return out

    return Source({names[s][i]: shape for s, shape in shapes.items() for i in range(len(ids))}, read, write)


def one_per_layer(ids, suffix, shape, read_one, write_one) -> Source:
    """`layered` for a parameter made of one tensor per layer."""
    return layered(
        ids,
        {suffix: shape},
        lambda get_l, box: read_one(lambda *r: get_l(suffix, *r), box),
        lambda a: {suffix: write_one(a)},
    )


def tensors(c, blocks: dict | None = None) -> dict:
    """{parameter path: Source} for the decoder with config `c` (see the module docstring).
    blocks: {path prefix: (HF layer indices, with the dense MLP)}, for models that stack their layers
    otherwise (meshpar.models.hf_moe); default {("layers",): (all layers, True)}."""
    E, V = c.embed, c.vocab
    out = {
        ("embedding",): Source(
            {"model.embed_tokens.weight": (V, E)},
            lambda get, b: get("model.embed_tokens.weight", *b),
            lambda a: {"model.embed_tokens.weight": a},
        ),
        ("final_norm", "scale"): Source(
            {"model.norm.weight": (E,)}, lambda get, b: get("model.norm.weight", *b), lambda a: {"model.norm.weight": a}
        ),
    }
    p = c.local_global or 1
    if blocks is None and p > 1:  # Pattern groups (models/layers.Pattern), then the tail
        blocks = {("layers", "blocks", str(i)): (ids, True) for i, ids in enumerate(grouped(p, c.layers // p))}
        for i in range(c.layers % p):
            tail = block_tensors(c, [c.layers - c.layers % p + i])
            out.update({("tail", "blocks", str(i), *path): unstacked(src) for path, src in tail.items()})
    for prefix, (ids, mlp) in (blocks or {("layers",): (range(c.layers), True)}).items():
        out.update({(*prefix, *path): src for path, src in block_tensors(c, ids, mlp).items()})
    if not c.tie_embeddings:
        out[("lm_head",)] = Source(
            {"lm_head.weight": (V, E)},
            lambda get, b: get("lm_head.weight", b[1], b[0]).T,
            lambda a: {"lm_head.weight": a.T},
        )
    return out


def unstacked(src: Source) -> Source:
    """A Source stacked over one layer, as the parameter of that layer alone (no `layers` dimension)."""
    return Source(src.tensors, lambda get, box: src.read(get, ((0, 1), *box))[0], lambda a: src.write(a[None]))


def grouped(p: int, groups: int) -> list[list[int]]:
    """HF layer indices of each block position of a stack scanned in groups of p blocks: block i of
    group j is HF layer j * p + i."""
    return [[j * p + i for j in range(groups)] for i in range(p)]


def block_tensors(c, ids, mlp: bool = True) -> dict:
    """{path within a block: Source} of the blocks stacked from HF layers `ids`: norms, attention,
    and (mlp) the dense SwiGLU."""
    E, N, K, D, F = c.embed, c.heads, c.kv_heads, c.head_dim, c.mlp
    G = N // K

    def vector(suffix, n):
        return one_per_layer(ids, suffix, (n,), lambda g, b: g(b[0]), lambda a: a)

    def head_rows(get_l, kind, box_k, box_j, d0, d1, *cols):
        """Rows of fused-QKV slot (k, j) from q/k/v ({kind}: weight or bias): head h, feature d is
        row h * D + d (ROPE_ROWS: the identity within a head)."""
        out = []
        for k in span(*box_k):
            parts = []
            for j in span(*box_j):
                proj, h = ("q_proj", k * G + j) if j < G else ("k_proj" if j == G else "v_proj", k)
                parts.append(get_l(f"self_attn.{proj}.{kind}", (h * D + d0, h * D + d1), *cols))
            out.append(parts)
        return out

    def qkv_read(get_l, box):  # [E_s, K_s, J_s, D_s]
        (e0, e1), ks, js, (d0, d1) = box
        rows = head_rows(get_l, "weight", ks, js, d0, d1, (e0, e1))
        return np.stack([np.stack([r.T for r in parts], 1) for parts in rows], 1)

    def qkv_write(a):  # [E, K, G+2, D] -> q [N*D, E], k/v [K*D, E]
        return {
            "self_attn.q_proj.weight": a[:, :, :G].reshape(E, N * D).T,
            "self_attn.k_proj.weight": a[:, :, G].reshape(E, K * D).T,
            "self_attn.v_proj.weight": a[:, :, G + 1].reshape(E, K * D).T,
        }

    def wo_read(get_l, box):  # o_proj [E, N*D] -> [N_s, D_s, E_s]
        (n0, n1), (d0, d1), (e0, e1) = box
        w = get_l("self_attn.o_proj.weight", (e0, e1), (n0 * D, n1 * D)).reshape(e1 - e0, n1 - n0, D)
        return w[:, :, d0:d1].transpose(1, 2, 0)

    post = c.post_norms  # Gemma: post_attention_layernorm follows attention
    out = {
        ("attn_norm", "scale"): vector("input_layernorm.weight", E),
        ("ffn_norm", "scale"): vector(
            "pre_feedforward_layernorm.weight" if post else "post_attention_layernorm.weight", E
        ),
        ("attn", "wqkv"): layered(
            ids,
            {
                "self_attn.q_proj.weight": (N * D, E),
                "self_attn.k_proj.weight": (K * D, E),
                "self_attn.v_proj.weight": (K * D, E),
            },
            qkv_read,
            qkv_write,
        ),
        ("attn", "wo"): layered(
            ids,
            {"self_attn.o_proj.weight": (E, N * D)},
            wo_read,
            lambda a: {"self_attn.o_proj.weight": a.reshape(N * D, E).T},
        ),
    }
    if mlp:

        def w_in_read(get_l, box):  # gate/up [F, E] -> [E_s, C_s, F_s]
            (e0, e1), cs, fs = box
            return np.stack([get_l(f"mlp.{('gate_proj', 'up_proj')[c]}.weight", fs, (e0, e1)).T for c in span(*cs)], 1)

        out[("ffn", "w_in")] = layered(
            ids,
            {"mlp.gate_proj.weight": (F, E), "mlp.up_proj.weight": (F, E)},
            w_in_read,
            lambda a: {"mlp.gate_proj.weight": a[:, 0].T, "mlp.up_proj.weight": a[:, 1].T},
        )
        out[("ffn", "w_down")] = one_per_layer(
            ids, "mlp.down_proj.weight", (E, F), lambda g, b: g(b[1], b[0]).T, lambda a: a.T
        )
    if post:
        out[("post_attn_norm", "scale")] = vector("post_attention_layernorm.weight", E)
        out[("post_ffn_norm", "scale")] = vector("post_feedforward_layernorm.weight", E)
    if c.qkv_bias:

        def bias_read(get_l, box):  # q/k/v biases [N*D], [K*D] -> [K_s, J_s, D_s]
            ks, js, (d0, d1) = box
            return np.stack([np.stack(parts, 0) for parts in head_rows(get_l, "bias", ks, js, d0, d1)], 0)

        out[("attn", "bqkv")] = layered(
            ids,
            {"self_attn.q_proj.bias": (N * D,), "self_attn.k_proj.bias": (K * D,), "self_attn.v_proj.bias": (K * D,)},
            bias_read,
            lambda a: {
                "self_attn.q_proj.bias": a[:, :G].reshape(N * D),
                "self_attn.k_proj.bias": a[:, G].reshape(K * D),
                "self_attn.v_proj.bias": a[:, G + 1].reshape(K * D),
            },
        )
    if c.qk_norm:
        out[("attn", "q_norm", "scale")] = vector("self_attn.q_norm.weight", D)
        out[("attn", "k_norm", "scale")] = vector("self_attn.k_norm.weight", D)
    return out
