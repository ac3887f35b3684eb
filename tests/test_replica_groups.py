"""Trainer replica groups (`trainer_replica_groups`): whole jobs joined per step by torchft's quorum.

The drills (slow): two groups of one trainer and one generator each, on the tiny model; group 1 is SIGKILLed at the
end of its 8th step and started again by hand, as its launcher would. Group 0 trains every global step, and group 1's
share too while it is away; group 1 rejoins by copying the policy from group 0, samples its own share until its
generator's batches are current, then trains what they sample; at the end both groups hold the same weights, bit for
bit, every global step trained each prompt of its batch once, and the weights equal (to fp32 rounding) an
independent replay of the same rows in one process without groups (plain torch: the model, the job's loss over each
global step's rows, clipping, AdamW, the linear schedule).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import prompts_log, prompts_log_runs

from hfllamarl.runtime.data.prompts import batch_rows, group_batch_rows

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "train_tiny.py"


def make(**kw):
    from hfllamarl import AsyncAIPOConfig

    kw.setdefault("output_dir", "/tmp/hfllamarl-test-config")
    kw.setdefault("report_to", "none")
    return AsyncAIPOConfig(**kw)


def test_group_shares_cut_the_larger_batch_in_order():
    """Group g of G trains the g-th of G consecutive shares of the batch of G x P prompts (hand check on an
    unshuffled data set: batch b of 2 x 4 prompts is rows 8b .. 8b+7)."""
    assert group_batch_rows(64, 4, 1, seed=0, shuffle=False, group=0, groups=2) == [8, 9, 10, 11]
    assert group_batch_rows(64, 4, 1, seed=0, shuffle=False, group=1, groups=2) == [12, 13, 14, 15]
    both = group_batch_rows(64, 4, 5, 3, True, 0, 2) + group_batch_rows(64, 4, 5, 3, True, 1, 2)
    assert both == batch_rows(64, 8, 5, 3, True) and len(set(both)) == 8


@pytest.mark.parametrize("kw,match", [
    ({"trainer_replica_groups": 2}, "needs the torchft lighthouse"),
    ({"trainer_replica_groups": 0}, "trainer_replica_groups=0; it must be a whole number >= 1"),
    ({"trainer_replica_group": 1}, "trainer_replica_groups is 1"),
    ({"trainer_replica_groups": 2, "trainer_replica_group": 2, "torchft_lighthouse": "http://h:1"},
     r"one of 0 \.\. 1"),
    ({"trainer_replica_groups": 2, "torchft_lighthouse": "http://h:1", "loss_type": "grpo"},
     "loss_type='grpo' normalises per sequence"),
    ({"trainer_replica_groups": 2, "torchft_lighthouse": "http://h:1", "scale_rewards": "batch"},
     "scale_rewards='batch'"),
    ({"trainer_replica_groups": 2, "torchft_lighthouse": "http://h:1", "drop_zero_variance_groups": True},
     "dynamic sampling"),
])
def test_replica_group_settings_that_cannot_work_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_a_valid_replica_group_config():
    c = make(trainer_replica_groups=2, trainer_replica_group=1, torchft_lighthouse="http://h:1")
    assert (c.trainer_replica_groups, c.trainer_replica_group) == (2, 1)


def test_only_group_0_checkpoints_on_its_trainer_and_its_generator_ranks():
    """A recipe with save_steps run as every group (the natural way): group 1 writes no checkpoint, and its
    generator's spec says so too (it once checkpointed alone and waited for its trainer in the barrier until
    collective_timeout_s, and group 0 made no step meanwhile)."""
    from hfllamarl.trainers.trainer_ranks import save_every

    kw = dict(trainer_replica_groups=2, torchft_lighthouse="http://h:1", save_strategy="steps", save_steps=10)
    assert save_every(make(trainer_replica_group=0, **kw), 60) == 10
    assert save_every(make(trainer_replica_group=1, **kw), 60) == 0
    assert save_every(make(save_strategy="steps", save_steps=10), 60) == 10


def test_a_missing_share_is_dealt_to_its_own_group_when_it_takes_part_else_to_the_participants_in_turn():
    """`ReplicaGroup.makes_up` on hand cases: every participant deals the missing shares the same way."""
    import torch

    from hfllamarl.runtime.training.replica_group import ReplicaGroup

    def dealt(groups, members, missing):
        out = {}
        for g in members:
            group = ReplicaGroup(g, groups, "http://h:1", torch.nn.Linear(2, 2), None, None, 10.0, "cpu", ("h", 1), 0, 1)
            group.members, group.missing = set(members), missing
            out.update({h: g for h in group.makes_up()})
        return out

    assert dealt(2, {0}, [1]) == {1: 0}  # group 1 away: group 0 samples its share
    assert dealt(2, {0, 1}, [1]) == {1: 1}  # group 1 back, holding nothing current: its own
    assert dealt(3, {0, 2}, [1]) == {1: 2}  # share 1: the second of the participants [0, 2]
    assert dealt(4, {0, 3}, [1, 2]) == {1: 3, 2: 0}
    assert dealt(4, {1, 2, 3}, [0, 2]) == {0: 1, 2: 2}
    assert dealt(2, {0, 1}, []) == {}


def test_a_made_up_share_holds_that_groups_prompts_sampled_on_policy_and_split_over_the_groups_ranks(tiny_model):
    """`ShareMakeup.sample`: the prompts of share 1 of a global batch (not share 0's), sampled by the trainer's model
    with each token's log-prob under it (a plain forward of the prompt and completion alone), each data-parallel rank
    keeping its positions; asked again in a retried attempt, the same rollouts (sampled once, counted once)."""
    from types import SimpleNamespace

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.runtime.training.bootstrap import BootstrapSampler
    from hfllamarl.runtime.training.replica_makeup import ShareMakeup

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = Dataset.from_dict({"prompt": [f"{n} + 1 =" for n in range(40)], "answer": [str(n + 1) for n in range(40)]})
    spec = SimpleNamespace(chat_template_kwargs={}, sampling=Sampling(temperature=0.8), max_completion_length=6,
                           max_model_len=128, prompts_per_batch=3, num_generations=2, seed=7, shuffle=True)
    group = SimpleNamespace(group=0, groups=2, members={0}, is_main=True, made_up=0, shared_generators=False)
    sampler = BootstrapSampler(model, tok, data, spec, torch.device("cpu"), model.generation_config)
    ranks = [ShareMakeup(sampler, 2, d) for d in (0, 1)]
    parts = [m.sample(group, 1, 5, version=9) for m in ranks]
    want = group_batch_rows(40, 3, 5, 7, True, 1, 2)
    assert [g.rollouts[0].row_index for g in parts[0] + parts[1]] == want
    assert not set(want) & set(group_batch_rows(40, 3, 5, 7, True, 0, 2))
    assert [g.position for g in parts[0]] == [0, 1] and [g.position for g in parts[1]] == [2]
    assert group.made_up == 6  # (each rank samples the whole share: its sharded forward passes stay in step)
    for g in parts[0] + parts[1]:
        assert g.rollouts[0].columns == {"answer": data[g.rollouts[0].row_index]["answer"]}
        for r in g.rollouts:
            assert r.versions == [9] * len(r.completion_ids) and len(r.completion_ids) >= 1
            with torch.no_grad():
                logits = model(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0].float()
            start = len(r.prompt_ids) - 1
            want_lp = torch.log_softmax(logits[start:start + len(r.completion_ids)] / 0.8, -1)
            want_lp = want_lp.gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(r.behavior_logprobs), want_lp, atol=1e-4)
    again = ranks[0].sample(group, 1, 5, version=9)
    assert [id(g) for g in again] == [id(g) for g in parts[0]] and group.made_up == 6


def test_two_fsdp2_ranks_of_a_group_make_up_a_share_in_step_and_split_it(tmp_path):
    """A group of two FSDP2 trainer ranks (gloo): both sample the whole missing share in step (no hang: neither stops
    decoding before the other), rank 0 keeps positions 0-1 and rank 1 position 2, and together they hold what the
    whole model samples in one process with the same stream: the same prompts and tokens, the same log-probs."""
    from conftest import SCRIPTS, run_script, tail

    from hfllamarl.testing.tiny import build_tiny_model

    model = build_tiny_model(str(tmp_path / "llama"))
    proc = run_script([str(SCRIPTS / "makeup_sharded.py"), model], nproc=2, timeout=300)
    assert proc.returncode == 0, tail(proc)
    res = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert res["sharded"]
    (first, second), whole = res["parts"], res["whole"]
    assert [p for p, _ in first] == [0, 1] and [p for p, _ in second] == [2] and [p for p, _ in whole] == [0, 1, 2]
    assert res["made_up"] == 6  # (rank 0 sampled the share twice: sharded, then whole)
    lengths = set()
    for (_, got), (_, want) in zip(first + second, whole):
        assert [(r[0], r[1], r[3]) for r in got] == [(r[0], r[1], r[3]) for r in want]
        for r, w in zip(got, want):
            assert max((abs(a - b) for a, b in zip(r[2], w[2])), default=0.0) < 1e-4
            lengths.add(len(r[1]))
    assert sum(len(rollouts) for _, rollouts in whole) == 12 and lengths


def test_a_share_the_trainer_cannot_sample_is_left_out_and_says_why(caplog):
    from types import SimpleNamespace

    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.runtime.training.replica_makeup import ShareMakeup, blocker

    spec = SimpleNamespace(agent=None, reward_models=[object()], sampling=Sampling(), generation_kwargs={"stop": ["x"]})
    why = blocker(spec)
    assert "reward models score on the generator" in why and "generation_kwargs ['stop'] are vLLM options" in why
    assert blocker(SimpleNamespace(agent=None, reward_models=[], sampling=Sampling(), generation_kwargs={})) is None
    group = SimpleNamespace(group=0, groups=2, members={0}, is_main=True, made_up=0, shared_generators=False)
    makeup = ShareMakeup(None, 1, 0, why)
    with caplog.at_level("WARNING", logger="hfllamarl"):
        assert makeup.sample(group, 1, 3, 3) == [] and makeup.sample(group, 1, 4, 4) == []
    assert group.made_up == 0
    said = [r.getMessage() for r in caplog.records if "is missing and not trained" in r.getMessage()]
    assert len(said) == 1 and "the share of group 1 of global step 4" in said[0] and why in said[0], said


WAIT_ALONE = """
import os, sys, time, torch
from hfllamarl.runtime.training.replica_group import ReplicaGroup
from hfllamarl.runtime.training.replica_quorum import group_store, start_lighthouse

lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=0.5)
model = torch.nn.Linear(4, 4)
store, host, port = group_store()
group = ReplicaGroup(1, 2, lighthouse.address(), model, torch.optim.AdamW(model.parameters()), None,
                     collective_timeout_s=10.0, device="cpu", store=(host, port), rank=0, world_size=1,
                     peer_wait_s=2.0)
