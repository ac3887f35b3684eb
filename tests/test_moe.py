"""An MoE policy's load-balancing loss, added as TRL's GRPOTrainer adds it: checked against transformers' own
`aux_loss` (what TRL adds: the model's forward on the padded micro-batch with its attention mask)."""

import pytest
import torch

from conftest import cpu_trainer
from hfllamarl.runtime.training.batching import completion_logprobs, pack_batch, pad_batch
from hfllamarl.runtime.training.moe import aux_loss_coef, balancing_loss_fn
from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.loop.sampling import Sampling


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from hfllamarl.testing.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path_factory.mktemp("moe") / "m"), family="qwen3_moe", seed=2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def rollouts(vocab: int) -> list[Rollout]:
    g = torch.Generator().manual_seed(5)
    out = []
    for p, c in [(3, 9), (5, 2), (2, 6), (4, 7)]:
        ids = torch.randint(3, vocab, (p + c,), generator=g).tolist()
        out.append(Rollout(prompt="", prompt_ids=ids[:p], completion_ids=ids[p:], behavior_logprobs=[-2.0] * c,
                           versions=[0] * c, finish_reason="stop", completion_text=""))
    return out


def test_the_coefficient_is_resolved_as_trl_does(moe):
    from transformers import LlamaConfig

    assert moe.config.router_aux_loss_coef == 0.001  # Qwen3-MoE's own
    assert aux_loss_coef(moe.config, None) == 0.001  # unset: the architecture's
    assert aux_loss_coef(moe.config, 0.0) == 0.0 and aux_loss_coef(moe.config, 0.05) == 0.05
    dense = LlamaConfig()
    assert aux_loss_coef(dense, None) == 0.0 and aux_loss_coef(dense, 0.0) == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.1, but the model .llama. is not a Mixture-of-Experts"):
        aux_loss_coef(dense, 0.1)


@pytest.mark.parametrize("build", [pack_batch, pad_batch])
def test_the_loss_equals_transformers_aux_loss_on_the_padded_micro_batch(moe, build):
    rows = rollouts(moe.config.vocab_size)
    batch = build(rows, 0, "cpu")
    routers = []
    with torch.no_grad():
        completion_logprobs(moe, batch, Sampling(), router_logits=routers)
        ours = balancing_loss_fn(moe)(routers, batch["token_mask"])
        padded = pad_batch(rows, 0, "cpu")
        want = moe(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                   position_ids=padded["position_ids"], output_router_logits=True).aux_loss
    assert len(routers) == moe.config.num_hidden_layers
    assert torch.allclose(ours, want, atol=1e-6), (float(ours), float(want))
    assert float(want) > 1.0  # (num_experts x sum f_i P_i: 1 when perfectly balanced) a real value, not 0


def executor(model, coef: float):
    ex = cpu_trainer(model, num_generations=2, micro_batch_size=2, router_aux_loss_coef=coef)
    ex.layout.packed = True
    return ex


def test_the_step_adds_coef_times_the_aux_loss_of_each_micro_batch(moe):
    """Gradient with the loss minus gradient without = coef / micro-batches x the gradient of transformers'
    aux_loss of each micro-batch (TRL: `loss + coef * aux_loss / gradient_accumulation_steps`)."""
    rows = rollouts(moe.config.vocab_size)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    coef = 0.3
    grads, stats = [], []
    for c in (0.0, coef):
        moe.zero_grad()
        loss, s = executor(moe, c)._accumulate_gradients(rows, advantages)
        grads.append({n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None})
        stats.append((loss, s))
    moe.zero_grad()
    auxes = []
    for k in range(2):  # micro-batches of 2
        padded = pad_batch(rows[2 * k:2 * k + 2], 0, "cpu")
        aux = moe(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                  position_ids=padded["position_ids"], output_router_logits=True).aux_loss
        (coef * aux / 2).backward()
        auxes.append(float(aux.detach()))
    router = [n for n in grads[1] if "gate" in n and "experts" not in n]
    assert router and "aux_loss" not in stats[0][1]
    for name, p in moe.named_parameters():
        if p.grad is None:
            continue
        assert torch.allclose(grads[1][name] - grads[0].get(name, 0.0), p.grad, atol=1e-6), name
    assert stats[1][1]["aux_loss"] == pytest.approx(auxes, abs=1e-6)
    assert stats[1][0] - stats[0][0] == pytest.approx(coef * sum(auxes) / 2, abs=1e-6)
