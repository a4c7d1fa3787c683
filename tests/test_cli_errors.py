"""Bad input: `meshpar` exits 2 with one line naming the thing at fault, never an XLA traceback."""

import pytest

from meshpar.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["mesh.data=3", "mesh.fsdp=1", "mesh.tensor=1"],
            "mesh axes multiply to 3 (data=3) but there are 8 devices; set one axis to -1 to fill, "
            "or run with --devices 3",
        ),
        (["mesh.data=-1", "mesh.fsdp=-1"], "only one mesh axis may be -1 (fill), got mesh.data, mesh.fsdp"),
        (["mesh.tensr=2"], "unknown config key 'mesh.tensr' (did you mean 'mesh.tensor'?)"),
        (["strategy=fsd"], "config key 'strategy' has unknown value 'fsd' (did you mean 'fsdp'?)"),
        (["rules=[[embd, [tensor]]]"], "rules[0]: unknown logical axis 'embd' (did you mean 'embed'?)"),
        (["rules=[[embed, [tensr]]]"], "rules[0] (embed): unknown mesh axis 'tensr' (did you mean 'tensor'?)"),
        (
            ["strategy=tp", "model.mlp=255"],
            "parameter 'layers.ffn.w_down': dimension 1 ('mlp', size 255) is not divisible by mesh axes tensor=2 (= 2)",
        ),
        (
            ["strategy=fsdp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "model.embed=36", "model.head_dim=8"],
            "parameter 'embedding': dimension 1 ('embed', size 36) is not divisible by mesh axes data=8 (= 8)",
        ),
        (
            ["batch.global_size=10"],
            "batch.global_size=10 is not divisible by the data-parallel size 4 (data=2 x fsdp=2); use a multiple of 4",
        ),
        (
            ["batch.global_size=16", "batch.microbatches=3"],
            "batch.global_size=16 is not divisible by batch.microbatches=3",
        ),
        (["model.size=3b"], "unknown model size '3b'"),
        (["model.heads=6", "model.kv_heads=4"], "model.heads=6 must be a multiple of model.kv_heads=4"),
        (["model.attention=cudnn"], "model.attention=cudnn needs an NVIDIA GPU (this backend is cpu)"),
        (["model.attention=splash"], "model.attention=splash needs a TPU (this backend is cpu"),
        (
            ["mesh.context=4", "mesh.fsdp=1", "mesh.tensor=1", "batch.length=20"],
            "batch.length=20 is not divisible by 2 x mesh.context = 8",
        ),
        (
            ["mesh.context=3", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"],  # the mesh first, not batch.length=64
            "mesh axes multiply to 3 (context=3) but there are 8 devices",
        ),
        (
            ["mesh.context=3"],
            "mesh axes multiply to 24 (data=2 x fsdp=2 x context=3 x tensor=2) but there are 8 devices",
        ),
        (["model.window=0"], "config key 'model.window' must be a positive number of tokens"),
        (["train.loss_chunks=3"], "train.loss_chunks=3 does not divide batch.length=64; pick a divisor"),
        (["train.loss_chunks=2", "train.loss=stages"], "train.loss_chunks=2 slices the built-in lm loss"),
        (["model.attention=flsh"], "config key 'model.attention' has unknown value 'flsh' (did you mean 'flash'?)"),
        (
            ["mesh.context=2", "mesh.pipeline=2", "mesh.fsdp=1", "mesh.tensor=1", "model.name=moe"],
            "mesh.context=2 with mesh.pipeline=2 and model.name=moe: a pipeline stage routes only its own share",
        ),
        (["train.lr=nan"], "config key 'train.lr' must be a finite number, got 'nan'"),
        (["model.rope_theta=.inf"], "config key 'model.rope_theta' must be a finite number, got inf"),
        (["moe.capacity_factor=-.inf"], "config key 'moe.capacity_factor' must be a finite number, got -inf"),
        (
            ["mesh.dcn={data: 3}"],
            "mesh.dcn sizes multiply to 3 (data=3), which does not divide the 8 devices; use DCN sizes whose "
            "product divides 8, or run with a multiple of 3 devices",
        ),
        (
            ["mesh.dcn={data: 2}"],
            "mesh axes multiply to 8 (data=2 x fsdp=2 x tensor=2) but there are 4 devices in each of the 2 DCN "
            "slices (mesh.dcn data=2) of the 8; set one axis to -1 to fill, or run with --devices 16",
        ),
        (
            ["train.loss=lmm"],
            "config key 'train.loss' has unknown value 'lmm' (did you mean 'lm'?); or name your own loss as "
            "PKG.MODULE:FN, FN(model, batch) -> (loss, metrics)",
        ),
        (
            ["train.loss=tests.test_cli_errors:shape_error_los"],
            "config key 'train.loss': module 'tests.test_cli_errors' has no 'shape_error_los' (did you mean "
            "'shape_error_loss'?)",
        ),
        (["train.max_consecutive_skips=0"], "config key 'train.max_consecutive_skips' must be >= 1, got 0"),
        (
            [
                "mesh.context=2",
                "mesh.fsdp=1",
                "mesh.data=4",
                "mesh.tensor=1",
                "model.attention=xla",
                "model.context_strategy=ring",
            ],
            "model.context_strategy=ring needs model.attention=flash",
        ),
    ],
)
def test_bad_input_is_one_clear_line(capsys, args, message):
    code, err = run_cli(capsys, "train", *args)
    assert code == 2
    assert message in err
    assert err.startswith("meshpar: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_wrong_loss_name_is_never_matched_to_what_its_module_imports(capsys):
    """The module's own functions and classes only: not `pytest` (a module it imports), which the
    old suggestion offered for 'pytst'."""
    code, err = run_cli(capsys, "train", "train.loss=tests.test_cli_errors:pytst")
    assert code == 2 and "module 'tests.test_cli_errors' has no 'pytst'" in err and "'pytest'" not in err
    assert err.count("\n") == 1


# user code that raises, in this (a user's) file: the CLI shows these frames, then one line
def _divide(n):
    return n / 0


def zero_division_factory(cfg, rngs):
    return _divide(cfg.model.layers)


def jax_error_factory(cfg, rngs):
    import jax.numpy as jnp

    return jnp.ones(3) @ jnp.ones(4)


def shape_error_loss(model, batch):
    import jax.numpy as jnp

    return jnp.ones(3) @ jnp.ones(4), {}


class _LostShard:
    def batch_spec(self, global_size, length):
        from meshpar.core.batch import lm_batch_spec

        return lm_batch_spec(global_size, length)

    def rows(self, seed, step, rows, length):
        raise OSError("the shard is gone")


def lost_shard_source(cfg):
    return _LostShard()


@pytest.mark.parametrize(
    "override, last, frames",
    [
        (
            "model.name=tests.test_cli_errors:zero_division_factory",
            "building model.name=tests.test_cli_errors:zero_division_factory: ZeroDivisionError: division by zero",
            ["zero_division_factory", "_divide"],
        ),
        (
            "model.name=tests.test_cli_errors:jax_error_factory",
            "building model.name=tests.test_cli_errors:jax_error_factory: TypeError: dot_general requires "
            "contracting dimensions to have the same shape, got (3,) and (4,).",
            ["jax_error_factory"],
        ),
        (
            "train.loss=tests.test_cli_errors:shape_error_loss",
            "tracing train.loss=tests.test_cli_errors:shape_error_loss: TypeError: dot_general requires "
            "contracting dimensions to have the same shape, got (3,) and (4,).",
            ["shape_error_loss"],
        ),
        (
            "data.kind=tests.test_cli_errors:lost_shard_source",
            "reading step 1's rows 0..0 from the data source tests.test_cli_errors._LostShard: OSError: the shard "
            "is gone",
            ["rows"],
        ),
        (
            "model.name=broken_user_module:factory",
            "importing model.name=broken_user_module:factory: NameError: name 'undefined_name' is not defined",
            ["<module>"],
        ),
        (
            "model.name=unparsable_user_module:factory",
            "importing model.name=unparsable_user_module:factory: SyntaxError: invalid syntax "
            "(unparsable_user_module.py, line 1)",
            ["<module>"],
        ),
    ],
)
def test_an_exception_in_user_code_shows_its_frames_then_one_line(
    capsys, monkeypatch, tmp_path, override, last, frames
):
    """A user's factory, loss, data source or module that raises (or whose JAX call raises): the
    frames of the user's own files, then the exception as the last line, prefixed by what meshpar was
    doing, exit status 2; not 42-79 lines of meshpar's and JAX's frames ending in JAX's note."""
    (tmp_path / "broken_user_module.py").write_text("import jax\nx = undefined_name\n")
    (tmp_path / "unparsable_user_module.py").write_text("def factory(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fast = ["model.layers=1", "batch.global_size=8", "batch.length=8", "precision=fp32", "steps=1"]
    code, err = run_cli(capsys, "train", override, *fast)
    lines = err.splitlines()
    shown = lines[lines.index("meshpar: in your code (most recent call last):") + 1 : -1]
    assert code == 2 and lines[-1] == f"meshpar: error: {last}", err[-3000:]
    places = [line.strip() for line in shown if line.startswith('  File "')]
    assert [p.rsplit(" in ", 1)[1] for p in places] == frames, shown
    here = "test_cli_errors.py" if "tests." in override else override.split("=")[1].split(":")[0] + ".py"
    assert all(p.split('"')[1].endswith(here) for p in places), shown
    assert "Traceback" not in err and "JAX has removed" not in err and "/meshpar/" not in "\n".join(shown)


def test_an_exception_in_meshpars_own_code_keeps_its_type_and_traceback():
    """`user_code` turns only exceptions raised through a user's frame into one line: a bug in
    meshpar's own code (here an empty row of the built-in language, read inside the boundary) keeps
    its type, and its traceback still points at meshpar."""
    import traceback

    from meshpar.train.batches import Batches
    from meshpar.train.data import MarkovLanguage

    with pytest.raises(IndexError) as caught:
        Batches(MarkovLanguage(8, 2, 0), None, 1, -1, 0).probe()
    assert traceback.extract_tb(caught.value.__traceback__)[-1].filename.endswith("meshpar/train/data.py")


def test_a_config_file_that_is_not_utf8_is_one_line(capsys, tmp_path):
    bad = tmp_path / "binary.yaml"
    bad.write_bytes(b"steps: 2\n\xff\xfe\x00")
    code, err = run_cli(capsys, "config", "--config", str(bad))
    assert code == 2 and err == (
        f"meshpar: error: config file '{bad}' is not UTF-8 text (byte 0xff at offset 9); a config is YAML: "
        "save it as UTF-8\n"
    )


def test_more_fake_devices_than_a_process_can_start_are_refused_before_any_is_made(capsys, monkeypatch):
    """--devices 100000 printed nothing for minutes while XLA made the devices: refused in one line."""
    from meshpar.core import mesh

    monkeypatch.setattr(mesh, "fake_cpu_devices", lambda n: pytest.fail(f"{n} devices were made"))
    code, err = run_cli(capsys, "train", "--devices", "100000")
    assert code == 2 and err.startswith(
        "meshpar: error: --devices 100000: a process fakes at most 2048 CPU devices (XLA starts a thread per device;"
    )
    assert "--target HW compiles for more devices" in err and err.count("\n") == 1


def test_inspect_reports_the_same_errors(capsys):
    code, err = run_cli(capsys, "inspect", "strategy=zero9")
    assert code == 2 and "unknown value 'zero9'" in err


def test_missing_config_file(capsys, tmp_path):
    code, err = run_cli(capsys, "train", "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml' does not exist" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "steps=1", "--devices", "1", "mesh.data=1"],
        ["train", "--devices", "1", "steps=1", "mesh.data=1"],
        ["train", "steps=1", "mesh.data=1", "--devices=1"],
    ],
)
def test_flags_and_overrides_mix_in_any_order(argv):
    from meshpar.cli import parse

    args = parse(argv)
    assert (args.command, args.devices, args.overrides) == ("train", 1, ["steps=1", "mesh.data=1"])
    args = parse(["inspect", "strategy=dp", "--json", "mesh.data=8", "--devices", "8"])
    assert args.json and args.devices == 8 and args.overrides == ["strategy=dp", "mesh.data=8"]


