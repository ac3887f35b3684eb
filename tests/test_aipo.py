"""AIPO loss and advantages against hand-computed values."""

import math

import pytest
import torch

from hfllamarl import load_plugin
from hfllamarl.losses import group_advantages
from hfllamarl.plugins.algorithms.aipo import AIPO


def test_advantage_is_reward_minus_group_mean():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # two groups of 3
    adv = AIPO(rho=2.0).advantages(r, group_size=3)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3]))


def test_advantage_scaling_options():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    assert torch.allclose(group_advantages(r, 2, "group"), torch.tensor([0.5, -0.5, 0.0, 0.0]) / (math.sqrt(0.5) + 1e-4))
    with pytest.raises(ValueError):
        group_advantages(r, 3)
    with pytest.raises(ValueError):
        group_advantages(r, 2, "bogus")


def test_loss_and_gradient_match_hand_computation():
    rho = 2.0
    algo = AIPO(rho=rho)
    # Two samples, three token slots; sample 1 has only two completion tokens.
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, -9.0]], requires_grad=True)
    mu = torch.tensor([[-1.0, -2.0, -1.0], [-0.1, -3.5, 0.0]])
    adv = torch.tensor([1.5, -0.5])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, metrics = algo.loss(logp, mu, adv, mask)

    ratio = torch.exp(logp.detach() - mu)
    w = torch.minimum(ratio, torch.tensor(rho))
    # Hand values: ratios e^0=1, e^1.5=4.48 (clipped to 2), e^-1=0.37; e^-0.1, e^0.5.
    expected_w = torch.tensor([[1.0, 2.0, math.exp(-1.0)], [math.exp(-0.1), math.exp(0.5), 0.0]])
    assert torch.allclose(w * mask, expected_w, atol=1e-6)
    # the logged value is TRL's dapo loss with c = pi/pi_old = 1 in value: -sum_t w_t A / tokens
    expected = -(w * adv[:, None] * mask).sum() / 5
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)

    loss.backward()
    # d loss / d logp_t = -w_t * A / num_tokens: no gradient through the weight itself,
    # and a clipped token (ratio 4.48 > rho) still gets gradient -rho * A / 5.
    expected_grad = -(w * adv[:, None] * mask) / 5
    assert torch.allclose(logp.grad, expected_grad, atol=1e-7)
    assert logp.grad[0, 1].item() == pytest.approx(-rho * 1.5 / 5)
    assert logp.grad[1, 2].item() == 0.0  # padding gets nothing

    assert metrics["clipped_frac"] == pytest.approx(1 / 5)
    assert metrics["is_ratio/max"] == pytest.approx(math.exp(1.5), rel=1e-5)
    assert metrics["is_ratio/min"] == pytest.approx(math.exp(-1.0), rel=1e-5)


def test_on_policy_tokens_have_weight_one():
    algo = AIPO(rho=4.0)
    logp = torch.randn(4, 5).clamp(max=-0.01).requires_grad_()
    loss, m = algo.loss(logp, logp.detach().clone(), torch.ones(4), torch.ones(4, 5))
    assert m["is_ratio/mean"] == pytest.approx(1.0) and m["clipped_frac"] == 0.0


def test_rho_below_one_rejected():
    with pytest.raises(ValueError):
        AIPO(rho=0.5)


def test_registered_as_entry_point():
    assert load_plugin("algorithms", "aipo") is AIPO
