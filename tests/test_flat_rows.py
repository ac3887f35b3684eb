"""Rows whose advantage is 0 (a group whose rewards are all equal): with skip_flat_backward (the default) they run the
trainer's forward pass only (`iterations.forward_only_plan`, `PolicyLoss.flat_rows_inert`), with skip_flat_rows neither
pass where the loss keeps rows apart (`iterations.rows_to_train`, `PolicyLoss.rows_apart`). Either way the step's loss
and gradient are those of the whole batch (and with the forward kept, its metrics too), checked against the same step
with every row run."""

import pytest
import torch

from conftest import cpu_trainer
from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.training.iterations import forward_only_plan, rows_to_train


def test_the_rows_run_are_those_with_signal_and_at_least_one():
    adv = torch.tensor([0.0, 1.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0])
    assert rows_to_train(adv, skip=True) == [1, 4]
    assert rows_to_train(torch.zeros(6), skip=True) == [0]  # (one row: the step's metrics)
    assert rows_to_train(adv, skip=False) == list(range(8))


def test_the_forward_only_plan_keeps_the_micro_batches():
    """Micro-batches of 3 as without the plan; in each, the rows with signal run with gradient and the flat ones
    without; a micro-batch of flat rows only runs no backward; a wholly flat batch still runs one (the optimizer
    steps on zeros, as over a flat batch without the plan) with one row of gradient."""
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    assert forward_only_plan(adv, 3, True) == [([], [0, 1, 2], False), ([4, 5], [3], False), ([6, 7], [8], False),
                                               ([], [9, 10, 11], False)]
    assert forward_only_plan(adv, 3, False) == [([0, 1, 2], [], False), ([3, 4, 5], [], False),
                                                ([6, 7, 8], [], False), ([9, 10, 11], [], False)]
    assert forward_only_plan(torch.zeros(5), 2, True) == [([0], [1], False), ([], [2, 3], False), ([], [4], False)]
    assert forward_only_plan(torch.ones(4), 4, True) == [([0, 1, 2, 3], [], False)]


def test_a_flat_group_has_advantage_exactly_0():
    """The group mean of equal rewards can round off them (three rewards of 0.1 in float64: -1.4e-17 each); a flat
    group's advantages are exactly 0 all the same, with unscored members too, so its rows are known to add nothing."""
    from hfllamarl.losses import group_advantages

    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.2, float("nan"), 0.2, 1.0, 0.0, 0.5], dtype=torch.float64)
    grouped = rewards.view(-1, 3)
    assert bool((grouped[:2] - grouped[:2].mean(1, keepdim=True) != 0).all())  # (the plain formula's rounding)
    for scale in ("none", "group", "batch"):
        adv = group_advantages(rewards, 3, scale)
        assert adv[:9].tolist() == [0.0] * 9, scale
        assert adv[9] > 0 > adv[10], scale


def test_which_losses_keep_rows_apart():
    from hfllamarl.corrections import build
    from plugins.algorithms.aipo import AIPO

    assert AIPO(rho=4.0).rows_apart  # dapo, AIPO's truncation per token
    assert AIPO(rho=4.0, loss_type="grpo").flat_rows_inert and not AIPO(rho=4.0, beta=0.04).flat_rows_inert
    assert not AIPO(rho=4.0, beta=0.04).rows_apart  # a KL term on every token
    assert not AIPO(rho=4.0, loss_type="grpo").rows_apart  # each sequence's mean, averaged over the micro-batch
    aipo = AIPO(rho=4.0)
    for name, apart in (("a3po:lag=8", True), ("a3po+trust:lag=8", True), ("token_mask", True), ("m2po", False),
                        ("token_truncate+ess", False)):
        aipo.correction = build(name, None, None, False)
        assert aipo.rows_apart == apart, name


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from hfllamarl.testing.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path_factory.mktemp("llama") / "m"), seed=5)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _three_groups(model, seed: int, behaviour) -> list[Rollout]:
    """Three groups of 4 rollouts (completions of 4, 6, 3 and 5 tokens); `behaviour(c, generator)`: mu's values."""
    g = torch.Generator().manual_seed(seed)
    rs = []
    for p in range(3):
        prompt = torch.randint(3, model.config.vocab_size, (5 + p,), generator=g).tolist()
        for c in (4, 6, 3, 5):
            rs.append(Rollout(prompt="", prompt_ids=prompt,
                              completion_ids=torch.randint(3, 50, (c,), generator=g).tolist(),
                              behavior_logprobs=behaviour(c, g), versions=[0] * c, finish_reason="stop",
                              completion_text=""))
    return rs


_TWO_FLAT = torch.tensor([0.0] * 4 + [1.0, -0.5, 0.25, -0.75] + [0.0] * 4)  # the first and last groups flat


def _same_step(model, steps: list):
    """Each of `steps` (callables that run one `_accumulate_gradients` on `model`) from zeroed gradients; asserts
    that the second's loss and every gradient equal the first's (and that the gradient is not all 0), and returns
    both steps' metrics."""
    out = []
    for step in steps:
        model.zero_grad()
        loss, stats = step()
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}, stats))
    (loss0, grads0, stats0), (loss1, grads1, stats1) = out
    assert loss1 == pytest.approx(loss0, abs=1e-6)
    for n in grads0:
        assert torch.allclose(grads1[n], grads0[n], atol=1e-6, rtol=1e-5), n
    assert any(float(g.abs().max()) > 0 for g in grads0.values())
    return stats0, stats1


