"""Run under torchrun with T trainer ranks + G generator ranks (one vLLM engine, tensor parallel over G):
after one weight sync, every generator rank's engine holds exactly what vLLM's own loader makes of the
trainer's weights written to disk (the independent check), and vLLM's greedy output follows them.

    GENERATORS=G torchrun --nproc_per_node T+G tests/scripts/weight_sync_check.py MODEL_DIR [BACKEND [BUCKET_BYTES]]

Environment: TRAINER_TP (the trainer ranks as FSDP2 x tensor parallelism), TRAINER_DTYPE / TRANSFER_DTYPE (a bf16 trainer feeding an fp32 generator), DIE=<rank> (that
rank exits in the middle of the transfer), SABOTAGE=kv_split (the generator asks for k/v rows as if KV
heads were split over its ranks: the independent check must catch it).
"""

import json
import os
import sys

import torch

from hfllamarl.runtime.loop.channels import Channel, ChannelKind
from hfllamarl.runtime.loop.controller import fail
from hfllamarl.runtime.generation.engine import build_engine, loader_boxes, verify_against_disk
from hfllamarl.runtime.loop.executor import Executor
from hfllamarl.runtime.weights.fsdp import full_state_dict, shard_model
from hfllamarl.runtime.weights.hf_export import export_weights
from hfllamarl.runtime.world.topology import init_topology
from hfllamarl.runtime.loop.weights_channel import WeightsChannel, build_backend

PROMPT = [7, 14, 5, 18]  # "3+1="


class Offer(Executor):  # the trainer side of the weights channel: offers version 1 once
    def __init__(self, model):
        self.model = model

    def get_output(self, name):
        return self.model, 1


class Receiver(Executor):  # the generator side: loads what arrives
    def __init__(self, llm):
        self.llm, self.version = llm, 0

    def put_input(self, name, value):
        from hfllamarl.runtime.generation.engine import load_weights

        self.version, weights = value
        load_weights(self.llm, weights)


def die_mid_transfer():
    import hfllamarl.plugins.weight_sync.ddma as ddma_module

    def dying(real):
        calls = []

        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                os._exit(9)
            return real(*args, **kwargs)

        return wrapper

    ddma_module.send_tensor = dying(ddma_module.send_tensor)
    ddma_module.DDMAWeightSync._irecv = dying(ddma_module.DDMAWeightSync._irecv)


def kv_split(boxes: dict, tp_rank: int, tp_size: int) -> dict:
    """What a sync that assumes KV heads are split over the ranks asks for (wrong when they are replicated)."""
    out = dict(boxes)
    for name, box in boxes.items():
        if box is not None and name.endswith(("k_proj.weight", "v_proj.weight")):
            rows = box[0][1] - box[0][0]
            per = rows // tp_size
            out[name] = ((box[0][0] + tp_rank * per, box[0][0] + (tp_rank + 1) * per),) + tuple(box[1:])
    return out


JOB: dict = {}  # this process's topology, once it has one


def main():
    model_dir = sys.argv[1]
    backend_name = sys.argv[2] if len(sys.argv) > 2 else "broadcast"
    generators = int(os.environ.get("GENERATORS", "1"))
    topo = JOB["topology"] = init_topology(num_generator_processes=generators, timeout_s=120, use_cpu=True,
                                           trainer_tp=int(os.environ.get("TRAINER_TP", "1")))
    topo.bridge("object"), topo.bridge("tensor")
    options = {"bucket_bytes": int(sys.argv[3])} if len(sys.argv) > 3 else {}
    if int(os.environ.get("DIE", "-1")) == topo.rank:
        die_mid_transfer()
    wire = os.environ.get("TRANSFER_DTYPE")
    trainer_dtype = getattr(torch, os.environ.get("TRAINER_DTYPE", "float32"))
    if wire:
        options["transfer_dtype"] = wire
    backend = build_backend(backend_name, topo, **options)
    channel = WeightsChannel(backend, topo)
    report = Channel("report", ChannelKind.GATHER, topo.generator_ranks, [0], topo)
    export_dir = os.path.join(os.environ.get("CHECK_DIR", "/tmp"), f"hfllamarl-sync-check-{os.environ['MASTER_PORT']}")

    if topo.role == "trainer":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=trainer_dtype)
        torch.manual_seed(123)
        with torch.no_grad():  # new weights, as if the trainer had taken a large step
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        shard_model(model, "cpu")
        backend.setup_trainer(model)
        # What the generator's engine must end up with, written for vLLM's own loader to read.
        export_weights(model, export_dir, write=topo.rank == 0, cast=backend.wire_dtype)
        channel.communicate_with(Offer(model))
        sent = [None] * topo.num_trainers  # what each trainer rank sent (nccl_ddma counts it)
        torch.distributed.all_gather_object(sent, getattr(backend, "sent_bytes", None))
        full = full_state_dict(model)
        got = report.communicate(None)
        if topo.rank == 0:
            gen = got[0]
            reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            reference.load_state_dict({n: t.float() for n, t in full.items()})
            hf_greedy = reference.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
            result = {
                "independent_check": [r["mismatches"] for r in got],
                "same_output_on_every_generator_rank": all(r["after"] == gen["after"] for r in got),
                "greedy_changed": gen["before"] != gen["after"],
                "greedy_matches_hf": gen["after"] == hf_greedy,
                "version": gen["version"],
                "trainer_ranks": topo.num_trainers,
                "sent_bytes": sent,
            }
            print("RESULT " + json.dumps(result), flush=True)
            import shutil

            shutil.rmtree(export_dir, ignore_errors=True)
    else:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = build_engine(model_dir, model_dir, dtype=wire or "float32", seed=0, max_model_len=128,
                           tensor_parallel_size=generators, distributed=generators > 1, use_cpu=True,
                           engine_id=os.environ["MASTER_PORT"])
        boxes = lambda weights: loader_boxes(llm, weights)  # noqa: E731
        if os.environ.get("SABOTAGE") == "kv_split":
            boxes = lambda weights: kv_split(loader_boxes(llm, weights), topo.local_rank, generators)  # noqa: E731
        backend.setup_generator(boxes)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

        def run():
            out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], greedy, use_tqdm=False)
            return list(out[0].outputs[0].token_ids)

        before = run()
        receiver = Receiver(llm)
        channel.communicate_with(receiver)
        after = run()
        mismatches = verify_against_disk(llm, export_dir)  # vLLM's own loader, the same weights from disk
        report.communicate({"mismatches": mismatches, "before": before, "after": after, "version": receiver.version})


if __name__ == "__main__":  # vLLM may start spawn workers that import this file
    try:
        main()
    except Exception as exc:
        if JOB.get("topology") is None:
            raise
        raise fail(JOB["topology"], exc)  # as the controller does: name the rank at fault
    JOB["topology"].liveness.mark_done()
