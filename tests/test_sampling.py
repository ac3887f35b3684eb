"""pi under every sampling transform vLLM applies: hand values, vLLM's own sampler as a reference, the config."""

import math

import pytest
import torch

from hfllamarl import AsyncAIPOConfig
from hfllamarl.runtime.loop.sampling import Sampling, processed_logits, sampled_logprobs, seen_tokens

LOGITS = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])  # [B=1, T=1, V=4]
P = torch.softmax(LOGITS[0, 0], -1).tolist()  # 0.644, 0.237, 0.087, 0.032


def kept(sampling, logits=LOGITS, seen=None):
    return torch.isfinite(processed_logits(logits, sampling, seen))[0, 0].tolist()


def test_top_k_top_p_min_p_by_hand():
    assert kept(Sampling(top_k=2)) == [True, True, False, False]
    # top-p 0.8: from the least likely, cumulative 0.032, 0.119 <= 0.2 are dropped; 0.356 is not
    assert kept(Sampling(top_p=0.8)) == [True, True, False, False]
    assert kept(Sampling(top_p=0.9)) == [True, True, True, False]  # only 0.032 <= 0.1
    # min-p 0.2: below 0.2 * 0.644 = 0.129 -> tokens 2 and 3 dropped
    assert kept(Sampling(min_p=0.2)) == [True, True, False, False]
    assert kept(Sampling(min_p=0.1)) == [True, True, True, False]  # 0.087 >= 0.064 stays
    # the renormalised log-prob of token 0 among tokens {0, 1}
    lp = sampled_logprobs(LOGITS, torch.tensor([[0]]), Sampling(top_k=2))
    assert lp.item() == pytest.approx(2.0 - math.log(math.exp(2.0) + math.exp(1.0)), abs=1e-6)
    # temperature comes first: T=0.5 doubles the logits, so top-p 0.9 keeps only the two most likely
    assert kept(Sampling(temperature=0.5, top_p=0.9)) == [True, True, False, False]


def test_penalties_by_hand():
    """prompt [1], completion [3, 1, 2]: at position 2 (predicting token 2), tokens 1 and 3 have been seen."""
    logits = torch.tensor([[[2.0, 1.0, 0.5, -1.0]] * 3])  # [1, 3, 4]
    seen = seen_tokens(torch.tensor([[1]]), torch.tensor([[1]]), torch.tensor([[3, 1, 2]]), 4)
    x = processed_logits(logits, Sampling(repetition_penalty=2.0), seen)[0]
    # position 0: prompt token 1 seen -> 1/2; position 2: 1 -> 0.5 and 3 (negative) -> -2
    assert x[0].tolist() == [2.0, 0.5, 0.5, -1.0]
    assert x[2].tolist() == [2.0, 0.5, 0.5, -2.0]
    x = processed_logits(logits, Sampling(frequency_penalty=0.5, presence_penalty=0.25), seen)[0]
    # prompt tokens do not count; at position 2 tokens 3 and 1 appeared once each in the completion
    assert x[0].tolist() == [2.0, 1.0, 0.5, -1.0]
    assert x[2].tolist() == [2.0, 1.0 - 0.75, 0.5, -1.0 - 0.75]


def test_masked_tokens_get_no_gradient_the_kept_ones_do():
    logits = LOGITS.clone().requires_grad_()
    sampled_logprobs(logits, torch.tensor([[0]]), Sampling(top_k=2)).sum().backward()
    g = logits.grad[0, 0]
    assert g[2] == 0 and g[3] == 0 and g[0] > 0 and g[1] < 0


@pytest.mark.slow
def test_the_same_distribution_as_vllms_sampler():
    """Random logits through vLLM's own sampler steps (penalties, temperature, min-p, top-k/top-p, in its
    order) and through ours: the same survivors and the same log-probs."""
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    V, T = 40, 6
    s = Sampling(temperature=0.7, top_k=12, top_p=0.85, min_p=0.03, repetition_penalty=1.3,
                 presence_penalty=0.2, frequency_penalty=0.1)
    prompt, completion = torch.tensor([[3, 5, 7, 5]]), torch.randint(0, V, (1, T))
    logits = torch.randn(1, T, V) * 3
    ours = torch.log_softmax(processed_logits(logits, s, seen_tokens(prompt, torch.ones_like(prompt), completion, V)),
                             -1)[0]
    for t in range(T):  # vLLM samples position t with the completion so far as its output tokens
        x = logits[0, t:t + 1].clone()
        n = torch.tensor([1])
        out = completion[:, :t] if t else torch.full((1, 1), V)  # vLLM pads with vocab_size
        x = apply_penalties(x, prompt, out, torch.tensor([s.presence_penalty]),
                            torch.tensor([s.frequency_penalty]), torch.tensor([s.repetition_penalty]))
        x = x / torch.tensor([[s.temperature]])
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < probs.amax(-1, keepdim=True) * torch.tensor([[s.min_p]]), float("-inf"))
        x = apply_top_k_top_p_pytorch(x, torch.tensor([s.top_k]) * n, torch.tensor([s.top_p]))
        theirs = torch.log_softmax(x, -1)[0]
        assert torch.equal(torch.isfinite(theirs), torch.isfinite(ours[t])), t
        finite = torch.isfinite(theirs)
        assert torch.allclose(theirs[finite], ours[t][finite], atol=1e-5), t


