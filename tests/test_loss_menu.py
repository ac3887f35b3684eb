"""The loss menu (TRL's loss_type, GSPO, the vLLM importance-sampling modes, the off-policy mask, the
normalisations) against hand values, and the `grpo` plugin against TRL's own `GRPOTrainer._compute_loss`."""

import math

import pytest
import torch

from hfllamarl import load_plugin
from hfllamarl.losses import (StepShape, aggregate, behavior_weight, off_policy_mask, per_token_objective,
                              policy_ratio)
from trl_loss_reference import trl_loss


# ----------------------------------------------------------------------------- the objectives, by hand
def test_ppo_double_clip_values_and_gradients():
    # ratios 1.0 (inside), 1.5 (above 1 + 0.3), 0.5 (below 1 - 0.2), 1.1 (inside)
    x = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.1]]))
    for A, grad in ((1.0, [-1.0, 0.0, -0.5, -1.1]), (-1.0, [1.0, 1.5, 0.0, 1.1])):
        logp = x.clone().requires_grad_()
        coef = policy_ratio(logp, torch.zeros(1, 4), torch.ones(1, 4), "token")
        per = per_token_objective("dapo", coef, torch.tensor([[A]]), logp, 0.2, 0.3)
        # -min(r A, clip(r, 0.8, 1.3) A): A = 1 -> -(1, 1.3, 0.5, 1.1); A = -1 -> (1, 1.5, 0.8, 1.1)
        expected = [-1.0, -1.3, -0.5, -1.1] if A > 0 else [1.0, 1.5, 0.8, 1.1]
        assert torch.allclose(per.detach(), torch.tensor([expected]), atol=1e-6)
        per.sum().backward()  # d/dlogp of -r A is -r A where the unclipped term is the min, 0 where clipped
        assert torch.allclose(logp.grad, torch.tensor([grad]), atol=1e-6), (A, logp.grad)


def test_delta_caps_the_unclipped_term():
    x = torch.log(torch.tensor([[1.0, 3.0]]))  # A < 0, ratio 3: min(3, delta=2) * -A = 2, and no gradient
    for delta, value, grad in ((None, [1.0, 3.0], [1.0, 3.0]), (2.0, [1.0, 2.0], [1.0, 0.0])):
        logp = x.clone().requires_grad_()
        per = per_token_objective("grpo", torch.exp(logp), torch.tensor([[-1.0]]), logp, 0.2, 0.3, delta)
        assert torch.allclose(per.detach(), torch.tensor([value]), atol=1e-6)
        per.sum().backward()
        assert torch.allclose(logp.grad, torch.tensor([grad]), atol=1e-6), delta


def test_cispo_weight_is_clipped_and_carries_no_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    coef = torch.tensor([[0.5, 7.0]], requires_grad=True)
    per = per_token_objective("cispo", coef, torch.tensor([[2.0]]), logp, epsilon_high=5.0)
    # -min(c, 5) * A * log pi = -(0.5 * 2 * -1, 5 * 2 * -2) = (1, 20)
    assert torch.allclose(per.detach(), torch.tensor([[1.0, 20.0]]))
    per.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -10.0]])) and coef.grad is None


def test_sapo_soft_gate():
    coef = torch.tensor([[1.0, 1.5]], requires_grad=True)
    per = per_token_objective("sapo", coef, torch.tensor([[1.0]]), torch.zeros(1, 2), sapo_temperature_pos=2.0)
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    # -sigmoid(tau (c - 1)) * 4 / tau * A, tau = 2 (A > 0): c = 1 -> -0.5 * 2 = -1
    assert per[0, 0].item() == pytest.approx(-1.0) and per[0, 1].item() == pytest.approx(-sig(1.0) * 2, rel=1e-6)
    per.sum().backward()  # d/dc = -4 sigmoid'(tau (c - 1)) = -4 s (1 - s)
    assert coef.grad[0, 0].item() == pytest.approx(-1.0) and coef.grad[0, 1].item() == pytest.approx(
        -4 * sig(1.0) * (1 - sig(1.0)), rel=1e-6)