start = time.monotonic()
try:
    group.begin(0)
except RuntimeError as e:
    print(f"{time.monotonic() - start:.2f} {e}", flush=True)
os._exit(0)  # (torchft's server threads would hold the interpreter's exit)
"""


def test_a_group_other_than_0_alone_waits_for_a_peer_then_stops_with_what_to_do():
    """A group other than 0 that finds no live group (the lighthouse's first quorum has it alone, at global step 0:
    restarted by its launcher, or launched after the others were lost) does not train from the initial weights: it
    forms the quorum again for up to its start-up budget (2 s here), then stops with an error that says to start
    group 0 (again) first."""
    proc = subprocess.run([sys.executable, "-c", WAIT_ALONE], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RUST_LOG="warn"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    seconds, message = float(line.split(" ", 1)[0]), line.split(" ", 1)[1]
    assert 2.0 <= seconds < 30, line
    assert "trainer replica group 1 found no live group to copy the policy from in 2 s" in message \
        and "only group 0 starts a run. Start group 0" in message, message
    assert "waiting up to 2 s" in proc.stderr, proc.stderr[-2000:]


# AdamW's epsilon in the drills and their replay: at the default 1e-8 an element whose gradient is about 0 takes a step
# of about the learning rate either way, so fp32 rounding can set two equal trainings apart by as much as a share
# left out (two replays of one drill's rows, per sequence and padded: 2.6e-4 of the movement apart at 1e-8, 2.0e-5
# at 1e-6)
EPS = 1e-6


def _group(model, out, group, lighthouse, *extra, launcher=(), config=None, sleep=0.5):
    """One group's job, its output in OUT/../g<group>-<n>.log (a file: a pipe nobody reads would fill and stop it);
    `config`: more AsyncAIPOConfig fields; `sleep`: seconds after each step (a survivor outlasts a restart)."""
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.parent.glob(f"g{group}-*.log")))
    log = open(out.parent / f"g{group}-{n}.log", "w")
    cmd = [sys.executable, *launcher, str(SCRIPT), model, str(out), "--steps", "80", "--step-sleep", str(sleep),
           "--reward", "digits", "--no-bootstrap", "--timeout", "30", "--save-model", str(out / "final"),
           "--dump-trained",
           "--extra", json.dumps({"trainer_replica_groups": 2, "trainer_replica_group": group,
                                  "torchft_lighthouse": lighthouse, "save_strategy": "no", "adam_epsilon": EPS,
                                  **(config or {})}), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log.name
    log.close()
    return proc


def _replay(model_dir, outs, steps):
    """The same rows trained without replica groups: one process, one model, plain torch. Global step s trains the
    union of the groups' dumped rows of step s (`train_tiny.py --dump-trained`: tokens, behaviour log-probs,
    advantages as each group trained them) with the job's loss normalised over all their tokens, the gradient clipped
    at max_grad_norm, AdamW, the linear schedule; a step without rows steps only the schedule. Returns the initial
    and the replayed state dicts."""
    import torch

    lines = [e for out in outs for path in out.glob("trained-batches-group*-rank0.jsonl") for e in prompts_log(path)]
    last = {}  # a step committed again (the groups went back to a checkpoint): the last quorum's commit counts
    for e in lines:
        last[e["global_step"]] = max(last.get(e["global_step"], -1), e["quorum"])
    by_step = {}
    for e in lines:
        if e["quorum"] == last[e["global_step"]]:
            key = (e["global_step"], e["group"])
            assert key not in by_step, f"group {e['group']} trained global step {e['global_step']} twice"
            by_step[key] = e
    config = make(max_steps=steps, learning_rate=1e-3, num_generations=4, max_completion_length=4, max_staleness=1,
                  seed=0, trainer_replica_groups=2, torchft_lighthouse="http://h:1", adam_epsilon=EPS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny forwards: a second thread only spins, and beside another test it slows it 10x)
    try:
        return _replayed(model_dir, config, by_step, steps)
    finally:
        torch.set_num_threads(threads)


def _replayed(model_dir, config, by_step, steps):
    import torch
    from transformers import AutoModelForCausalLM

    from hfllamarl.losses import StepShape

    assert (config.weight_decay, config.warmup_steps, str(config.lr_scheduler_type.value), config.temperature,
            config.bf16, config.mask_truncated_completions) == (0.0, 0, "linear", 1.0, False, False)
    algorithm = config.build_algorithm()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(0.9, 0.999), eps=EPS,
                                  weight_decay=0.0)
    for step in range(1, steps + 1):
        entries = [by_step[step, g] for g in (0, 1) if (step, g) in by_step]
        rollouts = [r for e in entries for r in e["rollouts"]]
        if not rollouts:
            continue
        advantages = torch.tensor([a for e in entries for a in e["advantages"]], dtype=torch.float32)
        width = max(len(r["completion_ids"]) for r in rollouts)
        behavior, mask = torch.zeros(len(rollouts), width), torch.zeros(len(rollouts), width)
        rows = []
        for i, r in enumerate(rollouts):  # each sequence on its own (no padding, no packing)
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            n, p = len(r["completion_ids"]), len(r["prompt_ids"])
            logits = model(input_ids=ids).logits[0, p - 1:p - 1 + n].float() / config.temperature
            rows.append(torch.log_softmax(logits, -1).gather(-1, ids[0, p:, None])[:, 0])
            behavior[i, :n] = torch.tensor(r["behavior_logprobs"])
            mask[i, :n] = 1.0
        logprobs = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in rows])
        loss, _ = algorithm.loss(logprobs, behavior, advantages, mask, shape=StepShape(tokens=float(mask.sum())))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        for group in optimizer.param_groups:  # the linear schedule from learning_rate to 0 over the run
            group["lr"] = config.learning_rate * (steps - (step - 1)) / steps
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return initial, model.state_dict(), by_step


def _torchrun():
    """A group's launch under torchrun that restarts it once (its trainer and its generator as two ranks)."""
    from conftest import free_port

    return ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1", "--master-port",
            str(free_port())]


