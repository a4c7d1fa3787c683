"""The layouts `meshpar plan` considers: every way to write the device count as the mesh axes' sizes,
split into ICI x DCN, times the presets that use those axes, remat, and the microbatch counts; a
candidate as the config overrides that run it; and the keys a user pinned (`Pins`), which keep only
the candidates that agree with them (`meshpar.plan.search` costs and ranks what is left)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from meshpar.core.errors import ConfigError
from meshpar.core.mesh import MESH_AXES
from meshpar.plan.costmodel import REMATS, Candidate, ModelFacts

ORDER = ("dp", "zero1", "zero2", "fsdp", "hsdp", "tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp")


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _factorizations(n: int, k: int):
    if k == 1:
        yield (n,)
        return
    for d in _divisors(n):
        for rest in _factorizations(n // d, k - 1):
            yield (d,) + rest


def _fits_family(strategy: str, s: dict) -> bool:
    d, f, t = s["data"], s["fsdp"], s["tensor"]
    return {
        "dp": f == 1 and t == 1,
        "zero1": f == 1 and t == 1,
        "zero2": f == 1 and t == 1,
        "fsdp": d == 1 and t == 1,
        "hsdp": d > 1 and f > 1 and t == 1,
        "tp": t > 1 and f == 1,
        "tp_sp": t > 1 and f == 1,
        "fsdp_tp": t > 1 and f > 1 and d == 1,
        "fsdp_tp_sp": t > 1 and f > 1 and d == 1,
    }[strategy]


def split_ici_dcn(sizes: tuple, n: int, domain: int) -> tuple | None:
    """DCN part of each axis: the ICI domain is filled from the innermost axis outwards."""
    room = min(domain, n)
    ici = [1] * len(sizes)
    for i in reversed(range(len(sizes))):
        ici[i] = math.gcd(sizes[i], room)
        room //= ici[i]
    if room != 1:
        return None
    return tuple(s // i for s, i in zip(sizes, ici))


def candidates(facts: ModelFacts, n: int, hw, strategies) -> list[Candidate]:
    """Every (mesh, preset, remat, microbatches, schedule) the search costs."""
    d, b = facts.dims, facts.run.global_size
    layers = d.get("layers") or 1
    experts = facts.moe.get("num_experts", 1)
    out = []
    for sizes in _factorizations(n, len(MESH_AXES)):
        s = dict(zip(MESH_AXES, sizes))
        if layers % s["pipeline"] or experts % s["expert"] or (s["expert"] > 1 and not facts.moe):
            continue
        if s["context"] > 1 and (facts.run.length % (2 * s["context"]) or (s["pipeline"] > 1 and facts.moe)):
            continue  # the balanced order's 2 x context chunks; MoE stages route whole sequences
        if (facts.run.length // s["context"]) % facts.run.loss_chunks:
            continue  # train.loss_chunks slices a device's share of a sequence
        dcn = split_ici_dcn(sizes, n, hw.domain)
        if dcn is None:
            continue
        dp = s["data"] * s["fsdp"] * s["expert"]
        if b % dp:
            continue
        for st in strategies:
            if not _fits_family(st, s) or (st == "hsdp" and s["data"] < s["fsdp"] and dcn[1] == 1 and n > hw.domain):
                continue
            for remat in REMATS:
                base = Candidate(sizes, dcn, st, remat)
                p = s["pipeline"]
                if p == 1:
                    ma = 1
                    while b % (dp * ma) == 0 and ma <= 64:
                        out.append(replace(base, microbatches=ma))
                        ma *= 2
                    continue
                for m in _divisors(b // dp):  # every M the rows split into, down to one sequence each
                    if m < p:  # fewer microbatches than stages: idle stages, never better
                        continue
                    out += [replace(base, pp_microbatches=m, schedule=sc) for sc in ("gpipe", "1f1b")]
                    out += [
                        replace(base, pp_microbatches=m, schedule="interleaved", virtual=v)
                        for v in (2, 3, 4)
                        if layers % (v * p) == 0 and m % p == 0
                    ]
    return out


def overrides(cand: Candidate, n: int) -> list[str]:
    """KEY=VALUE overrides that turn a config into this plan (what the winner YAML holds)."""
    s, dcn = cand.shape, cand.dcn_shape
    out = [f"mesh.{a}={s[a] // dcn[a]}" for a in MESH_AXES]
    dcn_items = {a: v for a, v in dcn.items() if v > 1}
    out.append("mesh.dcn={" + ", ".join(f"{a}: {v}" for a, v in dcn_items.items()) + "}")
    out += [
        f"strategy={cand.strategy}",
        f"model.remat={cand.remat}",
        f"batch.microbatches={cand.microbatches}",
        f"devices={n}",
    ]
    if s["pipeline"] > 1:
        out += [
            f"pipeline.schedule={cand.schedule}",
            f"pipeline.microbatches={cand.pp_microbatches}",
            f"pipeline.virtual_stages={cand.virtual}",
        ]
    return out


PIPELINE_KEYS = ("pipeline.schedule", "pipeline.microbatches", "pipeline.virtual_stages")


@dataclass(frozen=True)
class Pins:
    """What a user fixed of the layout the search chooses, by a KEY=VALUE override of its key:
    `mesh.<axis>=K` the axis's size over all devices (ICI x DCN; -1 leaves it free), `mesh.dcn` the
    part of every axis across nodes or slices, `strategy`, `model.remat`, `batch.microbatches`, and
    `pipeline.*` (which keep only pipelined plans). `keys`: the pinned keys as given (KEY=VALUE)."""

    sizes: dict = field(default_factory=dict)  # axis -> its size over all devices
    dcn: dict | None = None  # axis -> its DCN factor (every axis), or None: free
    strategy: str | None = None
    remat: str | None = None
    microbatches: int | None = None
    pipeline: dict = field(default_factory=dict)  # pipeline.* key -> value
    keys: tuple = ()

    @classmethod
    def of(cls, given: list[str], mesh, pipeline, strategy: str, remat: str, microbatches: int) -> Pins:
        """The pins of the dotted keys `given` on the command line, with the run config's (validated)
        values: `mesh` and `pipeline` its sections, `strategy`, `remat` (`model.remat`) and
        `microbatches` (`batch.microbatches`)."""
        dcn = dict(mesh.dcn or {})
        pinned_dcn = "mesh.dcn" in given or any(k.startswith("mesh.dcn.") for k in given)
        sizes = {
            a: getattr(mesh, a) * (int(dcn.get(a, 1)) if pinned_dcn else 1)
            for a in MESH_AXES
            if f"mesh.{a}" in given and getattr(mesh, a) != -1
        }
        if remat not in REMATS and "model.remat" in given:
            raise ConfigError(
                f"model.remat={remat}: `meshpar plan` costs model.remat {', '.join(REMATS)}; pin one of "
                "them or leave model.remat to the search"
            )
        out = cls(
            sizes,
            {a: int(dcn.get(a, 1)) for a in MESH_AXES} if pinned_dcn else None,
            strategy if "strategy" in given else None,
            remat if "model.remat" in given else None,
            microbatches if "batch.microbatches" in given else None,
            {k: getattr(pipeline, k.split(".")[1]) for k in PIPELINE_KEYS if k in given},
        )
        return replace(out, keys=tuple(_shown(out, mesh)))

    def allows(self, cand: Candidate) -> bool:
        """Whether `cand` agrees with every pinned key."""
        s = cand.shape
        if any(s[a] != v for a, v in self.sizes.items()):
            return False
        if self.dcn is not None and cand.dcn_shape != self.dcn:
            return False
        if self.strategy not in (None, cand.strategy) or self.remat not in (None, cand.remat):
            return False
        if self.microbatches not in (None, cand.microbatches):
            return False
        if self.pipeline:
            if s["pipeline"] == 1:
                return False
            have = {
                "pipeline.schedule": cand.schedule,
                "pipeline.microbatches": cand.pp_microbatches,
                "pipeline.virtual_stages": cand.virtual,
            }
            return all(have[k] == v for k, v in self.pipeline.items())
        return True


def _shown(pins: Pins, mesh) -> list[str]:
    """The pinned keys as KEY=VALUE (`mesh`: the run's `cfg.mesh`, the sizes as given), in the config's order."""
    out = [f"mesh.{a}={getattr(mesh, a)}" for a in MESH_AXES if a in pins.sizes]
    if pins.dcn is not None:
        out.append("mesh.dcn={" + ", ".join(f"{a}: {v}" for a, v in pins.dcn.items() if v > 1) + "}")
    for key, value in (
        ("strategy", pins.strategy),
        ("model.remat", pins.remat),
        ("batch.microbatches", pins.microbatches),
    ):
        if value is not None:
            out.append(f"{key}={value}")
    return out + [f"{k}={v}" for k, v in pins.pipeline.items()]
