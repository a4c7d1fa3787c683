"""Peak host memory of `model.init_from=hf:DIR` loading vs the checkpoint's size.

    python bench/bench_hf_load.py [--dir /tmp/hf_bench] [--devices 1|8]

Builds (once) a random Llama of ~156M parameters with transformers, saved in bf16 as 2 safetensors
shards (~312 MB) with an index, then in this process loads it with meshpar into fp32 parameters
(1 device: dp; 8 fake devices: fsdp_tp) and prints one JSON line: checkpoint bytes, the loaded
weights' bytes, the process's resident memory before, at its peak (ru_maxrss) and after loading,
and tracemalloc's transient peak (numpy blocks alive beyond what stays as weights).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path


def build(d: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    c = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        torch_dtype="bfloat16",
    )
    transformers.LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained(
        d, safe_serialization=True, max_shard_size="200MB"
    )


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/hf_bench")
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    d = Path(args.dir)
    if not (d / "config.json").exists():
        # built in a child process, so torch's memory is not this process's
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import bench_hf_load as b; from pathlib import Path; b.build(Path({str(d)!r}))",
            ],
            check=True,
        )
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from meshpar.core.config import load_config
    from meshpar.train.step import Trainer

    mesh = (
        ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "strategy=dp"]
        if args.devices == 1
        else ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "strategy=fsdp_tp"]
    )
    cfg = load_config(
        None, [f"model.init_from=hf:{d}", "precision=fp32", f"devices={args.devices}", "batch.global_size=8", *mesh]
    )
    tr = Trainer(cfg, devices=jax.devices()[: args.devices])
    ckpt = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    before = rss()
    tracemalloc.start()
    t0 = time.perf_counter()
    params = jax.block_until_ready(tr.load_pretrained())
    seconds = time.perf_counter() - t0
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    after = rss()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    print(
        json.dumps(
            {
                "devices": args.devices,
                "checkpoint_bytes": ckpt,
                "weights_bytes": weights,
                "rss_before": before,
                "rss_peak": maxrss,
                "rss_after": after,
                "peak_growth": maxrss - before,
                "transient_beyond_weights": maxrss - after,
                "tracemalloc_transient": peak - kept,
                "load_s": round(seconds, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