def _stop(procs, lighthouse):
    for p in procs:
        if p.poll() is None:
            p.kill()
    lighthouse.shutdown()


def _ended(proc0, proc1, out0, out1):
    """Both groups' last processes ended well: their outputs and prompts logs."""
    err0, err1 = Path(proc0.log_path).read_text(), Path(proc1.log_path).read_text()
    assert proc0.returncode == 0, err0[-3000:]
    assert proc1.returncode == 0, err1[-3000:]
    log0 = prompts_log(out0 / "trained_prompts-group0-rank0.jsonl")
    log1 = prompts_log(out1 / "trained_prompts-group1-rank0.jsonl")
    return err0, err1, log0, log1


@pytest.mark.slow
def test_a_killed_group_is_left_out_and_rejoins_from_its_peer(tmp_path, tiny_model):
    from hfllamarl.runtime.training.replica_quorum import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout_s=2.0, join_timeout_s=1.0)
    out0, out1 = tmp_path / "g0", tmp_path / "g1"
    procs = []
    try:
        # (both launched at once: group 1 waits for group 0 to start the run, up to half of its collective_timeout_s,
        # 60 s here, longer than one job's start-up on a loaded machine)
        procs.append(_group(tiny_model, out0, 0, lighthouse.address()))
        first = _group(tiny_model, out1, 1, lighthouse.address(), "--kill-at-step", "8", "--timeout", "60")
        procs.append(first)
        first.wait(timeout=300)
        assert first.returncode == -signal.SIGKILL
        killed_at = float((out1 / "killed_at").read_text())
        again = _group(tiny_model, out1, 1, lighthouse.address(), "--timeout", "60")
        procs.append(again)
        again.wait(timeout=300)
        procs[0].wait(timeout=300)
    finally:
        _stop(procs, lighthouse)
    err0, err1, log0, log1 = _ended(procs[0], again, out0, out1)
    steps0 = [e["global_step"] for e in log0]  # the survivor started the run and trained every step, each once
    assert steps0 == list(range(1, 81))
    assert all(len(e["rows"]) in (4, 8) for e in log0)  # (8: group 1's share too, while it is missing)
    before, after = prompts_log_runs(log1)
    killed = before[-1]["global_step"]  # (its 8th step: the 8th global one, unless it started second and healed)
    rejoined = after[0]["global_step"]
    assert killed + 1 < rejoined and [e["global_step"] for e in after] == list(range(rejoined, 81))
    assert any(e["rows"] for e in after), "the restarted group never trained its share"
    # (group 0 sampled group 1's share itself while it was away, group 1 its own until its generator's were current)
    assert "samples the share of group 1 itself while it is missing (that group is away)" in err0
    assert "samples the share of group 1 itself while it is missing (that group holds nothing current" in err1
    # the recovery, as the survivor logged it
    assert "left: [1]" in err0 and f"rejoined: 1 (absent for global steps {killed + 1}-{rejoined - 1}" in err0, \
        err0[-3000:]
    assert "copied the weights, optimizer and schedule from a peer" in err1
    step_times = {e["global_step"]: e["time"] for e in log0}
    print(f"drill: killed after global step {killed} at t=0; survivor's next step at "
          f"+{step_times[killed + 1] - killed_at:.1f} s; "
          f"group 1 back in global step {rejoined} at +{step_times[rejoined] - killed_at:.1f} s")
    _check_final_weights(tiny_model, out0, out1, log0 + log1, 80)


