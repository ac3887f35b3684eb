"""Dynamic sampling (drop_zero_variance_groups): groups without signal are not trained, steps are refilled."""

import json
import math
import os
import pickle
import shutil

import pytest

from conftest import SCRIPTS, SIDE_BY_SIDE_ENV, popen_script, run_script, step_logs, tail, trained_rows
from hfllamarl.runtime.training.dynamic_sampling import GroupFilter, ScoredGroup, join_scored, split_scored
from hfllamarl.runtime.data.prompts import batch_rows
from hfllamarl.runtime.loop.rollout import Rollout, RolloutGroup


def group(row: int, rewards: list[float], version: int = 0, batch: int = 0) -> ScoredGroup:
    rollouts = [Rollout(prompt="p", prompt_ids=[1], completion_ids=[2], behavior_logprobs=[-1.0], versions=[version],
                        finish_reason="stop", completion_text="", row_index=row) for _ in rewards]
    return ScoredGroup(RolloutGroup(rollouts, batch, version, 0.0, 1), list(rewards), {"f": list(rewards)})


def rows(scored):
    return [s.group.rollouts[0].row_index for s in scored]


def test_flat_groups_are_dropped_and_the_rest_kept_for_the_next_step():
    f = GroupFilter(groups_per_step=2, max_staleness=2)
    batch = [group(0, [1, 1]), group(1, [0, 1]), group(2, [0.5, 0.5]), group(3, [1, 0]), group(4, [0, 0.2])]
    train, counts = f.select(batch, version=0)
    assert rows(train) == [1, 3]  # in order, the flat rows 0 and 2 left out
    assert rows(f.reserve) == [4]
    assert counts == {"dynamic_sampling/scored_groups": 5.0, "dynamic_sampling/flat_groups": 2.0,
                      "dynamic_sampling/trained_groups": 2.0, "dynamic_sampling/unused_groups": 0.0,
                      "dynamic_sampling/reserve_groups": 1.0}
    # the next step trains the reserve first (older), then the new batch's groups with signal
    train, counts = f.select([group(5, [0, 1], version=1, batch=1), group(6, [2, 2], version=1, batch=1)], version=1)
    assert rows(train) == [4, 5] and f.reserve == [] and counts["dynamic_sampling/flat_groups"] == 1.0


def test_a_short_step_trains_what_it_has():
    f = GroupFilter(groups_per_step=3, max_staleness=1)
    train, counts = f.select([group(0, [1, 1]), group(1, [0, 1])], version=0)
    assert rows(train) == [1] and counts["dynamic_sampling/trained_groups"] == 1.0


def test_reserve_groups_expire_past_the_staleness_bound_and_the_reserve_is_bounded():
    f = GroupFilter(groups_per_step=1, max_staleness=1)
    # sampled by version 0, trained from version 1 at the earliest: staleness 1, fine; version 2 would be too stale
    train, counts = f.select([group(0, [0, 1]), group(1, [0, 1]), group(2, [1, 0])], version=1)
    assert rows(train) == [0]
    assert f.reserve == [] and counts["dynamic_sampling/unused_groups"] == 2.0  # they would be 2 versions old
    f = GroupFilter(groups_per_step=1, max_staleness=3)
    f.select([group(0, [0, 1]), group(1, [0, 1]), group(2, [1, 0])], version=0)
    assert rows(f.reserve) == [2]  # room for one step's share: the newest kept


def test_synchronous_jobs_keep_no_reserve():
    f = GroupFilter(groups_per_step=1, max_staleness=0)
    f.select([group(0, [0, 1]), group(1, [0, 1])], version=0)
    assert f.reserve == []


def test_split_and_join_are_inverse():
    groups = [group(0, [1, 2]).group, group(1, [3, 4]).group]
    scored = split_scored(groups, [1, 2, 3, 4], {"f": [1, 2, None, 4]})
    assert [s.rewards for s in scored] == [[1, 2], [3, 4]] and scored[1].per_func == {"f": [None, 4]}
    assert join_scored(scored) == (groups, [1, 2, 3, 4], {"f": [1, 2, None, 4]})


