"""The off-policy corrections (`hfllamarl.corrections`, group `hfllamarl.corrections`) against hand computations of
their papers' formulas, their effect on the loss's gradient, the learning-rate factor of the step, and how a config
chooses one (`off_policy_correction`, "auto")."""

import math

import pytest
import torch

from hfllamarl import AsyncAIPOConfig, load_plugin
from hfllamarl.corrections import effective_sample_ratio, staleness_default
from hfllamarl.losses import StepShape
from hfllamarl.registry import installed
from hfllamarl.runtime.training.iterations import scaled_lr

BUILT_IN = ["aipo", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "coupled", "decoupled",
            "a3po", "m2po", "ess"]


def logs(*ratios):
    """`[1, T]` log-probs of pi_old and mu with pi_old/mu = ratios (mu = 0.5 for every token)."""
    mu = torch.full((1, len(ratios)), math.log(0.5))
    return mu + torch.log(torch.tensor([ratios])), mu


def test_every_built_in_is_installed_and_callable():
    assert sorted(installed("corrections")) == sorted(BUILT_IN)
    old, mu = logs(1.0, 2.0)
    for name in BUILT_IN:
        out = load_plugin("corrections", name)()(old, mu, torch.ones(1, 2), torch.full((1, 2), 3.0))
        assert out.weight is None or torch.isfinite(out.weight).all(), name


def test_decoupled_drops_weights_above_the_cap_or_clips_them():
    old, mu = logs(2.0, 6.0, 0.5)
    mask = torch.ones(1, 3)
    out = load_plugin("corrections", "decoupled")(cap=5.0)(old, mu, mask)
    assert torch.allclose(out.weight, torch.tensor([[2.0, 0.0, 0.5]]))
    assert out.anchor is None and out.bounded == pytest.approx(1 / 3)
    clipped = load_plugin("corrections", "decoupled")(cap=5.0, action="truncate")(old, mu, mask)
    assert torch.allclose(clipped.weight, torch.tensor([[2.0, 5.0, 0.5]]))


def test_a3po_interpolates_the_proximal_policy_by_staleness():
    # pi_old/mu = 8 for three tokens sampled 1, 2 and 4 versions ago: alpha = 0, 1/2, 3/4
    old, mu = logs(8.0, 8.0, 8.0)
    out = load_plugin("corrections", "a3po")(cap=5.0)(old, mu, torch.ones(1, 3), torch.tensor([[1.0, 2.0, 4.0]]))
    assert torch.allclose(out.weight, torch.tensor([[1.0, 8 ** 0.5, 8 ** 0.75]]), rtol=1e-6)
    # log pi_prox = log mu + alpha * (log pi_old - log mu): pi_prox/mu is the weight, pi_old/pi_prox the rest
    assert torch.allclose(out.anchor - mu, torch.log(torch.tensor([[1.0, 8 ** 0.5, 8 ** 0.75]])), atol=1e-6)
    # a tempered weight above the cap is dropped: 16 ** (3/4) = 8 > 5
    old16, mu16 = logs(16.0)
    dropped = load_plugin("corrections", "a3po")(cap=5.0)(old16, mu16, torch.ones(1, 1), torch.tensor([[4.0]]))
    assert dropped.weight.item() == 0.0 and dropped.bounded == 1.0
    with pytest.raises(ValueError, match="staleness"):
        load_plugin("corrections", "a3po")()(old, mu, torch.ones(1, 3))


def test_a3po_lag_clips_recent_tokens_against_mu_and_stale_ones_against_a_lagging_policy():
    # lag 4: a token 2 versions stale has alpha 0 (plain PPO on mu: weight 1, anchor mu), one 8 stale alpha 1/2
    old, mu = logs(4.0, 4.0)
    out = load_plugin("corrections", "a3po")(lag=4)(old, mu, torch.ones(1, 2), torch.tensor([[2.0, 8.0]]))
    assert torch.allclose(out.weight, torch.tensor([[1.0, 2.0]]))
    assert torch.allclose(out.anchor, mu + torch.log(torch.tensor([[1.0, 2.0]])), atol=1e-6)
    # written into the name; explicit kwargs win
    config = AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=4, off_policy_correction="a3po:lag=4,cap=3")
    assert (config.build_algorithm().correction.lag, config.build_algorithm().correction.cap) == (4.0, 3.0)
    config = AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=4, off_policy_correction="a3po:lag=4",
                             off_policy_correction_kwargs={"lag": 2})
    assert config.build_algorithm().correction.lag == 2.0
    with pytest.raises(ValueError, match="name:option=value"):
        AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="a3po:lag=four")