def _check_final_weights(model_dir, out0, out1, prompts_log, steps):
    """Both groups end with one policy, bit for bit, and it equals (to fp32 rounding) one process's training on the
    same rows without the failure: its distance to the replay's, against how far the weights moved (L2 over every
    weight). With AdamW's epsilon at 1e-6 (`EPS`) that ratio was 1.9e-6 to 5.4e-6 in runs of the three drills; the
    same replays with the made-up share of one step left out gave 0.087 to 0.33. And every global step trained each
    prompt of its batch once, whichever group held it or made it up."""
    from safetensors.torch import load_file

    final, other = load_file(out0 / "final" / "model.safetensors"), load_file(out1 / "final" / "model.safetensors")
    assert final.keys() == other.keys() and all((final[k] == other[k]).all() for k in final)
    initial, replayed, by_step = _replay(model_dir, [out0, out1], steps)
    logged = {}
    for e in prompts_log:
        logged.setdefault(e["global_step"], []).append(e["rows"])
    for (step, _), e in by_step.items():  # the dumped rows are the ones the prompts logs name for that step
        assert [r["row"] for r in e["rollouts"][::4]] in logged[step]
    for step in range(1, steps + 1):  # nothing skipped, nothing twice: each global step trained every prompt of its
        # batch (the 8 a single job samples) once, whichever group held it or sampled it when it was missing
        rows = [r["row"] for g in (0, 1) if (step, g) in by_step for r in by_step[step, g]["rollouts"][::4]]
        assert sorted(rows) == sorted(batch_rows(64, 8, step - 1, 0)), (step, rows)

    def norm(a, b):
        return sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in final) ** 0.5

    moved, gap = norm(final, initial), norm(final, replayed)
    largest = max(float((final[k] - replayed[k]).abs().max()) for k in final)
    print(f"replay of the same rows in one process: the weights moved by {moved:.3g} (L2), differ from the replay's "
          f"by {gap / moved:.2e} of that (largest element {largest:.2e})")
    assert moved > 1.0 and gap < 5e-4 * moved


