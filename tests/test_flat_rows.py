"""With skip_flat_rows, rows whose advantage is 0 (a group whose rewards are all equal) skip the trainer's forward and
backward where the loss keeps rows apart (`iterations.rows_to_train`, `PolicyLoss.rows_apart`): the step's loss and gradient are those
of the whole batch, checked against the same step with every row run."""

import pytest
import torch

from conftest import cpu_trainer
from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.training.iterations import rows_to_train


def test_the_rows_run_are_those_with_signal_and_at_least_one():
    adv = torch.tensor([0.0, 1.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0])
    assert rows_to_train(adv, skip=True) == [1, 4]
    assert rows_to_train(torch.zeros(6), skip=True) == [0]  # (one row: the step's metrics)
    assert rows_to_train(adv, skip=False) == list(range(8))


def test_which_losses_keep_rows_apart():
    from hfllamarl.corrections import build
    from plugins.algorithms.aipo import AIPO

    assert AIPO(rho=4.0).rows_apart  # dapo, AIPO's truncation per token
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


def test_a_step_that_skips_flat_rows_has_the_whole_batchs_loss_and_gradient(model):
    """Three groups of 4, two of them flat (advantage 0): with the skip the trainer runs 4 of 12 rows and logs the
    skipped share; the loss and every gradient equal the step that runs all 12 (micro-batches of 3: 4 against 2)."""
    g = torch.Generator().manual_seed(1)
    rs = []
    for p in range(3):
        prompt = torch.randint(3, model.config.vocab_size, (5 + p,), generator=g).tolist()
        for c in (4, 6, 3, 5):
            rs.append(Rollout(prompt="", prompt_ids=prompt,
                              completion_ids=torch.randint(3, 50, (c,), generator=g).tolist(),
                              behavior_logprobs=[-3.0] * c, versions=[0] * c, finish_reason="stop",
                              completion_text=""))
    advantages = torch.tensor([0.0] * 4 + [1.0, -0.5, 0.25, -0.75] + [0.0] * 4)
    out = []
    for skip in (False, True):
        ex = cpu_trainer(model, num_generations=4, micro_batch_size=3, skip_flat_rows=True)
        assert ex.skips_flat_rows  # (AIPO, no reference model)
        ex.skips_flat_rows = skip
        model.zero_grad()
        loss, stats = ex._accumulate_gradients(rs, advantages)
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}, stats))
    (loss0, grads0, stats0), (loss1, grads1, stats1) = out
    assert stats0["trainer/flat_rows_skipped_frac"] == [0.0]
    assert stats1["trainer/flat_rows_skipped_frac"] == [pytest.approx(8 / 12)]
    assert loss1 == pytest.approx(loss0, abs=1e-6)
    for n in grads0:
        assert torch.allclose(grads1[n], grads0[n], atol=1e-6, rtol=1e-5), n
    assert any(float(g.abs().max()) > 0 for g in grads0.values())


def test_data_parallel_ranks_run_as_many_rows():
    """Two trainer ranks (gloo) with one and three rows of signal: both run three (rank 0 topped up in order)."""
    import json

    from conftest import SCRIPTS, run_script, tail

    proc = run_script([str(SCRIPTS / "flat_rows_ranks.py")], nproc=2, timeout=300)
    assert proc.returncode == 0, tail(proc)
    rows = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert rows == [[0, 1, 2], [0, 2, 5]]


def test_skip_flat_rows_is_refused_where_it_cannot_be_exact():
    from hfllamarl import AsyncAIPOConfig

    AsyncAIPOConfig(output_dir="/tmp/hfllamarl-flat", report_to="none", skip_flat_rows=True)  # aipo, dapo, beta 0
    for kw, says in (({"beta": 0.04}, "beta 0.04"), ({"loss_type": "grpo"}, "loss_type 'grpo'"),
                     ({"top_entropy_quantile": 0.5}, "top_entropy_quantile 0.5")):
        with pytest.raises(ValueError, match="skip_flat_rows=True needs a loss") as err:
            AsyncAIPOConfig(output_dir="/tmp/hfllamarl-flat", report_to="none", skip_flat_rows=True, **kw)
        assert says in str(err.value), str(err.value)
