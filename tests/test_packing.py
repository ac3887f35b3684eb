"""Padding-free packing: the log-probs and gradients of a packed micro-batch are those of each sequence alone."""

from types import SimpleNamespace

import pytest
import torch

from hfllamarl.runtime.training.batching import completion_logprobs, pack_batch, packing_agrees, pad_batch
from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.loop.sampling import Sampling, sampled_logprobs, seen_tokens

FAMILIES = ["llama", "llama_gqa", "qwen2", "qwen3", "qwen3_moe", "mistral", "llama32"]  # mistral: window 4
SAMPLINGS = [Sampling(temperature=0.7),
             Sampling(temperature=0.9, top_k=12, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.2)]


def rollouts(vocab: int, seed: int = 0) -> list[Rollout]:
    """Sequences of uneven lengths, one with an empty completion."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, c in [(3, 11), (5, 2), (2, 0), (4, 7), (1, 5), (6, 1)]:
        ids = torch.randint(3, vocab, (p + c,), generator=g).tolist()
        out.append(Rollout(prompt="", prompt_ids=ids[:p], completion_ids=ids[p:], behavior_logprobs=[-1.0] * c,
                           versions=[0] * c, finish_reason="stop", completion_text=""))
    return out


def alone(model, r: Rollout, sampling: Sampling) -> torch.Tensor:
    """The reference: the sequence in a forward of its own (no padding, no mask), its completion scored directly."""
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    logits = model(input_ids=ids).logits[:, len(r.prompt_ids) - 1:-1]  # [1, c, V]
    tokens = torch.tensor([r.completion_ids])
    seen = seen_tokens(torch.tensor([r.prompt_ids]), torch.ones(1, len(r.prompt_ids), dtype=torch.long), tokens,
                       logits.shape[-1]) if sampling.penalties else None
    return sampled_logprobs(logits, tokens, sampling, seen)[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from hfllamarl.testing.tiny import build_tiny_model

    built = {}
    for family in FAMILIES:
        path = build_tiny_model(str(tmp_path_factory.mktemp(family) / "m"), family=family, seed=1)
        built[family] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return built


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["temperature", "transforms"])
def test_packed_and_padded_logprobs_equal_each_sequence_alone(models, family, sampling):
    model = models[family]
    rows = rollouts(model.config.vocab_size)
    packed = pack_batch(rows, 0, "cpu")
    assert packed["input_ids"].shape[0] < len(rows)  # some sequences share a row
    with torch.no_grad():
        got_packed = completion_logprobs(model, packed, sampling)
        got_padded = completion_logprobs(model, pad_batch(rows, 0, "cpu"), sampling)
        for i, r in enumerate(rows):
            c = len(r.completion_ids)
            want = alone(model, r, sampling)
            assert torch.allclose(got_packed[i, :c], want, atol=2e-5), (family, i)
            assert torch.allclose(got_padded[i, :c], want, atol=2e-5), (family, i)
            assert not got_packed[i, c:].any()  # past the completion: 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_gradients_equal_padded(models, family):
    model = models[family]
    rows = rollouts(model.config.vocab_size, seed=3)
    grads = []
    for build in (pack_batch, pad_batch):
        model.zero_grad()
        batch = build(rows, 0, "cpu")
        logp = completion_logprobs(model, batch, Sampling(temperature=0.8))
        (-(logp * batch["mask"]).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_models_keep_packed_sequences_apart(models, family):
    assert packing_agrees(models[family], models[family].config.vocab_size, "cpu")


class CausalOnlyLM(torch.nn.Module):
    """A model (as custom code may bring) whose attention honours a padding mask but not packed position ids."""

    def __init__(self, vocab: int = 40, dim: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(vocab_size=vocab)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Embedding(64, dim)
        self.attn = torch.nn.MultiheadAttention(dim, 2, batch_first=True)
        self.lm_head = torch.nn.Linear(dim, vocab)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        h = self.embed(input_ids) + self.position(position_ids)
        L = input_ids.shape[1]
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
        padding = (attention_mask == 0) if attention_mask is not None else None
        h = h + self.attn(h, h, h, attn_mask=causal, key_padding_mask=padding, need_weights=False)[0]
        return SimpleNamespace(logits=self.lm_head(h))


def test_a_model_that_leaks_across_packed_sequences_is_trained_padded():
    model = CausalOnlyLM()
    assert not packing_agrees(model, 40, "cpu")
    rows = rollouts(40)
    with torch.no_grad():  # it would have been wrong: packed log-probs differ from each sequence alone
        packed = completion_logprobs(model, pack_batch(rows, 0, "cpu"), Sampling())
        padded = completion_logprobs(model, pad_batch(rows, 0, "cpu"), Sampling())
    assert (packed - padded).abs().max() > 1e-3


def test_the_lm_head_runs_only_where_a_completion_token_is_predicted(models):
    """No logits for prompt tokens, padding or the last token: [1, N, H] into the head, N = completion tokens."""
    model = models["llama"]
    rows = rollouts(model.config.vocab_size)
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    try:
        with torch.no_grad():
            completion_logprobs(model, pack_batch(rows, 0, "cpu"), Sampling())
    finally:
        handle.remove()
    assert seen == [torch.Size([1, sum(len(r.completion_ids) for r in rows), model.config.hidden_size])]
