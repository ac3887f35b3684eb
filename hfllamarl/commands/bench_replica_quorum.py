"""`hfllamarl bench replica-quorum`: what the fault-tolerant layout of trainer replicas costs a step without failures.

    hfllamarl bench replica-quorum [--steps 20] [--rounds 2] [--hidden-size 512] [--layers 6] [--precision auto]

Two trainer replica groups of one rank each, one core each, train the vs-TRL bench's model (a random-init Llama,
18.7M parameters by default) on the same rows, side by side in two layouts, alternated `--rounds` times:

- `hsdp` (today's): one trainer world of 2 ranks, FSDP2 with `trainer_fsdp_shard_size=1` (hybrid sharding: the
  groups replicate, their gradients are averaged by FSDP2 inside the backward pass);
- `quorum` (fault-tolerant): each group a world of its own (FSDP2 over its one rank) and a torchft quorum per step
  through `hfllamarl.runtime.training.replica_quorum.ReplicaQuorum` (the quorum, the gradient average over the step's
  participants, the commit vote), with a lighthouse in this process. torchft 0.2.0 must be installed.

Each step is the bench's batch, 16 completions of 96 tokens after a 10-token prompt (fixed random tokens per step,
behaviour log-probs around the model's), split over the two groups (`replica_rows`), AIPO's default loss
(dapo objective, TRL's token-level truncated weight), AdamW. Precision as the vs-TRL bench: bf16 mixed precision on a
CPU with bf16 instructions (`auto`), else fp32. It prints each layout's median step time (first group, the first two
steps left out as warm-up), the ratio, the quorum layout's own time per step (quorum + gradient average + vote), and
one JSON line. The trainer does not run in the quorum layout yet: this measures what it will add to a step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT, COMPLETION, ROWS, GROUP, WARMUP = 10, 96, 16, 4, 2


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout and round (after 2 warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="each layout runs this many times, alternated")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--output-dir", default="outputs/bench_replica_quorum")


def make_rows(step: int, vocab: int):
    """Step `step`'s rows and advantages (fixed by the step, the whole batch's, before any split)."""
    import torch

    from hfllamarl.losses import group_advantages
    from hfllamarl.runtime.loop.rollout import Rollout

    g = torch.Generator().manual_seed(7000 + step)
    rows = []
    for _ in range(ROWS // GROUP):
        prompt = torch.randint(4, vocab, (PROMPT,), generator=g).tolist()
        for _ in range(GROUP):
            ids = torch.randint(4, vocab, (COMPLETION,), generator=g).tolist()
            mu = (-torch.rand(COMPLETION, generator=g) * 3.0 - 2.5).tolist()
            rows.append(Rollout(prompt="", prompt_ids=prompt, completion_ids=ids, behavior_logprobs=mu,
                                versions=[step] * COMPLETION, finish_reason="stop", completion_text=""))
    return rows, group_advantages(torch.rand(ROWS, generator=g), GROUP)


def worker(job: dict) -> None:
    """One group (one rank) of one layout: trains WARMUP + steps steps, writes its step times to job["result"]."""
    import torch
    import torch.distributed as dist

    from hfllamarl.policy_loss import Correction, Objective, PolicyLoss
    from hfllamarl.runtime.training.batching import completion_logprobs, pack_batch
    from hfllamarl.runtime.training.replica_rows import replica_slice, replica_step_shape
    from hfllamarl.runtime.weights.fsdp import shard_model

    os.sched_setaffinity(0, [job["core"]])
    torch.set_num_threads(1)
    quorum, store = None, None
    if job["layout"] == "hsdp":
        store = dist.TCPStore("127.0.0.1", job["port"], is_master=False)  # (hosted by the bench)
        dist.init_process_group("gloo", store=store, rank=job["group"], world_size=2)
    else:
        from hfllamarl.runtime.training.replica_quorum import group_store

        store, host, port = group_store()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    shard_model(model, "cpu", mixed_precision="bf16" if job["precision"] == "bf16" else None, tp=1, shard=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    loss_fn = PolicyLoss(Objective(loss_type="dapo"), Correction("token_truncate", None, 3.0))
    if job["layout"] == "quorum":
        from hfllamarl.runtime.training.replica_quorum import ReplicaQuorum

        quorum = ReplicaQuorum(job["group"], job["lighthouse"], model, opt, collective_timeout_s=60.0,
                               store=(host, port), rank=0, world_size=1, min_replicas=2)
    steps, own = [], []
    for step in range(WARMUP + job["steps"]):
        t0 = time.perf_counter()
        index, parts, sync = job["group"], 2, 0.0
        if quorum is not None:
            q = quorum.begin_step()
            index, parts, sync = q.index, q.participants, time.perf_counter() - t0
        rows, adv = make_rows(step, model.config.vocab_size)
        share = replica_slice(len(rows), index, parts)
        shape = replica_step_shape(sum(len(r.completion_ids) for r in rows), parts)
        batch = pack_batch([rows[i] for i in share], model.config.pad_token_id or 0, "cpu")
        logprobs = completion_logprobs(model, batch, 1.0)
        loss, _ = loss_fn.loss(logprobs, batch["behavior_logprobs"], adv[share.start:share.stop], batch["mask"],
                               shape=shape)  # (hsdp: 2 participants, FSDP2 averages over both ranks)
        loss.backward()  # (hsdp: FSDP2 averages the gradients over both groups here)
        committed = True
        if quorum is not None:
            t1 = time.perf_counter()
            quorum.average_gradients(model.parameters())
            committed = quorum.commit()
            sync += time.perf_counter() - t1
        if not committed:
            raise SystemExit(f"group {job['group']}: step {step} did not commit (no failure was injected)")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= WARMUP:
            steps.append(time.perf_counter() - t0)
            own.append(sync)
    with open(job["result"], "w") as fh:
        json.dump({"steps": steps, "quorum_seconds": own}, fh)
    if quorum is not None:
        quorum.shutdown()
    sys.stdout.flush()
    os._exit(0)  # (torchft's server threads would otherwise hold the interpreter's exit)


def run_layout(layout: str, job: dict, out: str, round_: int) -> dict:
    """Both groups of `layout`, each in a process of its own on a core of its own; the first group's results."""
    from torch.distributed import TCPStore

    lighthouse = store = None
    if layout == "quorum":
        from hfllamarl.runtime.training.replica_quorum import start_lighthouse

        lighthouse = start_lighthouse(min_replicas=2)
        extra = {"lighthouse": lighthouse.address()}
    else:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # (the hsdp layout's world)
        extra = {"port": store.port}
    cores = sorted(os.sched_getaffinity(0))
    procs, results = [], []
    for group in range(2):
        result = os.path.join(out, f"{layout}-{round_}-{group}.json")
        results.append(result)
        spec = dict(job, **extra, layout=layout, group=group, core=cores[group % len(cores)], result=result)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.setdefault("RUST_LOG", "warn")
        procs.append(subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        errors = [p.communicate(timeout=900)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if lighthouse is not None:
            lighthouse.shutdown()
    if any(p.returncode for p in procs):
        raise SystemExit(f"{layout} failed:\n" + "\n".join(e[-3000:] for e in errors if e))
    with open(results[0]) as fh:
        return json.load(fh)


def run(args) -> int:
    from hfllamarl.commands.bench_vs_trl import bench_model
    from hfllamarl.runtime.generation.preflight import cpu_has_bf16
    from hfllamarl.runtime.training.replica_quorum import import_torchft

    os.environ.setdefault("RUST_LOG", "warn")  # (the lighthouse, in this process, logs every quorum at INFO)
    import_torchft()  # (a missing torchft is named before anything starts)
    if args.steps < 1 or args.rounds < 1:
        raise SystemExit("give --steps >= 1 and --rounds >= 1")
    precision = ("bf16" if cpu_has_bf16() else "fp32") if args.precision == "auto" else args.precision
    os.makedirs(args.output_dir, exist_ok=True)
    model = bench_model(args.output_dir, args.hidden_size, args.layers, seed=0)
    job = {"model": model, "steps": args.steps, "precision": precision}
    steps = {"hsdp": [], "quorum": []}
    own = []
    with tempfile.TemporaryDirectory(dir=args.output_dir) as out:
        for round_ in range(args.rounds):
            for layout in ("hsdp", "quorum"):
                print(f"round {round_ + 1}: {layout} ...", flush=True)
                r = run_layout(layout, job, out, round_)
                steps[layout] += r["steps"]
                if layout == "quorum":
                    own += r["quorum_seconds"]
    med = {k: statistics.median(v) for k, v in steps.items()}
    ratio = med["quorum"] / med["hsdp"]
    own_med = statistics.median(own)
    print(f"\n2 trainer replica groups x 1 rank, {ROWS} completions of {COMPLETION} tokens a step, {precision}, "
          f"{args.rounds} x {args.steps} steps per layout")
    print(f"  hsdp (one world, FSDP2 replicates)      median step {med['hsdp']:.3f} s")
    print(f"  quorum (torchft, a world per group)     median step {med['quorum']:.3f} s   ({ratio:.3f}x)")
    print(f"    of which the quorum, gradient average and commit vote (with any wait for the other group): {own_med:.3f} s "
          f"({own_med / med['quorum']:.1%} of the step)")
    print(json.dumps({"precision": precision, "steps": args.steps, "rounds": args.rounds,
                      "hsdp_step_s": round(med["hsdp"], 4), "quorum_step_s": round(med["quorum"], 4),
                      "ratio": round(ratio, 4), "quorum_own_s": round(own_med, 4)}))
    return 0


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
