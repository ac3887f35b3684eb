"""num_iterations, top_entropy_quantile and sync_ref_model, checked against hand computations and against TRL."""

import copy
import json
import shutil
import threading

import pytest
import torch

from conftest import SCRIPTS, SIDE_BY_SIDE_ENV, run_script, tail
from hfllamarl.plugins.algorithms.aipo import AIPO
from hfllamarl.runtime.training.iterations import high_entropy_mask, mix_reference
from hfllamarl.runtime.data.rewards import RewardRunner
from hfllamarl.runtime.loop.rollout import Rollout, RolloutGroup
from hfllamarl.runtime.loop.sampling import Sampling
from hfllamarl.runtime.loop.schedule import Schedule
from hfllamarl.runtime.world.topology import Topology
from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec


def test_schedule_counts_optimizer_steps():
    s = Schedule.of_steps(5, max_staleness=1, iterations=2)  # batches of 2, 2, 1 passes
    assert (s.num_batches, s.num_steps, s.version_staleness) == (3, 5, 2)
    assert [s.passes(b) for b in range(3)] == [2, 2, 1]
    # tick 0 trains nothing (s=1), tick 1 batch 0 (steps 1-2), tick 2 batch 1 (3-4), tick 3 batch 2 (step 5)
    assert [s.step_done(t) for t in range(4)] == [0, 2, 4, 5]
    assert [s.tick_of_step(n) for n in (2, 4, 5)] == [1, 2, 3]
    with pytest.raises(ValueError, match="step 3 is inside a batch of 2 optimizer passes"):
        s.tick_of_step(3)


def test_entropy_mask_keeps_the_top_quantile_as_a_hand_quantile():
    ent = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])  # 7.0 is padding: not in the quantile, never kept
    # the 6 completion entropies sorted: 0.1 0.2 0.3 0.5 0.7 0.9; the 0.5 quantile (q = 0.5) by linear
    # interpolation sits at rank 2.5: 0.3 + 0.5 * (0.5 - 0.3) = 0.4 -> tokens 0.9, 0.5, 0.7 kept
    got = high_entropy_mask(ent, mask, 0.5)
    assert got.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]
    # q = 0.2: the 0.8 quantile at rank 4.0 = 0.7 -> 0.9 and 0.7
    assert high_entropy_mask(ent, mask, 0.2).tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]]
    assert high_entropy_mask(ent, mask, 1.0).tolist() == mask.float().tolist()


def test_reference_mix_is_the_hand_mix_of_two_state_dicts():
    torch.manual_seed(0)
    policy, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    p, r = copy.deepcopy(policy.state_dict()), copy.deepcopy(ref.state_dict())
    mix_reference(policy, ref, 0.3)
    for name in p:
        assert torch.allclose(ref.state_dict()[name], 0.3 * p[name] + 0.7 * r[name])
        assert torch.equal(policy.state_dict()[name], p[name])  # the policy is untouched


class Recording(AIPO):
    """AIPO that records what the trainer hands its loss (a real algorithm plugin, not a stand-in)."""

    def __init__(self):
        super().__init__(rho=4.0)
        self.calls = []

    def loss(self, logprobs, behavior_logprobs, advantages, mask, ref_logprobs=None, shape=None, old_logprobs=None,
             entropy_mask=None):
        self.calls.append({"pi": logprobs.detach().clone(), "old": old_logprobs, "mask": mask,
                           "entropy_mask": entropy_mask})
        return super().loss(logprobs, behavior_logprobs, advantages, mask, ref_logprobs, shape, old_logprobs,
                            entropy_mask)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _groups():
    rollouts = [Rollout(prompt="p", prompt_ids=[3, 4], completion_ids=[5 + i, 6, 7], behavior_logprobs=[-3.0] * 3,
                        versions=[0, 0, 0], finish_reason="stop", completion_text=str(i), row_index=i // 2)
                for i in range(4)]
    return [RolloutGroup(rollouts[:2], 0, 0, 0.1, 12), RolloutGroup(rollouts[2:], 0, 0, 0.1, 12)]


def _hand_logprobs(model, rollout):
    """log p(completion token | prefix) from a plain forward of the whole sequence (no project code)."""
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    n = len(rollout.prompt_ids)
    return torch.stack([logp[n - 1 + t, tok] for t, tok in enumerate(rollout.completion_ids)])


def test_two_passes_clip_against_the_policy_before_the_first():
    model = _model()
    before = copy.deepcopy(model)  # the pre-batch policy, for an independent forward
    algorithm, steps = Recording(), []
    spec = TrainerSpec(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), scheduler=None,
                       algorithm=algorithm, rewards=RewardRunner([lambda completions, **kw: [float(c) for c in completions]]),
                       backend=None, schedule=Schedule.of_steps(2, 0, iterations=2), num_generations=2,
                       micro_batch_size=2, sampling=Sampling(), max_grad_norm=None, pad_token_id=0,
                       device=torch.device("cpu"), padding_free=False, top_entropy_quantile=0.5,
                       on_step=lambda step, metrics: steps.append((step, metrics)) or False)
    ex = TrainerExecutor(spec, Topology(mode="single", rank=0, world_size=2, num_generators=1, timeout_s=10,
                                        use_cpu=True))
    ex.train_on(_groups())
    assert ex.version == 2 and [s for s, _ in steps] == [1, 2]
    assert "reward" in steps[0][1] and "reward" not in steps[1][1]  # the batch's metrics once, as TRL at generation
    assert "loss" in steps[1][1] and "grad_norm" in steps[1][1]
    assert len(algorithm.calls) == 4  # 2 passes x 2 micro-batches
    rollouts = [r for g in _groups() for r in g.rollouts]
    for k in range(2):
        first, second = algorithm.calls[k], algorithm.calls[2 + k]
        assert torch.equal(first["old"], first["pi"])  # pass 1: pi_old is pi
        assert torch.equal(second["old"], first["pi"])  # pass 2: still the pre-batch policy, no new forward
        hand = torch.stack([_hand_logprobs(before, r) for r in rollouts[2 * k:2 * k + 2]])
        assert torch.allclose(second["old"], hand, atol=1e-5)
        assert (second["pi"] - second["old"]).abs().max() > 1e-4  # the policy moved between the passes
        em = second["entropy_mask"]
        assert em is not None and 0 < em.sum() < second["mask"].sum()  # half the tokens, by entropy


