"""The trainer's batch: padding, log-probs and the loss on completions of any length, empty ones included."""

import pytest
import torch

from hfllamarl.plugins.algorithms.aipo import AIPO
from hfllamarl.runtime.loop.sampling import Sampling
from hfllamarl.runtime.loop.schedule import Schedule
from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.training.batching import completion_logprobs, pack_batch, pack_rows, packing_agrees, pad_batch


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def rollout(prompt, completion, logprobs=None):
    logprobs = logprobs if logprobs is not None else [-1.0] * len(completion)
    return Rollout(prompt="p", prompt_ids=prompt, completion_ids=completion, behavior_logprobs=logprobs,
                   versions=[0] * len(completion), finish_reason="stop", completion_text="")


def test_padding_puts_every_completion_at_the_same_column():
    b = pad_batch([rollout([5, 6, 7], [8, 9]), rollout([5], []), rollout([1, 2], [3])], pad_id=0, device="cpu")
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [0, 0, 5, 0, 0], [0, 1, 2, 3, 0]]
    assert b["mask"].tolist() == [[1, 1], [0, 0], [1, 0]]
    assert b["position_ids"][2].tolist()[1:4] == [0, 1, 2]  # positions count real tokens only
    # the flat position (row x 5 + column) whose logits predict each completion token
    assert b["targets"][0].tolist() == [2, 3] and b["targets"][2].tolist() == [12, 0]


def test_first_fit_decreasing_rows():
    assert pack_rows([3, 9, 5, 4, 2], 9) == [[1], [2, 3], [0, 4]]
    assert pack_rows([4, 4, 4], 8) == [[0, 1], [2]]  # ties keep their order


def test_packing_lays_sequences_end_to_end_with_positions_restarting():
    rows = [rollout([5, 6, 7], [8, 9]), rollout([5], []), rollout([1, 2], [3]), rollout([4], [6, 7])]
    b = pack_batch(rows, pad_id=0, device="cpu")
    # lengths 5, 1, 3, 3 in rows of width 5: [0], [2, 1] then 3 does not fit with 2+1 -> [3]
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 5, 0], [4, 6, 7, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0], [0, 1, 2, 0, 1]]
    assert b["attention_mask"] is None
    assert b["targets"][0].tolist() == [2, 3]  # token 8 is predicted at row 0, column 2
    assert b["targets"][2].tolist()[:1] == [6]  # token 3 at row 1, column 1 = flat 6
    assert b["targets"][3].tolist() == [10, 11]  # row 2, columns 0 and 1
    assert b["mask"].tolist() == [[1, 1], [0, 0], [1, 0], [1, 1]]


def test_pad_to_multiple_of_rounds_the_width_up():
    rows = [rollout([5, 6, 7], [8, 9]), rollout([1, 2], [3])]
    assert pad_batch(rows, 0, "cpu", multiple_of=8)["input_ids"].shape == (2, 8)
    assert pack_batch(rows, 0, "cpu", multiple_of=8)["input_ids"].shape == (1, 8)  # 5 + 3 tokens fit one row


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.7),
                                      Sampling(temperature=0.7, top_k=10, repetition_penalty=1.5, presence_penalty=0.3)])
def test_logprobs_do_not_depend_on_padding(model, sampling):
    """Padding (token 0, left of the short prompt) is not a token the penalties have seen."""
    alone = pad_batch([rollout([1], [2, 0, 4, 5])], 0, "cpu")
    padded = pad_batch([rollout([5, 6, 7], [8, 9]), rollout([1], [2, 0, 4, 5])], 0, "cpu")
    with torch.no_grad():
        a = completion_logprobs(model, alone, sampling)[0]
        b = completion_logprobs(model, padded, sampling)[1]
    assert torch.allclose(a, b, atol=1e-5)


def test_empty_completions_get_no_gradient_and_keep_the_loss_finite(model):
    rows = [rollout([5, 6], [7, 8]), rollout([5, 6], []), rollout([5, 6], [9])]
    batch = pad_batch(rows, 0, "cpu")
    logp = completion_logprobs(model, batch, 1.0)
    logp.retain_grad()
    loss, metrics = AIPO(rho=4.0).loss(logp, batch["behavior_logprobs"], torch.tensor([1.0, -2.0, 1.0]),
                                       batch["mask"])
    assert torch.isfinite(loss)
    loss.backward()
    assert logp.grad[1].abs().sum() == 0  # the empty completion
    assert logp.grad[0].abs().sum() > 0 and logp.grad[2, 0] != 0 and logp.grad[2, 1] == 0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_a_micro_batch_of_only_empty_completions(model):
    batch = pad_batch([rollout([5, 6], []), rollout([7], [])], 0, "cpu")
    model.zero_grad()
    loss, _ = AIPO(rho=4.0).loss(completion_logprobs(model, batch, 1.0), batch["behavior_logprobs"],
                                 torch.tensor([0.5, -0.5]), batch["mask"])
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.parameters())


