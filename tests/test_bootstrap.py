"""The trainer's bootstrap (`hfllamarl.runtime.training.bootstrap`): what it samples, against transformers' own
generate and a full forward; where it stops; and a single-process run that bootstraps and hands over."""

import os
from types import SimpleNamespace

import pytest
import torch

from conftest import run_script, step_logs, tail, trained_rows
from hfllamarl.runtime.data.prompts import batch_rows
from hfllamarl.runtime.loop.sampling import Sampling
from hfllamarl.runtime.loop.schedule import Schedule
from hfllamarl.runtime.training import bootstrap

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def test_the_limit_stops_before_a_checkpointed_or_evaluated_step_and_leaves_the_last_batch():
    assert bootstrap.batch_limit(Schedule.of_steps(10, 1), save_steps=0, eval_every=0) == 9  # all but the last
    assert bootstrap.batch_limit(Schedule.of_steps(10, 1), save_steps=4, eval_every=0) == 3  # steps 1-3
    assert bootstrap.batch_limit(Schedule.of_steps(10, 0), save_steps=1, eval_every=0) == 0
    # two passes per batch: batch 1 holds steps 3-4, and step 4 is checkpointed
    assert bootstrap.batch_limit(Schedule.of_steps(10, 1, iterations=2), save_steps=4, eval_every=0) == 1
    evaluated = Schedule.of_steps(10, 1, eval_every=3)
    assert bootstrap.batch_limit(evaluated, save_steps=0, eval_every=3) == 2  # version 3 is evaluated
    assert bootstrap.batch_limit(Schedule.of_steps(1, 1), save_steps=0, eval_every=0) == 0


def _spec(**kw):
    base = dict(chat_template_kwargs={}, sampling=Sampling(), max_completion_length=12, max_model_len=128,
                prompts_per_batch=2, num_generations=3, seed=0, shuffle=True)
    base.update(kw)
    return SimpleNamespace(**base)


def _model(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path)


def test_greedy_samples_are_transformers_generate_and_end_at_its_end_of_sequence(tiny_model):
    """top_k=1 makes the sampling greedy: every completion must be what transformers' generate(do_sample=False)
    writes for that prompt alone (no padding), cut where it stops, with an end-of-sequence token chosen so that
    some completions stop on it and others run to max_completion_length."""
    model, tok = _model(tiny_model)
    prompts = ["What is 3 + 4?", "Add 12 and 30, then write the sum", "7 * 6 ="]
    ids = [tok(p)["input_ids"] for p in prompts]
    free = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in ids]
    stop = free[0][4]  # the fifth token of the first completion ends a sequence
    reference = []
    for p, f in zip(ids, free):
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, eos_token_id=stop, pad_token_id=0)[0, len(p):]
        reference.append([t for t in out.tolist()][: (f.index(stop) + 1) if stop in f else 12])
    sampler = bootstrap.BootstrapSampler(model, tok, None, _spec(sampling=Sampling(top_k=1)), torch.device("cpu"),
                                         SimpleNamespace(eos_token_id=[stop]))
    tokens, logprobs, reasons = sampler._decode(ids, torch.Generator().manual_seed(0))
    assert tokens == reference
    assert reasons == ["stop" if stop in f else "length" for f in free] and "stop" in reasons
    assert all(lp == 0.0 for row in logprobs for lp in row)  # one token left: probability 1


