"""NaN or inf anywhere in a training step stops it before the optimizer, naming what, where and when."""

import copy

import pytest
import torch

from hfllamarl.runtime.training.finite import NonFiniteError
from hfllamarl.losses import masked_mean
from hfllamarl.plugins.algorithms.aipo import AIPO
from hfllamarl.runtime.data.rewards import RewardRunner
from hfllamarl.runtime.loop.sampling import Sampling
from hfllamarl.runtime.loop.schedule import Schedule
from hfllamarl.runtime.loop.rollout import Rollout, RolloutGroup
from hfllamarl.runtime.world.topology import Topology
from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec


@pytest.fixture
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def groups(mu_nan_at=None):
    rollouts = []
    for i in range(4):
        mu = [-1.0, -2.0, -1.5]
        if mu_nan_at is not None and mu_nan_at[0] == i:
            mu[mu_nan_at[1]] = float("nan")
        rollouts.append(Rollout(prompt="p", prompt_ids=[3, 4], completion_ids=[5 + i, 6, 7], behavior_logprobs=mu,
                                versions=[0, 0, 0], finish_reason="stop", completion_text=str(i), row_index=10 + i // 2))
    return [RolloutGroup(rollouts[:2], 0, 0, 0.1, 12), RolloutGroup(rollouts[2:], 0, 0, 0.1, 12)]


def executor(model, algorithm=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    spec = TrainerSpec(model=model, optimizer=opt, scheduler=None, algorithm=algorithm or AIPO(rho=4.0),
                     rewards=RewardRunner([lambda completions, **kw: [float(c) for c in completions]]), backend=None,
                     schedule=Schedule(1, 0), num_generations=2, micro_batch_size=2,
                     sampling=Sampling(), max_grad_norm=1.0, pad_token_id=0, device=torch.device("cpu"))
    topo = Topology(mode="single", rank=0, world_size=2, num_generators=1, timeout_s=10, use_cpu=True)
    return TrainerExecutor(spec, topo)


def assert_untouched(model, before, ex):
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert not ex.spec.optimizer.state, "the optimizer took a step"
    assert ex.version == 0


def test_nan_mu_names_the_sample_and_token(model):
    before = copy.deepcopy(model.state_dict())
    ex = executor(model)
    with pytest.raises(NonFiniteError) as err:
        ex.train_on(groups(mu_nan_at=(3, 1)))
    msg = str(err.value)
    assert "step 1, rank 0 (trainer 0): mu (the generator's log-prob" in msg
    # micro-batches of 2: sample 3 is the second of the second micro-batch; row 11; token 1 is id 6
    assert "is nan at sample 3 of the batch (dataset row 11), completion token 1 (id 6)" in msg
    assert "the weights hold no NaN/inf" in msg
    assert_untouched(model, before, ex)


def test_nan_pi_is_caught_before_the_backward_pass(model):
    before = copy.deepcopy(model.state_dict())

    def poison(module, args, output):  # the logits that predict sample 1's completion token 2
        # the lm head runs only where a completion token is predicted, sample by sample ([1, N, V]): sample 0's 3
        # tokens, then sample 1's
        output = output.clone()
        output[0, 3 + 2, :] = float("inf")
        return output

    model.lm_head.register_forward_hook(poison)
    ex = executor(model)
    with pytest.raises(NonFiniteError, match=r"pi \(the policy's log-prob of the sampled token\) is nan at sample 1 "
                                             r"of the batch \(dataset row 10\), completion token 2 \(id 7\); 1 non-finite"):
        ex.train_on(groups())
    assert_untouched(model, before, ex)


class NanGradient(AIPO):
    """A loss that is finite but whose gradient is NaN (the unselected branch of a where() divides by zero)."""

    def loss(self, logprobs, behavior_logprobs, advantages, mask):
        loss, metrics = super().loss(logprobs, behavior_logprobs, advantages, mask)
        trap = torch.where(mask > 2, logprobs / 0.0, torch.zeros_like(logprobs)).sum()
        return loss + trap, metrics


class NanLoss(AIPO):
    def loss(self, logprobs, behavior_logprobs, advantages, mask):
        loss, metrics = super().loss(logprobs, behavior_logprobs, advantages, mask)
        return loss * float("nan"), metrics


def test_nan_gradient_with_a_finite_loss_stops_before_the_optimizer(model):
    before = copy.deepcopy(model.state_dict())
    ex = executor(model, NanGradient(rho=4.0))
    with pytest.raises(NonFiniteError, match=r"the gradient norm is nan; the gradient of model\.\S+ is nan"):
        ex.train_on(groups())
    assert_untouched(model, before, ex)


def test_nan_loss_from_the_algorithm(model):
    before = copy.deepcopy(model.state_dict())
    ex = executor(model, NanLoss(rho=4.0))
    with pytest.raises(NonFiniteError, match="the loss is nan .pi, mu and the advantages are finite"):
        ex.train_on(groups())
    assert_untouched(model, before, ex)


def test_a_finite_step_still_trains(model):
    before = copy.deepcopy(model.state_dict())
    ex = executor(model)
    metrics = ex.train_on(groups())
    assert ex.version == 1 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert masked_mean(torch.ones(2), torch.ones(2)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("tp", ["1", "2"])
def test_a_nan_on_one_trainer_rank_stops_every_rank_before_the_backward_pass(tmp_path, tp):
    """Rank 1 alone sees the NaN; both ranks raise the same error naming it (no rank is left waiting in a
    collective), and no shard changes; the same when the two ranks are one tensor-parallel group."""
    import json

    from conftest import SCRIPTS, run_script, tail

    proc = run_script([str(SCRIPTS / "finite_check.py")], nproc=2, timeout=300,
                      env={"RESULT_DIR": str(tmp_path), "TRAINER_TP": tp})
    assert proc.returncode == 0, tail(proc)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["message"] == results[1]["message"], results
    assert "rank 1 (trainer 1): mu (the generator's log-prob of the sampled token) is nan at sample 2" in \
        results[0]["message"]
    assert all(r["unchanged"] for r in results)