def test_m2po_drops_the_largest_squares_until_the_second_moment_is_below_tau():
    # log weights 0.1, -0.1, 0.5, 0.05: mean square 0.068 > 0.04; without the 0.5 one: 0.0075 < 0.04
    log_w = torch.tensor([[0.1, -0.1, 0.5, 0.05]])
    mu = torch.full((1, 4), -1.0)
    out = load_plugin("corrections", "m2po")(tau=0.04)(mu + log_w, mu, torch.ones(1, 4))
    expected = torch.exp(log_w) * torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    assert torch.allclose(out.weight, expected)
    assert out.bounded == pytest.approx(0.25)
    assert out.metrics["correction/m2"] == pytest.approx((0.01 + 0.01 + 0.25 + 0.0025) / 4)
    # a batch within the budget keeps every token, with the whole (untruncated) weight
    small = torch.tensor([[0.1, -0.15, 0.12, 0.05]])
    kept = load_plugin("corrections", "m2po")(tau=0.04)(mu + small, mu, torch.ones(1, 4))
    assert torch.allclose(kept.weight, torch.exp(small)) and kept.bounded == 0.0
    # padding is neither counted nor kept
    padded = load_plugin("corrections", "m2po")(tau=0.04)(mu + log_w, mu, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    assert padded.bounded == 0.0 and padded.weight[0, 2] == 0.0


def test_ess_scales_the_step_by_the_root_of_the_effective_sample_ratio():
    # weights 1, 1, 3: ESS = 5^2 / 11, ESS / N = 25 / 33
    assert effective_sample_ratio(torch.log(torch.tensor([1.0, 1.0, 3.0]))) == pytest.approx(25 / 33)
    assert effective_sample_ratio(torch.tensor([700.0, 700.0])) == pytest.approx(1.0)  # no overflow
    ess = load_plugin("corrections", "ess")()
    scale, metrics = ess.step_scale(torch.log(torch.tensor([1.0, 1.0, 3.0])))
    assert scale == pytest.approx(math.sqrt(25 / 33)) and metrics["correction/ess"] == pytest.approx(25 / 33)
    assert load_plugin("corrections", "ess")(rule="linear").step_scale(
        torch.log(torch.tensor([1.0, 1.0, 3.0])))[0] == pytest.approx(25 / 33)
    # the loss's weight: the sequence's product, truncated at 8
    old, mu = logs(3.0, 4.0)
    assert torch.allclose(ess(old, mu, torch.ones(1, 2)).weight, torch.tensor([[8.0]]))


def test_the_step_rule_goes_on_top_of_any_correction():
    algorithm = AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=4, off_policy_correction="a3po+ess").build_algorithm()
    assert algorithm.scales_steps and type(algorithm.correction.base).__name__ == "A3PO"
    old, mu = logs(8.0, 8.0)
    staleness = torch.full((1, 2), 4.0)
    wrapped = algorithm.correction(old, mu, torch.ones(1, 2), staleness)
    plain = load_plugin("corrections", "a3po")()(old, mu, torch.ones(1, 2), staleness)
    assert torch.equal(wrapped.weight, plain.weight) and torch.equal(wrapped.anchor, plain.anchor)
    assert algorithm.step_scale(torch.log(torch.tensor([1.0, 1.0, 3.0])))[0] == pytest.approx(math.sqrt(25 / 33))
    assert not AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=4, off_policy_correction="a3po").build_algorithm(
    ).scales_steps


def test_scaled_lr_steps_at_the_factor_and_restores_the_rate():
    p = torch.nn.Parameter(torch.tensor([1.0]))
    optimizer = torch.optim.SGD([p], lr=0.5)
    p.grad = torch.tensor([2.0])
    with scaled_lr(optimizer, 0.25):
        optimizer.step()
    assert p.item() == pytest.approx(1.0 - 0.5 * 0.25 * 2.0)
    assert optimizer.param_groups[0]["lr"] == 0.5


def _grad(algorithm, logp, old, mu, adv, mask, staleness=None):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = algorithm.loss(logp, mu, adv, mask, shape=StepShape.of(mask), old_logprobs=old,
                                   staleness=staleness)
    loss.backward()
    return logp.grad, metrics


