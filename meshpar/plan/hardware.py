"""Accelerator presets for `meshpar plan`: peak FLOPs, memory, and the bandwidth of each link tier.

A cluster is two tiers. Devices inside one *ICI domain* (an NVLink/NVSwitch node of GPUs, or a TPU
slice) talk over the fast interconnect; domains talk over the data-center network (DCN: InfiniBand
for GPU nodes, the TPU DCN between slices). `meshpar.core.mesh` puts the innermost mesh axes on ICI and
`mesh.dcn` on DCN; the planner does the same.

Bandwidths are what a *ring collective along one mesh axis* gets per device and per direction
(bytes/s): the quantity `V (n-1)/n / bw` needs.
  * NVLink behind NVSwitch: every GPU sends at its full NVLink rate to any peer, so one axis gets
    the GPU's unidirectional NVLink bandwidth (half the bidirectional datasheet figure).
  * TPU ICI: an axis laid along one torus dimension with wrap-around runs a bidirectional ring
    over 2 links: 2 x the one-way bandwidth of a link (= per-chip bidirectional ICI / ports / 2).
  * DCN: each GPU has its own NIC (400 Gb/s NDR on H100/H200 nodes, 200 Gb/s HDR on DGX A100);
    a TPU chip gets the per-pod DCN figure divided by the chips of the pod.

The time model's other figures (`meshpar.plan.roofline`, `meshpar.plan.steptime`):
  * `efficiency`: the fraction of peak a large bf16 matmul reaches inside a training step (H100:
    767 TFLOP/s measured on the lent H100, 0.776; others 0.8, an assumption).
  * `hbm_bw`: device-memory bandwidth (datasheets), which bounds every kernel that is not a matmul.
  * `comm_efficiency`: the fraction of a link's bandwidth a large collective reaches (0.8: NCCL's
    own tuning model caps A100 NVLink's bus bandwidth at 235 of 300 GB/s).
  * `latency`: the alpha of the alpha-beta model, per collective, per ICI hop, per DCN hop; for
    GPUs NCCL's tuning constants for its Simple-protocol ring (src/graph/tuning.cc: 8.4, 3.4 and
    9.6 us).
  * `dcn_rings`: "node" (every preset), a collective's rings spread over all of a domain's NICs, as
    NCCL's channels are; "device", one flat ring whose slowest link is each device's own NIC (what
    DeepSpeed's ZeRO-3 measured in Narayanan et al. 2021, Table 2: `meshpar.plan.papers`).

Every figure cites its source; `--hardware my.yaml` takes the same keys for anything else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from meshpar.core.errors import ConfigError, suggest

GB = 1e9
KIB, MIB = 2**10, 2**20


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    memory_bytes: float  # HBM per device
    domain: int  # devices per ICI domain (GPU node / largest TPU slice)
    ici_bw: float  # bytes/s per device per direction for a ring along one mesh axis, inside a domain
    dcn_bw: float  # bytes/s per device per direction between domains
    efficiency: float = 0.8  # fraction of peak a large bf16 matmul reaches (`meshpar.plan.roofline`)
    kind: str = "gpu"  # gpu: any count <= domain or a multiple of it; tpu: slices are powers of two
    source: str = ""
    hbm_bw: float = 0.0  # bytes/s of device memory (what bounds the kernels that are not matmuls)
    comm_efficiency: float = 0.8  # fraction of a link's bandwidth a large collective reaches
    latency: tuple = (8.4e-6, 3.4e-6, 9.6e-6)  # seconds: per collective, per ICI hop, per DCN hop
    # how a collective across domains uses the NICs: "node", its rings spread over every NIC of the
    # domain (NCCL's channel per NIC: V / n_i per device on DCN); "device", one flat ring whose
    # slowest link is each device's own NIC, which carries the whole volume
    dcn_rings: str = "node"
    # what a deviceless compile needs to describe the device (meshpar.plan.target): for a GPU its
    # sm_count, compute_capability "9.0", clock_ghz, memory_bandwidth (B/s), l2_bytes,
    # shared_memory_per_sm, device_kind; for a TPU its chip, libtpu's name ("v5p"), and dims (2 or 3)
    target: dict | None = None

    def check_devices(self, n: int) -> None:
        """One line when `n` devices cannot be formed from this hardware's nodes or slices."""
        if n < 1:
            raise ConfigError(f"--devices must be >= 1, got {n}")
        if self.kind == "tpu":
            ok = (n <= self.domain and n & (n - 1) == 0) or (n > self.domain and n % self.domain == 0)
            if not ok:
                p = 1 << (n.bit_length() - 1)
                raise ConfigError(
                    f"--devices {n} is not a {self.name} slice: a slice holds a power of two chips "
                    f"up to {self.domain}, and more chips are whole slices of {self.domain} "
                    f"(e.g. --devices {p if p <= self.domain else n - n % self.domain or self.domain})"
                )
        elif n > self.domain and n % self.domain:
            raise ConfigError(
                f"--devices {n} cannot be formed from {self.name} nodes of {self.domain}: use up to "
                f"{self.domain}, or a multiple of {self.domain} (e.g. --devices {n - n % self.domain})"
            )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _gpu(sm_count, capability, clock_ghz, bandwidth, l2_bytes, smem_per_sm, kind) -> dict:
    """A GPU's facts for its compiler (NVIDIA datasheets and CUDA's occupancy tables)."""
    return {
        "sm_count": sm_count,
        "compute_capability": capability,
        "clock_ghz": clock_ghz,
        "memory_bandwidth": bandwidth,
        "l2_bytes": l2_bytes,
        "shared_memory_per_sm": smem_per_sm,
        "device_kind": kind,
    }