def test_gspo_sequence_ratio_is_the_length_normalised_ratio():
    logp = torch.tensor([[-1.0, -2.0, -5.0], [-1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    coef = policy_ratio(logp, old, mask, "sequence")
    assert coef.shape == (2, 1)
    assert torch.allclose(coef, torch.tensor([[math.exp((0.5 - 1.0) / 2)], [math.exp(2.0)]]))


# ----------------------------------------------------------------------------- weights and masks, by hand
def test_behaviour_weight_modes():
    old = torch.log(torch.tensor([[2.0, 0.25, 1.0], [4.0, 1.0, 1.0]]))
    mu = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # per token pi_old/mu = (2, 0.25, 1), (4, 1, -); per sequence the product: 0.5 and 4
    w = behavior_weight(old, mu, mask, "token_truncate", 0.5, 3.0)
    assert torch.allclose(w * mask, torch.tensor([[2.0, 0.5, 1.0], [3.0, 1.0, 0.0]]))
    w = behavior_weight(old, mu, mask, "token_mask", 0.5, 3.0)
    assert torch.allclose(w * mask, torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    w = behavior_weight(old, mu, mask, "sequence_truncate", None, 3.0)
    assert torch.allclose(w, torch.tensor([[0.5], [3.0]]))
    w = behavior_weight(old, mu, mask, "sequence_mask", None, 3.0)
    assert torch.allclose(w, torch.tensor([[0.5], [0.0]]))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='tokens'"):
        behavior_weight(old, mu, mask, "tokens")


def test_off_policy_mask_drops_negative_advantage_sequences_that_drifted():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    mu = torch.tensor([[-0.2, -0.2], [-0.2, -0.2], [-1.1, -0.9]])  # mean KL(mu || pi): 0.8, 0.8, 0.0
    keep = off_policy_mask(torch.tensor([[-1.0], [1.0], [-1.0]]), logp, mu, torch.ones(3, 2), threshold=0.5)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0]  # drifted and A < 0; A >= 0 kept; close enough kept


def test_normalisations():
    per = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    shape = StepShape(tokens=16.0, trainer_ranks=2, micro_batches=2, max_completion_length=5)
    assert aggregate(per, mask, "grpo", shape).item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(per, mask, "bnpo", shape).item() == pytest.approx(10.0 / 4)
    assert aggregate(per, mask, "dr_grpo", shape).item() == pytest.approx(10.0 / (2 * 5))
    assert aggregate(per, mask, "luspo", shape).item() == pytest.approx((6.0 + 4.0) / 2)
    # dapo: one weight per token of the whole step (16 tokens over 2 ranks); the trainer divides by 2 micro-batches
    # and averages the 2 ranks' gradients: 10 * 2 / (16 / 2) = 2.5 here, i.e. 10 / 16 of the step's loss
    assert aggregate(per, mask, "dapo", shape).item() == pytest.approx(2.5)
    assert aggregate(per, mask, "cispo", StepShape.of(mask)).item() == pytest.approx(10.0 / 4)


# ----------------------------------------------------------------------------- AIPO composed
def test_aipo_sequence_level_and_dr_grpo_normalisation():
    """GSPO's sequence ratio c = exp(mean_t log pi/pi_old) with AIPO's token weight min(pi_old/mu, rho) on top."""
    aipo = load_plugin("algorithms", "aipo")(rho=2.0, loss_type="dr_grpo", importance_sampling_level="sequence")
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mu = torch.tensor([[-2.0, -3.0], [-0.5, -3.0]])  # pi_old/mu: e, e (truncated to 2) | 1 (and padding)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, m = aipo.loss(logp, mu, adv, mask, shape=StepShape(tokens=3, max_completion_length=4))
    # c = 1 in value: -c A w summed over the tokens, / (2 sequences x 4): (-1 * (2 + 2) + 2 * 1) / 8
    assert loss.item() == pytest.approx(-2.0 / 8)
    loss.backward()
    # dc/dlog pi_t = c / |o|: sequence 0 gets -A * (2 + 2) / 2 / 8 per token, sequence 1 -A * 1 / 1 / 8
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [0.25, 0.0]]))
    assert m["clipped_frac"] == pytest.approx(2 / 3)  # two of the three tokens' weights truncated at rho