def test_behaviour_log_probs_are_those_of_a_full_forward_of_each_completion(tiny_model):
    """Sampled at temperature 0.7 from left-padded prompts of different lengths: each token's recorded log-prob is
    log softmax(logits / 0.7) of a plain forward over that prompt and completion alone (no cache, no padding)."""
    from datasets import Dataset

    model, tok = _model(tiny_model)
    rows = Dataset.from_dict({"prompt": ["What is 3 + 4?", "Add 12 and 30, then write the sum of both", "7 * 6 ="],
                              "answer": ["7", "42", "42"]})
    spec = _spec(sampling=Sampling(temperature=0.7), prompts_per_batch=3, num_generations=2)
    sampler = bootstrap.BootstrapSampler(model, tok, rows, spec, torch.device("cpu"), model.generation_config)
    groups = sampler.sample(batch_index=0, version=5)
    assert [g.rollouts[0].row_index for g in groups] == batch_rows(3, 3, 0, 0, True)
    assert [g.position for g in groups] == [0, 1, 2] and all(g.policy_version == 5 for g in groups)
    checked = 0
    for g in groups:
        assert len(g.rollouts) == 2 and g.rollouts[0].columns == {"answer": rows[g.rollouts[0].row_index]["answer"]}
        for r in g.rollouts:
            assert r.versions == [5] * len(r.completion_ids) and r.finish_reason in ("stop", "length")
            assert r.completion_text == tok.decode(r.completion_ids, skip_special_tokens=True)
            with torch.no_grad():
                logits = model(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0].float()
            start = len(r.prompt_ids) - 1
            want = torch.log_softmax(logits[start:start + len(r.completion_ids)] / 0.7, -1)
            want = want.gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(r.behavior_logprobs), want, atol=1e-4), (r.behavior_logprobs, want)
            checked += len(r.completion_ids)
    assert checked >= 6


@pytest.mark.parametrize("staleness", [1, 0])
def test_a_batch_still_being_sampled_when_the_generators_come_up_is_trained_by_the_loops_first_tick(tiny_model,
                                                                                                   monkeypatch,
                                                                                                   staleness):
    """The generators come up while the trainer samples batch 1: with max_staleness 1 batch 1 is not trained during
    the bootstrap but waits for the loop's first tick (tick 2 trains batch 1 while the generators sample batch 2);
    synchronous (max_staleness 0), whose tick 2 trains batch 2, the bootstrap trains it first. Either way each batch
    is trained once, in order, by the real trainer executor on the real sampler's groups."""
    from datasets import Dataset

    from hfllamarl.plugins.algorithms.aipo import AIPO
    from hfllamarl.runtime.data.rewards import RewardRunner
    from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec
    from hfllamarl.runtime.world import startup
    from hfllamarl.runtime.world.topology import Topology

    monkeypatch.setattr(startup, "bootstrapping", lambda topology, seconds: None)  # (the announcement to generators)
    model, tok = _model(tiny_model)
    rows = Dataset.from_dict({"prompt": [f"{a} + 1 =" for a in range(8)], "answer": [str(a + 1) for a in range(8)]})
    schedule = Schedule.of_steps(6, staleness)
    trained = []
    spec = TrainerSpec(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None,
                       algorithm=AIPO(rho=4.0), rewards=RewardRunner([lambda completions, **kw: [float(len(c) % 3)
                                                                                                for c in completions]]),
                       backend=None, schedule=schedule, num_generations=3, micro_batch_size=6, sampling=Sampling(),
                       max_grad_norm=1.0, pad_token_id=0, device=torch.device("cpu"),
                       on_step=lambda step, metrics: trained.append(step) and False)
    ex = TrainerExecutor(spec, Topology(mode="single", rank=0, world_size=2, num_generators=1, timeout_s=10,
                                        use_cpu=True))
    ex._reported = True  # (its start-up report reads the generators' marks from the job's store: none here)
    sampler = bootstrap.BootstrapSampler(model, tok, rows, _spec(schedule=schedule, num_generations=3),
                                         torch.device("cpu"), model.generation_config)
    # Asked before each batch and, with max_staleness >= 1, after each sampling: ready while batch 1 was sampled.
    answers = iter([False, False, False, True] if staleness else [False, False, True])
    sampled = bootstrap.run(ex, sampler, limit=4, generator_ready=lambda: next(answers))
    assert sampled == 2 and not ex.bootstrapping
    if not staleness:
        assert ex.bootstrapped == 2 and trained == [1, 2] and not ex.inbox
        return
    assert ex.bootstrapped == 1 and trained == [1] and list(ex.inbox) == [1]
    assert [g.batch_index for g in ex.inbox[1]] == [1, 1] and all(g.policy_version == 1 for g in ex.inbox[1])
    ex.first_tick = sampled
    ex.set_step(sampled)  # the loop's first tick (the generators sample batch 2; no rollouts have come from them)
    ex.step()
    assert trained == [1, 2] and not ex.inbox and ex.version == 2  # batch 1 trained once, in its tick
    ex.set_step(sampled + 1)  # batch 2 is the generators': not here yet, and nothing else is trained in its place
    with pytest.raises(RuntimeError, match="batch 2 never arrived"):
        ex.step()


