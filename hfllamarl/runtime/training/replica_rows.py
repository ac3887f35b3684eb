"""Which rows of a step's batch each trainer replica group trains, and the loss normalisation that makes the
average of the groups' gradients the whole batch's gradient, however many groups take part in the step.

A step's batch is a fixed list of rows (the same on every group: it depends on the step's index only). The quorum
of the step (`replica_quorum.StepQuorum`) gives each participating group an index; group i of P trains the i-th
of P contiguous, near-equal slices (sizes differ by at most one row). A step retried after a failed commit, or
with fewer groups, re-splits the same rows over the groups then present: every row is trained once per committed
step.

Normalisation: the groups' gradients are averaged (torchft's AVG: the sum over the P groups, divided by P). Each
group therefore scales its token-loss sum by P / (completion tokens of the whole batch), which is the project's
`StepShape(tokens=<whole batch>, trainer_ranks=P)` for the token-normalised losses (dapo, cispo, vespo): the
average is then the whole batch's token sum over its tokens, whatever P and however unevenly the rows split. A
sequence-normalised loss (grpo's per-sequence mean over the sequences) needs rows, not tokens, as its unit and
equal slices; that is not handled here.
"""

from __future__ import annotations

from hfllamarl.losses import StepShape


def replica_slice(num_rows: int, index: int | None, participants: int) -> range:
    """The rows (positions in the batch) group `index` of `participants` trains: contiguous, the first
    `num_rows % participants` groups one row more. A group that does not take part (index None) trains none."""
    if index is None:
        return range(0)
    if not 0 <= index < participants:
        raise ValueError(f"replica index {index} is not among {participants} participants")
    base, extra = divmod(num_rows, participants)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def replica_step_shape(batch_tokens: float, participants: int, ranks_per_group: int = 1, micro_batches: int = 1,
                       max_completion_length: int | None = None) -> StepShape:
    """The loss normalisation of one rank's share: the whole batch's completion tokens (every group's), and the
    number of ranks whose gradients are averaged: the groups (see the module docstring) times the data-parallel
    ranks inside a group (FSDP2's reduce-scatter averages over those first)."""
    return StepShape(tokens=float(batch_tokens), trainer_ranks=int(participants) * int(ranks_per_group),
                     micro_batches=micro_batches, max_completion_length=max_completion_length)