def test_a_rollout_must_carry_one_logprob_and_version_per_token():
    with pytest.raises(ValueError, match="one behaviour log-prob and one version per completion token"):
        Rollout(prompt="p", prompt_ids=[1], completion_ids=[2, 3], behavior_logprobs=[-1.0], versions=[0, 0],
                finish_reason="stop", completion_text="")


def test_the_trainer_refuses_a_token_staler_than_max_staleness():
    """A schedule bug that let one token of a partial rollout go past the bound must stop the run, not train."""
    from hfllamarl.runtime.loop.rollout import RolloutGroup
    from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec

    def never(**_):
        raise AssertionError("the rewards ran: the stale token was not caught before scoring")

    job = TrainerSpec(model=None, optimizer=None, scheduler=None, algorithm=None, rewards=never, backend=None,
                     schedule=Schedule(10, 2, 3), num_generations=2, micro_batch_size=2,
                     sampling=Sampling(), max_grad_norm=None, pad_token_id=0, device="cpu")
    trainer = TrainerExecutor(job, topology=None)
    trainer.version = 5
    fresh = Rollout(prompt="p", prompt_ids=[1], completion_ids=[2, 3], behavior_logprobs=[-1.0, -1.0],
                    versions=[4, 5], finish_reason="stop", completion_text="")
    stale = Rollout(prompt="p", prompt_ids=[1], completion_ids=[2, 3, 4], behavior_logprobs=[-1.0] * 3,
                    versions=[2, 3, 4], finish_reason="stop", completion_text="")  # token 0: 3 versions old
    group = RolloutGroup(rollouts=[fresh, stale], batch_index=3, policy_version=2, generation_seconds=0.0,
                         batch_tokens=5)
    with pytest.raises(RuntimeError, match="batch 3 was sampled 3 policy versions ago, past max_staleness=2"):
        trainer.train_on([group])


def test_an_unscored_eval_completion_is_out_of_the_eval_reward_as_in_trl():
    """TRL leaves a completion no reward function scored out of `reward`/`reward_std` in eval mode too (NaN, then
    nanmean/nanstd); counting it as 0 would lower eval accuracy for a grader's timeout."""
    from hfllamarl.runtime.data.rewards import RewardRunner
    from hfllamarl.runtime.loop.rollout import RolloutGroup
    from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec

    def graded(completions, **kwargs):  # "x" could not be graded
        return [None if c == "x" else float(c) for c in completions]

    job = TrainerSpec(model=None, optimizer=None, scheduler=None, algorithm=None, rewards=RewardRunner([graded]),
                      backend=None, schedule=Schedule(10, 1), num_generations=2, micro_batch_size=2,
                      sampling=Sampling(), max_grad_norm=None, pad_token_id=0, device="cpu")
    rollouts = [Rollout(prompt="p", prompt_ids=[1], completion_ids=[2], behavior_logprobs=[-1.0], versions=[3],
                        finish_reason="stop", completion_text=text) for text in ("1", "0", "x", "1")]
    groups = [RolloutGroup(rollouts=rollouts[:2], batch_index=0, policy_version=3, generation_seconds=0.0,
                           batch_tokens=2, eval_version=3),
              RolloutGroup(rollouts=rollouts[2:], batch_index=0, policy_version=3, generation_seconds=0.0,
                           batch_tokens=2, eval_version=3)]
    metrics = TrainerExecutor(job, topology=None).evaluation_metrics(groups)
    scored = [1.0, 0.0, 1.0]  # by hand: the three graded completions
    mean = sum(scored) / 3
    assert metrics["eval_reward"] == pytest.approx(mean)
    assert metrics["eval_reward_std"] == pytest.approx((sum((x - mean) ** 2 for x in scored) / 3) ** 0.5)
    assert metrics["eval_rewards/graded/mean"] == pytest.approx(mean)
    assert metrics["eval_reward_unscored"] == 1 and metrics["eval_samples"] == 4