def test_coupled_ppo_clips_stale_tokens_that_decoupled_trains():
    # one batch pass (pi = pi_old), tokens with pi_old/mu = 2 and 1.1, positive advantage, dapo (token sum / tokens)
    old, mu = logs(2.0, 1.1)
    mask, adv = torch.ones(1, 2), torch.tensor([1.0])
    coupled = load_plugin("algorithms", "grpo")(loss_type="dapo", off_policy_correction="coupled")
    grad, _ = _grad(coupled, old, old, mu, adv, mask)
    # c = pi/mu: 2 is past 1 + eps (no gradient), 1.1 is inside (-c A / tokens)
    assert torch.allclose(grad, torch.tensor([[0.0, -1.1 / 2]]))
    decoupled = load_plugin("algorithms", "grpo")(loss_type="dapo", off_policy_correction="decoupled")
    grad, metrics = _grad(decoupled, old, old, mu, adv, mask)
    # c = pi/pi_old = 1, weight b = pi_old/mu: -b A / tokens
    assert torch.allclose(grad, torch.tensor([[-2.0 / 2, -1.1 / 2]]))
    assert metrics["clipped_frac"] == 0.0


def test_a3po_in_the_loss_clips_against_the_interpolated_policy():
    # pi = pi_old, pi_old/mu = 2 sampled 4 versions ago: b = 2^(3/4), c = pi/pi_prox = 2^(1/4) = 1.19 (inside 1.28)
    old, mu = logs(2.0, 4.0)
    mask, adv = torch.ones(1, 2), torch.tensor([1.0])
    a3po = load_plugin("algorithms", "aipo")(epsilon_high=0.28, off_policy_correction="a3po")
    grad, metrics = _grad(a3po, old, old, mu, adv, mask, torch.full((1, 2), 4.0))
    # token 1: d(-c A b)/dlogpi = -c b A = -2 (c b = pi/mu); token 2: c = 4^(1/4) = 1.41 past 1.28: no gradient
    assert torch.allclose(grad, torch.tensor([[-2.0 / 2, 0.0]]), atol=1e-6)
    assert metrics["correction/alpha_mean"] == pytest.approx(0.75)


def test_the_trust_mask_drops_cispos_tokens_past_the_trust_region_in_their_advantages_direction():
    # One batch pass (pi = pi_old), coupled (anchor mu): c = pi/mu = 2, 1.1, 0.5, 2 with A = +1, +1, -1, -1 (one token
    # per sequence). CISPO (epsilon_high = 5: its weight min(c, 5)) trains all four: gradient -min(c, 5) A / tokens.
    old, mu = logs(2.0, 1.1, 0.5, 2.0)
    old, mu = old.view(4, 1), mu.view(4, 1)
    mask, adv = torch.ones(4, 1), torch.tensor([1.0, 1.0, -1.0, -1.0])
    plain = load_plugin("algorithms", "grpo")(loss_type="cispo", epsilon_high=5.0, off_policy_correction="coupled")
    grad, _ = _grad(plain, old, old, mu, adv, mask)
    assert torch.allclose(grad, torch.tensor([[-2.0], [-1.1], [0.5], [2.0]]) / 4)
    # "+trust" (CISPO's mask M_t, [1 - 0.2, 1 + 0.28]): A > 0 and c = 2 > 1.28, A < 0 and c = 0.5 < 0.8 get none;
    # c = 1.1 (inside) and c = 2 with A < 0 (the advantage pushes it back) keep theirs; the normaliser is unchanged
    masked = load_plugin("algorithms", "grpo")(loss_type="cispo", epsilon_high=5.0,
                                               off_policy_correction="coupled+trust")
    grad, metrics = _grad(masked, old, old, mu, adv, mask)
    assert torch.allclose(grad, torch.tensor([[0.0], [-1.1], [0.0], [2.0]]) / 4)
    assert metrics["correction/trust_masked_frac"] == pytest.approx(0.5)
    # its bounds are options; for a PPO-clipped loss with the same bounds it changes nothing (the clip already did it)
    wide = load_plugin("algorithms", "grpo")(loss_type="cispo", epsilon_high=5.0,
                                             off_policy_correction="coupled+trust:trust_high=1.5,trust_low=0.6")
    assert torch.allclose(_grad(wide, old, old, mu, adv, mask)[0], torch.tensor([[-2.0], [-1.1], [0.5], [2.0]]) / 4)
    dapo = {c: load_plugin("algorithms", "grpo")(loss_type="dapo", epsilon_high=0.28, off_policy_correction=c)
            for c in ("coupled", "coupled+trust")}
    assert torch.equal(*(_grad(a, old, old, mu, adv, mask)[0] for a in dapo.values()))
    # on top of a3po (anchor pi_prox), with a3po's own options in the same name
    a3po = load_plugin("algorithms", "grpo")(loss_type="cispo", epsilon_high=5.0,
                                             off_policy_correction="a3po+trust:lag=1")
    grad, _ = _grad(a3po, old, old, mu, adv, mask, torch.full((4, 1), 4.0))
    # alpha = 3/4: b = w^(3/4), c = w^(1/4) = 1.19, 1.02, 0.84, 1.19: all inside, gradient -min(c, 5) b A = -w A
    assert torch.allclose(grad, torch.tensor([[-2.0], [-1.1], [0.5], [2.0]]) / 4, atol=1e-6)
    with pytest.raises(ValueError, match="trust_low"):
        AsyncAIPOConfig(output_dir="/tmp/x", algorithm="grpo", loss_type="cispo",
                        off_policy_correction="coupled+trust:trust_low=1.5")


