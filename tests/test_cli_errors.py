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
    ],
)
def test_an_output_file_in_a_missing_folder_is_one_line(capsys, tmp_path, argv, flag):
    """Said before any work (no compile, no plan): the flag, the path and the folder at fault."""
    missing = tmp_path / "no" / "dir"
    (tmp_path / "run.jsonl").write_text("")
    argv = [a.format(missing=missing, run=tmp_path / "run.jsonl") for a in argv]
    code, err = run_cli(capsys, *argv)
    path = next(a for a in argv if a.startswith(str(missing)))
    assert code == 2 and err == (
        f"meshpar: error: {flag} {path}: the folder {missing} does not exist; create it or choose another path\n"
    )


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
