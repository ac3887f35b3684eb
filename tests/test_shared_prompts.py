"""A group's prompt computed once (`share_prompts`): the log-probs and gradients of the shared layout against each
sequence run alone through the plain transformers model (its own forward, no layout code), the cost model against
hand values, and the trainer's step with and without sharing."""

import pytest
import torch

from conftest import cpu_trainer
from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.loop.sampling import Sampling
from hfllamarl.runtime.training.batching import completion_logprobs
from hfllamarl.runtime.training.shared_prompts import (Layout, PromptSharing, prompt_units, share_batch,
                                                       sharing_agrees)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from hfllamarl.testing.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path_factory.mktemp(request.param) / "m"), family=request.param, seed=3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def rollouts(vocab: int, seed: int = 7) -> list[Rollout]:
    """Two prompts, interleaved (a shuffled micro-batch), completions of unequal lengths and one empty."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (11, 6)]
    out = []
    for which, c in [(0, 5), (1, 3), (0, 9), (0, 0), (1, 7), (0, 4), (1, 1)]:
        ids = torch.randint(3, vocab, (c,), generator=g).tolist()
        out.append(Rollout(prompt="", prompt_ids=prompts[which], completion_ids=ids, behavior_logprobs=[-2.0] * c,
                           versions=[0] * c, finish_reason="stop", completion_text=""))
    return out


def alone(model, r: Rollout) -> torch.Tensor:
    """log pi of `r`'s completion tokens, the sequence alone through the model (no mask, no layout)."""
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    p, c = len(r.prompt_ids), len(r.completion_ids)
    logp = torch.log_softmax(model(input_ids=ids).logits[0, p - 1:p - 1 + c].float(), -1)
    return logp.gather(-1, ids[0, p:, None])[:, 0]


def test_units_keep_a_prompts_completions_together_in_runs():
    rs = rollouts(50)
    assert prompt_units(rs, 1) == [[i] for i in (0, 2, 3, 5)] + [[i] for i in (1, 4, 6)]
    assert prompt_units(rs, 2) == [[0, 2], [3, 5], [1, 4], [6]]
    assert prompt_units(rs, 8) == [[0, 2, 3, 5], [1, 4, 6]]


@pytest.mark.parametrize("per_copy", [2, 4])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_log_probs_and_gradients_equal_each_sequence_alone(model, per_copy, attention):
    model.config._attn_implementation = attention
    try:
        rs = rollouts(model.config.vocab_size)
        weights = torch.randn(len(rs), 9, generator=torch.Generator().manual_seed(1))
        model.zero_grad()
        want = [alone(model, r) for r in rs]
        sum((w[:len(x)] * x).sum() for w, x in zip(weights, want)).backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        kind = {"sdpa": "bool", "eager": "float"}[attention]
        batch = share_batch(rs, 0, "cpu", per_copy, kind)
        got = completion_logprobs(model, batch, Sampling())
        (got * weights[:, :got.shape[1]] * batch["mask"]).sum().backward()
        separate = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rs)
        assert int(batch["token_mask"].sum()) == separate - {2: 2 * 11 + 6, 4: 3 * 11 + 2 * 6}[per_copy]  # copies left out
        for i, (r, x) in enumerate(zip(rs, want)):
            assert torch.allclose(got[i, :len(x)], x, atol=2e-5), (i, got[i], x)
            assert (got[i, len(x):] == 0).all()
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad, want_grads[n], atol=2e-5, rtol=1e-4), n
    finally:
        model.config._attn_implementation = "sdpa"


def test_the_model_check_tells_a_leak_from_agreement(model):
    sharing = PromptSharing.for_model(model)
    assert sharing is not None and sharing.mask == "bool"
    assert sharing_agrees(model, sharing, model.config.vocab_size, "cpu")
    model.config._attn_implementation = "flash_attention_2"  # (takes no 4-D mask: no sharing, nothing checked)
    try:
        assert PromptSharing.for_model(model) is None
    finally:
        model.config._attn_implementation = "sdpa"


def _rollouts(prompt: int, completions: list[int]) -> list[Rollout]:
    return [Rollout(prompt="", prompt_ids=list(range(prompt)), completion_ids=[1] * c, behavior_logprobs=[0.0] * c,
                    versions=[0] * c, finish_reason="stop", completion_text="") for c in completions]


def test_the_cost_model_by_hand():
    """cost = tokens x linear params + 2 x rows x W^2 x attention width x layers, with the units packed first-fit
    decreasing into rows as wide as the longest unit."""
    s = PromptSharing(linear_params=1000, attention_width=2, layers=3, mask="bool")
    rs = _rollouts(100, [20, 20, 20, 20])
    assert s.cost(rs, 1) == 480 * 1000 + 2 * 4 * 120 ** 2 * 2 * 3  # four rows of 120
    assert s.cost(rs, 2) == 280 * 1000 + 2 * 2 * 140 ** 2 * 2 * 3  # two units of 140
    assert s.cost(rs, 4) == 180 * 1000 + 2 * 1 * 180 ** 2 * 2 * 3  # one unit of 180
    assert s.choose(rs) == 4  # 568,800 against 750,400 (2) and 1,171,200 (1)
    assert s.choose(_rollouts(2, [100, 100, 100, 100])) == 1  # a short prompt: wider rows cost more than it saves
    # long completions: 1200 / 1000 / 900 tokens against rows of 4 x 300^2 / 2 x 500^2 / 900^2: 3.12M, 3.0M, 3.42M
    mid = PromptSharing(linear_params=2000, attention_width=1, layers=1, mask="bool")
    assert mid.choose(_rollouts(100, [200, 200, 200, 200])) == 2
    assert s.choose(_rollouts(100, [20])) == 1  # nothing to share
    windowed = PromptSharing(linear_params=1000, attention_width=2, layers=3, mask="bool", sliding_window=110)
    assert windowed.choose(rs) == 1  # a sequence longer than the window: the custom mask would not apply it


def executor(model, share: bool):
    ex = cpu_trainer(model, num_generations=4, micro_batch_size=8, share_prompts=share)
    ex.layout = Layout.checked(ex.spec)
    return ex


def test_the_trainer_step_is_the_same_with_shared_prompts(model):
    """One step's gradient and loss with share_prompts against the packed layout (prompt copies), on long prompts
    where the cost model shares; the step logs the share of tokens it did not compute."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, model.config.vocab_size, (60,), generator=g).tolist()
    rs = [Rollout(prompt="", prompt_ids=prompt, completion_ids=torch.randint(3, 50, (c,), generator=g).tolist(),
                  behavior_logprobs=[-3.0] * c, versions=[0] * c, finish_reason="stop", completion_text="")
          for c in (4, 6, 3, 5)]
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75])
    out = []
    for share in (False, True):
        ex = executor(model, share)
        assert (ex.layout.sharing is not None) == share and ex.layout.packed
        model.zero_grad()
        loss, stats = ex._accumulate_gradients(rs, advantages)
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}, stats))
    (loss0, grads0, stats0), (loss1, grads1, stats1) = out
    assert stats0["shared_prompts/tokens_saved_frac"] == [0.0]
    assert stats1["shared_prompts/tokens_saved_frac"][0] == pytest.approx(3 * 60 / (4 * 60 + 18))
    assert loss1 == pytest.approx(loss0, abs=1e-6)
    for n in grads0:
        assert torch.allclose(grads1[n], grads0[n], atol=2e-5, rtol=1e-4), n
    assert any(float(g.abs().max()) > 0 for g in grads0.values())