def test_aipo_is_grpo_with_a_truncated_token_weight_at_rho():
    """Same gradient: AIPO's min(pi/mu, rho) A grad log pi, and TRL's loss with pi_old = pi (one step per batch)
    and the token_truncate weight capped at rho (the values differ: AIPO's has log pi in it)."""
    logp0 = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -3.0, -1.0]])
    mu = torch.tensor([[-2.5, -2.0, -0.1], [-0.4, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([0.7, -1.3])
    grads = []
    for algo in (load_plugin("algorithms", "aipo")(rho=2.0, loss_type="bnpo"),
                 load_plugin("algorithms", "grpo")(loss_type="bnpo", vllm_importance_sampling_mode="token_truncate",
                                                   vllm_importance_sampling_clip_max=2.0)):
        logp = logp0.clone().requires_grad_()
        algo.loss(logp, mu, adv, mask)[0].backward()
        grads.append(logp.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


# ----------------------------------------------------------------------------- grpo against TRL itself


TRL_CASES = [
    {},  # TRL's defaults: dapo, token level, sequence_mask at 3.0
    {"loss_type": "grpo", "beta": 0.1},
    {"loss_type": "bnpo", "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.5},
    {"loss_type": "dr_grpo", "max_completion_length": 7, "vllm_importance_sampling_mode": "token_mask",
     "vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 2.0},
    {"loss_type": "cispo", "epsilon_high": 5.0, "importance_sampling_level": "sequence",
     "vllm_importance_sampling_mode": "sequence_truncate", "beta": 0.05, "use_bias_correction_kl": False},
    {"loss_type": "sapo", "vllm_importance_sampling_mode": "sequence_truncate", "off_policy_mask_threshold": 0.3},
    {"loss_type": "luspo", "importance_sampling_level": "sequence", "delta": 1.5, "off_policy_mask_threshold": 0.1,
     "beta": 0.2},
    {"importance_sampling_level": "sequence", "epsilon": 0.1, "epsilon_high": 0.28,
     "vllm_importance_sampling_correction": False},
]


@pytest.mark.parametrize("options", TRL_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_grpo_loss_and_gradient_equal_trls(options):
    torch.manual_seed(0)
    B, T = 6, 5
    logp0 = -torch.rand(B, T) * 3
    mu = logp0 + torch.randn(B, T) * 0.4  # stale behaviour log-probs
    ref = logp0 + torch.randn(B, T) * 0.3
    mask = (torch.arange(T)[None, :] < torch.tensor([5, 3, 1, 4, 5, 2])[:, None]).float()
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.0, 2.0])
    from trl import GRPOConfig

    config = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none", **options)
    names = ("loss_type", "importance_sampling_level", "off_policy_mask_threshold", "epsilon", "epsilon_high",
             "delta", "beta", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "use_bias_correction_kl")
    ours = load_plugin("algorithms", "grpo")(scale_rewards="group", **{n: getattr(config, n) for n in names})
    shape = StepShape(tokens=float(mask.sum()), max_completion_length=config.max_completion_length)

    logp_trl = logp0.clone().requires_grad_()
    expected = trl_loss(logp_trl, mu, mask, adv[:, None], options, ref=ref)
    expected.backward()
    logp = logp0.clone().requires_grad_()
    loss, _ = ours.loss(logp, mu, adv, mask, ref_logprobs=ref if config.beta else None, shape=shape)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(logp.grad, logp_trl.grad, rtol=1e-5, atol=1e-7)


def test_settings_the_algorithm_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="loss_type='vespo' needs a per-token correction"):
        load_plugin("algorithms", "grpo")(loss_type="vespo")  # TRL's default sequence_mask, refused as TRL does
    with pytest.raises(ValueError, match="aipo_rho=2.0 and vllm_importance_sampling_mode='sequence_mask'.*two "
                                         "different corrections"):
        load_plugin("algorithms", "aipo")(rho=2.0, vllm_importance_sampling_clip_max=2.0)
    with pytest.raises(ValueError, match="aipo_rho=2.0 bounds the importance weight.*correction=False"):
        load_plugin("algorithms", "aipo")(rho=2.0, vllm_importance_sampling_correction=False)
    with pytest.raises(ValueError, match="loss_type='bogus'"):
        load_plugin("algorithms", "grpo")(loss_type="bogus")
    with pytest.raises(ValueError, match="loss_type='bogus'"):
        load_plugin("algorithms", "aipo")(loss_type="bogus")
    with pytest.raises(ValueError, match="clip_min .* must be below"):
        load_plugin("algorithms", "grpo")(vllm_importance_sampling_clip_min=3.0)
    # the same correction said twice is not a contradiction
    load_plugin("algorithms", "aipo")(rho=2.0, vllm_importance_sampling_mode="token_truncate",
                                      vllm_importance_sampling_clip_max=2.0)
