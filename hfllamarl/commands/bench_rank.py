"""One rank of `hfllamarl bench weight-sync` (started by `hfllamarl.commands.bench_weight_sync`, never by hand).

Trainer ranks build a Llama of the requested size and shard it with FSDP2; generator ranks
receive. For each backend, every rank passes a barrier, then the trainers send and the
generators receive the whole weight set; the time is the generator side's (the weights are
ready there). A thread samples this process's RSS during each phase. Results go to rank 0,
which prints them as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """Peak resident memory of this process while the context is open (sampled every 2 ms)."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


def llama_config_for(params: float):
    """A Llama config (hidden 768, 12 heads, vocab 32000) with enough layers for `params` parameters."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 768, 2048, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, -(-int(params - 2 * vocab * hidden) // per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)


def _dummy_engine(opts: dict, topo):
    """vLLM (random weights, no tokenizer) for the bench's model shape, tensor parallel over the generator ranks."""
    import tempfile

    from hfllamarl.runtime.generation.engine import build_engine

    directory = tempfile.mkdtemp(prefix="hfllamarl-bench-model-")
    llama_config_for(opts["params"]).save_pretrained(directory)
    return build_engine(directory, directory, dtype="float32", seed=0, max_model_len=256,
                        tensor_parallel_size=topo.replica_size, distributed=topo.replica_size > 1,
                        use_cpu=True, kv_cache_bytes=32 << 20, load_format="dummy", skip_tokenizer_init=True,
                        engine_id=f"bench-{topo.store_addr[1]}-{topo.replica}")


def emulate_links(gbps: float) -> None:
    """Give this rank a network link of `gbps` gigabits per second each way, as a NIC would: a transfer it posts
    (sent or received) is handed to the transport no earlier than its link has carried the ones posted before it.
    Each direction is a queue served by a thread of its own, so a rank sends and receives at once, as over a real
    link. On one machine the transfers otherwise share its CPU cores, and the time measures the cores rather than
    how the bytes are routed (bench only: the runtime never paces)."""
    import queue
    import threading

    from hfllamarl.runtime.loop import channels

    post, rate = channels._start, gbps * 1e9 / 8
    queues = {"send": queue.Queue(), "recv": queue.Queue()}

    def serve(q):
        free = 0.0
        while True:
            nbytes, start, box = q.get()
            begin = max(time.perf_counter(), free)
            time.sleep(max(0.0, begin - time.perf_counter()))
            free = begin + nbytes / rate
            try:
                box["wait"] = start()
            except BaseException as exc:  # handed to whoever waits
                box["error"] = exc
            box["posted"].set()

    for q in queues.values():
        threading.Thread(target=serve, args=(q,), daemon=True).start()

    def paced(topo, tensor, peer, what, kind, op):
        box = {"posted": threading.Event()}
        start = lambda: post(topo, tensor, peer, what, kind, op)  # noqa: E731
        queues[op].put((tensor.numel() * tensor.element_size(), start, box))

        def wait(_keep_alive=tensor):
            box["posted"].wait()
            if "error" in box:
                raise box["error"]
            box["wait"]()

        return wait

    channels._start = paced


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_replicas(opts: dict, topo, backend, model, results: dict) -> None:
    """nccl_ddma to the first R replicas, for each R of `opts["replicas"]`, interleaved repeat by repeat (so that
    every R meets the same load on a shared machine): this rank's time from a common barrier to the end of its part
    (a replica beyond R idles), its CPU seconds, and on the first repeat the digest of what it received."""
    from hfllamarl.runtime.loop.channels import bridge_barrier
    from hfllamarl.runtime.loop.weights_channel import crop, tensor_digest

    for rep in range(opts["repeats"]):
        for count in opts["replicas"]:
            bridge_barrier(topo, "bench")
            backend.targets = list(range(count))
            cpu, start = _cpu_seconds(), time.perf_counter()
            got = None
            if topo.role == "trainer":
                backend.send(model)
            elif topo.replica < count:
                got = list(backend.receive())
            entry = results.setdefault(f"replicas/{count}", {"seconds": [], "cpu": [], "digest": None})
            if topo.role == "trainer" or topo.replica < count:
                entry["seconds"].append(time.perf_counter() - start)
            entry["cpu"].append(_cpu_seconds() - cpu)
            if got is not None and rep == 0:
                entry["digest"] = tensor_digest((n, crop(t, backend.region(n, topo.rank))) for n, t in got)
            del got


