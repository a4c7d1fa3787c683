"""Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 in and out of Hugging Face format (meshpar.models.hf_llama.FAMILIES),
proven against transformers itself on tiny random models saved here.

Each family's own parts are made to matter: norm weights and biases are random (transformers
initialises them to ones and zeros, under which a swapped or dropped mapping is invisible), the
prompt (300 tokens) is longer than Mistral's window, and a permutation test per family shows that
the logits test would catch a wrong mapping.
"""

import json
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import save_file  # noqa: E402

from meshpar.core.errors import ConfigError  # noqa: E402
from meshpar.io import hf  # noqa: E402
from tests.io.test_hf import FSDP_TP, PROMPT, generated, greedy, logits, reference, tensors_of, trainer  # noqa: E402

GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 1 + ["sliding_attention"] * 2
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
}
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 48}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24, "use_sliding_window": False}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 48,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    # 5 layers in groups of 3 (local, local, global), the last 2 a tail; RoPE base and scaling per layer type; tied
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 48,
            "query_pre_attn_scalar": 24,
            "num_hidden_layers": 5,
            "tie_word_embeddings": True,
            "layer_types": GEMMA3_TYPES,
            "rope_parameters": GEMMA3_ROPE,
        },
    ),
}


def save_family(path, family, seed=0, **kw):
    """A random model of `family` (weights std 0.1; norm weights 1 + N(0, 0.3), biases N(0, 0.3)), fp32."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    c = getattr(transformers, config_cls)(
        **{
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
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
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    m.save_pretrained(path, safe_serialization=True)
    return m


def rewritten(src, dst, change):
    """A copy of the checkpoint at `src` with its tensors passed through `change(dict)`."""
    t = change(tensors_of(src))
    dst.mkdir()
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst)
    return dst


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_transformers_on_1_and_8_devices(tmp_path, family):
    m = save_family(tmp_path, family)
    ref = reference(m, PROMPT)
    assert ref.std() > 0.3
    for n, mesh in [(1, None), (8, FSDP_TP)]:
        tr = trainer(tmp_path, n, mesh)
        diff = np.abs(logits(tr, tr.load_pretrained(), PROMPT) - ref).max()
        print(f"{family} devices={n}: max |logits - transformers| = {diff:.3g}")
        assert diff <= 1e-4


def _swap(a, b):
    def change(t):
        for k in [k for k in t if k.endswith(a)]:
            t[k], t[k.replace(a, b)] = t[k.replace(a, b)], t[k]
        return t

    return change


@pytest.mark.parametrize(
    "family,change",
    [
        ("qwen2", _swap("self_attn.k_proj.bias", "self_attn.v_proj.bias")),  # biases read into the wrong slot
        ("qwen3", _swap("self_attn.q_norm.weight", "self_attn.k_norm.weight")),  # q/k norms swapped
        ("gemma2", _swap("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")),  # post-norms swapped
        ("gemma3_text", _swap("layers.3.self_attn.q_norm.weight", "layers.3.self_attn.k_norm.weight")),  # in the tail
    ],
)
def test_a_wrong_mapping_moves_the_logits(tmp_path, family, change):
    """The same mapping error in the checkpoint that a wrong table would make: the test above must see it."""
    m = save_family(tmp_path / "a", family)
    tr = trainer(rewritten(tmp_path / "a", tmp_path / "b", change))
    assert np.abs(logits(tr, tr.load_pretrained(), PROMPT) - reference(m, PROMPT)).max() > 1e-2


def test_mistral_window_is_read_from_config_json(tmp_path):
    """Mistral's only difference from Llama is the window: read without it, the 300-token logits move."""
    m = save_family(tmp_path / "a", "mistral")
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "model.safetensors", tmp_path / "b")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "b" / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    tr = trainer(tmp_path / "b")
    assert np.abs(logits(tr, tr.load_pretrained(), PROMPT) - reference(m, PROMPT)).max() > 1e-2