def test_launch_names_a_bad_process_count(capsys):
    code, err = run_cli(capsys, "launch", "two", "steps=1")
    assert code == 2 and "meshpar launch: N must be a positive number of processes, got 'two'" in err
    assert err.count("\n") == 1


def test_keys_the_run_will_not_read_get_one_warning_line():
    from meshpar.train.step import Trainer
    from tests.conftest import devices, make_cfg

    cfg = make_cfg("moe.num_experts=4", "pipeline.schedule=1f1b", "rules=[[patch, [tensor]]]")
    assert cfg.ignored == ["moe.num_experts", "pipeline.schedule"]
    lines = Trainer(cfg, devices=devices(8)).warnings()
    assert lines[0] == (
        "warning: ignoring moe.num_experts, pipeline.schedule: moe.* needs model.name=moe "
        "(model.name=decoder); pipeline.* needs mesh.pipeline > 1"
    )
    assert lines[1].startswith("warning: rules[0] (patch) name no parameter, variable or batch leaf")
    assert (
        make_cfg(
            "model.name=moe",
            "moe.num_experts=4",
            mesh={"data": 4, "pipeline": 2},
        ).ignored
        == []
    )


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_one_line(capsys, port):
    code, err = run_cli(capsys, "serve", "--port", port)
    assert code == 2 and err == f"meshpar: error: --port {port} is out of range: use 1..65535 (0: any free one)\n"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["train", "--metrics-out", "{missing}/m.jsonl"], "--metrics-out"),
        (["plan", "--devices", "8", "--out", "{missing}/plan.yaml"], "--out"),
        (["plot", "{run}", "-o", "{missing}/run.png"], "-o"),
        (["export", "--out", "{missing}/hf"], "--out"),
    ],
)
def test_an_output_file_in_a_missing_folder_is_one_line(capsys, tmp_path, argv, flag):
    """Said before any work (no compile, no plan, no folder made): the flag, the path and the folder at
    fault; `export --out` creates its own folder only, in a folder that exists."""
    missing = tmp_path / "no" / "dir"
    (tmp_path / "run.jsonl").write_text("")
    argv = [a.format(missing=missing, run=tmp_path / "run.jsonl") for a in argv]
    code, err = run_cli(capsys, *argv)
    path = next(a for a in argv if a.startswith(str(missing)))
    assert code == 2 and err == (
        f"meshpar: error: {flag} {path}: the folder {missing} does not exist; create it or choose another path\n"
    )
    assert not missing.parent.exists()


