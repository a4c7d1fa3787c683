"""Published training runs the planner is calibrated against: each row as its paper ran it.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), on DGX A100 80GB nodes (8 GPUs on NVSwitch, 8 x 200 Gb/s HDR InfiniBand):
  * Table 1 (weak scaling, PTD-P): GPT models of 1.7B to 1T parameters on 32 to 3072 GPUs, vocabulary
    51200, 2048 tokens, tensor parallel inside a node, pipeline across, full activation recompute,
    microbatches of one sequence; "achieved teraFLOP/s per GPU" counts the recompute (the paper's
    eq. 3: F = 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step), so it is a hardware FLOPs utilization.
  * Table 2: 175B (96 layers, 12288 wide) at batch 1536 on 384, 768 and 1536 GPUs, ZeRO-3 without
    model parallelism (microbatches of 4, 2, 1 sequences) against PTD-P (tensor 8 x pipeline 12,
    microbatches of one).

Each row becomes a meshpar config of the same shape: meshpar's decoder with heads of h / a, a gated MLP of 8h/3 (the
8 h^2 weights of GPT's 4h MLP; rounded to a multiple of 128), tied embeddings and attention that stores its scores
(`xla`: Megatron's fused softmax of 2021, before flash attention). Without a pipeline a replica's sequences run as
one batch: Megatron accumulates microbatches but reduces the gradients once, which meshpar does only for the batch
it holds whole. Costed by `meshpar.plan.search.estimate` on the `a100-80g` preset. The step time it predicts is
turned into the paper's own measure (eq. 3 over the predicted step), so a row compares seconds per step, whatever
each side counts as a FLOP.

Table 2's ZeRO-3 rows ran on DeepSpeed, not on an XLA program, and are costed as DeepSpeed ran them
(`DEEPSPEED`): fp16 weights and gradients on the wire (ZeRO's own accounting, 2 + 2 + 12 bytes per
parameter: Rajbhandari et al. 2020, sec. 3); each weight gathered when its submodule runs (ZeRO-3
prefetches a bucket of 5e7 parameters ahead, 3% of one 175B layer), so the gathers wait on the
critical path, while the gradients' reduce-scatters overlap the backward (its `overlap_comm`); and
one flat ring per process group, so each GPU's whole volume crosses its own 25 GB/s NIC. That last
is read off the table itself: the step stays at 66.7 s from 768 to 1536 GPUs, a fixed per-GPU volume
(3 x 349 GB) at about one NIC's rate, where rings spread over a node's 8 NICs (as NCCL's channels
are, and as meshpar's planner assumes for XLA's collectives) would move it 8x faster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshpar.core.config import load_config
from meshpar.core.mesh import MESH_AXES
from meshpar.plan.candidates import split_ici_dcn
from meshpar.plan.hardware import load_hardware
from meshpar.plan.search import estimate

SOURCE = "Narayanan et al. 2021 (SC'21), arXiv:2104.04473"
VOCAB, LENGTH = 51200, 2048


@dataclass(frozen=True)
class Run:
    """One published run: a GPT model, its layout and what it measured."""

    name: str
    heads: int
    hidden: int
    layers: int
    tensor: int
    pipeline: int
    gpus: int
    batch: int
    tflops: float  # measured teraFLOP/s per GPU (eq. 3, recompute counted)
    strategy: str = "tp"  # tp: PTD-P (tensor x pipeline x data); fsdp: ZeRO-3 over every GPU
    micro: int = 1  # sequences per microbatch
    source: str = ""
    runtime: str = "meshpar"  # meshpar: costed as meshpar's program of the layout; deepspeed: `DEEPSPEED`

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)

    def paper_flops(self) -> float:
        """Eq. 3 of the paper: FLOPs of one step, recomputation included."""
        b, s, l, h, v = self.batch, LENGTH, self.layers, self.hidden, VOCAB
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def measured_hfu(self, peak: float = 312e12) -> float:
        return self.tflops * 1e12 / peak

    def measured_step_s(self) -> float:
        return self.paper_flops() / (self.gpus * self.tflops * 1e12)

    def overrides(
        self, schedule: str = "1f1b", virtual: int = 1, microbatches: int | None = None, selective: bool = False
    ) -> list[str]:
        """KEY=VALUE overrides that make this run a meshpar config (`devices` set by the caller).
        `selective`: the same layout with Korthikanti et al. 2022's sequence parallelism and selective
        recompute (`tp_sp`, `save_dots`) in place of full recompute."""

        mlp = 128 * round(8 * self.hidden / 3 / 128)
        sizes = {"pipeline": self.pipeline, "data": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": self.tensor}
        sizes["fsdp" if self.strategy == "fsdp" else "data"] = self.data
        full = tuple(sizes[a] for a in MESH_AXES)
        dcn = dict(zip(MESH_AXES, split_ici_dcn(full, self.gpus, 8)))
        out = [
            "model.size=7b",
            f"model.layers={self.layers}",
            f"model.embed={self.hidden}",
            f"model.heads={self.heads}",
            f"model.kv_heads={self.heads}",
            f"model.mlp={mlp}",
            f"model.vocab={VOCAB}",
            "model.tie_embeddings=true",
            f"model.remat={'save_dots' if selective else 'full'}",
            "model.attention=xla",
            f"batch.length={LENGTH}",
            f"batch.global_size={self.batch}",
            f"strategy={'tp_sp' if selective and self.strategy == 'tp' else self.strategy}",
            *(f"mesh.{a}={sizes[a] // dcn[a]}" for a in MESH_AXES),
            "mesh.dcn={" + ", ".join(f"{a}: {v}" for a, v in dcn.items() if v > 1) + "}",
        ]
        if self.pipeline > 1:  # microbatches of `micro` sequences through the stages
            per_replica = self.batch // self.data // self.micro
            out += [
                f"pipeline.schedule={schedule}",
                f"pipeline.microbatches={microbatches or per_replica}",
                f"pipeline.virtual_stages={virtual}",
            ]
        return out


_T1 = "Table 1"
TABLE1 = [
    Run("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, source=_T1),
    Run("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, source=_T1),
    Run("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, source=_T1),
    Run("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, source=_T1),
    Run("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, source=_T1),
    Run("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, source=_T1),
    Run("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, source=_T1),
    Run("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, source=_T1),
    Run("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, source=_T1),
    Run("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163, source=_T1),
]
_T2 = "Table 2"
TABLE2 = [
    *(
        Run(f"175B ZeRO-3 x{n}", 96, 12288, 96, 1, 1, n, 1536, f, "fsdp", 1536 // n, _T2, "deepspeed")
        for n, f in ((384, 144), (768, 88), (1536, 44))
    ),
    *(
        Run(f"175B PTD-P x{n}", 96, 12288, 96, 8, 12, n, 1536, f, source=_T2)
        for n, f in ((384, 153), (768, 149), (1536, 141))
    ),
]


# DeepSpeed's ZeRO-3 of 2021 (the module's docstring): bytes per parameter on the wire and at rest,
# how its rings cross the nodes, and the collectives it waits for (the gathers, made on demand)
DEEPSPEED = {"bytes_per_param": (2, 2, 12), "dcn_rings": "device", "waits_for": ("all-gather",)}


def cost(run: Run, hardware=None, **kw) -> dict:
    """The planner's step for `run` as it ran: predicted seconds, the paper's measure of them, and
    the planner's own parts (compute, exposed collectives, bubble) and memory."""

    hw = hardware or load_hardware("a100-80g")
    cfg = load_config(None, run.overrides(**kw))
    cfg.devices = run.gpus
    bpp, waits_for = None, ()  # meshpar: what its precision policy stores, its program's overlap
    if run.runtime == "deepspeed":
        hw = dataclasses.replace(hw, dcn_rings=DEEPSPEED["dcn_rings"])
        bpp, waits_for = DEEPSPEED["bytes_per_param"], DEEPSPEED["waits_for"]
    ev = estimate(cfg, hw, bytes_per_param=bpp, waits_for=waits_for)
    if ev is None:
        raise ValueError(f"{run.name}: a tensor does not divide its mesh axes")
    t = ev["time"]
    hfu = run.paper_flops() / (t["step_s"] * run.gpus * hw.peak_flops)
    return {
        "name": run.name,
        "step_s": t["step_s"],
        "measured_step_s": run.measured_step_s(),
        "hfu": hfu,
        "measured_hfu": run.measured_hfu(hw.peak_flops),
        "ratio": hfu / run.measured_hfu(hw.peak_flops),
        "time": t,
        "memory_gib": ev["memory"]["total"] / 2**30,
        "fits": ev["fits"],
    }