def main(argv: list[str]) -> int:
    opts = json.loads(argv[0])
    from hfllamarl.runtime.loop.channels import Channel, ChannelKind, recv_tensor, send_tensor
    from hfllamarl.runtime.weights.fsdp import shard_model
    from hfllamarl.runtime.world.topology import init_topology
    from hfllamarl.runtime.loop.weights_channel import build_backend, crop, tensor_digest

    torch.set_num_threads(1)
    if opts.get("link_gbps"):
        emulate_links(opts["link_gbps"])
    topo = init_topology(opts["generators"], timeout_s=600, use_cpu=True, tensor_parallel_size=opts.get("tp"),
                         trainer_tp=opts.get("trainer_tp", 1))
    topo.trainer_shard = opts.get("trainer_shard")  # (hybrid sharding, as trainer_fsdp_shard_size sets it)
    topo.join_bridges()
    results: dict = {"rank": topo.rank, "role": topo.role}

    model = llm = None
    if topo.role == "generator":  # an engine of the same shape (random weights): its loaders say what each rank reads
        llm = _dummy_engine(opts, topo)
    if topo.role == "trainer":
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config_for(opts["params"]))
        results["params"] = sum(p.numel() for p in model.parameters())
        shard_model(model, "cpu")
        full = {n: t.full_tensor() for n, t in model.state_dict().items()}
        total_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        results["bytes"] = total_bytes
    # Plans are made once, before any timing; then the full copy used for checking is dropped.
    backends = {}
    for name in opts["backends"]:
        options = {"bucket_bytes": opts["bucket_mb"] << 20, "fan_out": opts.get("fan_out")} if name == "nccl_ddma" else {}
        backend = backends[name] = build_backend(name, topo, **options)
        if topo.role == "trainer":
            backend.setup_trainer(model)
            # What each generator rank must end up with: its part of every weight.
            results[f"expected/{name}"] = [tensor_digest((n, crop(t, backend.region(n, g))) for n, t in full.items()
                                                         if backend.receives(n, g))
                                           for g in topo.generator_ranks]
        else:
            from hfllamarl.runtime.generation.engine import loader_boxes

            backend.setup_generator(lambda weights: loader_boxes(llm, weights))
    if topo.role == "trainer":
        del full
    import gc

    gc.collect()
    sizes = Channel("sizes", ChannelKind.BROADCAST, [0], topo.generator_ranks, topo)
    received = sizes.communicate(results.get("bytes"))
    total_bytes = received if topo.role == "generator" else results["bytes"]
    from hfllamarl.runtime.loop.channels import bridge_barrier

    # The transport's bound: the model's bytes as one message from trainer rank 0 to each generator
    # rank (all at once), no copies: what any backend that moves the full model over one link costs.
    times = []
    bound_ranks = topo.replica_ranks(0)  # one replica: what one link per generator rank costs
    for _ in range(opts["repeats"]):
        buf = torch.empty(total_bytes, dtype=torch.uint8)
        bridge_barrier(topo, "bench")
        start = time.perf_counter()
        if topo.rank == 0:  # to every generator rank of one replica at once
            for wait in [send_tensor(topo, buf, dst, "bound") for dst in bound_ranks]:
                wait()
        elif topo.rank in bound_ranks:
            recv_tensor(topo, buf, 0, "bound")
        times.append(time.perf_counter() - start)
        del buf
    results["bound_s"] = sorted(times)[len(times) // 2]

    if opts.get("replicas"):
        time_replicas(opts, topo, backends["nccl_ddma"], model, results)
    for name in opts["backends"] if not opts.get("replicas") else []:
        backend = backends[name]
        times, digest = [], None
        with RssPeak() as mem:
            for rep in range(opts["repeats"]):
                bridge_barrier(topo, "bench")
                start = time.perf_counter()
                if topo.role == "trainer":
                    backend.send(model)
                    got = None
                else:
                    got = list(backend.receive())
                times.append(time.perf_counter() - start)
                if got is not None and rep == 0:
                    digest = tensor_digest((n, crop(t, backend.region(n, topo.rank))) for n, t in got)
                del got
        results[name] = {"seconds": sorted(times)[len(times) // 2], "peak_rss_mb": mem.peak / 2**20,
                         "growth_mb": (mem.peak - mem.start) / 2**20, "digest": digest,
                         "sent_bytes": getattr(backend, "sent_bytes", None) if topo.role == "trainer" else None}

    gathered = Channel("results", ChannelKind.GATHER, list(range(topo.world_size)), [0], topo).communicate(results)
    topo.liveness.mark_done()
    if topo.rank == 0:
        print("BENCH_RESULT " + json.dumps(gathered), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
