"""What the planner reads of a run beside its model (`Workload`): the global batch, the LM loss's
token slices, attention's options and the precision policy. `meshpar.plan.costmodel.ModelFacts`
carries one, so the cost functions take the facts and a candidate, never the whole config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """What the cost model reads of a run beside its model: the global batch (B sequences of T
    tokens), the LM loss's token slices, attention's options and the precision policy."""

    global_size: int
    length: int
    loss_chunks: int = 1
    attention: str = "auto"
    softcap: float | None = None
    documents: bool = False  # packed documents: segment ids and positions travel beside the tokens
    precision: str = "bf16"
    context_strategy: str = "all_gather"  # model.context_strategy: what attention holds across `context`