_NVIDIA_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS dense BF16, 80 GB HBM3, NVLink 900 GB/s "
    "bidirectional; DGX H100: 8 GPUs per node, 8x ConnectX-7 400 Gb/s NDR InfiniBand (one per GPU)"
)
_H100_MATMUL = 0.776  # the matmuls of a Llama-3 8B-shaped step ran at 767 TFLOP/s on the lent H100 (bench/RESULTS.md)
_TPU_LAT = (5e-6, 1e-6, 10e-6)  # assumed (no published per-hop figure used): ICI hops ~1 us, DCN ~10 us
PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in [
        Hardware(
            "h100",
            989e12,
            80 * GB,
            8,
            450 * GB,
            50 * GB,
            efficiency=_H100_MATMUL,
            hbm_bw=3.35e12,
            source=_NVIDIA_H100,
            target=_gpu(132, "9.0", 1.98, 3.35e12, 50 * MIB, 228 * KIB, "NVIDIA H100 80GB HBM3"),
        ),
        Hardware(
            "h200",
            989e12,
            141 * GB,
            8,
            450 * GB,
            50 * GB,
            efficiency=_H100_MATMUL,
            hbm_bw=4.8e12,
            source="NVIDIA H200 datasheet (SXM): 989 TFLOPS dense BF16, 141 GB HBM3e, NVLink 900 GB/s bidirectional; "
            "HGX H200 nodes of 8, 400 Gb/s NDR InfiniBand per GPU",
            target=_gpu(132, "9.0", 1.98, 4.8e12, 50 * MIB, 228 * KIB, "NVIDIA H200"),
        ),
        Hardware(
            "a100-80g",
            312e12,
            80 * GB,
            8,
            300 * GB,
            25 * GB,
            hbm_bw=2.039e12,
            efficiency=0.68,
            source="NVIDIA A100 datasheet (SXM 80GB): 312 TFLOPS dense BF16, NVLink 600 GB/s bidirectional; DGX A100: "
            "8 GPUs, 8x 200 Gb/s HDR InfiniBand",
            target=_gpu(108, "8.0", 1.41, 2.039e12, 40 * MIB, 164 * KIB, "NVIDIA A100-SXM4-80GB"),
        ),
        Hardware(
            "tpu-v4",
            275e12,
            32 * 2**30,
            4096,
            2 * 45 * GB,
            6.25 * GB,
            kind="tpu",
            hbm_bw=1.2e12,
            latency=_TPU_LAT,
            source="Cloud TPU v4 docs: 275 TFLOPS BF16, 32 GiB HBM2, 3D torus, pods of 4096 chips; ICI 45 GB/s one-way "
            "per link (JAX scaling book, TPU chapter); DCN taken as v5p's 50 Gb/s per chip (no v4 figure)",
            target={"chip": "v4", "dims": 3},
        ),
        Hardware(
            "tpu-v5e",
            197e12,
            16 * GB,
            256,
            2 * 25 * GB,
            25e9 / 8,
            kind="tpu",
            hbm_bw=819e9,
            latency=_TPU_LAT,
            source="Cloud TPU v5e docs: 197 TFLOPS BF16, 16 GB HBM2e, ICI 1600 Gb/s per chip over 4 ports (2D torus), "
            "256-chip pods, DCN 6.4 Tb/s per pod (25 Gb/s per chip)",
            target={"chip": "v5e", "dims": 2},
        ),
        Hardware(
            "tpu-v5p",
            459e12,
            95 * 2**30,
            6144,
            2 * 100 * GB,
            50e9 / 8,
            kind="tpu",
            hbm_bw=2.765e12,
            latency=_TPU_LAT,
            source="Cloud TPU v5p docs: 459 TFLOPS BF16, 95 GiB HBM2e, ICI 1200 GB/s bidirectional per chip over 6 "
            "links (3D torus), largest slice 6144 chips, DCN 50 Gb/s per chip",
            target={"chip": "v5p", "dims": 3},
        ),
        Hardware(
            "tpu-v6e",
            918e12,
            32 * GB,
            256,
            2 * 56 * GB,
            100e9 / 8,
            kind="tpu",
            hbm_bw=1.64e12,
            latency=_TPU_LAT,
            source="Cloud TPU v6e (Trillium) docs: 918 TFLOPS BF16, 32 GB HBM, ICI 3584 Gb/s per chip over 4 ports "
            "(2D torus), 256-chip pods, DCN 25.6 Tb/s per pod (100 Gb/s per chip)",
            target={"chip": "v6e", "dims": 2},
        ),
    ]
}

