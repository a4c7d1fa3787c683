"""Mixtral and Qwen3-MoE in and out of Hugging Face format (meshpar.models.hf_moe), proven against
transformers itself on tiny random models saved here: logits on 1 device, under expert parallelism
and under tensor parallelism; an expert-order permutation caught; export round trips bitwise and
loads in transformers; the run's model.name and moe.* keys come from config.json, and one the user
gives must agree, in one line.
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshpar.io import hf  # noqa: E402
from tests.io.test_hf import FSDP_TP, generated, greedy, logits, measured_load, reference, tensors_of, trainer  # noqa: E402
from tests.io.test_hf_families import exports_as, rewritten  # noqa: E402

EP = {"expert": 4, "data": 2}
PROMPT = np.random.default_rng(1).integers(0, 320, (8, 300))  # 8 rows: batch split over data x expert
FAMILIES = {
    # family: (config, model, its config, the moe.* keys a run sets)
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "sliding_window": 48},
        ["moe.num_experts=4", "moe.top_k=2", "moe.every=1", "moe.capacity_factor=null"],
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 2,
            "norm_topk_prob": False,
            "head_dim": 24,
        },
        [
            "moe.num_experts=4",
            "moe.top_k=2",
            "moe.every=2",
            "moe.capacity_factor=null",
            "moe.expert_mlp=32",
            "moe.norm_topk=false",
        ],
    ),
}


def save_moe(path, family, seed=0, shard=None, **kw):
    """A random MoE of `family`: weights std 0.1, norm weights 1 + N(0, 0.3); 4 layers, 4 experts, top 2."""
    config_cls, model_cls, extra, _ = FAMILIES[family]
    torch.manual_seed(seed)
    c = getattr(transformers, config_cls)(
        **{
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "initializer_range": 0.1,
            "attn_implementation": "eager",
            **extra,
            **kw,
        }
    )
    m = getattr(transformers, model_cls)(c).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    m.save_pretrained(path, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    return m


def moe_trainer(path, family, n=1, mesh=None, *extra):
    return trainer(path, n, mesh, "model.name=moe", *FAMILIES[family][3], *extra)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_transformers_on_1_device_under_ep_and_under_tp(tmp_path, family):
    m = save_moe(tmp_path, family)
    ref = reference(m, PROMPT)
    assert ref.std() > 0.3
    for n, mesh in [(1, None), (8, EP), (8, FSDP_TP)]:
        tr = moe_trainer(tmp_path, family, n, mesh)
        diff = np.abs(logits(tr, tr.load_pretrained(), PROMPT) - ref).max()
        print(f"{family} devices={n} mesh={mesh}: max |logits - transformers| = {diff:.3g}")
        assert diff <= 1e-4


def test_shuffled_experts_move_the_logits(tmp_path):
    """Experts 0 and 1 swapped in every layer (their router rows left): a wrong expert order in the
    table would do the same, and the logits test sees it."""
    m = save_moe(tmp_path / "a", "mixtral")

    def swap(t):
        for k in [k for k in t if ".experts.0." in k]:
            j = k.replace(".experts.0.", ".experts.1.")
            t[k], t[j] = t[j], t[k]
        return t

    tr = moe_trainer(rewritten(tmp_path / "a", tmp_path / "b", swap), "mixtral")
    assert np.abs(logits(tr, tr.load_pretrained(), PROMPT) - reference(m, PROMPT)).max() > 1e-2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_loads_in_transformers_and_round_trips_bitwise(tmp_path, family):
    m = save_moe(tmp_path / "src", family)
    tr = moe_trainer(tmp_path / "src", family, 8, EP)
    exports_as(m, tr, tmp_path / "src", tmp_path / "out", FAMILIES[family][1], family, PROMPT[:1])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_init_from_alone_reads_the_experts_from_config_json(tmp_path, capsys, family):
    """`model.init_from=hf:DIR` alone is the run that model.name=moe and the moe.* keys make, and the
    planner (hence FLOP counts and plans) sees its experts; the file `meshpar config` writes from it
    reads back as the same run, without a warning."""
    import dataclasses

    from meshpar.cli import main
    from meshpar.core.config import load_config
    from meshpar.core.notices import config_warnings
    from meshpar.plan.costmodel import ModelFacts
    from tests.conftest import make_cfg

    save_moe(tmp_path, family)
    alone = make_cfg(f"model.init_from=hf:{tmp_path}", "model.layers=null")
    explicit = make_cfg(f"model.init_from=hf:{tmp_path}", "model.layers=null", "model.name=moe", *FAMILIES[family][3])
    assert alone.model.name == "moe" and dataclasses.asdict(alone) == dataclasses.asdict(explicit)
    every, width = {"mixtral": (1, 96), "qwen3_moe": (2, 32)}[family]
    assert ModelFacts.from_config(alone).moe == {
        "num_experts": 4,
        "every": every,
        "top_k": 2,
        "capacity_factor": None,
        "expert_mlp": width,
        "shared_experts": 0,
    }
    capsys.readouterr()
    assert main(["config", f"model.init_from=hf:{tmp_path}"]) == 0
    (tmp_path / "my.yaml").write_text(capsys.readouterr().out)
    again = load_config(tmp_path / "my.yaml")
    assert dataclasses.asdict(again) == dataclasses.asdict(load_config(None, [f"model.init_from=hf:{tmp_path}"]))
    assert config_warnings(again) == []


@pytest.mark.parametrize(
    "family, override, message",
    [
        ("mixtral", "moe.num_experts=8", "moe.num_experts=8 disagrees with {cfg} (num_local_experts: 4)"),
        ("mixtral", "moe.routing=top1", "moe.routing=top1 disagrees with {cfg} (num_experts_per_tok: 2)"),
        (
            "mixtral",
            "moe.capacity_factor=1.25",
            "moe.capacity_factor=1.25 disagrees with {cfg} (MixtralForCausalLM: null)",
        ),
        ("qwen3_moe", "moe.every=1", "moe.every=1 disagrees with {cfg} (decoder_sparse_step: 2)"),
        ("qwen3_moe", "moe.expert_mlp=null", "moe.expert_mlp=null disagrees with {cfg} (moe_intermediate_size: 32)"),
        ("qwen3_moe", "model.name=decoder", "model.name=decoder disagrees with {cfg} (a mixture of experts: moe)"),
    ],
)
def test_a_moe_key_that_disagrees_with_config_json_is_one_line(tmp_path, capsys, family, override, message):
    """Said when the config loads (`meshpar config` compiles nothing): the key, its value and config.json's."""
    from meshpar.cli import main

    save_moe(tmp_path, family)
    capsys.readouterr()
    assert main(["config", f"model.init_from=hf:{tmp_path}", override]) == 2
    err = capsys.readouterr().err
    assert err == f"meshpar: error: {message.format(cfg=tmp_path / 'config.json')}; drop it: model.init_from sets it\n"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_matches_transformers_greedy_under_expert_parallelism(tmp_path, capsys, family):
    from meshpar.io.tokenizer import HFTokenizer
    from tests.io.test_hf import save_tokenizer

    m = save_moe(tmp_path / "hf", family)
    tok_dir = save_tokenizer(tmp_path / "tok")
    prompt = "the quick brown fox jumps over the lazy dog and says hello world"
    want = greedy(m, HFTokenizer(str(tok_dir)).prompt(prompt), 8)
    out = generated(
        capsys,
        "--prompt",
        prompt,
        "--max-new-tokens",
        "8",
        "--devices",
        "8",
        f"model.init_from=hf:{tmp_path / 'hf'}",
        f"data.tokenizer={tok_dir}",
        "precision=fp32",
        "serve.cache_length=64",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "mesh.expert=4",
    )
    # (model.init_from alone: model.name=moe and the moe.* keys come from config.json)
    assert len(out["tokens"][0]) >= 4 and out["tokens"][0] == want[: len(out["tokens"][0])]  # may stop at EOS