def exports_as(m, tr, src, out, arch, family, prompt):
    """Export `tr`'s load of `src` to `out` in fp32 and check it: the same tensors bit for bit (HF ->
    meshpar -> HF), config.json of `arch`/`family`, transformers loads it with no missing, unexpected
    or mismatched keys, and gives `m`'s logits exactly. -> the model transformers loaded."""
    from flax import nnx

    from meshpar.core.sharding import building

    with building(tr.policy):
        abstract = nnx.eval_shape(lambda: tr.factory(nnx.Rngs(0)))
    hf.export(tr.load_pretrained(), abstract, str(out), "fp32")
    a, b = tensors_of(src), tensors_of(out)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # HF -> meshpar -> HF
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [arch] and written["model_type"] == family
    back, info = getattr(transformers, arch).from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys")
    assert np.abs(reference(back.eval(), prompt) - reference(m, prompt)).max() == 0
    return back


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_loads_in_transformers_and_round_trips_bitwise(tmp_path, family):
    m = save_family(tmp_path / "src", family)
    tr = trainer(tmp_path / "src", 8, FSDP_TP)
    back = exports_as(m, tr, tmp_path / "src", tmp_path / "out", FAMILIES[family][1], family, PROMPT[:1])
    assert back.config.sliding_window == m.config.sliding_window
    assert back.config.rope_parameters == m.config.rope_parameters
    assert getattr(back.config, "layer_types", None) == getattr(m.config, "layer_types", None)


def test_gemma3_rope_and_pattern_are_read_per_layer_type(tmp_path):
    """Gemma 3's local and global layers differ by RoPE base and scaling: read with the two swapped,
    the logits move; its transformers 4 config.json (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern, no layer_types) reads as the same model; a pattern that is not groups of
    sliding layers closed by a full one is refused in one line."""
    m = save_family(tmp_path / "a", "gemma3_text")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())

    def variant(name, config):
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "a" / "model.safetensors", tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return trainer(tmp_path / name)

    swapped = {"sliding_attention": GEMMA3_ROPE["full_attention"], "full_attention": GEMMA3_ROPE["sliding_attention"]}
    tr = variant("swapped", {**cfg, "rope_parameters": swapped})
    assert np.abs(logits(tr, tr.load_pretrained(), PROMPT[:1]) - reference(m, PROMPT[:1])).max() > 1e-2
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    tr = variant(
        "v4",
        {
            **old,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "sliding_window_pattern": 3,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    )
    assert tr.spec.shapes["tail"]["blocks"][1]["attn"]["q_norm"]["scale"].shape == (16,)
    assert np.abs(logits(tr, tr.load_pretrained(), PROMPT[:1]) - reference(m, PROMPT[:1])).max() <= 1e-4
    with pytest.raises(ConfigError, match=r"config.json: key 'layer_types' must repeat"):
        variant("odd", {**cfg, "layer_types": ["full_attention", *GEMMA3_TYPES[1:]]})


def test_gemma3_fine_tunes_and_exports_its_tail_and_refuses_a_pipeline(tmp_path):
    """A Gemma 3 whose layers are not a multiple of its pattern trains (the tail's weights move), its
    export gives the checkpoint's logits in transformers; a pipeline (which cannot hold the tail) is
    refused in one line."""
    from meshpar.cli import main
    from meshpar.io.checkpoint import restore_weights

    src = tmp_path / "hf"
    save_family(src, "gemma3_text")
    common = [
        f"model.init_from=hf:{src}",
        "precision=fp32",
        "batch.global_size=8",
        "batch.length=32",
        "train.warmup_steps=1",
        "train.lr=0.01",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "--devices",
        "8",
    ]
    assert main(["train", "steps=2", *common]) == 0
    assert main(["export", "--out", str(tmp_path / "out"), "--dtype", "fp32", *common]) == 0
    a, b = tensors_of(src), tensors_of(tmp_path / "out")
    assert sorted(a) == sorted(b)
    assert not np.array_equal(a["model.layers.4.mlp.down_proj.weight"], b["model.layers.4.mlp.down_proj.weight"])
    tr = trainer(src)
    target = {
        "params": jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tr.spec.shapes, tr.param_shardings
        )
    }
    tree, step, _ = restore_weights(str(tmp_path / "ckpt"), target, lambda m: None)
    back = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert step == 2 and np.abs(logits(tr, tree["params"], PROMPT[:1]) - reference(back, PROMPT[:1])).max() <= 1e-4
    with pytest.raises(
        ConfigError,
        match=r"cannot be pipelined: its 5 layers are 1 scanned groups of 3 plus a tail "
        r"of 2 local layers.*set mesh.pipeline=1",
    ):
        trainer(src, 8, {"pipeline": 2, "data": 4}, "strategy=dp")


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text", "qwen3"])
def test_generate_matches_transformers_greedy(tmp_path, capsys, family):
    """Greedy decoding equals transformers' generate; where the family has a window, one of 16 and a
    prompt longer than it: prefill and each decoded token see only the last 16 positions (Gemma: on
    its local layers; its global ones see all)."""
    from meshpar.io.tokenizer import HFTokenizer
    from tests.io.test_hf import save_tokenizer

    m = save_family(tmp_path / "hf", family, **({} if family == "qwen3" else {"sliding_window": 16}))
    tok_dir = save_tokenizer(tmp_path / "tok")
    prompt = "the quick brown fox jumps over the lazy dog and says hello world " * 2
    ids = HFTokenizer(str(tok_dir)).prompt(prompt)
    assert len(ids) > 16
    want = greedy(m, ids, 8)
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
        "serve.cache_length=128",
        "mesh.data=4",
        "mesh.fsdp=1",
        "mesh.tensor=2",
    )
    assert len(out["tokens"][0]) >= 4 and out["tokens"][0] == want[: len(out["tokens"][0])]  # may stop at EOS


