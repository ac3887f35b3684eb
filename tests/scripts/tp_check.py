"""Run under torchrun with T trainer ranks (TRAINER_TP ranks per tensor-parallel group): for each model directory
given, the policy sharded as the trainer shards it (tensor parallel x FSDP2) against the same model whole in this
process (transformers alone, the independent reference):

- the log-probs and entropies of completion tokens (`completion_logprobs`, on vocabulary-sharded logits when the
  output layer is split) and a loss over them: equal to the whole model's on the same sequences; the same under
  vLLM's transforms (top-k, top-p, min-p, a repetition penalty);
- after backward (and `reduce_partial_gradients`), every parameter's gradient, gathered whole: equal to the whole
  model's gradient of the same loss summed over every data-parallel rank's sequences, divided as FSDP2 averages;
- the boxes `local_box` names: each rank's part is that box of the full tensor, and the sending ranks' boxes tile it;
- the parameter bytes each rank holds, against the whole model's;
- after one AdamW step, the updated weights; the optimizer state written with torch's distributed checkpoint and
  read into the model sharded with FSDP2 alone: its Adam moments, against the whole model's.

    TRAINER_TP=2 torchrun --nproc_per_node 4 tests/scripts/tp_check.py MODEL_DIR [MODEL_DIR ...]

Each model is checked twice: tensor parallelism alone, then with sequence parallelism (`trainer_sequence_parallel`:
the residual stream and norms between the blocks split by sequence; the batches padded to a multiple of the group)
and activation checkpointing (the layers run again in backward, their collectives with them); then with hybrid
sharding (FSDP2 over groups of data-parallel ranks, replicated across them), with and without tensor parallelism.
Prints `RESULT {json}` on rank 0, one entry per model and variant ("<dir>", "<dir> sequence", "<dir> hybrid",
"<dir> hybrid tp").
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def check(path: str, tp: int, sequence: bool = False, shard: int | None = None) -> dict:
    import transformers

    from hfllamarl.runtime.loop.rollout import Rollout
    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.runtime.training.batching import completion_logprobs, pad_batch
    from hfllamarl.runtime.weights.fsdp import local_box, shard_model
    from hfllamarl.runtime.weights.tensor_parallel import reduce_partial_gradients

    rank, world = dist.get_rank(), dist.get_world_size()
    dp, d = world // tp, dist.get_rank() // tp
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    whole = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if sequence:  # (and activation checkpointing, as `hfllamarl plan` assumes: the blocks' collectives run again)
        model.gradient_checkpointing_enable()
        model.train()  # (checkpointing acts in training mode only)
    shard_model(model, "cpu", tp=tp, sequence_parallel=sequence, shard=shard)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    vocab = whole.config.vocab_size
    g = torch.Generator().manual_seed(7)
    rows = []
    for i in range(4 * dp):  # 4 sequences per data-parallel rank, prompts and completions of different lengths
        p, c = 3 + i % 4, 2 + (i * 3) % 5
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        rows.append(Rollout(prompt="", prompt_ids=ids[:p], completion_ids=ids[p:], behavior_logprobs=[0.0] * c,
                            versions=[0] * c, finish_reason="stop", completion_text=""))
    sampling = Sampling(temperature=0.7)
    mine = rows[4 * d:4 * d + 4]
    batch = pad_batch(mine, 0, torch.device("cpu"), multiple_of=tp if sequence else None)  # (sequence: split evenly)
    # vLLM's transforms (top-k, top-p, min-p, a repetition penalty) need the whole distribution: gathered, then as
    # without tensor parallelism
    transforms = Sampling(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.3)
    with torch.no_grad():
        got = completion_logprobs(model, batch, transforms)
        want = completion_logprobs(whole, pad_batch(mine, 0, torch.device("cpu")), transforms)
    real = (batch["mask"] > 0) & torch.isfinite(want)  # (a token outside top-k/top-p: -inf on both sides)
    transforms_error = float((got[real] - want[real]).abs().max())
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        transforms_error = float("inf")
    runs, mlp = [0], model.model.layers[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):  # (a module's hooks do not fire when checkpointing recomputes it: its forward does)
        runs[0] += 1
        return forward(*args, **kwargs)

    mlp.forward = counted
    widths = []  # the sequence length each decoder layer's output holds on this rank (1/tp of it: sequence parallel)
    hooks = [layer.register_forward_hook(lambda m, a, out: widths.append((out[0] if isinstance(out, tuple) else out)
                                                                          .shape[1]))
             for layer in model.model.layers]
    logprobs, entropy = completion_logprobs(model, batch, sampling, entropy=True)
    for h in hooks:
        h.remove()
    loss = -(logprobs * torch.linspace(0.5, 1.5, logprobs.numel()).reshape(logprobs.shape)).sum()
    loss.backward()  # (with activation checkpointing, the layers run again inside it: `runs` grows)
    reduce_partial_gradients(model)

    ref_lp, ref_ent = [], []
    for k in range(dp):
        b = pad_batch(rows[4 * k:4 * k + 4], 0, torch.device("cpu"))
        lp, ent = completion_logprobs(whole, b, sampling, entropy=True)
        part = -(lp * torch.linspace(0.5, 1.5, lp.numel()).reshape(lp.shape)).sum()
        (part / dp).backward()  # FSDP2 averages the data-parallel ranks' gradients
        ref_lp.append(lp.detach())
        ref_ent.append(ent)
    out = {"transforms_error": transforms_error,
           "logprob_error": float((logprobs.detach() - ref_lp[d]).abs().max()),
           "entropy_error": float((entropy - ref_ent[d]).abs().max()),
           "held_share": held / full_bytes, "stream_share": max(widths) / batch["input_ids"].shape[1],
           "layer_runs": runs[0]}
    errors, scale, tiled = {}, {}, []
    state = dict(whole.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors[name] = float((grad - state[name].grad).abs().max())
        scale[name] = float(state[name].grad.abs().max())
        local, box, owner = local_box(p, rank)
        full = p.full_tensor()
        part = full[tuple(slice(s, e) for s, e in box)]
        if not torch.equal(local.reshape(part.shape), part):
            tiled.append(f"{name}: rank {rank}'s part is not box {box}")
        volume = 1
        for s, e in box:
            volume *= e - s
        sent = torch.tensor([volume if owner else 0])
        dist.all_reduce(sent)
        if int(sent) != full.numel():
            tiled.append(f"{name}: the sending ranks' boxes cover {int(sent)} of {full.numel()} elements")
    out.update(optimizer_round_trip(path, model, whole))
    everyone = [None] * world
    dist.all_gather_object(everyone, {**out, "grad_errors": errors, "box_errors": tiled})
    if rank == 0:
        return {"ranks": everyone, "grad_scale": scale}
    return {}


def optimizer_round_trip(path: str, model, whole) -> dict:
    """One AdamW step on the sharded policy and on the whole model (the updated weights compared), then the sharded
    optimizer's state written with torch's distributed checkpoint, as a checkpoint does, and read into the same model
    sharded with FSDP2 alone (tensor parallelism off): its Adam moments compared with the whole model's."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from hfllamarl.runtime.weights.fsdp import shard_model

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(whole.parameters(), lr=1e-3)
    opt.step()
    ref_opt.step()
    state = dict(whole.named_parameters())
    updated = noise = 0.0  # Adam divides each gradient by its own size: where a gradient is rounding noise (below
    for n, p in model.named_parameters():  # 1e-5 of its tensor's largest), its weight may move by up to lr either way
        diff = (p.full_tensor() - state[n]).abs()
        clear = state[n].grad.abs() > 1e-5 * state[n].grad.abs().max()
        updated = max(updated, float(diff[clear].max()) if clear.any() else 0.0)
        noise = max(noise, float(diff[~clear].max()) if (~clear).any() else 0.0)
    where = [tempfile.mkdtemp(prefix="hfllamarl-tp-check-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=where[0])
    other = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    shard_model(other, "cpu", tp=1, shard=dist.get_world_size())  # (FSDP2 alone, over every rank)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    loaded = {"optimizer": get_optimizer_state_dict(other, other_opt)}
    dcp.load(loaded, checkpoint_id=where[0])
    set_optimizer_state_dict(other, other_opt, optim_state_dict=loaded["optimizer"])
    moments = 0.0
    for n, p in other.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            mine = other_opt.state[p][key]
            mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
            moments = max(moments, float((mine - ref_opt.state[state[n]][key]).abs().max()))
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(where[0], ignore_errors=True)
    return {"updated_error": updated, "noise_moved": noise, "moments_error": moments}


def main():
    tp = int(os.environ.get("TRAINER_TP", "2"))
    from hfllamarl.runtime.world import topology

    dist.init_process_group("gloo")

    class TrainerSide:  # what the trainer mesh reads of the job's topology
        trainer_tp, trainer_shard, role, device_type = tp, None, "trainer", "cpu"

    topology._TOPOLOGY = TrainerSide()
    results = {path: check(path, tp) for path in sys.argv[1:]}
    # sequence parallelism (the stream between the blocks split by sequence inside each group): the same checks
    results.update({f"{path} sequence": check(path, tp, sequence=True) for path in sys.argv[1:]})
    # hybrid sharding (trainer_fsdp_shard_size): FSDP2 over groups of 2 data-parallel ranks, replicated across the
    # groups, without tensor parallelism (a 2 x 2 mesh), and with it (replicas 2 x shard 1 x tensor parallel 2)
    for variant, (t, shard) in {"hybrid": (1, 2), "hybrid tp": (tp, 1)}.items():
        TrainerSide.trainer_tp, TrainerSide.trainer_shard = t, shard
        results.update({f"{path} {variant}": check(path, t, shard=shard) for path in sys.argv[1:]})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
