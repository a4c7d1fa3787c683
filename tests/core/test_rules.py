"""Logical-axis resolution: first match, skip size-1 and used axes, joint axes, divisibility errors."""

import pytest
from jax.sharding import PartitionSpec as P

from meshpar.core.errors import ShardingError
from meshpar.core.rules import LOGICAL_AXES, PRESETS, parse_user_rules, resolve, table

MESH = {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "tensor": 2}


def test_first_candidate_that_exists_with_size_above_one_wins():
    rules = table(embed=["expert", "fsdp", "data"])  # expert has size 1: skipped
    assert resolve(("embed",), rules, MESH) == P("fsdp")


def test_an_axis_is_used_at_most_once_per_spec():
    rules = table(embed=["tensor"], mlp=["tensor", "fsdp"])
    assert resolve(("embed", "mlp"), rules, MESH) == P("tensor", "fsdp")


def test_two_dimensions_can_never_share_the_expert_axis():
    mesh = {**MESH, "expert": 2, "data": 1}
    rules = table(expert="expert", group=[("data", "fsdp", "expert")])
    spec = resolve(("expert", "group", "capacity", "embed"), rules, mesh)
    assert spec == P("expert", "fsdp")
    flat = [a for p in spec if p for a in ((p,) if isinstance(p, str) else p)]
    assert flat.count("expert") == 1


def test_joint_candidate_drops_size_one_and_used_axes():
    rules = table(batch=[("data", "fsdp", "expert")], embed="fsdp")
    assert resolve(("batch", "length", "embed"), rules, MESH) == P(("data", "fsdp"))
    assert resolve(("embed", "batch"), rules, MESH) == P("fsdp", "data")


def test_indivisible_dimension_is_an_error_naming_tensor_dimension_and_axes():
    with pytest.raises(ShardingError) as e:
        resolve(("embed", "mlp"), table(mlp="tensor"), MESH, shape=(64, 255), what="parameter 'layers.ffn.w_in'")
    msg = str(e.value)
    assert "parameter 'layers.ffn.w_in'" in msg and "dimension 1" in msg and "'mlp'" in msg
    assert "size 255" in msg and "tensor=2" in msg and "[mlp, null]" in msg


def test_open_vocabulary_a_name_no_rule_covers_is_replicated_and_listed():
    """A user model may name its own dimensions; without a rule they replicate (and are listed)."""
    from meshpar.core.rules import uncovered

    rules = PRESETS["fsdp_tp"].param_rules()
    assert resolve(("patch", "embed"), rules, MESH) == P(None, ("data", "fsdp"))
    assert uncovered(("patch", "embed", None), rules) == ["patch"]
    user = parse_user_rules([["patch", ["tensor"]]])
    assert resolve(("patch", "embed"), user + rules, MESH) == P("tensor", ("data", "fsdp"))


def test_user_rule_whose_axis_is_taken_is_an_error_not_a_silent_replication():
    user = parse_user_rules([["mlp", ["data"]]])
    rules = user + PRESETS["fsdp_tp"].param_rules()
    with pytest.raises(ShardingError) as e:
        resolve(("embed", "mlp"), rules, MESH, (64, 256), "parameter 'w_in'", strict=len(user))
    msg = str(e.value)
    assert "parameter 'w_in'" in msg and "rules[0]" in msg and "'data'" in msg and "dimension 0 ('embed')" in msg
    assert "\n" not in msg
    # the preset's own fall-through (batch over whichever batch axes are left) stays legal
    assert resolve(("embed", "mlp"), PRESETS["fsdp_tp"].param_rules(), MESH) == P(("data", "fsdp"), "tensor")


def test_user_rules_go_first_and_null_replicates():
    user = parse_user_rules([["embed", ["tensor"]], ["vocab", None]])
    preset = PRESETS["fsdp_tp"].param_rules()
    assert resolve(("embed", "vocab"), user + preset, MESH) == P("tensor")
    assert resolve(("embed", "vocab"), preset, MESH) == P(("data", "fsdp"), "tensor")


def test_user_rules_reject_unknown_mesh_axes():
    with pytest.raises(ShardingError, match="unknown mesh axis 'tensr'.*'tensor'"):
        parse_user_rules([["embed", ["tensr"]]])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_names_only_known_logical_and_mesh_axes(name):
    from meshpar.core.mesh import MESH_AXES

    s = PRESETS[name]
    for rules in (s.param_rules(), s.rest_rules(), s.opt_rules()):
        for logical, cands in rules:
            assert logical in LOGICAL_AXES
            for c in cands:
                assert set((c,) if isinstance(c, str) else c) <= set(MESH_AXES)


def test_zero_presets_replicate_params_but_shard_optimizer_state():
    for name in ("zero1", "zero2"):
        s = PRESETS[name]
        assert resolve(("embed", "mlp"), s.param_rules(), MESH) == P()
        assert resolve(("embed", "mlp"), s.opt_rules(), MESH) == P(("data", "fsdp"))