def make(**kw):
    return AsyncAIPOConfig(output_dir="/tmp/hfllamarl-test-config", report_to="none", **kw)


def test_one_distribution_for_both_sides():
    c = make(temperature=0.8, top_k=20, min_p=0.05, generation_kwargs={"temperature": 0.6, "stop": ["\n"]})
    assert c.sampling == Sampling(temperature=0.6, top_k=20, min_p=0.05)  # generation_kwargs wins, as in TRL
    assert c.neutral_generation_kwargs == {"stop": ["\n"]}
    assert make(top_k=-1).sampling.top_k == 0 and make().sampling.temperature_only


@pytest.mark.parametrize("kw,match", [
    ({"generation_kwargs": {"logit_bias": {1: 5.0}}}, r"generation_kwargs\['logit_bias'\] is not supported"),
    ({"generation_kwargs": {"n": 3}}, "num_generations"),
    ({"generation_kwargs": {"min_tokens": 3}}, "end-of-sequence"),
    ({"temperature": 0.0}, "temperature=0.0: it must be > 0"),
    ({"top_p": 0.0}, r"top_p=0.0: it must be in \(0, 1\]"),
])
def test_what_the_trainer_cannot_follow_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_a_stale_token_the_current_policy_can_no_longer_sample_weighs_zero():
    """Off-policy, a token sampled under old weights may fall outside the current top-k: pi = 0. Its weight is
    0 and nothing turns NaN (loss, gradient, the KL to a reference), as it would with log pi = -inf. Padding
    (here the second sample's last position) does not count either."""
    from hfllamarl.plugins.algorithms.aipo import AIPO
    from hfllamarl.runtime.loop.sampling import within_support

    s = Sampling(top_k=2)
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]],
                           [[2.0, 1.0, 0.0, -1.0], [0.0, 1.0, 2.0, 9.0]]], requires_grad=True)
    tokens = torch.tensor([[0, 3], [1, 0]])  # token 3 at [0, 1] is outside the top-2; [1, 1] is padding (also outside)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    raw = sampled_logprobs(logits, tokens, s)
    assert torch.isneginf(raw[0, 1]) and torch.isneginf(raw[1, 1])
    logp, outside = within_support(raw, mask, s)
    assert outside.tolist() == [[False, True], [False, False]] and torch.isfinite(logp).all()
    mu = torch.full((2, 2), -1.0)
    ref = torch.where(outside, logp.detach(), logp.detach() - 0.1)  # as the trainer hands it to the algorithm
    loss, m = AIPO(rho=4.0, beta=0.1).loss(logp, mu, torch.tensor([1.0, -1.0]), mask, ref_logprobs=ref)
    assert m["kl"] > 0
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1].abs().sum() == 0 and logits.grad[0, 0].abs().sum() > 0  # the outside token: no gradient
    assert m["is_ratio/min"] == 0.0


def test_sampled_logprobs_reads_both_of_vllms_containers():
    """The generator asks vLLM for the sampled token's log-prob at every position (`logprobs=0`); vLLM keeps them as
    one dict per position or, with `flat_logprobs=True`, as flat lists. Both, built by vLLM's own code from the same
    hand values, give those values; a container that misses a position or names another token is refused."""
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs

    from hfllamarl.runtime.loop.rollout import sampled_logprobs

    ids, values = [5, 9, 5, 2], [-0.25, -1.5, -0.125, -3.0]
    for flat in (False, True):
        container = create_sample_logprobs(flat)
        for token, value in zip(ids, values):
            append_logprobs_for_next_position(container, [token], [value], [None], rank=1, num_logprobs=0)
        assert sampled_logprobs(container, ids) == values, flat
        with pytest.raises(RuntimeError, match="4 tokens but"):
            sampled_logprobs(container, ids[:3] + [7])  # the last position holds another token
        with pytest.raises(RuntimeError, match="5 tokens but"):
            sampled_logprobs(container, ids + [1])  # one position more than the container has
    with pytest.raises(RuntimeError, match="2 tokens but 0"):
        sampled_logprobs(None, [1, 2])
