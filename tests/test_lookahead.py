"""Lookahead sampling weights (`sampler_lookahead`): what the sync sends is the weights torch's own AdamW would reach
in as many steps as the batch waits for its training, each with the gradient equal to AdamW's running mean; when
and how far it looks ahead; and the settings it cannot honour, refused with the reason."""

import copy
import json

import pytest
import torch

from hfllamarl.runtime.loop.schedule import Schedule
from hfllamarl.runtime.weights.lookahead import MAX_STEPS, LookaheadWeights, check_lookahead, sampling_weights


def _trained(weight_decay: float = 0.1, tied: bool = True):
    """A small model with a tied weight and a buffer, after three real AdamW steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 11, bias=False))
    if tied:
        model[2].weight = model[0].weight
    model.register_buffer("positions", torch.arange(5.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    for _ in range(3):
        model(torch.randint(0, 11, (4, 6))).logsumexp(-1).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _adamw_reference(model, optimizer, steps: int) -> dict:
    """torch's AdamW, `steps` more steps on a copy, every gradient equal to exp_avg at the time."""
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=optimizer.param_groups[0]["weight_decay"])
    ref_opt.load_state_dict(optimizer.state_dict())
    for _ in range(steps):
        for p in ref.parameters():
            p.grad = ref_opt.state[p]["exp_avg"].clone()
        ref_opt.step()
    return ref.state_dict()


@pytest.mark.parametrize("steps,weight_decay", [(1, 0.0), (1, 0.1), (3, 0.1)])
def test_the_sent_weights_are_adamws_own_next_steps(steps, weight_decay):
    model, optimizer = _trained(weight_decay)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sent = dict(LookaheadWeights(model, model, optimizer, steps).state_dict())
    reference = _adamw_reference(model, optimizer, steps)
    assert sorted(sent) == sorted(before)  # the same names, the tied weight under both
    for name, tensor in reference.items():
        assert torch.allclose(sent[name], tensor, rtol=0, atol=2e-7), name
        if name != "positions":
            assert (tensor - before[name]).abs().max() > 1e-3, name  # the check is not vacuous: the weights moved
    assert torch.equal(sent["positions"], before["positions"])  # buffers go as they are
    for name, tensor in model.state_dict().items():  # the trainer's own weights are only read
        assert torch.equal(tensor, before[name]), name


def test_no_optimizer_state_yet_and_zero_steps_send_the_weights_as_they_are():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for steps in (0, 2):
        sent = LookaheadWeights(model, model, optimizer, steps).state_dict()
        assert all(torch.equal(sent[k], v) for k, v in model.state_dict().items())
    frozen, optimizer = _trained(tied=False)
    frozen[1].weight.requires_grad_(False)
    optimizer.state.pop(frozen[1].weight)  # (a frozen parameter has no AdamW state)
    sent = LookaheadWeights(frozen, frozen, optimizer, 1).state_dict()
    assert torch.equal(sent["1.weight"], frozen[1].weight) and not torch.equal(sent["1.bias"], frozen[1].bias)


def _spec(max_staleness: int, steps: int = 10, iterations: int = 1, eval_every: int = 0, lookahead: bool = True):
    class Spec:
        pass

    spec = Spec()
    spec.schedule = Schedule.of_steps(steps, max_staleness, iterations=iterations, eval_every=eval_every)
    spec.lookahead = lookahead
    spec.model, spec.optimizer = _trained()
    return spec


@pytest.mark.parametrize("staleness,iterations", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_it_looks_one_step_towards_the_version_that_trains_the_batch(staleness, iterations):
    """At tick t the generator starts batch t; the trainer, s batches behind, holds version (t - s) * k and trains
    batch t from version t * k: the sent weights move one step of those s * k (none past the last batch or the
    run's last step)."""
    steps = 12
    spec = _spec(staleness, steps=steps, iterations=iterations)
    assert MAX_STEPS == 1
    for tick in range(staleness, spec.schedule.num_ticks):
        version = (tick - staleness) * iterations
        sent, ahead = sampling_weights(spec, spec.model, tick, version)
        if tick >= spec.schedule.num_batches or version == 0:  # (version 0: AdamW has no state yet)
            assert ahead == 0 and sent is spec.model, tick
        else:
            assert ahead == min(staleness * iterations, steps - version, 1), tick
            assert isinstance(sent, LookaheadWeights) and sent.steps == ahead


def test_an_evaluated_version_and_a_job_without_lookahead_get_the_weights_as_they_are():
    spec = _spec(1, eval_every=4)
    assert sampling_weights(spec, spec.model, 5, 4) == (spec.model, 0)  # version 4 is evaluated on the generator
    assert sampling_weights(spec, spec.model, 6, 5)[1] == 1
    off = _spec(1, lookahead=False)
    assert sampling_weights(off, off.model, 6, 5) == (off.model, 0)


def test_lora_is_refused_with_the_reason():
    check_lookahead("adamw", None)
    check_lookahead("none", object())
    with pytest.raises(ValueError, match="peft_config.*adapters.*Remove sampler_lookahead"):
        check_lookahead("adamw", object())


def test_the_config_refuses_lookahead_where_it_means_nothing(tmp_path):
    from hfllamarl import AsyncAIPOConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8, num_generations=4)
    assert AsyncAIPOConfig(**common).sampler_lookahead == "none"
    assert AsyncAIPOConfig(**common, sampler_lookahead="adamw").sampler_lookahead == "adamw"
    with pytest.raises(ValueError, match="sampler_lookahead='ahead'; choose one of 'none', 'adamw'"):
        AsyncAIPOConfig(**common, sampler_lookahead="ahead")
    with pytest.raises(ValueError, match="max_staleness=0: a synchronous job samples with the weights it trains"):
        AsyncAIPOConfig(**common, sampler_lookahead="adamw", max_staleness=0)
    with pytest.raises(ValueError, match="partial rollouts"):
        AsyncAIPOConfig(**common, sampler_lookahead="adamw", max_staleness=2, max_completion_length=64,
                        partial_rollout_tokens=32)
    AsyncAIPOConfig(**common, sampler_lookahead="none", max_staleness=0)  # 'none' is always possible


def test_two_fsdp2_ranks_send_shards_of_adamws_own_next_steps(tmp_path):
    """Two trainer ranks (FSDP2 over gloo): each moves its own shard with its own shard of AdamW's state; gathered,
    the weights equal torch's AdamW on the whole model and state."""
    from conftest import SCRIPTS, run_script, tail

    from hfllamarl.testing.tiny import build_tiny_model

    model = build_tiny_model(str(tmp_path / "llama"))
    proc = run_script([str(SCRIPTS / "lookahead_sharded.py"), model, "2"], nproc=2, timeout=300)
    assert proc.returncode == 0, tail(proc)
    res = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    assert res["sharded"]  # every weight of more than one row was a shard on each rank
    assert all(d < 1e-6 for d in res["diffs"].values()), res["diffs"]
    assert min(res["moved"].values()) > 1e-4, res["moved"]  # every trained weight moved
