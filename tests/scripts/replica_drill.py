"""One trainer replica group of one rank for the replica drills (tests/test_replica_quorum.py): a tiny Llama trained
with AIPO's loss on fixed rows, its step's quorum, row share and gradient average from
`hfllamarl.runtime.training.replica_quorum` / `replica_rows`.

    python replica_drill.py MODEL OUT --replica 1 --lighthouse ADDR --steps 24 [--pace 0.1] [--timeout 9] [--fsdp]

Prints one line per step attempt, `STEP t=<unix time> replica=.. step=.. index=.. parts=.. rows=a:b healed=0|1
commit=0|1 quorum=.. sync_ms=..` (sync_ms: the time in the quorum, the gradient average and
the commit vote), then `DONE`, and saves the final weights to OUT/final_<replica>.pt. `--pace` sleeps that many
seconds per row trained before the gradient average (a real step's compute, which a tiny model does not have), so
that a drill can act mid-run, and mostly lands inside a step.

The rows: step k's batch is 8 synthetic completions of 2 prompts (groups of 4), fixed by k (`make_batch`), with
behaviour log-probs drawn around the model's so that AIPO's truncated weight min(pi_old/mu, 4) varies per token.
`reference_run` trains the same rows in one process, whole batches, without torchft: the drills' reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

LR = 5e-4
ROWS, GROUP = 8, 4


def make_batch(step: int, vocab: int) -> tuple[list, torch.Tensor]:
    """Step `step`'s rows (rollouts) and their advantages (`[ROWS]`, from rewards fixed by the step, relative to the
    mean of their group of GROUP: computed over the whole batch, before any split)."""
    from hfllamarl.losses import group_advantages
    from hfllamarl.runtime.loop.rollout import Rollout

    g = torch.Generator().manual_seed(1000 + step)
    rows = []
    for _ in range(ROWS // GROUP):
        prompt = torch.randint(4, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(GROUP):
            c = int(torch.randint(1, 9, (1,), generator=g))
            ids = torch.randint(4, vocab, (c,), generator=g).tolist()
            mu = (-torch.rand(c, generator=g) * 3.0 - 2.5).tolist()  # around a random-init model's log pi (~ -4)
            rows.append(Rollout(prompt="", prompt_ids=prompt, completion_ids=ids, behavior_logprobs=mu,
                                versions=[step] * c, finish_reason="stop", completion_text=""))
    rewards = torch.rand(ROWS, generator=g)
    return rows, group_advantages(rewards, GROUP)


def build(model_path: str, fsdp: bool = False):
    """The model (fp32, eval mode: no dropout), its AdamW and the AIPO loss (dapo objective, token weight
    min(pi_old/mu, 4)). `fsdp`: the model sharded by FSDP2 over this group's ranks (the default process group),
    each decoder layer a unit, as the trainer shards it: its parameters, gradients and AdamW state are DTensors."""
    from transformers import AutoModelForCausalLM

    from hfllamarl.policy_loss import Correction, Objective, PolicyLoss

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    if fsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, opt, PolicyLoss(Objective(loss_type="dapo"), Correction("token_truncate", None, 4.0))


def backward(model, algorithm, rows: list, advantages: torch.Tensor, shape) -> float:
    """Forward and backward over `rows` (one micro-batch), normalised by `shape`; returns the loss (0: no rows)."""
    from hfllamarl.runtime.training.batching import completion_logprobs, pad_batch

    if not rows:
        return 0.0
    batch = pad_batch(rows, model.config.pad_token_id, "cpu")
    logprobs = completion_logprobs(model, batch, 1.0)
    loss, _ = algorithm.loss(logprobs, batch["behavior_logprobs"], advantages, batch["mask"], shape=shape)
    loss.backward()
    return float(loss.detach())


def reference_run(model_path: str, steps: int) -> dict[str, torch.Tensor]:
    """The rows of `steps` steps trained in this process, one whole batch per step: the final weights."""
    from hfllamarl.losses import StepShape

    model, opt, algorithm = build(model_path)
    for step in range(steps):
        rows, adv = make_batch(step, model.config.vocab_size)
        opt.zero_grad()
        backward(model, algorithm, rows, adv, StepShape(tokens=float(sum(len(r.completion_ids) for r in rows))))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--pace", type=float, default=0.0, help="seconds per trained row")
    ap.add_argument("--timeout", type=float, default=9.0)
    ap.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (DTensor gradients and state)")
    ap.add_argument("--start-after", default=None,
                    help="a file: imports done and the model loaded, wait until it exists before joining (a standby "
                    "replacement, as a preloaded restart would be: the drill measures recovery, not Python's imports)")
    a = ap.parse_args()
    print(f"START t={time.time():.3f} replica={a.replica}", flush=True)

    from hfllamarl.runtime.training.replica_quorum import ReplicaQuorum, group_store
    from hfllamarl.runtime.training.replica_rows import replica_slice, replica_step_shape

    torch.set_num_threads(1)
    if a.fsdp:  # (the group's own world: one rank here, FSDP2 over it; the store also serves torchft's Manager)
        import torch.distributed as dist

        store, host, port = group_store()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model, opt, algorithm = build(a.model, fsdp=a.fsdp)
    print(f"BUILT t={time.time():.3f} replica={a.replica}", flush=True)
    if a.start_after:
        print(f"STANDBY t={time.time():.3f} replica={a.replica}", flush=True)
        deadline = time.monotonic() + 300
        while not os.path.exists(a.start_after):
            if time.monotonic() > deadline:
                sys.exit(f"{a.start_after} did not appear within 300 s")
            time.sleep(0.02)
    if not a.fsdp:
        store, host, port = group_store()
    quorum = ReplicaQuorum(a.replica, a.lighthouse, model, opt, collective_timeout_s=a.timeout, store=(host, port),
                           rank=0, world_size=1)
    print(f"UP t={time.time():.3f} replica={a.replica}", flush=True)
    while quorum.step < a.steps:
        t0 = time.perf_counter()
        q = quorum.begin_step()
        t_quorum = time.perf_counter() - t0
        rows, adv = make_batch(q.step, model.config.vocab_size)
        share = replica_slice(len(rows), q.index, q.participants)
        opt.zero_grad()
        shape = replica_step_shape(sum(len(r.completion_ids) for r in rows), q.participants)
        backward(model, algorithm, [rows[i] for i in share], adv[share.start:share.stop], shape)
        if a.pace:  # (a real step's compute, before its gradient average, grows with its rows: a lone survivor's too)
            time.sleep(a.pace * len(share))
        t1 = time.perf_counter()
        quorum.average_gradients(model.parameters())
        committed = quorum.commit()
        t_sync = t_quorum + time.perf_counter() - t1  # the quorum's own time: quorum, gradient average, commit vote
        if committed:
            opt.step()
        print(f"STEP t={time.time():.3f} replica={a.replica} step={q.step} index={q.index} parts={q.participants} "
              f"rows={share.start}:{share.stop} healed={int(q.healed)} commit={int(committed)} quorum={q.quorum_id} "
              f"sync_ms={t_sync * 1e3:.1f}",
              flush=True)
    final = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    torch.save(final, os.path.join(a.out, f"final_{a.replica}.pt"))
    print(f"DONE t={time.time():.3f} replica={a.replica} step={quorum.step}", flush=True)
    quorum.shutdown()
    del store
    sys.stdout.flush()
    os._exit(0)  # (torchft's server threads would otherwise hold the interpreter's exit)


if __name__ == "__main__":
    main()
