"""Hugging Face checkpoints: safetensors read straight into shardings, and written back.

    params = load("hf:/ckpts/llama", abstract_model, shardings)     # {param path: jax.Array}, sharded
    export(params, abstract_model, "out/", dtype="bf16", max_shard_size="5GB")

A Hugging Face directory holds `config.json` and `model.safetensors`, or shards listed by
`model.safetensors.index.json` (`weight_map`: tensor name -> file). What a tensor *means* is the
model's business: a model that reads this format implements

    model.hf_tensors() -> {parameter path (tuple of keys): Source}    # see `Source`
    model.hf_config()  -> dict                                        # its config.json
    model.hf_ignorable(name) -> bool       (optional) a tensor that may be present and is not read

(`meshpar.models.hf_llama` for the reference decoder: renames, transposes, fused QKV and gate/up,
layers stacked, the RoPE layout). This module knows only the file format, so the framework never
imports a model.

Loading (`load`): every parameter is assembled in its target sharding from per-device blocks: for
each block a local device holds, the model's `Source.read` returns exactly that block, reading only
the slices of the HF tensors it needs (safetensors memory-maps the file and copies only the slice
asked for); the block goes to its device at once and replicas are copied device to device. So a
process reads only what its devices hold, and the host holds one block at a time, never the model.

Refusals, before any array is built (never half-loaded), one line naming the file and the key:
a missing `config.json`, a shard file the index names that does not exist, a tensor whose dtype
meshpar cannot read (F32, F16 and BF16 only), a tensor missing, a tensor whose shape disagrees with
what `config.json` implies, a tensor that nothing reads.

Export (`export`): process 0 writes; every process takes part in gathering one parameter at a time
(`process_allgather`), which is split into its HF tensors and written at offsets planned before any
data moves (the safetensors header lists every tensor's offset, so shards are laid out first and
filled array by array: host memory is one parameter, not one shard).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from meshpar.core.errors import ConfigError
from meshpar.core.pretrained import hf_path, read_config, read_json  # noqa: F401 - config.json, read before any model
from meshpar.io.failures import one_line

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
NAMES = {v: k for k, v in DTYPES.items()}
EXPORT_DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Source:
    """One meshpar parameter in terms of HF tensors.

    tensors: {HF name: shape} the parameter is made of (shapes as `config.json` implies them).
    read(get, box) -> np.ndarray: the block `box` (one (start, stop) per parameter dimension) of
        the parameter, where `get(name, *ranges)` returns that block of HF tensor `name` (one
        (start, stop) per tensor dimension; fewer ranges: the rest whole).
    write(array) -> {HF name: np.ndarray}: the whole parameter split into its HF tensors.
    """

    tensors: dict
    read: Callable
    write: Callable


class Checkpoint:
    """The safetensors files of one HF directory: names, files, shapes and dtypes from the headers
    (nothing else is read until `get`)."""

    def __init__(self, spec: str):
        from safetensors import safe_open

        self.root = hf_path(spec)
        self.config = read_config(spec)
        if (self.root / INDEX).is_file():
            index = read_json(self.root / INDEX)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{self.root / INDEX}: key 'weight_map' is missing or empty")
            self.file_of = dict(weight_map)
            for name, file in self.file_of.items():
                if not (self.root / file).is_file():
                    raise ConfigError(
                        f"{self.root / INDEX}: key '{name}' is in shard '{file}', which does not exist in {self.root}"
                    )
        elif (self.root / SINGLE).is_file():
            self.file_of = None
        else:
            raise ConfigError(f"{self.root}: no {SINGLE} and no {INDEX} (only safetensors checkpoints are read)")
        self.handles, self.info, self.offsets = {}, {}, {}
        files = sorted(set(self.file_of.values())) if self.file_of else [SINGLE]
        for file in files:
            try:
                h = safe_open(str(self.root / file), framework="np")
            except Exception as e:  # noqa: BLE001 - a truncated or foreign file
                raise ConfigError(f"{self.root / file}: not a readable safetensors file ({one_line(e)})") from None
            self.handles[file] = h
            for name in h.keys():
                if self.file_of is not None and self.file_of.get(name) != file:
                    continue  # the index decides which file holds a name
                sl = h.get_slice(name)
                self.info[name] = (file, sl.get_dtype(), tuple(sl.get_shape()))
        if self.file_of:
            for name, file in self.file_of.items():
                if name not in self.info:
                    raise ConfigError(f"{self.root / file}: key '{name}' is listed in {INDEX} but not in that file")

    def where(self, name: str) -> str:
        return str(self.root / self.info[name][0]) if name in self.info else str(self.root)

    def check(self, sources: dict, ignorable: Callable[[str], bool] = lambda n: False) -> None:
        """Every tensor the sources name is present, readable and of the shape config.json implies;
        every tensor present is read by some source (or `ignorable`)."""
        wanted = {}
        for src in sources.values():
            wanted.update(src.tensors)
        for name, shape in wanted.items():
            if name not in self.info:
                raise ConfigError(
                    f"{self.root}: key '{name}' is missing from the checkpoint "
                    f"({'no shard lists it in ' + INDEX if self.file_of else 'not in ' + SINGLE})"
                )
            _, dtype, have = self.info[name]
            if dtype not in DTYPES:
                raise ConfigError(
                    f"{self.where(name)}: key '{name}' has dtype {dtype}; meshpar reads {', '.join(DTYPES)} weights"
                )
            if have != tuple(shape):
                raise ConfigError(
                    f"{self.where(name)}: key '{name}' has shape {list(have)} but config.json implies {list(shape)}"
                )
        extra = sorted(n for n in self.info if n not in wanted and not ignorable(n))
        if extra:
            raise ConfigError(
                f"{self.where(extra[0])}: key '{extra[0]}' is not read by this model"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                + "; its config.json describes another architecture or options meshpar does not implement"
            )

    def get(self, name: str, *ranges) -> np.ndarray:
        """The block of tensor `name` given by `ranges` ((start, stop) per leading dimension): a
        read-only memory map of the tensor's bytes (offsets from the file's safetensors header),
        of which only the block is copied to the heap (safetensors' own slices copy whole rows)."""
        file, dtype, shape = self.info[name]
        if file not in self.offsets:
            with open(self.root / file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            self.offsets[file] = (8 + n, {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"})
        start, offsets = self.offsets[file]
        view = np.memmap(self.root / file, dtype=DTYPES[dtype], mode="r", offset=start + offsets[name], shape=shape)
        index = tuple(slice(a, b) for a, b in ranges)
        return np.array(view[index])


def _box(index, shape) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def load(spec: str, model, shardings, shapes, info: Callable[[str], None] | None = None) -> dict:
    """An `hf:DIR` checkpoint as `model`'s parameters: a pure dict like `shapes` (ShapeDtypeStructs)
    whose arrays are born in `shardings`, each process reading only its devices' blocks. Tensors
    the model reads from nowhere are refused unless `model.hf_ignorable(name)` says otherwise."""
    sources = hf_sources(model)
    ckpt = Checkpoint(spec)
    flat = jax.tree_util.tree_leaves_with_path(shapes)
    missing = [_key(p) for p, _ in flat if _key(p) not in sources]
    if missing:
        raise ConfigError(f"{type(model).__name__}.hf_tensors() has no source for parameter {'.'.join(missing[0])}")
    ckpt.check(sources, getattr(model, "hf_ignorable", lambda n: False))
    shard_leaves = jax.tree.leaves(shardings)
    out = [
        _build(ckpt, sources[_key(path)], sds, sharding, _key(path))
        for (path, sds), sharding in zip(flat, shard_leaves)
    ]
    if info:
        info(f"read {len(out)} arrays from {len(ckpt.handles)} safetensors file(s) in {ckpt.root}")
    return jax.tree.unflatten(jax.tree.structure(shapes), out)


def _build(ckpt: Checkpoint, src: Source, sds, sharding, key: tuple) -> jax.Array:
    """One parameter, block by block: each distinct block a local device holds is read, put on its
    device and dropped from the host before the next is read; replicas copy from the device."""
    placed, shards = {}, []
    for device, index in sharding.addressable_devices_indices_map(tuple(sds.shape)).items():
        box = _box(index, sds.shape)
        if box in placed:
            shards.append(jax.device_put(placed[box], device))
            continue
        block = np.asarray(src.read(ckpt.get, box))
        want = tuple(b - a for a, b in box)
        if block.shape != want:
            raise ConfigError(
                f"{ckpt.root}: the source of parameter {'.'.join(key)} returned a block of shape "
                f"{list(block.shape)} for {list(want)}"
            )
        placed[box] = jax.device_put(
            block.astype(sds.dtype, copy=False), device
        ).block_until_ready()  # host copy freed now
        del block
        shards.append(placed[box])
    return jax.make_array_from_single_device_arrays(tuple(sds.shape), sharding, shards)


def hf_sources(model, export: bool = False) -> dict:
    """`model.hf_tensors()`; one line naming what the model lacks to be read from (or, `export`,
    written as) a Hugging Face checkpoint."""
    needs = ("hf_tensors", "hf_config") if export else ("hf_tensors",)
    missing = [f"{n}()" for n in needs if not callable(getattr(model, n, None))]
    if missing:
        what = "be exported to Hugging Face format" if export else "read Hugging Face checkpoints"
        raise ConfigError(
            f"model {type(model).__name__} cannot {what}: it needs {' and '.join(missing)} "
            "(see meshpar.io.hf; meshpar.models.decoder implements them)"
        )
    return model.hf_tensors()


def _key(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


# ----------------------------------------------------------------------------------------------
# Export


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10^9, '500MiB' -> 500 * 2^20, '1000' -> 1000 bytes (Hugging Face's units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise ConfigError(f"--max-shard-size '{text}' must look like 5GB, 500MB or 200MiB")
    base = 1024 if m.group(3) == "IB" else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def plan_shards(tensors: list[tuple[str, tuple, np.dtype]], max_bytes: int) -> list[list[str]]:
    """Greedy: tensors in order, a new shard when the next one would pass `max_bytes` (a tensor
    larger than that gets a shard of its own, as Hugging Face does)."""
    shards, size = [[]], 0
    for name, shape, dt in tensors:
        n = math.prod(shape) * dt.itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _header(names, meta: dict) -> tuple[bytes, dict]:
    """safetensors header (8-byte little-endian length, JSON, space-padded to 8 bytes) and offsets."""
    header, offsets, at = {"__metadata__": {"format": "pt"}}, {}, 0
    for name in names:
        shape, dt = meta[name]
        n = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": NAMES[dt], "shape": list(shape), "data_offsets": [at, at + n]}
        offsets[name] = at
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    return head, {k: v + len(head) for k, v in offsets.items()}


def _gather(x) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def export(
    params: dict,
    model,
    out: str,
    dtype: str = "bf16",
    max_shard_size: str | int = "5GB",
    config_extra: dict | None = None,
    generation: dict | None = None,
) -> dict:
    """Write `params` (a pure dict of (sharded) arrays of `model`) as a Hugging Face directory.
    Returns {"files", "tensors", "bytes"}. All processes call it; process 0 writes."""
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype '{dtype}' must be one of {', '.join(EXPORT_DTYPES)}")
    dt = EXPORT_DTYPES[dtype]
    sources = hf_sources(model, export=True)
    flat = jax.tree_util.tree_leaves_with_path(params)
    meta, order = {}, []
    for path, _ in flat:
        for name, shape in sources[_key(path)].tensors.items():
            meta[name] = (tuple(shape), dt)
            order.append(name)
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    shards = plan_shards([(n, *meta[n]) for n in order], limit)
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    writer = jax.process_index() == 0
    root = Path(out)
    where = {}
    if writer:
        root.mkdir(parents=True, exist_ok=True)
        for file, names in zip(files, shards):
            head, offsets = _header(names, meta)
            size = len(head) + sum(math.prod(meta[n][0]) * dt.itemsize for n in names)
            with open(root / file, "wb") as f:
                f.write(head)
                f.truncate(size)
            where.update({n: (file, offsets[n]) for n in names})
        for stale in [INDEX] if len(files) == 1 else [SINGLE]:
            (root / stale).unlink(missing_ok=True)
    handles = {file: open(root / file, "r+b") for file in files} if writer else {}
    try:
        for path, x in flat:  # one parameter on the host at a time
            full = _gather(x)
            if not writer:
                continue
            for name, t in sources[_key(path)].write(full).items():
                t = np.ascontiguousarray(np.asarray(t).astype(dt))
                if t.shape != meta[name][0]:
                    raise ConfigError(
                        f"{type(model).__name__}.hf_tensors(): '{name}' written with shape "
                        f"{list(t.shape)}, declared {list(meta[name][0])}"
                    )
                file, at = where[name]
                handles[file].seek(at)
                handles[file].write(t.tobytes())
            del full
    finally:
        for h in handles.values():
            h.close()
    total = sum(math.prod(s) * d.itemsize for s, d in meta.values())
    if writer:
        if len(files) > 1:
            weight_map = {n: where[n][0] for n in order}
            (root / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
            )
        config = {
            **model.hf_config(),
            **(config_extra or {}),
            "torch_dtype": "bfloat16" if dtype == "bf16" else "float32",
        }
        (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if generation:
            (root / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    return {"files": files, "tensors": len(order), "bytes": total}


def end_tokens(tokenizer, init_from: str | None) -> list[int]:
    """The ids that end a completion: every EOS id the tokenizer's folder names, and those of
    `init_from`'s config.json and generation_config.json (one id or a list: chat models list their
    end-of-turn token there too)."""
    ends = list(getattr(tokenizer, "eos_ids", None) or [])
    if init_from:
        for name in ("config.json", "generation_config.json"):
            f = hf_path(init_from) / name
            eos = read_json(f).get("eos_token_id") if f.is_file() else None
            ends += [
                e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and not isinstance(e, bool)
            ]
    return list(dict.fromkeys(ends))


def provenance(init_from: str | None, tokenizer: str | None) -> tuple[dict, dict | None]:
    """What an export carries over besides weights: bos/eos/pad ids for config.json and a
    generation_config.json, from `init_from`'s directory (`model.init_from`), else from `tokenizer`
    (`data.tokenizer`)."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    extra, generation = {}, None
    if init_from:
        root = hf_path(init_from)
        src = read_config(init_from)
        extra = {k: src[k] for k in keys if src.get(k) is not None}
        if (root / "generation_config.json").is_file():
            generation = read_json(root / "generation_config.json")
    if not extra and tokenizer:
        from meshpar.io.tokenizer import HFTokenizer  # local: the tokenizers library loads only for text

        tok = HFTokenizer(tokenizer)
        extra = {k: v for k, v in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id)) if v is not None}
    if generation is None and extra:
        generation = {k: v for k, v in extra.items()}
    return extra, generation