def test_the_reference_is_synced_every_n_optimizer_steps_as_a_hand_mix():
    model = _model()
    ref = copy.deepcopy(model).requires_grad_(False)
    r0 = copy.deepcopy(ref.state_dict())
    after = []
    spec = TrainerSpec(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), scheduler=None,
                       algorithm=AIPO(rho=4.0, beta=0.1),
                       rewards=RewardRunner([lambda completions, **kw: [float(c) for c in completions]]),
                       backend=None, schedule=Schedule.of_steps(2, 0, iterations=2), num_generations=2,
                       micro_batch_size=2, sampling=Sampling(), max_grad_norm=None, pad_token_id=0,
                       device=torch.device("cpu"), ref_model=ref, ref_sync=(0.25, 2),
                       on_step=lambda step, m: after.append(copy.deepcopy(model.state_dict())) or False)
    ex = TrainerExecutor(spec, Topology(mode="single", rank=0, world_size=2, num_generators=1, timeout_s=10,
                                        use_cpu=True))
    ex.train_on(_groups())
    # step 1: not a multiple of 2, no sync; step 2: ref = 0.25 * policy_2 + 0.75 * ref_0
    for name, value in ref.state_dict().items():
        assert torch.allclose(value, 0.25 * after[1][name] + 0.75 * r0[name], atol=1e-6), name
        assert not torch.equal(after[0][name], after[1][name]) or "rotary" in name or "norm" in name


def _run(tiny_model, out, side, *extra):
    return run_script([str(SCRIPTS / "iterations_run.py"), tiny_model, str(out), "--trainer", side, *extra],
                      timeout=400, env={"HF_HUB_OFFLINE": "1", **SIDE_BY_SIDE_ENV})


def _history(proc):
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LOG_HISTORY "))
    return json.loads(line[len("LOG_HISTORY "):])


@pytest.mark.slow
def test_steps_and_lr_schedule_equal_trls_and_a_resume_is_exact(tiny_model, tmp_path):
    """max_steps=3, num_iterations=2 (batches of 2 and 1 passes), linear lr with warm-up, sync_ref_model every 2
    steps: the same steps, epochs and learning rates as TRL's GRPOTrainer logs; resuming from checkpoint-2 (the
    reference synced at step 2 restored with it) ends with the uninterrupted run's weights."""
    from safetensors.torch import load_file

    procs = {}

    def run(side, *extra):
        procs[side] = _run(tiny_model, tmp_path / side, side, *extra)

    threads = [threading.Thread(target=run, args=("trl",)),
               threading.Thread(target=run, args=("hfllamarl", "--save-steps", "2"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for side, proc in procs.items():
        assert proc.returncode == 0, (side, tail(proc))
        assert "GLOBAL_STEP 3" in proc.stdout
    trl, ours = (_history(procs[s]) for s in ("trl", "hfllamarl"))
    steps = [h for h in trl if "loss" in h]
    assert [h["step"] for h in steps] == [h["step"] for h in ours if "loss" in h] == [1, 2, 3]
    for theirs, mine in zip(steps, [h for h in ours if "loss" in h]):
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"])  # 0.0, 0.01, 0.005
        assert mine["epoch"] == pytest.approx(theirs["epoch"])
        assert ("reward" in mine) == ("reward" in theirs)  # generation metrics on steps 1 and 3 only
    assert (tmp_path / "hfllamarl" / "checkpoint-2" / "hfllamarl" / "reference").is_dir()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "hfllamarl" / "checkpoint-2", resumed / "checkpoint-2")
    proc = _run(tiny_model, resumed, "hfllamarl", "--save-steps", "2", "--resume", str(resumed / "checkpoint-2"))
    assert proc.returncode == 0, tail(proc)
    whole, again = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "hfllamarl", resumed))
    start = load_file(str(tmp_path / "hfllamarl" / "checkpoint-2" / "model.safetensors"))
    assert any(not torch.equal(whole[k], start[k]) for k in whole)  # step 3 trained something
    for name in whole:
        assert torch.equal(whole[name], again[name]), name