def test_an_export_folder_under_a_file_is_one_line(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    code, err = run_cli(capsys, "export", "--out", str(tmp_path / "f" / "out"))
    assert code == 2 and err == (
        f"meshpar: error: --out {tmp_path / 'f' / 'out'}: {tmp_path / 'f'} is a file, "
        "not a folder; choose another path\n"
    )


def test_an_out_of_vocabulary_prompt_id_is_refused_before_the_model_is_placed(capsys, monkeypatch):
    """The vocabulary is the config's (model.vocab, the size preset, init_from's config.json): the id
    is refused before any weight is built or loaded (it took ~17 s of set-up before)."""
    from meshpar.serve.engine import Engine

    def placed(*a, **k):
        raise AssertionError("the engine was built before the prompt was checked")

    monkeypatch.setattr(Engine, "__init__", placed)
    code, err = run_cli(capsys, "generate", "--prompt-ids", "1,2,99999", "model.vocab=256")
    assert code == 2 and err == "meshpar: error: prompt token id 99999 is outside the vocabulary 0..255\n"


def test_a_text_prompt_needs_a_byte_vocabulary_before_any_id_is_checked(capsys, monkeypatch):
    """'héllo' is bytes 104 195 169 ...: with model.vocab=128 the fault is the vocabulary too small
    for byte prompts (it said "token id 195 is outside the vocabulary"), before the model is placed."""
    from meshpar.serve.engine import Engine

    monkeypatch.setattr(Engine, "__init__", lambda *a, **k: pytest.fail("the engine was built"))
    code, err = run_cli(capsys, "generate", "--prompt", "héllo", "model.vocab=128")
    assert code == 2 and err == (
        "meshpar: error: text prompts use byte tokens 0..255 and need model.vocab >= 256, got 128; "
        "give token ids with --prompt-ids instead\n"
    )
