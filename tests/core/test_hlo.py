"""Which devices a collective joins, read from HLO text in each of XLA's notations (meshpar/core/hlo.py):
the pipeline's deadlock check and `inspect`'s collective axes both read groups here."""

import pytest

from meshpar.core.hlo import device_groups


def _line(groups: str, op: str = "all-reduce") -> str:
    return f"  %x.1 = f32[4]{{0}} {op}(%p), channel_id=1, {groups}, use_global_device_ids=true, to_apply=%sum"


@pytest.mark.parametrize(
    "groups, expected",
    [
        ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
        ("replica_groups={}", None),  # every device
        ("replica_groups=[2,2]<=[4]", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[2,2]T(1,0)", [[0, 2], [1, 3]]),
        # jaxlib 0.11: named by mesh axes, as a pipeline's psum over `context` prints
        (
            "replica_groups=mesh['pipeline'=2,'data'=2,'fsdp'=1,'context'=2] {'context'}",
            [[0, 1], [2, 3], [4, 5], [6, 7]],
        ),
        ("replica_groups=mesh['pipeline'=2,'data'=2,'context'=2] {'pipeline'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['pipeline'=2,'data'=2,'context'=2] {'data','context'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # Shardy's sub-axes of b=4: (1)2 its major factor, (2)2 its minor one
        ("replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4] {'b':(2)2}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        # a mesh whose devices are not in order: which device sits at each mesh position
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'a'}", [[0, 1], [2, 3]]),
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}", [[3, 2], [1, 0]]),
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=(?) {'b'}", None),  # not read: the caller assumes all
        ("replica_groups=mesh['a'=2,'b'=2] {'c'}", None),  # an axis the mesh lacks: not read either
    ],
)
def test_replica_groups_in_each_notation(groups, expected):
    assert device_groups(_line(groups)) == expected


def test_a_permute_names_its_pairs():
    line = _line("source_target_pairs={{0,4},{1,5}}", "collective-permute")
    assert device_groups(line) == [[0, 4], [1, 5]]