def test_what_cannot_bootstrap_says_why():
    args = SimpleNamespace(bootstrap_generation=True, drop_zero_variance_groups=False)
    single = SimpleNamespace(mode="single", failure="stop")
    spec = SimpleNamespace(agent=None, reward_models=[], schedule=Schedule.of_steps(4, 1), sampling=Sampling(),
                           generation_kwargs={}, eval_on_start=False, replica_groups=1)
    assert bootstrap.blocker(args, spec, single, resuming=False) is None
    spec.replica_groups = 2
    assert "trainer replica groups" in bootstrap.blocker(args, spec, single, resuming=False)
    spec.replica_groups = 1
    assert "launcher" in bootstrap.blocker(args, spec, SimpleNamespace(mode="launcher", failure="stop"), resuming=False)
    assert "replica" in bootstrap.blocker(args, spec, SimpleNamespace(mode="single", failure="continue"), False)
    assert "resumes" in bootstrap.blocker(args, spec, single, resuming=True)
    spec.sampling = Sampling(repetition_penalty=1.1)
    spec.generation_kwargs = {"stop": ["\n"]}
    why = bootstrap.blocker(args, spec, single, resuming=False)
    assert "penalties" in why and "stop" in why
    args.bootstrap_generation = False
    assert bootstrap.blocker(args, spec, single, resuming=False) == "bootstrap_generation=False"


@pytest.mark.slow
def test_a_single_process_run_bootstraps_trains_the_same_prompts_and_hands_over(tiny_model, tmp_path):
    """`python train_tiny.py` (one trainer, its generator child spawned): the trainer trains the first batches on its
    own samples (on-policy: staleness 0, pi/mu 1), the generator takes over with the trainer's weights (every sync
    checked against vLLM's own loader; its first batch, sampled under them, is on-policy too), the checkpoints
    fall where they are due, and every step trains the rows the schedule names (`batch_rows`), whoever sampled them."""
    import json

    out = str(tmp_path / "run")
    proc = run_script([os.path.join(SCRIPTS, "train_tiny.py"), tiny_model, out, "--steps", "8", "--report-to", "none",
                       "--verify-weight-sync", "--save-steps", "4"],
                      env={"HFLLAMARL_PRELOAD": "0"})  # (its generator starts cold, importing vLLM: the one-shot path)
    assert proc.returncode == 0, tail(proc)
    profile = json.loads([line for line in proc.stdout.splitlines() if line.startswith("STARTUP ")][-1][8:])
    handed = int(profile.get("bootstrapped_batches", 0))
    trained = int(profile["bootstrap_trained_batches"])
    assert 1 <= handed <= 3, profile  # (never a checkpointed step: checkpoint 4 has the generator's part too)
    assert trained in (handed, handed - 1), profile  # (the last one sampled may be trained by the loop's first tick)
    assert profile["trainer_first_step"] < profile["generator_ready"] <= profile["trainer_handover"], profile
    logs = step_logs(proc.stdout)
    assert [h["step"] for h in logs] == list(range(1, 9))
    # On-policy: the batches the trainer sampled, and when it trained them all before the hand-over, the generator's
    # first (sampled under the handed weights while the trainer waited). When the last one waited for the loop, the
    # generator sampled its first batch while the trainer trained that one: one version behind, as every later batch.
    on_policy = handed + 1 if trained == handed else handed
    for h in logs[:on_policy]:
        assert h["staleness/mean"] == 0.0 and abs(h["is_ratio/max"] - 1.0) < 1e-3, h
        assert abs(h["is_ratio/min"] - 1.0) < 1e-3, h
    assert all(h["staleness/mean"] > 0 for h in logs[on_policy:on_policy + 1]), logs[on_policy]
    assert {"checkpoint-4", "checkpoint-8"} <= set(os.listdir(out)), os.listdir(out)
    rows = trained_rows(out)
    assert rows == {step: batch_rows(64, 4, step - 1, seed=0) for step in range(1, 9)}