def test_the_sampler_trust_mask_keeps_gspos_own_clip_for_the_batchs_drift():
    # GSPO as TRL's docs configure it (epsilon 3e-4, epsilon_high 4e-4), one pass (pi = pi_old), two sequences of
    # two tokens sampled by a stale mu, A = +1 each: pi_old/mu = (2, 2) and (1.1, 1.0) per token, so pi/mu per
    # sequence (geometric mean) is 2 and sqrt(1.1) = 1.049.
    old, mu = logs(2.0, 2.0, 1.1, 1.0)
    old, mu = old.view(2, 2), mu.view(2, 2)
    mask, adv = torch.ones(2, 2), torch.tensor([1.0, 1.0])

    def gspo(correction):
        return load_plugin("algorithms", "grpo")(loss_type="grpo", importance_sampling_level="sequence",
                                                 epsilon=3e-4, epsilon_high=4e-4, off_policy_correction=correction)

    # anchored at mu (coupled, as a3po is up to its lag), GSPO's clip at 1 + 4e-4 stops both sequences
    assert torch.equal(_grad(gspo("coupled"), old, old, mu, adv, mask)[0], torch.zeros(2, 2))
    # around the sampler: the objective's ratio is pi/pi_old = 1 (inside its clip); sequence 1 (2 > 1.28, A > 0)
    # gets no gradient, sequence 2 (1.049, inside [0.8, 1.28]) d/dlogpi_t of -s A mean_t(b_t) / 2 sequences, with
    # s = exp(mean_t log pi/pi_old) (ds/dlogpi_t = 1/2) and b = min(pi_old/mu, 3) = (1.1, 1.0): -1.05 / 4
    grad, metrics = _grad(gspo("token_truncate+sampler_trust"), old, old, mu, adv, mask)
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0], [-1.05 / 4, -1.05 / 4]]), atol=1e-6)
    assert metrics["correction/trust_masked_frac"] == pytest.approx(0.5)
    # "+trust" draws the region around the anchor (pi_old here): nothing is masked, sequence 1 trains with b = 2
    grad, _ = _grad(gspo("token_truncate+trust"), old, old, mu, adv, mask)
    assert torch.allclose(grad, torch.tensor([[-2.0 / 4, -2.0 / 4], [-1.05 / 4, -1.05 / 4]]), atol=1e-6)
    # for a token-level loss the region is per token: pi/mu = 2 (A > 0) is dropped, 1.1 kept (dapo: sum / tokens)
    dapo = load_plugin("algorithms", "grpo")(loss_type="dapo", off_policy_correction="token_truncate+sampler_trust")
    old, mu = logs(2.0, 1.1)
    grad, _ = _grad(dapo, old, old, mu, torch.tensor([1.0]), torch.ones(1, 2))
    assert torch.allclose(grad, torch.tensor([[0.0, -1.1 / 2]]), atol=1e-6)
    assert "reference='sampler'" in repr(dapo.correction)
    # a mistyped base is named, with what the suffixes are
    with pytest.raises(Exception, match=r"tokn_truncate.*\+sampler_trust' \(around the sampler\)"):
        AsyncAIPOConfig(output_dir="/tmp/x", algorithm="grpo", max_staleness=4,
                        off_policy_correction="tokn_truncate+sampler_trust").build_algorithm()