@pytest.mark.slow
def test_a_frozen_group_is_left_out_and_its_launcher_restarts_it(tmp_path, tiny_model):
    """Group 1 under `torchrun --max-restarts 1` (its trainer and its generator as two ranks); its trainer rank
    SIGSTOPs itself at the end of its 8th step (once that step's lines are written: a freeze from outside could land
    between a step's commit and its lines, and the replay would miss a share that was trained). Group 0 leaves it
    out and trains on; group 1's generator gives up on its frozen trainer after collective_timeout_s, torchrun
    restarts the group, and it rejoins from group 0."""
    from hfllamarl.runtime.training.replica_quorum import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout_s=2.0, join_timeout_s=1.0)
    out0, out1 = tmp_path / "g0", tmp_path / "g1"
    procs = []
    try:
        # (both at once: group 1 waits for group 0 to start the run, see the killed drill; group 0 keeps 30 s, the
        # longest it waits in a collective its frozen peer is inside)
        procs.append(_group(tiny_model, out0, 0, lighthouse.address(), "--steps", "100"))
        procs.append(_group(tiny_model, out1, 1, lighthouse.address(), "--steps", "100", "--timeout", "60",
                            "--freeze-at-step", "8", launcher=_torchrun()))
        for p in procs:
            p.wait(timeout=500)
        stopped_at = float((out1 / "killed_at").read_text())
    finally:
        _stop(procs, lighthouse)
    err0, err1, log0, log1 = _ended(procs[0], procs[-1], out0, out1)
    steps0 = [e["global_step"] for e in log0]  # group 0 started the run and trained every step
    assert steps0 == list(range(1, 101))
    runs = prompts_log_runs(log1)
    assert len(runs) == 2, "group 1 did not come back"
    frozen_at, after = runs[0][-1]["global_step"], runs[1]
    assert steps0[0] <= frozen_at  # (on a loaded machine group 0 may start late: it joined before the freeze)
    assert after[-1]["global_step"] == 100 and any(e["rows"] for e in after), "group 1 never came back"
    rejoined = after[0]["global_step"]
    assert "left: [1]" in err0 and f"rejoined: 1 (absent for global steps {frozen_at + 1}-{rejoined - 1}" in err0
    assert "copied the weights, optimizer and schedule from a peer" in err1
    times = {e["global_step"]: e["time"] for e in log0}
    print(f"drill: SIGSTOP after global step {frozen_at}; survivor's next step +{times[frozen_at + 1] - stopped_at:.1f} s; "
          f"group 1 back (restarted by torchrun) in global step {rejoined} at +{times[rejoined] - stopped_at:.1f} s")
    _check_final_weights(tiny_model, out0, out1, log0 + log1, 100)


