"""The trainer's CPU attention (`hfllamarl.runtime.training.attention`): the plain matmul-softmax form against
PyTorch's own SDPA (values and gradients, every mask kind transformers passes, grouped KV heads), a whole model in
bf16 against transformers' eager attention, which calls take which form, and when a model is switched."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from hfllamarl.runtime.training import attention
from hfllamarl.runtime.training.attention import NAME, attention_forward, use_fast_cpu_attention


class Heads(torch.nn.Module):
    """What transformers' attention functions read of their module."""

    def __init__(self, groups: int = 1):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _packed_mask(batch: int, length: int, starts: list[int]) -> torch.Tensor:
    """A block-diagonal causal boolean mask `[B, 1, T, T]`: sequences starting at `starts` in every row."""
    seq = torch.zeros(length, dtype=torch.long)
    for s in starts[1:]:
        seq[s:] += 1
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    return allowed[None, None].expand(batch, 1, length, length)


@pytest.mark.parametrize("padded", [False, True])
def test_a_decoding_step_in_the_plain_form_equals_torchs_sdpa(padded):
    """One query row over cached keys (the trainer's own sampling), every key or a left-padded batch's mask."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, 4, 1, 32, generator=g), torch.randn(4, 2, 9, 32, generator=g), torch.randn(4, 2, 9, 32,
                                                                                                     generator=g)
    mask = None
    if padded:
        mask = torch.ones(4, 1, 1, 9, dtype=torch.bool)
        mask[1, ..., :3] = False
        mask[3, ..., :1] = False
    ours = attention._plain(Heads(2), q, k, v, mask, None, None)
    theirs = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "bool", "additive"])
@pytest.mark.parametrize("groups", [1, 2])
def test_the_plain_form_equals_torchs_sdpa_values_and_gradients(kind, groups):
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 3, 4, 17, 32
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, H // groups, T, D, generator=g, requires_grad=True)
    v = torch.randn(B, H // groups, T, D, generator=g, requires_grad=True)
    weights = torch.randn(B, T, H, D, generator=g)
    boolean = _packed_mask(B, T, [0, 6, 11])
    mask = {"causal": None, "bool": boolean,
            "additive": torch.zeros(B, 1, T, T).masked_fill(~boolean, torch.finfo(torch.float32).min)}[kind]

    def reference():  # torch's own, grouped heads repeated by hand
        kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=boolean if kind != "causal" else None,
                                             is_causal=kind == "causal")
        return out.transpose(1, 2)

    outputs = []
    for run in (lambda: attention._plain(Heads(groups), q, k, v, mask, None, None), reference):
        for t in (q, k, v):
            t.grad = None
        out = run()
        (out * weights).sum().backward()
        outputs.append([out.detach()] + [t.grad.clone() for t in (q, k, v)])
    for ours, theirs in zip(*outputs):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from hfllamarl.testing.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("qwen2") / "m"), family="qwen2", seed=5)


def _bf16(path: str, implementation: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=implementation)


def test_a_whole_bf16_model_with_the_plain_form_computes_what_transformers_eager_attention_does(qwen2, monkeypatch):
    """Qwen2 shape (q/k/v biases, 2 KV heads for 4 query heads), bf16, a packed 4-D mask as the trainer passes:
    the logits and the gradients of the switched model, the plain form forced, against the same weights under
    transformers' eager attention (the same arithmetic, written by transformers)."""
    ours, theirs = _bf16(qwen2, "sdpa"), _bf16(qwen2, "eager")
    assert use_fast_cpu_attention(ours, torch.device("cpu"), named=False)
    monkeypatch.setattr(attention, "_plain_is_faster", lambda *a, **k: True)
    calls = []
    plain = attention._plain
    monkeypatch.setattr(attention, "_plain", lambda *a: calls.append(1) or plain(*a))
    ids = torch.randint(3, ours.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    boolean = _packed_mask(2, 20, [0, 8, 15])
    positions = torch.tensor([list(range(8)) + list(range(7)) + list(range(5))] * 2)
    grads = []
    for model, mask in ((ours, boolean),
                        (theirs, torch.zeros(2, 1, 20, 20, dtype=torch.bfloat16).masked_fill(
                            ~boolean, torch.finfo(torch.bfloat16).min))):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
        logits.logsumexp(-1).sum().backward()
        grads.append((logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    assert calls, "the plain form was not taken"
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-6)
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grad, grads[1][1][name], rtol=1e-2, atol=1e-3, msg=name)


def test_which_calls_take_the_plain_form(monkeypatch):
    """Measured once per shape (training-shaped or decoding); never in fp32, over more than LONGEST keys, or where
    several query rows meet a longer cache (a prefill continued); the measurement is real and logged."""
    measured = []
    monkeypatch.setattr(attention, "_choice", {})
    real = attention._plain_is_faster
    monkeypatch.setattr(attention, "_plain_is_faster", lambda *a, **k: measured.append((a, k)) or real(*a, **k))
    module = Heads()

    def call(dtype, rows, length, mask=None):
        q = torch.randn(1, 2, rows, 32, dtype=dtype)
        kv = torch.randn(1, 2, length, 32, dtype=dtype)
        out, _ = attention_forward(module, q, kv, kv, mask)
        assert out.shape == (1, rows, 2, 32) and torch.isfinite(out.float()).all()

    call(torch.float32, 40, 40)
    call(torch.bfloat16, attention.LONGEST + 1, attention.LONGEST + 1)
    call(torch.bfloat16, 1, attention.LONGEST + 1)
    call(torch.bfloat16, 5, 40)
    assert measured == []
    call(torch.bfloat16, 40, 40)
    call(torch.bfloat16, 50, 50, _packed_mask(1, 50, [0, 20]))  # the same bucket (64): one measurement
    call(torch.bfloat16, 1, 60)  # a decoding step: measured on its own
    train, decode = (torch.bfloat16, 2, 32, 64, False), (torch.bfloat16, 2, 32, 64, True)
    assert {a + (k.get("decoding", False),) for a, k in measured} == {train, decode}
    assert sorted(attention._choice) == [train, decode]


def test_which_models_are_switched(qwen2, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32)
    assert not use_fast_cpu_attention(model, torch.device("cpu"), named=True)  # the user named it: kept
    assert not use_fast_cpu_attention(model, torch.device("cuda", 0), named=False)  # a GPU keeps SDPA
    assert model.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32, attn_implementation="eager")
    assert not use_fast_cpu_attention(eager, torch.device("cpu"), named=False)
    assert use_fast_cpu_attention(model, torch.device("cpu"), named=False)
    assert model.config._attn_implementation == NAME
    model.save_pretrained(tmp_path / "saved")  # what the user gets back does not name it
    assert NAME not in json.dumps(json.loads((tmp_path / "saved" / "config.json").read_text()))
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        for decoding in (False, True):
            attention._choice.pop((torch.bfloat16, 7, 32, 64, decoding), None)
            attention._plain_is_faster(torch.bfloat16, 7, 32, 64, decoding=decoding)
    messages = [r.getMessage() for r in caplog.records]
    assert any("7 heads of 32, rows up to 64 tokens" in m and "ms SDPA" in m for m in messages), messages
    assert any("7 heads of 32, decoding over keys up to 64 tokens" in m and "ms SDPA" in m for m in messages)