@pytest.mark.slow
def test_two_trainer_ranks_drop_refill_and_resume_with_the_reserve(family_model, tmp_path):
    """2 trainer ranks + 1 generator, 4 prompts per rank per step and 2 extra per rank; the rows whose answer is 0
    score 1.0 whatever the completion. Then the same job resumes from checkpoint 2. Beside the first run, the same
    settings from plain `python` (one trainer, 4 prompts and 4 extra per step)."""
    model = family_model("llama")  # a random model: its completions' digit shares vary within a group
    extra = json.dumps({"drop_zero_variance_groups": True, "dynamic_sampling_extra_prompts": 4})
    args = ["--steps", "4", "--max-staleness", "2", "--reward", "flat_zero", "--report-to", "none", "--save-steps", "2",
            "--extra", extra]
    single = str(tmp_path / "single")
    plain = popen_script([str(SCRIPTS / "train_tiny.py"), model, single, "--steps", "3", *args[2:]],
                         {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, **SIDE_BY_SIDE_ENV})
    first = str(tmp_path / "first")
    proc = run_script([str(SCRIPTS / "train_tiny.py"), model, first, *args], nproc=3)
    out, err = plain.communicate(timeout=600)
    assert plain.returncode == 0, err[-4000:]
    flat = {i for i, a in enumerate(_answers()) if a == "0"}
    single_rows = trained_rows(single)
    for h in step_logs(out):
        assert h["dynamic_sampling/scored_groups"] == 8 and h["dynamic_sampling/trained_groups"] <= 4, h
        assert h["dynamic_sampling/trained_groups"] == len(single_rows[h["step"]])
        assert not set(single_rows[h["step"]]) & flat and math.isfinite(h["loss"]), h
    assert [h["step"] for h in step_logs(out)] == [1, 2, 3]
    assert proc.returncode == 0, tail(proc)
    logs = step_logs(proc.stdout)
    generated = {b: batch_rows(64, 12, b, seed=0) for b in range(4)}  # 8 prompts per step + 4 extra
    flat = {i for i, a in enumerate(_answers()) if a == "0"}
    assert flat & {r for b in generated.values() for r in b}, "no flat prompt was generated: the test shows nothing"
    per_rank = [trained_rows(first, rank) for rank in (0, 1)]
    seen = []
    for step in range(1, 5):
        counts = [len(per_rank[k][step]) for k in (0, 1)]
        assert counts[0] == counts[1] <= 4, counts  # both ranks train as many groups (FSDP2's micro-batches match)
        h = logs[step - 1]
        assert h["dynamic_sampling/trained_groups"] == sum(counts)
        assert h["dynamic_sampling/scored_groups"] == 12
        for k in (0, 1):
            assert not set(per_rank[k][step]) & flat, (step, k)  # no group without signal is trained
            seen += per_rank[k][step]
    assert sum(h["dynamic_sampling/flat_groups"] for h in logs) >= 1
    assert len(seen) == len(set(seen)), "a group was trained twice"
    assert set(seen) <= {r for b in generated.values() for r in b}
    # resume from checkpoint 2: its reserve is trained first, then batches 2 and 3 as the schedule says
    reserves = []
    for k in (0, 1):
        with open(os.path.join(first, "checkpoint-2", "hfllamarl", f"trainer-{k}.pt"), "rb") as fh:
            reserves.append([s.group.rollouts[0].row_index for s in pickle.load(fh)["reserve"]])
    assert any(reserves), "no group waited in a reserve at checkpoint 2: the resume would not show it kept"
    second = str(tmp_path / "second")
    shutil.copytree(first, second)
    shutil.rmtree(os.path.join(second, "checkpoint-4"))
    proc = run_script([str(SCRIPTS / "train_tiny.py"), model, second, *args, "--resume"], nproc=3)
    assert proc.returncode == 0, tail(proc)
    for k in (0, 1):
        resumed = trained_rows(second, k)
        assert resumed[3][:len(reserves[k])] == reserves[k], (k, resumed[3], reserves[k])
        allowed = set(reserves[k]) | set(generated[2]) | set(generated[3])
        assert set(resumed[3]) | set(resumed[4]) <= allowed


def _answers():
    from hfllamarl.testing.tiny import successor_rows

    return [r["answer"] for r in successor_rows(64, seed=2)]  # train_tiny.py's training set


def test_a_step_with_no_group_with_signal_trains_nothing():
    """Every group flat: no forward, no optimizer step; the step still counts (the policy version advances with
    the same weights) and says so in its metrics."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfllamarl.plugins.algorithms.aipo import AIPO
    from hfllamarl.runtime.data.rewards import RewardRunner
    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.runtime.loop.schedule import Schedule
    from hfllamarl.runtime.world.topology import Topology
    from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    before = copy.deepcopy(model.state_dict())
    spec = TrainerSpec(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), scheduler=None,
                       algorithm=AIPO(rho=4.0), rewards=RewardRunner([lambda completions, **kw: [1.0] * len(completions)]),
                       backend=None, schedule=Schedule(1, 0), num_generations=2, micro_batch_size=2,
                       sampling=Sampling(), max_grad_norm=1.0, pad_token_id=0, device=torch.device("cpu"),
                       dynamic_sampling_groups=2)
    ex = TrainerExecutor(spec, Topology(mode="single", rank=0, world_size=2, num_generators=1, timeout_s=10,
                                        use_cpu=True))
    metrics = ex.train_on([group(0, [0, 0]).group, group(1, [0, 0]).group])
    assert ex.version == 1 and not spec.optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    assert metrics["dynamic_sampling/trained_groups"] == 0 and metrics["dynamic_sampling/flat_groups"] == 2
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0 and ex.trained_rows == [[]]