@pytest.mark.parametrize("loss", ["aipo", "grpo", "dapo", "cispo", "gspo", "vespo"])
def test_auto_is_trls_correction_when_synchronous_and_the_studys_default_when_stale(loss):
    fields = ({"algorithm": "aipo"} if loss == "aipo" else
              {"algorithm": "grpo", "loss_type": "grpo", "importance_sampling_level": "sequence"} if loss == "gspo"
              else {"algorithm": "grpo", "loss_type": loss})
    sync = AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=0,
                           **fields, **({"vllm_importance_sampling_mode": "token_truncate"} if loss == "vespo" else {}))
    assert sync.algorithm_options["off_policy_correction"] == "trl"
    stale = AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=4, **fields)
    assert stale.algorithm_options["off_policy_correction"] == staleness_default(loss, 4) != "trl"
    # what docs/operations/staleness.md's table of defaults says, by hand
    at_4 = {"cispo": "a3po+trust:lag=8", "gspo": "sequence_mask+sampler_trust:trust_low=0.1,trust_high=0.1"}.get(
        loss, "a3po:lag=8")
    at_1 = {"aipo": "token_truncate", "grpo": "token_truncate", "dapo": "token_truncate"}.get(loss, at_4)
    assert stale.algorithm_options["off_policy_correction"] == at_4
    one = AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=1, **fields)
    assert one.algorithm_options["off_policy_correction"] == at_1
    assert AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=2, **fields).algorithm_options[
        "off_policy_correction"] == at_4
    # a TRL correction field set by the user is honoured as set
    set_ = AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=4, vllm_importance_sampling_mode="token_mask", **fields)
    assert set_.algorithm_options["off_policy_correction"] == "trl"
    assert set_.build_algorithm().correction.mode == "token_mask"
    # ... also when written with TRL's default value (a recipe that spells TRL's correction out); argparse passes
    # every field, so there only a value that differs from TRL's counts
    written = AsyncAIPOConfig(output_dir="/tmp/x", max_staleness=4, vllm_importance_sampling_mode="sequence_mask",
                              **fields) if loss != "vespo" else set_
    assert written.algorithm_options["off_policy_correction"] == "trl"
    from transformers import HfArgumentParser

    args = [f"--{k}={v}" for k, v in fields.items()]
    parsed, = HfArgumentParser(AsyncAIPOConfig).parse_args_into_dataclasses(
        ["--output_dir=/tmp/x", "--max_staleness=4", *args])
    assert parsed.algorithm_options["off_policy_correction"] == staleness_default(loss, 4)


def test_bad_correction_settings_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="two different corrections"):
        AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="m2po", vllm_importance_sampling_clip_max=2.0)
    with pytest.raises(ValueError, match="two different corrections"):
        AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="m2po", aipo_rho=2.0)
    with pytest.raises(ValueError, match="Did you mean a3po.*'auto', 'trl', 'none'"):  # the names it takes
        AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="a3p0")
    with pytest.raises(ValueError, match="name the correction"):
        AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="trl", off_policy_correction_kwargs={"tau": 1})
    with pytest.raises(ValueError, match="tau"):
        AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="m2po", off_policy_correction_kwargs={"tau": -1})
    with pytest.raises(ValueError, match="off_policy_correction_kwargs"):
        AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="m2po", off_policy_correction_kwargs={"cap": 1})
    with pytest.raises(ValueError, match="per-token correction"):
        AsyncAIPOConfig(output_dir="/tmp/x", algorithm="grpo", loss_type="vespo", off_policy_correction="ess")
    with pytest.raises(ValueError, match="does not use it"):
        AsyncAIPOConfig(output_dir="/tmp/x", algorithm="on_policy_pg", off_policy_correction="m2po")
    # the "aipo" correction takes aipo_rho; a JSON string (a recipe, the command line) is read as a dict
    config = AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="aipo", aipo_rho=2.0)
    assert config.build_algorithm().correction.clip_max == 2.0
    config = AsyncAIPOConfig(output_dir="/tmp/x", off_policy_correction="m2po",
                             off_policy_correction_kwargs='{"tau": 0.1}')
    assert config.build_algorithm().correction.tau == 0.1