CONTEXT_MESH = {"data": 2, "fsdp": 2, "context": 2, "tensor": 2}
# preset -> the weight [embed, mlp] at rest, in the optimizer state, and at use (activations' rules)
STATE_OVER_CONTEXT = {
    "dp": (P(), P(), P()),
    "zero1": (P("context"), P(("data", "fsdp", "context")), P()),
    "zero2": (P("context"), P(("data", "fsdp", "context")), P()),
    "fsdp": (P(("data", "fsdp", "context")), P(("data", "fsdp", "context")), P(("data", "fsdp"))),
    "hsdp": (P(("fsdp", "context")), P(("fsdp", "context")), P("fsdp")),
    "tp": (P(None, "tensor"), P(None, "tensor"), P(None, "tensor")),
    "tp_sp": (P(None, "tensor"), P(None, "tensor"), P(None, "tensor")),
    "fsdp_tp": (
        P(("data", "fsdp", "context"), "tensor"),
        P(("data", "fsdp", "context"), "tensor"),
        P(("data", "fsdp"), "tensor"),
    ),
}
STATE_OVER_CONTEXT["fsdp_tp_sp"] = STATE_OVER_CONTEXT["fsdp_tp"]  # SP moves activations only


@pytest.mark.parametrize("name", list(STATE_OVER_CONTEXT))
def test_the_train_state_is_split_over_context_as_over_the_data_axes(name):
    """`Strategy.rest`: ZeRO's state over data x fsdp x context and its master weights over context, FSDP's
    parameters over its axes x context; dp and tp replicate over context as over data. Activations (and
    weights at use) keep the data axes only: their `length` takes `context`."""
    from meshpar.core.layout import Layout

    class Mesh:
        axis_names, devices = tuple(CONTEXT_MESH), type("D", (), {"shape": tuple(CONTEXT_MESH.values())})

    layout = Layout(Mesh, PRESETS[name])
    rest, opt, use = STATE_OVER_CONTEXT[name]
    assert layout.spec(("embed", "mlp"), (64, 64), kind="rest") == rest
    assert layout.spec(("embed", "mlp"), (64, 64), kind="opt_state") == opt
    assert layout.spec(("embed", "mlp"), (64, 64)) == use
    length = ("context", "tensor") if name.endswith("tp_sp") else "context"  # SP splits it over tensor too
    assert layout.spec(("batch", "length", "embed"), (8, 16, 64)) == P(("data", "fsdp"), length)


@pytest.mark.parametrize("name", ["zero1", "fsdp", "hsdp"])
def test_a_state_dimension_context_does_not_divide_keeps_the_data_axes_split(name):
    """On data=2 x fsdp=2 x context=2 an `embed` the data axes divide and data x context does not (4;
    hsdp: 2 over fsdp x context) keeps the state split as before `context` joined: never an error a run
    without context did not have. One the data axes do not divide stays an error."""
    from meshpar.core.layout import Layout

    class Mesh:
        axis_names, devices = tuple(CONTEXT_MESH), type("D", (), {"shape": tuple(CONTEXT_MESH.values())})

    layout = Layout(Mesh, PRESETS[name])
    embed, want = (2, P("fsdp")) if name == "hsdp" else (4, P(("data", "fsdp")))
    assert layout.spec(("embed", "mlp"), (embed, 64), kind="opt_state") == want
    assert layout.spec(("embed", "mlp"), (embed, 64), kind="rest") == (P("context") if name == "zero1" else want)
    with pytest.raises(ShardingError, match="not divisible by mesh axes"):
        layout.spec(("embed", "mlp"), (3, 64), kind="opt_state")


# the logical names of the tensors meshpar's models and layers constrain, in their dimensions' order
FLAX_CASES = [
    ("batch", "length", "embed"),
    ("batch", None, "embed"),
    ("batch", "seq", "heads", "kv"),
    ("batch", "seq", "kv_heads", None, "kv"),
    ("batch", "seq", "mlp"),
    ("batch", "seq", "vocab"),
    ("group", None, "embed"),
    ("group", "capacity", "expert", "embed"),
    ("vocab", "embed"),
    ("embed", "vocab"),
    ("embed", None, "mlp"),
    ("heads", "kv", "embed"),
    ("layers", "embed", "mlp"),
    ("layers", "expert", "embed", "expert_mlp"),
    ("layers", "cache_batch", "kv_heads", "cache_length", "kv"),
]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("mesh", [MESH, {a: 2 for a in ("pipeline", "data", "fsdp", "expert", "tensor", "context")}])
def test_flax_logical_rules_resolve_as_meshpar_does(preset, mesh):
    """Flax's own resolver (`flax.linen.logical_to_mesh_axes`) over `flax_table`'s rules gives every
    case meshpar's PartitionSpec, under each preset, with a user rule ahead of it whose candidate an
    earlier dimension takes part of (meshpar takes the rest), and one that replicates."""
    import flax.linen as nn

    from meshpar.core.flax_rules import flax_table

    user = table(mlp=[("fsdp", "tensor")], vocab=None)
    for rules in (PRESETS[preset].rules("params"), user + PRESETS[preset].rules("params")):
        flax_rules = flax_table(rules, mesh)
        for names in FLAX_CASES:
            want = tuple(resolve(names, rules, mesh))
            got = tuple(nn.logical_to_mesh_axes(names, flax_rules))
            assert got[: len(want)] == want and not any(got[len(want) :]), (preset, names, got, want)
