"""Reading a compiler's dumps (`meshpar.plan.buffers`): the heap's peak from its slots, without a compile."""

from meshpar.plan.buffers import peak_buffers, peak_instant

HLO = """
  %p = s32[2,4097]{1,0} parameter(0)
  %fusion.1 = bf16[2,4096,32000]{2,1,0} fusion(%p), kind=kOutput, metadata={op_name="jit(step)/dot_general"}
  %fusion.2 = bf16[2,4096,32000]{2,1,0} fusion(%fusion.1), kind=kLoop, metadata={op_name="jit(step)/convert"}
  %copy.3 = bf16[12,2,4096,768]{3,2,1,0} copy(%q)
"""
MIB = 2**20


def dumps(cotangent_offset: int) -> tuple[str, str]:
    """A live-range dump whose own peak line (at 8) holds the cotangent and the stored inputs, and a
    buffer assignment that puts the cotangent at `cotangent_offset` (MiB) of the temporary allocation."""
    live = f"""HloLiveRange (max 12):
  BufferLiveRange:
    p{{}}:0-12
    copy.3{{}}:1-11
    fusion.1{{}}:4-6
    fusion.2{{}}:6-9
  Live ranges at 8 (peak):
    fusion.2{{}}: {500 * MIB} bytes (cumulative: {500 * MIB} bytes)
    copy.3{{}}: {144 * MIB} bytes (cumulative: {644 * MIB} bytes)
"""
    assignment = f"""allocation 0: size {33 * 1024}, parameter 0, shape |s32[2,4097]| at ShapeIndex {{}}:
 value: <1 p @0> (size={33 * 1024},offset=0): s32[2,4097]
allocation 1: size {1144 * MIB}, preallocated-temp:
 value: <2 copy.3 @0> (size={144 * MIB},offset=0): bf16[12,2,4096,768]
 value: <3 fusion.1 @0> (size={500 * MIB},offset={144 * MIB}): bf16[2,4096,32000]
 value: <4 fusion.2 @0> (size={500 * MIB},offset={cotangent_offset * MIB}): bf16[2,4096,32000]
"""
    return live, assignment


def test_the_peak_is_where_a_value_and_the_one_it_defines_hold_two_slots():
    """libtpu wrote 125m fsdp's logits' cotangent (8 v5p chips) to its own slot: at the instruction that
    reads the logits and writes the cotangent both are held, and the heap peaks there (1.22 of its
    1.23 GiB), not at the live-range dump's own peak line (1.07 GB with the arguments)."""
    live, two_slots = dumps(644)
    assert peak_instant(live, two_slots) == (6, (144 + 500 + 500) * MIB + 33 * 1024)  # the argument too
    peak = peak_buffers(live, HLO, assignment=two_slots)
    assert [(b["name"], b["bytes"] // MIB) for b in peak] == [("fusion.1", 500), ("fusion.2", 500), ("copy.3", 144)]
    assert not any("slot_of" in b for b in peak)


def test_a_value_written_over_the_one_it_reads_is_counted_once():
    """XLA:GPU writes the cotangent over the logits (one slot): the peak holds 644 MiB at 6 and at 8
    alike, the first such instant is taken, and the cotangent is named as in the logits' slot."""
    live, one_slot = dumps(144)
    assert peak_instant(live, one_slot) == (4, 644 * MIB + 33 * 1024)
    live_at_6 = live.replace("fusion.1{}:4-6", "fusion.1{}:6-6")  # the logits defined where they are read
    peak = peak_buffers(live_at_6, HLO, assignment=one_slot)
    assert [b["name"] for b in peak] == ["fusion.1", "fusion.2", "copy.3"] and peak[1]["slot_of"] == "fusion.1"


def test_without_an_assignment_the_dumps_own_peak_line_is_read():
    live, _ = dumps(644)
    assert [b["name"] for b in peak_buffers(live, HLO)] == ["fusion.2", "copy.3"]
