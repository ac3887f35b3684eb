"""`hfllamarl bench load`: what loading the policy costs each trainer rank, sharded vs whole, side by side.

    hfllamarl bench load [--params 3e8] [--trainers 2] [--modes sharded,whole]

Writes a random Llama of about `--params` parameters to a temporary directory (safetensors, fp32),
then, for each mode, starts `--trainers` trainer ranks (gloo) that load it and shard it with FSDP2 (with
`--trainer-tp t`: tensor parallel t x FSDP2, as `trainer_tensor_parallel_size`):

- `sharded`: hfllamarl's loader (`hfllamarl.runtime.weights.loading`): built on the meta device, sharded, each rank
  reading only its rows from the files;
- `whole`: `from_pretrained` on every rank, then sharding (what most trainers do).

Each rank samples its resident memory (every 2 ms) from just before loading to the end of sharding and
reports the peak growth over the model's fp32 bytes.

With `--train-step`, each rank then trains one step on `--sequences` sequences of `--length` tokens per
data-parallel rank (the completion log-probs the loss uses, backward, AdamW), and reports its peak growth from
before loading to the end of that step: what training holds per rank (weights, gradients, Adam's two moments,
activations). The same step runs first on one rank holding the whole model, for the ratio in the same run. Its
ranks run with `MALLOC_MMAP_THRESHOLD_=65536` (unless `--glibc-default`): glibc then returns every freed block of
64 KiB or more at once, so the resident size is what is live; by default glibc raises that threshold as blocks are
freed and keeps FSDP2's freed layer buffers in its heap (the resident peak then reads up to ~2x what is live).
Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def add_arguments(parser) -> None:
    parser.add_argument("--params", type=float, default=3e8, help="model size in parameters (default 3e8)")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--trainer-tp", type=int, default=1, help="trainer tensor-parallel size (the trainer ranks as "
                        "FSDP2 x tensor parallelism, as trainer_tensor_parallel_size)")
    parser.add_argument("--sequence-parallel", action="store_true", help="with --trainer-tp: split the stream "
                        "between the blocks by sequence too (as trainer_sequence_parallel)")
    parser.add_argument("--modes", default="sharded,whole", help="comma-separated: sharded, whole")
    parser.add_argument("--train-step", action="store_true", help="also train one step after loading (sharded "
                        "mode) and report each rank's peak while training, against one rank holding the whole model")
    parser.add_argument("--sequences", type=int, default=2, help="with --train-step: sequences per data-parallel rank")
    parser.add_argument("--length", type=int, default=256, help="with --train-step: tokens per sequence")
    parser.add_argument("--glibc-default", action="store_true", help="with --train-step: leave glibc's malloc "
                        "as it is (its resident peak then includes freed blocks it kept)")
    parser.add_argument("--timeout", type=float, default=1800)


def _worker(opts: dict) -> None:
    import torch
    import torch.distributed as dist

    from hfllamarl.commands.bench_rank import RssPeak
    from hfllamarl.runtime.weights.fsdp import shard_model
    from hfllamarl.runtime.world.topology import settle_collectives_at_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    settle_collectives_at_exit()
    path, mode = opts["path"], opts["mode"]
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    import gc

    gc.collect()
    start = time.perf_counter()
    with RssPeak() as mem:
        if mode == "sharded":
            from hfllamarl.runtime.weights.loading import build_empty, load_shards, materialize

            model = build_empty(config, torch.float32)
            shard_model(model, "cpu", tp=opts.get("tp", 1), sequence_parallel=opts.get("sp", False))
            materialize(model, torch.device("cpu"))
            load_shards(model, path)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            shard_model(model, "cpu", tp=opts.get("tp", 1), sequence_parallel=opts.get("sp", False))
        gc.collect()
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    # A check that the rows are the right ones: every rank sums its share (a part several ranks hold, once);
    # rank 0 compares with the file.
    from hfllamarl.runtime.weights.fsdp import local_box

    checksum = torch.tensor([sum(float(local_box(p, dist.get_rank())[0].detach().double().sum())
                                 for p in model.parameters())], dtype=torch.float64)
    dist.all_reduce(checksum)
    final = _rss() - mem.start
    trained = {}  # (after the checksum: the step changes the weights)
    if opts.get("train"):
        with RssPeak() as step_mem:
            trained = _train_step(model, config, opts["train"], opts.get("tp", 1))
        trained["train_peak_growth"] = max(step_mem.peak, mem.peak) - mem.start
    result = {"rank": dist.get_rank(), "mode": mode, "peak_growth": mem.peak - mem.start,
              "final_growth": final, "local_bytes": local, "seconds": seconds,
              "checksum": float(checksum.item()), **trained}
    print("LOAD_RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _train_step(model, config, shape: dict, tp: int) -> dict:
    """One training step as the trainer takes it: completion log-probs (on vocabulary-sharded logits when the output
    layer is split), a loss over them, backward, the partial gradients summed, AdamW. Every rank of a
    tensor-parallel group trains the same sequences; data-parallel ranks, their own."""
    import torch
    import torch.distributed as dist

    from hfllamarl.runtime.loop.rollout import Rollout
    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.runtime.training.batching import completion_logprobs, pad_batch
    from hfllamarl.runtime.weights.tensor_parallel import reduce_partial_gradients

    g = torch.Generator().manual_seed(dist.get_rank() // tp)
    length, prompt = shape["length"], shape["length"] // 4
    rows = []
    for _ in range(shape["sequences"]):
        ids = torch.randint(0, config.vocab_size, (length,), generator=g).tolist()
        rows.append(Rollout(prompt="", prompt_ids=ids[:prompt], completion_ids=ids[prompt:],
                            behavior_logprobs=[0.0] * (length - prompt), versions=[0] * (length - prompt),
                            finish_reason="length", completion_text=""))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    start = time.perf_counter()
    batch = pad_batch(rows, 0, torch.device("cpu"), multiple_of=tp)
    logprobs = completion_logprobs(model, batch, Sampling(temperature=1.0))
    loss = -(logprobs * batch["mask"]).sum() / batch["mask"].sum()
    loss.backward()
    reduce_partial_gradients(model)
    opt.step()
    return {"train_seconds": time.perf_counter() - start, "loss": float(loss.detach())}


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _write_model(params: float, directory: str) -> tuple[int, int, float]:
    """A random Llama of about `params` parameters saved to `directory`; returns (parameters, fp32 bytes, sum)."""
    import torch
    from transformers import LlamaForCausalLM

    from hfllamarl.commands.bench_rank import llama_config_for

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config_for(params))
    model.save_pretrained(directory)
    n = sum(p.numel() for p in model.parameters())
    total = sum(float(p.double().sum()) for p in model.parameters())
    return n, n * 4, total


def _launch(opts: dict, world: int, timeout: float) -> list[dict]:
    extra = {"MALLOC_MMAP_THRESHOLD_": "65536"} if opts.get("live") else {}
    from hfllamarl.runtime.world.ports import free_port

    port = free_port()  # (below the ephemeral range: a released kernel-chosen port can be taken before rank 0 binds it)
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)
        procs.append(subprocess.Popen([sys.executable, "-m", "hfllamarl.commands.bench_load", "--worker", json.dumps(opts)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise SystemExit(f"bench load: a trainer rank failed (exit code {p.returncode})")
            results += [json.loads(line[len("LOAD_RESULT "):]) for line in out.splitlines()
                        if line.startswith("LOAD_RESULT ")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(results, key=lambda r: r["rank"])


def _train_baseline(directory: str, train: dict, model_bytes: int, timeout: float, live: bool) -> dict:
    """The same training step on one rank holding the whole model (FSDP2 over one rank)."""
    (one,) = _launch({"path": directory, "mode": "sharded", "tp": 1, "train": train, "live": live}, 1, timeout)
    print(f"training one step ({train['sequences']} x {train['length']} tokens per data-parallel rank) on one rank "
          f"holding the whole model: peak growth {one['train_peak_growth'] / 2**20:.0f} MiB "
          f"({one['train_peak_growth'] / model_bytes:.2f}x the model), {one['train_seconds']:.1f} s")
    return {"one_rank_train_peak_over_model": round(one["train_peak_growth"] / model_bytes, 3),
            "one_rank_loss": one["loss"]}


def _print_training(ranks: list[dict], model_bytes: int, summary: dict) -> None:
    one = summary["one_rank_train_peak_over_model"]
    print(f"{'training':<10}{'rank':>5}{'peak growth MiB':>17}{'x model':>9}{'x one rank':>12}{'seconds':>9}"
          f"{'loss':>10}")
    for r in ranks:
        share = r["train_peak_growth"] / model_bytes
        print(f"{'':<10}{r['rank']:>5}{r['train_peak_growth'] / 2**20:>17.0f}{share:>9.2f}{share / one:>12.2f}"
              f"{r['train_seconds']:>9.1f}{r['loss']:>10.4f}")
    worst = max(r["train_peak_growth"] for r in ranks) / model_bytes
    summary["train_peak_over_model"] = round(worst, 3)
    summary["train_peak_over_one_rank"] = round(worst / one, 3)
    # (data-parallel rank 0 trains the one rank's sequences on the same weights: the same loss, to fp32 rounding)
    summary["train_loss_matches"] = abs(ranks[0]["loss"] - summary["one_rank_loss"]) <= 1e-4
    print(f"training peak per rank: {worst:.2f}x the model's bytes, {worst / one:.2f}x one rank's "
          f"({one:.2f}x the model)")


def run(args) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("sharded", "whole")]
    if bad or args.trainers < 1:
        raise SystemExit(f"--modes takes sharded and/or whole (got {bad}); --trainers must be >= 1")
    if args.trainer_tp < 1 or args.trainers % args.trainer_tp:
        raise SystemExit(f"--trainer-tp {args.trainer_tp} must divide --trainers {args.trainers}")
    if args.sequence_parallel and args.trainer_tp < 2:
        raise SystemExit("--sequence-parallel splits the sequence inside a tensor-parallel group: give --trainer-tp "
                         ">= 2")
    if args.train_step and "sharded" not in modes:
        raise SystemExit("--train-step trains after the sharded load: include sharded in --modes")
    train = {"sequences": args.sequences, "length": args.length} if args.train_step else None
    live = bool(train) and not args.glibc_default
    directory = tempfile.mkdtemp(prefix="hfllamarl-bench-load-")
    try:
        params, model_bytes, total = _write_model(args.params, directory)
        summary = {"params": params, "model_bytes": model_bytes, "trainer_ranks": args.trainers, "live_malloc": live,
                   "trainer_tp": args.trainer_tp,
                   "sequence_parallel": args.sequence_parallel}
        from hfllamarl.runtime.world.mesh import describe

        layout = describe(args.trainer_tp, args.trainers // args.trainer_tp, sequence=args.sequence_parallel)
        print(f"loading a {params / 1e6:.0f}M-parameter Llama ({model_bytes / 2**20:.0f} MiB fp32) on "
              f"{args.trainers} trainer rank(s), sharded with {layout}")
        print(f"{'mode':<10}{'rank':>5}{'peak growth MiB':>17}{'x model':>9}{'shard MiB':>11}{'seconds':>9}")
        if train:
            print("glibc's malloc: " + ("its default (freed blocks it keeps count)" if not live else
                                        "MALLOC_MMAP_THRESHOLD_=65536 (the resident size is what is live)"))
            summary.update(_train_baseline(directory, train, model_bytes, args.timeout, live))
        for mode in modes:
            opts = {"path": directory, "mode": mode, "tp": args.trainer_tp, "live": live,
                    "train": train if mode == "sharded" else None, "sp": args.sequence_parallel}
            ranks = _launch(opts, args.trainers, args.timeout)
            for r in ranks:
                print(f"{mode:<10}{r['rank']:>5}{r['peak_growth'] / 2**20:>17.0f}{r['peak_growth'] / model_bytes:>9.2f}"
                      f"{r['local_bytes'] / 2**20:>11.0f}{r['seconds']:>9.1f}")
            summary[f"{mode}_peak_over_model"] = round(max(r["peak_growth"] for r in ranks) / model_bytes, 3)
            summary[f"{mode}_seconds"] = round(max(r["seconds"] for r in ranks), 2)
            summary[f"{mode}_weights_match"] = abs(ranks[0]["checksum"] - total) <= 1e-6 * max(1.0, abs(total))
            if opts["train"]:
                _print_training(ranks, model_bytes, summary)
        if "sharded" in modes and "whole" in modes:
            summary["whole_over_sharded"] = round(summary["whole_peak_over_model"] / summary["sharded_peak_over_model"], 2)
            print(f"peak growth per rank: sharded {summary['sharded_peak_over_model']:.2f}x the model, whole "
                  f"{summary['whole_peak_over_model']:.2f}x ({summary['whole_over_sharded']:.2f}x more)")
        print(json.dumps(summary))
        return 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
    else:
        import argparse

        parser = argparse.ArgumentParser(prog="hfllamarl bench load")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
