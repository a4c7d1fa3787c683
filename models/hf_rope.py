"""RoPE as a Hugging Face config.json states it (transformers 5's `rope_parameters`, or 4's
`rope_theta` + `rope_scaling`; Gemma 3's per layer type) <-> the reference decoder's (theta, scaling),
and the row order of a head's q/k features (`interleaved_to_half`, see `meshpar.models.hf_llama`)."""

from __future__ import annotations

import numpy as np

from meshpar.core.errors import ConfigError


def interleaved_to_half(d: int) -> np.ndarray:
    """Rows of a head in Meta's interleaved RoPE layout, reordered for the half-split form (the
    permutation HF's conversion script applies): [0, 2, 4, ..., 1, 3, 5, ...]."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def rope_scaling(rs: dict, where: str) -> tuple:
    """A rope scaling dict -> ("linear", factor) or ("llama3", factor, low_freq_factor,
    high_freq_factor, original_max) (`meshpar.models.layers.rope_frequencies`)."""
    kind = rs.get("rope_type", rs.get("type", "default"))
    keys = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    }.get(kind)
    if keys is None:
        raise ConfigError(f"{where}: rope type '{kind}' is not implemented (default, linear and llama3 are)")
    for k in keys:
        if not isinstance(rs.get(k), (int, float)) or isinstance(rs.get(k), bool):
            raise ConfigError(f"{where}: {kind} rope scaling needs a number for '{k}'")
    return (kind, *(float(rs[k]) for k in keys))


def rope_settings(rope: dict, where: str, theta: float = 10000.0) -> tuple:
    """One RoPE dict (`rope_parameters`, or a layer type's in Gemma 3) -> (theta, scaling or None)."""
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{where}: key 'partial_rotary_factor' is not 1; the decoder rotates whole heads")
    kind = rope.get("rope_type", rope.get("type", "default"))
    return float(rope.get("rope_theta", theta)), None if kind in (None, "default") else rope_scaling(rope, where)


def rope_parameters(theta: float, scaling: tuple | None) -> dict:
    """(theta, scaling) -> its `rope_parameters` dict (the inverse of `rope_settings`)."""
    out = {"rope_type": "default", "rope_theta": theta}
    if scaling and scaling[0] == "linear":
        out.update(rope_type="linear", factor=scaling[1])
    elif scaling:
        _, f, lo, hi, orig = scaling
        out.update(
            rope_type="llama3",
            factor=f,
            low_freq_factor=lo,
            high_freq_factor=hi,
            original_max_position_embeddings=int(orig),
        )
    return out


def rope_of(hf: dict, where: str, family: str) -> tuple:
    """config.json's RoPE -> ((theta, scaling) of the global layers, that of the local ones): one dict
    for every layer (`rope_parameters` or 4's `rope_theta` + `rope_scaling`), or Gemma 3's per layer
    type (5's `rope_parameters.{full,sliding}_attention`, 4's `rope_local_base_freq`)."""
    rope = dict(hf.get("rope_parameters") or {})
    if family == "gemma3_text" and ("full_attention" in rope or "sliding_attention" in rope):
        return tuple(
            rope_settings({"rope_theta": t, **(rope.get(k) or {})}, f"{where}: key 'rope_parameters.{k}'")
            for k, t in (("full_attention", 1e6), ("sliding_attention", 1e4))
        )
    rope.update(hf.get("rope_scaling") or {})
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    theta = hf.get("rope_theta") or (1e6 if family == "gemma3_text" else 1e4)
    glob = rope_settings(
        {"rope_theta": theta, "partial_rotary_factor": hf.get("partial_rotary_factor") or 1.0, **rope},
        f"{where}: key '{key}'",
    )
    return glob, ((float(hf.get("rope_local_base_freq") or 1e4), None) if family == "gemma3_text" else glob)