def test_sharded_moe_checkpoint_loads_in_one_devices_share_of_host_memory(tmp_path):
    """Under expert parallelism a device reads only its experts' tensors and its slices of the rest,
    one block at a time: the host's transient peak is a few blocks, never the model."""
    m = save_moe(
        tmp_path,
        "mixtral",
        shard="2MB",
        hidden_size=256,
        intermediate_size=512,
        vocab_size=2048,
        initializer_range=0.05,
    )
    assert len(set(json.loads((tmp_path / hf.INDEX).read_text())["weight_map"].values())) > 3
    tr = moe_trainer(tmp_path, "mixtral", 8, EP)
    params, reads, _, transient = measured_load(tr)
    full = {k: v.size for k, v in tensors_of(tmp_path).items()}
    total = sum(v.nbytes for v in tensors_of(tmp_path).values())
    block = max(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    print(f"checkpoint {total} bytes, largest block {block}, host transient peak {transient}")
    assert transient < total / 8 and transient < 4 * block + (256 << 10)  # below one device's share
    # every expert tensor is read once in all (by a device that holds it; the data-parallel copy is
    # placed from that read), the other tensors in blocks of a device's size
    experts = [n for n in full if ".experts." in n]
    assert sum(s for n, s in reads if ".experts." in n) == sum(full[n] for n in experts)
    assert max(s for n, s in reads if n == "model.embed_tokens.weight") <= full["model.embed_tokens.weight"] // 2
    assert np.abs(logits(tr, params, PROMPT) - reference(m, PROMPT)).max() <= 1e-4