@pytest.mark.slow
def test_every_group_lost_at_once_resumes_from_group_0s_checkpoint(tmp_path, tiny_model):
    """Both groups under `torchrun --max-restarts 1`, group 0 checkpointing every 10 steps: group 1 is launched
    first (it waits for group 0: only group 0 starts a run), so the two start together; group 0's trainer rank is
    SIGKILLed at the end of global step 24 and group 1's one step later, so that no group is left. torchrun restarts
    both (group 0 10 s later, as on a slow machine): group 0 resumes from its newest checkpoint by itself; group 1,
    back first and finding no live group, waits for one and copies the policy from group 0 (on a crowded machine its
    restart can take longer than group 0's: then it finds group 0 back and copies at once). The run ends at its last
    step, both groups hold the same weights, and those equal the replay of the rows of the steps that count (1-20 as
    first trained, 21-50 as trained again)."""
    from hfllamarl.runtime.training.replica_quorum import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout_s=2.0, join_timeout_s=1.0)
    out0, out1 = tmp_path / "g0", tmp_path / "g1"
    procs = []
    try:
        checkpoints = {"save_strategy": "steps", "save_steps": 10}
        # (group 0's restart 10 s slower: group 1 is back first and must wait for it, not race it; collective_timeout_s
        # 180: group 1 waits up to 90 s, at its first launch and after its restart)
        # (group 1 first, and group 0 once group 1 waits for it: launched the other way round, group 1 could come
        # up after group 0's kill on a loaded machine and the drill would lose no group at once)
        for group, out, kill, config, delay in ((1, out1, 25, {}, "0"), (0, out0, 24, checkpoints, "10")):
            procs.append(_group(tiny_model, out, group, lighthouse.address(), "--steps", "50", "--kill-at-step",
                                str(kill), "--timeout", "180", "--restart-delay", delay, config=config, sleep=0,
                                launcher=_torchrun()))
            deadline = time.monotonic() + 120
            while group == 1 and "finds no live group" not in Path(procs[0].log_path).read_text():
                assert time.monotonic() < deadline and procs[0].poll() is None, "group 1 did not start"
                time.sleep(0.2)
        procs.reverse()
        for p in procs:
            p.wait(timeout=400)
    finally:
        _stop(procs, lighthouse)
    err0, err1, log0, log1 = _ended(procs[0], procs[-1], out0, out1)
    first0, again0 = prompts_log_runs(log0)
    first1, again1 = prompts_log_runs(log1)
    assert [e["step"] for e in first0][-1] == 24 and again0[0]["step"] == 21, "group 0 did not resume at step 21"
    resumed_at = again0[0]["global_step"] - 1  # (the checkpoint's global step: no live group had a newer policy)
    assert resumed_at == [e["global_step"] for e in first0 if e["step"] == 20][0]
    assert [e["global_step"] for e in again0] == list(range(resumed_at + 1, 51))
    assert first1[-1]["time"] < again0[0]["time"], "group 1 was still there when group 0 came back"
    assert again1[-1]["global_step"] == 50 and any(e["rows"] for e in again1), "group 1 never came back"
    assert "resuming from" in err0 and "checkpoint-20" in err0, err0[-3000:]
    assert "copied the weights, optimizer and schedule from a peer" in err1, err1[-3000:]
    # (once at its first launch, which the drill waits for; again after its restart unless group 0 was back first)
    waits = err1.count("finds no live group to copy the policy from, and only group 0 starts a run; waiting")
    assert waits in (1, 2), waits
    killed_at = float((out0 / "killed_at").read_text())
    print(f"drill: group 0 SIGKILLed after global step {first0[-1]['global_step']}, group 1 after "
          f"{first1[-1]['global_step']}; group 0 back from its checkpoint (global step {resumed_at}) in global step "
          f"{resumed_at + 1} at +{again0[0]['time'] - killed_at:.1f} s, group 1 in global step "
          f"{again1[0]['global_step']} at +{again1[0]['time'] - killed_at:.1f} s "
          f"({'back first, it waited for group 0' if waits == 2 else 'back after group 0'}); "
          f"{max(first0[-1]['global_step'], first1[-1]['global_step']) - resumed_at} global steps trained again")
    _check_final_weights(tiny_model, out0, out1, log0 + log1, 50)
