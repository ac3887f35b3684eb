"""grpo, rloo and on_policy_pg against hand-computed values (the loss menu itself: test_loss_menu.py)."""

import math

import pytest
import torch

from hfllamarl import load_plugin


def test_rloo_leave_one_out_advantage():
    rloo = load_plugin("algorithms", "rloo")(rho=4.0)
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 4.0])  # two groups of 4
    # Group 1: 1 - 0 = 1; 0 - 1/3 = -1/3. Group 2: 2 - 8/3 = -2/3; 4 - 2 = 2.
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, -2 / 3, -2 / 3, -2 / 3, 2.0])
    assert torch.allclose(rloo.advantages(r, 4), expected)
    assert torch.allclose(rloo.advantages(r, 4), 4 / 3 * (r.view(2, 4) - r.view(2, 4).mean(1, keepdim=True)).view(-1))


def test_on_policy_pg_has_no_importance_weight():
    pg = load_plugin("algorithms", "on_policy_pg")()
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mu = torch.tensor([[-3.0, -0.5]])  # far off-policy: must not matter
    loss, m = pg.loss(logp, mu, torch.tensor([2.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-(2.0 * -1.0 + 2.0 * -2.0) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]]))  # -A / num_tokens, weight 1
    assert m["is_ratio/max"] == pytest.approx(math.exp(2.0), rel=1e-5)
    assert pg.advantages(torch.tensor([1.0, 0.0]), 2).tolist() == [0.5, -0.5]


def test_grpo_group_scaled_advantages():
    grpo = load_plugin("algorithms", "grpo")()
    adv = grpo.advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std()
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std + 1e-4))


def test_behavior_kl_metric_is_zero_on_policy_and_positive_off():
    aipo = load_plugin("algorithms", "aipo")(rho=2.0)
    logp = torch.tensor([[-1.0, -2.0]])
    _, on = aipo.loss(logp, logp.clone(), torch.ones(1), torch.ones(1, 2))
    _, off = aipo.loss(logp, logp - 0.5, torch.ones(1), torch.ones(1, 2))
    assert on["behavior_kl"] == pytest.approx(0.0, abs=1e-7)
    r = math.exp(0.5)
    assert off["behavior_kl"] == pytest.approx(r - 1 - 0.5, rel=1e-5)


def test_reference_kl_is_trls_k3_estimator_with_its_gradient():
    from hfllamarl.losses import masked_mean, reference_kl

    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0], [-1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kl = reference_kl(logp, ref)
    # exp(d) - d - 1 with d = ref - logp: d = 0, 1, -1 (and 3, masked out)
    expected = torch.tensor([[0.0, math.e - 2.0], [math.exp(-1.0), math.exp(3.0) - 4.0]])
    assert torch.allclose(kl.detach(), expected, atol=1e-6)
    assert (kl >= 0).all()
    loss = masked_mean(kl, mask)
    loss.backward()
    # d/dlogp [exp(d) - d - 1] = -(exp(d) - 1), divided by the 3 unmasked tokens
    assert torch.allclose(logp.grad, -(torch.exp(ref - logp.detach()) - 1) * mask / 3, atol=1e-6)
    assert logp.grad[0, 0] == 0 and logp.grad[1, 1] == 0


@pytest.mark.parametrize("name", ["aipo", "grpo", "rloo", "on_policy_pg"])
def test_each_algorithm_adds_beta_times_trls_kl_itself(name):
    cls = load_plugin("algorithms", name)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    mu = torch.tensor([[-1.2, -2.0], [-0.5, -2.5]])
    ref = torch.tensor([[-1.0, -1.0], [-1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    base, plain = cls().loss(logp, mu, adv, mask)
    with_kl, m = cls(beta=0.5).loss(logp, mu, adv, mask, ref_logprobs=ref)
    kl = (0.0 + (math.e - 2.0) + math.exp(-1.0)) / 3  # exp(d) - d - 1, d = ref - logp = 0, 1, -1 (and one masked)
    assert m["kl"] == pytest.approx(kl, rel=1e-6) and "kl" not in plain
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * kl, rel=1e-6)
    assert cls(beta=0.5).loss(logp, mu, adv, mask)[0].item() == pytest.approx(base.item())  # no reference: no term


def test_an_option_the_algorithm_does_not_take_is_refused_not_ignored():
    from types import SimpleNamespace

    from hfllamarl.contracts import algorithm_kwargs

    class RhoOnly:
        def __init__(self, rho: float = 4.0):
            self.rho = rho

    from dataclasses import fields

    from hfllamarl import AsyncAIPOConfig
    from hfllamarl.contracts import ALGORITHM_OPTIONS

    defaults = {f.name: f.default for f in fields(AsyncAIPOConfig) if f.name in ALGORITHM_OPTIONS.values()}
    assert defaults["aipo_rho"] == 4.0 and defaults["loss_type"] == "dapo"
    config = SimpleNamespace(**defaults)
    assert algorithm_kwargs("rho_only", RhoOnly, config, defaults) == {"rho": 4.0}
    config.aipo_rho = 2.0
    assert algorithm_kwargs("rho_only", RhoOnly, config, defaults) == {"rho": 2.0}
    config.beta = 0.1
    with pytest.raises(ValueError, match=r"`beta=0.1` is set, but the 'rho_only' algorithm does not use it \(it takes "
                                         r"aipo_rho\).*KL term"):
        algorithm_kwargs("rho_only", RhoOnly, config, defaults)
    config.beta, config.vllm_importance_sampling_mode = 0.0, "token_truncate"
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode='token_truncate'` is set.*"
                                         r"algorithm='aipo', the default, whose aipo_rho bounds the same weight"):
        algorithm_kwargs("rho_only", RhoOnly, config, defaults)


def test_algorithm_metrics_reduce_by_their_names():
    from hfllamarl.runtime.training.trainer import reduce_metrics

    out = reduce_metrics({"loss": [0.5], "mine/thing": [1.0, 3.0], "is_ratio/max": [1.5, 4.0],
                          "is_ratio/min": [0.5, 0.25], "empty": []})
    assert out == {"loss": 0.5, "mine/thing": 2.0, "is_ratio/max": 4.0, "is_ratio/min": 0.25}


def test_an_algorithm_that_breaks_the_contract_is_named():
    from hfllamarl.runtime.training.trainer import checked_loss

    class Broken:
        pass

    w = torch.tensor([1.0, 2.0], requires_grad=True)
    good = (w.sum(), {"mine": torch.tensor(0.5), "n": 3})
    loss, metrics = checked_loss(Broken(), good)
    assert loss.shape == () and metrics == {"mine": 0.5, "n": 3.0}
    for out, match in [(w.sum(), "returned Tensor from loss"),
                        ((w * 2, {}), r"a tensor of shape \(2,\) as its loss"),
                        ((w.sum().detach(), {}), "without gradient"),
                        ((w.sum(), [0.5]), "returned list as its metrics"),
                        ((w.sum(), {"x": "high"}), "metric 'x' = 'high'")]:
        with pytest.raises(TypeError, match=f"the algorithm Broken .*{match}"):
            checked_loss(Broken(), out)
