"""Run under torchrun with T trainer ranks + 1 generator rank: after one weight sync the generator's
weights equal the trainer's full weights bitwise, and vLLM's greedy output follows them.

    torchrun --nproc_per_node 2|3 tests/scripts/weight_sync_check.py MODEL_DIR [BACKEND [BUCKET_BYTES]]
"""

import json
import os
import sys

import torch

from hfllamarl.channels import Channel, ChannelKind
from hfllamarl.controller import _name_lost_ranks
from hfllamarl.fsdp import full_state_dict, shard_model
from hfllamarl.generator import GeneratorExecutor, GeneratorSpec, tensor_digest
from hfllamarl.topology import init_topology
from hfllamarl.weight_sync import WeightsChannel, build_backend, crop


def main():
    global topo, backend, channel, report, model_dir, prompt, generators, wire, trainer_dtype
    model_dir = sys.argv[1]
    backend_name = sys.argv[2] if len(sys.argv) > 2 else "broadcast"
    generators = int(os.environ.get("GENERATORS", "1"))  # > 1: one engine, tensor parallel over them
    topo = init_topology(num_generator_processes=generators, timeout_s=120, use_cpu=True)
    topo.bridge("object"), topo.bridge("tensor")
    topo.start_heartbeat()
    options = {"bucket_bytes": int(sys.argv[3])} if len(sys.argv) > 3 else {}
    # DIE=<rank>: that rank exits in the middle of the transfer (after its 3rd message), to check that
    # every other rank fails naming it instead of hanging.
    DIE = int(os.environ.get("DIE", "-1"))
    if DIE == topo.rank:
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

    # TRAINER_DTYPE=bfloat16 TRANSFER_DTYPE=float32: a bf16 trainer, an fp32 generator; weights are
    # converted on the trainer and travel (and land) in fp32.
    wire = os.environ.get("TRANSFER_DTYPE")
    trainer_dtype = getattr(torch, os.environ.get("TRAINER_DTYPE", "float32"))
    if wire:
        options["transfer_dtype"] = wire
    backend = build_backend(backend_name, topo, **options)
    channel = WeightsChannel(backend, topo)
    prompt = [7, 14, 5, 18]  # "3+1="
    report = Channel("report", ChannelKind.GATHER, topo.generator_ranks, [0], topo)


    class Offer:  # the trainer side of the weights channel: offers version 1 once
        def __init__(self, model):
            self.model = model

        def get_output(self, name):
            return self.model, 1


    def run_role():
        if topo.role == "trainer":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=trainer_dtype)
            torch.manual_seed(123)
            with torch.no_grad():  # new weights, as if the trainer had taken a large step
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
            shard_model(model, "cpu")
            backend.setup_trainer(model)
            channel.communicate_with(Offer(model))
            full = full_state_dict(model)
            got = report.communicate(None)
            if topo.rank == 0:
                gen = got[0]
                reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                reference.load_state_dict({n: t.float() for n, t in full.items()})
                hf_greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)[0, len(prompt):].tolist()
                cast = {n: t.to(backend.wire_dtype(t.dtype)) for n, t in full.items()}
                expected = [tensor_digest((n, crop(t, backend.region(n, g))) for n, t in cast.items())
                            for g in topo.generator_ranks]
                result = {
                    "bitwise_equal": [r["digest"] for r in got] == expected,
                    "same_output_on_every_generator_rank": all(r["after"] == gen["after"] for r in got),
                    "greedy_changed": gen["before"] != gen["after"],
                    "greedy_matches_hf": gen["after"] == hf_greedy,
                    "version": gen["version"],
                    "trainer_ranks": topo.num_trainers,
                }
                print("RESULT " + json.dumps(result), flush=True)
        else:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            spec = GeneratorSpec(model_path=model_dir, tokenizer_path=model_dir, dataset=None, num_batches=0,
                                 prompts_per_batch=1, num_generations=1, max_completion_length=8, max_model_len=128,
                                 dtype=wire or "float32", weights_digest=True, tensor_parallel_size=generators)
            gen = GeneratorExecutor(spec, topo)
            gen.backend = backend
            gen.llm = gen._build_engine()
            backend.setup_generator()
            greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

            def run():
                return list(gen.llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0].token_ids)

            before = run()
            channel.communicate_with(gen)
            after = run()
            report.communicate({"digest": gen.weights_digest, "before": before, "after": after, "version": gen.version})


    try:
        run_role()
    except Exception as exc:
        _name_lost_ranks(topo, exc)  # as the controller does: name the rank that died first
        raise
    topo.mark_done()


if __name__ == "__main__":  # vLLM may start spawn workers that import this file
    main()