def test_a_step_that_skips_flat_rows_has_the_whole_batchs_loss_and_gradient(model):
    """Three groups of 4, two of them flat (advantage 0): with the skip the trainer runs 4 of 12 rows and logs the
    skipped share; the loss and every gradient equal the step that runs all 12 (micro-batches of 3: 4 against 2)."""
    rs = _three_groups(model, 1, lambda c, g: [-3.0] * c)

    def step(skip):
        ex = cpu_trainer(model, num_generations=4, micro_batch_size=3, skip_flat_rows=True)
        assert ex.skips_flat_rows  # (AIPO, no reference model)
        ex.skips_flat_rows = skip
        return ex._accumulate_gradients(rs, _TWO_FLAT)

    stats0, stats1 = _same_step(model, [lambda: step(False), lambda: step(True)])
    assert stats0["trainer/flat_rows_skipped_frac"] == [0.0]
    assert stats1["trainer/flat_rows_skipped_frac"] == [pytest.approx(8 / 12)]


def test_data_parallel_ranks_run_as_many_rows():
    """Two trainer ranks (gloo) with one and three rows of signal: both run three (rank 0 topped up in order)."""
    import json

    from conftest import SCRIPTS, run_script, tail

    proc = run_script([str(SCRIPTS / "flat_rows_ranks.py")], nproc=2, timeout=300)
    assert proc.returncode == 0, tail(proc)
    rows = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert rows == [[0, 1, 2], [0, 2, 5]]


def test_sharded_ranks_with_different_flat_rows_run_the_same_passes(tiny_model):
    """Two FSDP2 trainer ranks (gloo) whose flat micro-batches differ (each has one where the other has signal): with
    the flat rows run forward only, both run the same collective passes (a flat row with gradient, a spare pass
    without; a last micro-batch flat on both runs no backward, so the gradients are reduced in the one before), and
    the step's loss and gathered gradients equal those of every row run both ways."""
    import json

    from conftest import SCRIPTS, run_script, tail

    proc = run_script([str(SCRIPTS / "flat_rows_ranks.py"), tiny_model], nproc=2, timeout=300)
    assert proc.returncode == 0, tail(proc)
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert out["forward_only_frac"] == [4 / 6] and out["same_names"] and out["grads"] > 10
    assert out["loss"][1] == pytest.approx(out["loss"][0], abs=1e-6)
    assert out["entropy"][1] == pytest.approx(out["entropy"][0], rel=1e-5)
    assert out["max_grad"] > 1e-3 and out["max_diff"] <= 1e-6 * out["max_grad"] + 1e-9, out


def test_skip_flat_rows_is_refused_where_it_cannot_be_exact():
    from hfllamarl import AsyncAIPOConfig

    AsyncAIPOConfig(output_dir="/tmp/hfllamarl-flat", report_to="none", skip_flat_rows=True)  # aipo, dapo, beta 0
    for kw, says in (({"beta": 0.04}, "beta 0.04"), ({"loss_type": "grpo"}, "loss_type 'grpo'"),
                     ({"top_entropy_quantile": 0.5}, "top_entropy_quantile 0.5")):
        with pytest.raises(ValueError, match="skip_flat_rows=True needs a loss") as err:
            AsyncAIPOConfig(output_dir="/tmp/hfllamarl-flat", report_to="none", skip_flat_rows=True, **kw)
        assert says in str(err.value), str(err.value)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_flat_rows_run_forward_only_with_the_whole_batchs_loss_gradient_and_metrics(model, loss_type):
    """Three groups of 4, two of them flat, micro-batches of 3 (one of flat rows only, two mixed, one flat again):
    with the flat rows' backward left out the loss, every gradient and every metric (entropy, ratios, clip shares)
    equal the step that runs every row both ways, in fp32 to rounding; `grpo` normalises per micro-batch, so the
    micro-batches must be the same ones."""
    from hfllamarl.plugins.algorithms.aipo import AIPO

    rs = _three_groups(model, 2, lambda c, g: (-3.0 - torch.rand(c, generator=g)).tolist())

    def step(forward_only):
        ex = cpu_trainer(model, num_generations=4, micro_batch_size=3, skip_flat_backward=forward_only)
        ex.spec.algorithm = AIPO(rho=4.0, loss_type=loss_type)
        ex.skips_flat_backward = forward_only and ex.spec.algorithm.flat_rows_inert
        return ex._accumulate_gradients(rs, _TWO_FLAT)

    stats0, stats1 = _same_step(model, [lambda: step(False), lambda: step(True)])
    assert stats0["trainer/flat_rows_forward_only_frac"] == [0.0]
    assert stats1["trainer/flat_rows_forward_only_frac"] == [pytest.approx(8 / 12)]
    keys = set(stats0) - {"trainer/flat_rows_forward_only_frac"}
    assert keys == set(stats1) - {"trainer/flat_rows_forward_only_frac"} and "entropy" in keys
    for key in keys:
        assert stats1[key] == pytest.approx(stats0[key], rel=1e-5, abs=1e-6), key