_KEYS = {f.name for f in dataclasses.fields(Hardware)}


def load_hardware(name_or_path: str) -> Hardware:
    """A preset name, or a YAML file with the keys of `Hardware` (name, peak_flops, memory_bytes,
    domain, ici_bw, dcn_bw; optional efficiency, kind, source, hbm_bw (without it the non-matmul
    kernels cost nothing), comm_efficiency, latency as [per collective, per ICI hop, per DCN hop],
    dcn_rings as node or device)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        raise ConfigError(
            f"unknown hardware '{name_or_path}'"
            + suggest(name_or_path, PRESETS)
            + "; or give a YAML file with name, peak_flops, memory_bytes, domain, ici_bw, dcn_bw"
        )
    if not path.exists():
        raise ConfigError(f"hardware file '{path}' does not exist")
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"hardware file '{path}' must hold a mapping")
    for k in data:
        if k not in _KEYS:
            raise ConfigError(f"hardware file '{path}': unknown key '{k}'" + suggest(k, _KEYS))
    missing = [k for k in ("peak_flops", "memory_bytes", "domain", "ici_bw", "dcn_bw") if k not in data]
    if missing:
        raise ConfigError(f"hardware file '{path}' lacks {', '.join(missing)}")
    data.setdefault("name", path.stem)
    lat = data.get("latency")
    if lat is not None and not (isinstance(lat, (list, tuple)) and len(lat) == 3):
        raise ConfigError(
            f"hardware file '{path}': latency must be three seconds [per collective, per ICI hop, "
            f"per DCN hop], e.g. [8.4e-6, 3.4e-6, 9.6e-6]; got {lat!r}"
        )
    try:
        hw = Hardware(
            **{
                k: (
                    v
                    if k in ("name", "kind", "source", "target", "dcn_rings")
                    else int(v)
                    if k == "domain"
                    else tuple(float(x) for x in v)
                    if k == "latency"
                    else float(v)
                )
                for k, v in data.items()
            }
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"hardware file '{path}': {e}") from None
    if hw.kind not in ("gpu", "tpu"):
        raise ConfigError(f"hardware file '{path}': kind must be gpu or tpu, got '{hw.kind}'")
    if hw.dcn_rings not in ("node", "device"):
        raise ConfigError(f"hardware file '{path}': dcn_rings must be node or device, got '{hw.dcn_rings}'")
    return hw