def test_sampling_with_a_cache_in_the_plain_form_writes_what_transformers_eager_attention_does(qwen2, monkeypatch):
    """The trainer's own sampling (`bootstrap`): transformers' generate, a left-padded batch, bf16, greedy; the
    plain form forced in the prefill and in every decoding step, against eager attention on the same weights."""
    ours, theirs = _bf16(qwen2, "sdpa"), _bf16(qwen2, "eager")
    assert use_fast_cpu_attention(ours, torch.device("cpu"), named=False)
    monkeypatch.setattr(attention, "_plain_is_faster", lambda *a, **k: True)
    rows = []
    plain = attention._plain
    monkeypatch.setattr(attention, "_plain", lambda *a: rows.append(a[1].shape[2]) or plain(*a))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, ours.config.vocab_size, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    out = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
           for m in (ours, theirs)]
    assert 1 in rows and 9 in rows, rows  # decoding steps and the prefill both took it
    assert out[0].tolist() == out[1].tolist()


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_first_measurement_inside_a_checkpointed_forward_leaves_the_recomputation_alike(qwen2, monkeypatch,
                                                                                             reentrant):
    """With `gradient_checkpointing` (TRL's GRPOConfig turns it on by default) a shape's first call is measured inside
    a checkpointed layer's forward; its recomputation in the backward pass finds the choice made and measures
    nothing. The measurement's tensors must not count among the layer's saved ones (torch refuses a recomputation
    that saves other tensors: "A different number of tensors was saved"). Gradients against the same model without
    checkpointing, on the kernels the measurement chose (which one wins is this machine's timing, and the two round
    differently in bf16; each is checked against transformers' eager attention above)."""
    monkeypatch.setattr(attention, "_choice", {})
    checkpointed, plain = _bf16(qwen2, "sdpa"), _bf16(qwen2, "sdpa")
    for model in (checkpointed, plain):
        assert use_fast_cpu_attention(model, torch.device("cpu"), named=False)
        model.train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(3, checkpointed.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    grads = []
    for model in (checkpointed, plain):  # (the first measures each shape, inside its checkpointed layers)
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    assert attention._choice, "no shape was measured: the check would be vacuous"
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-5, atol=1e-6, msg=name)