def test_unsupported_family_options_are_one_line(tmp_path):
    save_family(tmp_path / "a", "qwen2")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(ConfigError, match=r"config.json: key 'use_sliding_window' is true; .* set it false"):
        trainer(tmp_path / "a")


def test_export_writes_the_family_that_has_the_decoders_options():
    """A decoder made here (not read) exports as the family whose format holds its options; what no
    family here holds is refused in one line."""
    from meshpar.models.decoder import DecoderConfig
    from meshpar.models.hf_llama import hf_config

    c = DecoderConfig(layers=2, embed=64, heads=4, kv_heads=2, head_dim=16, mlp=96, vocab=320)
    assert hf_config(c)["architectures"] == ["LlamaForCausalLM"]
    windowed = hf_config(c.replace(window=32))
    assert windowed["architectures"] == ["MistralForCausalLM"] and windowed["sliding_window"] == 32
    assert hf_config(c.replace(qk_norm=True))["model_type"] == "qwen3"
    with pytest.raises(ConfigError, match="model.softcap: attention soft-capping has no place"):
        hf_config(c.replace(softcap=30.0))


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MISTRAL_CHAT = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def _tokenizer(path, **config):
    from tests.io.test_hf import save_tokenizer

    d = save_tokenizer(path)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", **config}))
    return d


def test_bos_follows_the_tokenizer_not_config_json(tmp_path):
    """Qwen's tokenizer names no BOS though its config.json has a bos_token_id: prompts and documents
    start without one, as transformers' tokenizer encodes them."""
    from meshpar.io.tokenizer import HFTokenizer

    qwen = _tokenizer(tmp_path / "qwen", bos_token=None)
    (qwen / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = HFTokenizer(str(qwen))
    ids = tok.encode("hello world")
    assert tok.prompt("hello world") == ids and tok.document("hello world") == ids + [2]
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(qwen))
    assert ref("hello world")["input_ids"] == ids
    assert HFTokenizer(str(_tokenizer(tmp_path / "off", add_bos_token=False))).prompt("hello") == tok.encode("hello")
    assert HFTokenizer(str(_tokenizer(tmp_path / "llama"))).prompt("hello") == [1, *tok.encode("hello")]


@pytest.mark.parametrize("template", [CHATML, MISTRAL_CHAT], ids=["chatml", "mistral"])
def test_chat_template_renders_as_transformers_does(tmp_path, template):
    from meshpar.io.tokenizer import HFTokenizer

    d = _tokenizer(tmp_path / "tok", chat_template=template)
    messages = [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the lazy dog"},
        {"role": "user", "content": "quick brown fox ü"},
    ]
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert HFTokenizer(str(d)).chat(messages) == list(want)
    if template is MISTRAL_CHAT:
        with pytest.raises(ConfigError, match="chat_template failed: Conversation roles must alternate"):
            HFTokenizer(str(d)).chat(messages[:1] * 2)
    with pytest.raises(ConfigError, match="no chat_template in its tokenizer_config.json: drop --chat"):
        HFTokenizer(str(_tokenizer(tmp_path / "plain"))).chat(messages)


def test_generate_chat_matches_transformers_greedy(tmp_path, capsys):
    m = save_family(tmp_path / "hf", "qwen2")
    d = _tokenizer(tmp_path / "tok", bos_token=None, chat_template=CHATML)
    ids = transformers.PreTrainedTokenizerFast.from_pretrained(str(d)).apply_chat_template(
        [{"role": "user", "content": "hello world"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    want = greedy(m, ids, 6)
    out = generated(
        capsys,
        "--chat",
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "6",
        f"model.init_from=hf:{tmp_path / 'hf'}",
        f"data.tokenizer={d}",
        "precision=fp32",
        "--devices",
        "8",
        "serve.cache_length=64",
        "mesh.data=4",
        "mesh.fsdp=1",
        "mesh.tensor=2",
    )
    assert len(out["tokens"][0]) >= 3 and out["tokens"][0] == want[: len(out["tokens"][0])]
