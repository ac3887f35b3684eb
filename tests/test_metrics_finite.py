"""Every logged metric is finite: behavior_kl from the log-ratio (k3, hand values and the exact KL as references),
a token outside the current policy's support left out of it and counted, and one central check where metrics are
logged."""

import logging
import math

import pytest
import torch

from hfllamarl import load_plugin
from hfllamarl.losses import behavior_kl, ratio_metrics
from hfllamarl.runtime.loop.sampling import Sampling, within_support


def test_k3_on_in_support_tokens_matches_hand_values():
    # r = 1/2, 2, 1: (1/2 - 1 + ln 2) + (2 - 1 - ln 2) + 0 = 1/2, over 3 tokens; a padded 4th token is not counted
    log_ratio = torch.tensor([[math.log(0.5), math.log(2.0), 0.0, 50.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    kl, excluded = behavior_kl(log_ratio, mask)
    assert kl == pytest.approx(0.5 / 3, rel=1e-12) and excluded == 0.0
    m = ratio_metrics(torch.exp(log_ratio), mask, log_ratio)
    assert m["behavior_kl"] == pytest.approx(0.5 / 3, rel=1e-12)
    assert (m["is_ratio/min"], m["is_ratio/max"]) == pytest.approx((0.5, 2.0))
    assert m["is_ratio/mean"] == pytest.approx(3.5 / 3)


def test_k3_estimates_the_exact_kl_between_behaviour_and_policy():
    """Tokens sampled from mu: the k3 mean approaches KL(mu || pi) as torch.distributions computes it."""
    g = torch.Generator().manual_seed(0)
    mu = torch.distributions.Categorical(logits=torch.randn(50, generator=g))
    pi = torch.distributions.Categorical(logits=torch.randn(50, generator=g) * 0.5)
    tokens = torch.multinomial(mu.probs, 200_000, replacement=True, generator=g)
    log_ratio = (pi.logits[tokens] - mu.logits[tokens])[None]
    kl, _ = behavior_kl(log_ratio, torch.ones_like(log_ratio))
    exact = torch.distributions.kl_divergence(mu, pi).item()
    assert kl == pytest.approx(exact, rel=0.03), (kl, exact)


def test_a_token_outside_the_policys_support_gives_finite_metrics_and_is_counted():
    """mu finite, pi -inf (the sampled token's logit masked): the old form r - 1 - log r is inf; every metric of
    every built-in algorithm is finite now, and the token is counted in behavior_kl/excluded_frac."""
    logits = torch.tensor([[[0.0, 1.0, 2.0], [0.5, 0.0, -1.0], [1.0, 1.0, 1.0]]])  # [B=1, T=3, V=3]
    logits[0, 1, 0] = -math.inf  # the current policy can no longer sample token 0 at position 1
    sampled = torch.tensor([[2, 0, 1]])
    raw = torch.log_softmax(logits, -1).gather(-1, sampled[..., None])[..., 0]
    assert torch.isneginf(raw[0, 1])
    mu = torch.tensor([[-0.5, -0.8, -1.2]])
    mask = torch.ones(1, 3)
    r = torch.exp(raw - mu)
    assert math.isinf((r - 1 - torch.log(r)).mean().item())  # what was logged before
    # what the trainer passes a loss under truncated sampling (the token at OUTSIDE_LOGPROB), and the raw -inf
    logprobs, outside = within_support(raw, mask, Sampling(top_k=2))
    assert outside.tolist() == [[False, True, False]]
    expected = (torch.expm1(raw - mu) - (raw - mu))[0, [0, 2]].double().mean().item()  # the two in-support tokens
    for lp in (logprobs, raw):
        m = ratio_metrics(torch.exp(lp - mu), mask, lp - mu)
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["behavior_kl"] == pytest.approx(expected) and m["behavior_kl/excluded_frac"] == pytest.approx(1 / 3)
        assert m["is_ratio/min"] == 0.0
    m = ratio_metrics(torch.exp(raw - mu), mask)  # a third-party algorithm passing only the ratio: finite too
    assert math.isfinite(m["behavior_kl"]) and m["behavior_kl/excluded_frac"] == pytest.approx(1 / 3)
    logprobs = logprobs.clone().requires_grad_(True)
    for algo in (load_plugin("algorithms", "aipo")(rho=2.0), load_plugin("algorithms", "grpo")(),
                 load_plugin("algorithms", "on_policy_pg")()):
        loss, metrics = algo.loss(logprobs, mu, torch.tensor([1.0]), mask)
        assert math.isfinite(loss.item())
        assert all(math.isfinite(v) for v in metrics.values()), (type(algo).__name__, metrics)
        assert metrics["behavior_kl/excluded_frac"] == pytest.approx(1 / 3)


def test_a_ratio_past_float32s_range_stays_finite():
    """mu far below pi (log-ratio 100: exp overflows float32): is_ratio/max and behavior_kl are finite."""
    log_ratio, mask = torch.tensor([[100.0, 0.0]]), torch.ones(1, 2)
    m = ratio_metrics(torch.exp(log_ratio), mask, log_ratio)
    assert m["is_ratio/max"] == pytest.approx(math.exp(100.0))
    assert m["behavior_kl"] == pytest.approx((math.expm1(100.0) - 100.0) / 2)


def test_the_logging_point_drops_a_non_finite_metric_with_a_warning_naming_it(caplog):
    from hfllamarl.runtime.training.reporting import finite_logs

    with caplog.at_level(logging.WARNING, logger="hfllamarl.runtime.training.reporting"):
        out = finite_logs({"loss": 0.5, "behavior_kl": math.inf, "entropy": math.nan, "epoch": 1}, step=7)
    assert out == {"loss": 0.5, "epoch": 1}
    text = caplog.text
    assert "'behavior_kl' is inf at step 7" in text and "'entropy' is nan at step 7" in text
