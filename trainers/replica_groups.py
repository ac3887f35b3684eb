"""`AsyncAIPOConfig`'s trainer replica group fields checked (`trainer_replica_groups`, `trainer_replica_group`,
`torchft_lighthouse`): the values, and the settings a group cannot honour yet, each refused with its reason."""

from __future__ import annotations

TOKEN_LOSSES = ("dapo", "cispo", "vespo")  # normalised by the step's tokens: exact over the groups, rows or none


def check_replica_groups(config, algorithm) -> None:
    """Refuse bad values of the replica-group fields, and what a replica group does not do (yet)."""
    from hfllamarl.runtime.training.replica_group import lighthouse_address

    from .config import _is_whole

    groups, group = config.trainer_replica_groups, config.trainer_replica_group
    if not _is_whole(groups) or groups < 1:
        raise ValueError(f"AsyncAIPOConfig: trainer_replica_groups={groups!r}; it must be a whole number >= 1.")
    if groups == 1:
        if config.trainer_replica_shared_generators:
            raise ValueError("AsyncAIPOConfig: trainer_replica_shared_generators is set, but trainer_replica_groups is "
                             "1: the groups would share group 0's generators; set trainer_replica_groups, or remove it.")
        if group != 0:
            raise ValueError(f"AsyncAIPOConfig: trainer_replica_group={group!r} is set, but trainer_replica_groups "
                             "is 1: set trainer_replica_groups to the number of groups.")
        return
    if not _is_whole(group) or not 0 <= group < groups:
        raise ValueError(f"AsyncAIPOConfig: trainer_replica_group={group!r}; it must be one of 0 .. {groups - 1} "
                         f"(trainer_replica_groups={groups}).")
    if lighthouse_address(config.torchft_lighthouse) is None:
        raise ValueError("AsyncAIPOConfig: trainer_replica_groups > 1 needs the torchft lighthouse every group joins: "
                         "start one (`torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000`) and set "
                         "torchft_lighthouse (or TORCHFT_LIGHTHOUSE) to its address; or, on one machine, run the "
                         "recipe with `hfllamarl train --trainer_replica_groups N` (no trainer_replica_group, no "
                         "launcher): it starts the lighthouse and every group.")
    loss_type = getattr(getattr(algorithm, "objective", None), "loss_type", None)
    refusals = [
        (loss_type not in TOKEN_LOSSES,
         f"loss_type={loss_type!r} normalises per sequence or micro-batch; the groups' average is exact for the "
         f"token-normalised losses {', '.join(TOKEN_LOSSES)} (a group may train no rows in a step)"),
        (getattr(algorithm, "scale_rewards", None) == "batch",
         "scale_rewards='batch' would normalise over each group's share, not the batch; use 'group' or 'none'"),
        (config.num_iterations != 1, "num_iterations > 1 is not combined with replica groups yet"),
        (bool(config.sync_ref_model), "sync_ref_model is not combined with replica groups yet"),
        (bool(config.drop_zero_variance_groups), "dynamic sampling is not combined with replica groups yet"),
        (config.generator_failure != "stop", "generator_failure='continue' is not combined with replica groups yet"),
        (bool(config.partial_rollout_tokens), "partial rollouts are not combined with replica groups yet"),
        (bool(config.trainer_replica_shared_generators) and _trainer_processes(config) > 1,
         f"trainer_replica_shared_generators hands each group its share as a whole, to a group of one trainer "
         f"process; this group has {_trainer_processes(config)} (launch each group as one process, or let each "
         "group run its own generators)"),
    ]
    why = [text for hit, text in refusals if hit]
    if why:
        raise ValueError(f"AsyncAIPOConfig: trainer_replica_groups={groups}: " + "; ".join(why) + ".")


def _trainer_processes(config) -> int:
    topology = getattr(config, "_topology", None)
    return topology.num_trainers if topology is not None else 1
