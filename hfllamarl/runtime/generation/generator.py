"""The generator executor: an embedded vLLM engine (`hfllamarl.runtime.generation.engine`) that samples rollouts for the trainer.

Each tick it samples one
generation batch with the newest weights it holds and records, for every sampled token, the
behaviour log-prob (under the sampling transforms, `hfllamarl.runtime.loop.sampling`, as the trainer computes pi) and
the policy version.
With partial rollouts a completion samples at most `partial_rollout_tokens` per tick; the
unfinished ones are carried and continued at the next tick under the weights of that tick.
New weights are loaded in place with vLLM's `reload_weights`, streaming from the weight sync (a LoRA policy's
adapters alone, under lora_sync='adapter', go into vLLM's LoRA support instead: `AdapterSlot`); with
`verify_weight_sync` every sync is then checked against vLLM's own loader reading the same weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hfllamarl.runtime.weights import checkpoint
from hfllamarl.runtime.weights.checkpoint import load_generator_side
from hfllamarl.runtime.data.episodes import completion
from hfllamarl.runtime.world import startup
from hfllamarl.runtime.world.collector import collector_paused
from hfllamarl.runtime.generation.engine import WeightSyncMismatch, build_engine, load_weights, loader_boxes, verify_against_disk
from hfllamarl.runtime.weights.lora_adapters import engine_options
from hfllamarl.runtime.world.core_lending import open_board
from hfllamarl.runtime.loop.executor import Executor, wait_for_startup
from hfllamarl.runtime.data.prompts import PromptEncoder, group_batch_rows
from hfllamarl.runtime.loop.rollout import ROLLOUTS, UNFINISHED, InFlightBatch, Rollout, RolloutGroup
from hfllamarl.runtime.loop.sampling import Sampling
from hfllamarl.runtime.loop.schedule import Schedule, replica_share
from hfllamarl.runtime.world.topology import Topology
from hfllamarl.runtime.loop.weights_channel import (DATA_OFFSET, HEAD_START, POLICY_WEIGHTS, REPLICAS, build_backend,
                                                    verify_dir)

logger = logging.getLogger(__name__)



@dataclass
class GeneratorSpec:
    """Everything a generator rank needs; picklable, so a child process can receive it."""

    model_path: str
    tokenizer_path: str
    dataset: Any  # a `datasets.Dataset`, or the path of one saved with `save_to_disk`
    schedule: Schedule
    prompts_per_batch: int
    num_generations: int
    max_completion_length: int
    max_model_len: int
    seed: int = 0
    shuffle: bool = True
    sampling: Sampling = field(default_factory=Sampling)  # temperature, top-p/k, min-p, penalties: both sides alike
    generation_kwargs: dict = field(default_factory=dict)  # vLLM SamplingParams that leave the distribution alone
    chat_template_kwargs: dict = field(default_factory=dict)
    dtype: str = "auto"
    enforce_eager: bool = True
    quantization: str | None = None  # vLLM online quantization of the generator ("fp8"); the trainer is unaffected
    model_impl: str = "vllm"  # vLLM's model implementation: its own ("vllm") or transformers' ("transformers")
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    weight_sync_backend: str = "broadcast"
    weight_sync_options: dict = field(default_factory=dict)
    verify_weight_sync: bool = False  # check every sync against vLLM's loader reading the trainer's export
    output_dir: str = ""
    save_steps: int = 0  # checkpoint after every `save_steps` trainer steps (0: never)
    save_total_limit: int | None = None
    partial_rollout_tokens: int | None = None  # per-tick token budget of one completion (None: no partial rollouts)
    initial_version: int = 0  # the policy version of `model_path` (> 0 when resuming from a checkpoint)
    resume_dir: str | None = None
    unsampled: list = field(default_factory=list)  # a resume's batches to sample before its first tick
    startup_timeout_s: float = 240.0  # how long the ranks wait for each other's start-up (vllm_server_timeout)
    reward_models: list = field(default_factory=list)  # `RewardModel`s scored here as each batch finishes
    eval_dataset: Any = None  # evaluation during training: a `datasets.Dataset` (or a saved one's path)
    eval_every: int = 0  # evaluate every policy version that is a multiple of this (0: never)
    eval_on_start: bool = False  # also the starting policy (version 0)
    eval_delay: int = 0  # no evaluation of a version below this (eval_delay), but for eval_on_start's
    num_generations_eval: int = 1
    agent: Any = None  # tools / environments / rollout_func: `hfllamarl.runtime.agents.multi_turn.AgentSpec`
    lora_adapter: dict | None = None  # lora_sync='adapter': {"config": adapter_config.json, "rank": max_lora_rank,
    # "start": a resumed run's adapter directory or None}; the engine keeps the base weights and loads adapters
    replica_group: int = 0  # trainer_replica_groups: which share of each batch this job's trainer trains
    replica_groups: int = 1
    shared_generators: bool = False  # the groups share group 0's generators: they sample every group's share
    bootstrapped: bool = False  # the trainer may sample the first batches (`runtime.training.bootstrap`): the
    # tick to start at is read past the start-up rendezvous (its weights come with that tick's sync)

    @property
    def batch_prompts(self) -> int:
        """Prompts this job's generators sample a batch: its share, or with shared generators every group's."""
        return self.prompts_per_batch * (self.replica_groups if self.shared_generators else 1)


class GeneratorExecutor(Executor):
    role = "generator"

    def __init__(self, spec: GeneratorSpec, topology: Topology):
        self.spec, self.topology = spec, topology
        self.version = spec.initial_version
        self.tick = -1
        self.pending: list[RolloutGroup] = []  # finished batches, sent at the next rollouts channel
        self.in_flight: list[InFlightBatch] = []  # started batches with completions still carried
        self.head_start_rows: dict | None = None  # this tick's first tokens from the trainer (`training.head_start`)
        self.weight_load_seconds = 0.0
        self.cpu_mark = time.process_time()  # (this process's CPU time when its last tick closed)
        self.eval_dataset = None  # `init` loads spec.eval_dataset
        self.data_offset = 0  # trainer replica groups: the global batch of this job's batch 0 (the weights header)
        # The newest version evaluated. A resume evaluates the checkpoint's own version when it is due (an
        # uninterrupted run evaluates it at the tick the resume starts with, after the checkpoint was written).
        self.evaluated = spec.initial_version - 1 if spec.initial_version or spec.eval_on_start else 0
        self.backend = None  # the weight-sync backend; `run_job` sets the one its channel uses
        self.core_board = None  # single-process CPU job: where this child says it has finished a tick
        self.adapters = None  # lora_sync='adapter': the engine's live adapter (`AdapterSlot`)
        self.agent = None  # `MultiTurn`, when the job has tools, environments or a rollout_func
        self.live = list(range(getattr(topology, "num_replicas", 1)))  # live replicas, told by the trainer each tick
        self.weights_broken = False  # the last weight sync lost its relay source part-way (re-sent before sampling)

    # ------------------------------------------------------------------ set-up
    def init(self) -> None:
        spec = self.spec
        for name in ("started", "imported", "job"):  # (a launcher's generator rank: its process began its work)
            startup.mark(name)
        with collector_paused():  # (imports: datasets, transformers' tokenizers, vLLM)
            self.dataset, self.eval_dataset = _loaded(spec.dataset), _loaded(spec.eval_dataset)
            from transformers import AutoTokenizer

            self.encoder = PromptEncoder(AutoTokenizer.from_pretrained(spec.tokenizer_path), spec.chat_template_kwargs)
            self.llm = self._build_engine()
            if spec.lora_adapter is not None:
                from hfllamarl.runtime.weights.lora_adapters import AdapterSlot

                self.adapters = AdapterSlot(self.llm, spec.lora_adapter["config"], spec.lora_adapter.get("start"),
                                            spec.initial_version)
            startup.mark("engine")
        self.core_board = open_board(self.topology.num_generators) if self.topology.mode == "child" else None
        self.slot = self.topology.rank - self.topology.num_trainers  # this generator's place on the core board
        startup.mark("ready")
        startup.publish(self.topology)  # (the first trainer rank reads it past the wait below)
        wait_for_startup(self.topology, spec.startup_timeout_s)
        if spec.bootstrapped:  # the trainer sampled the first batches itself: this generator starts where it stopped
            self.first_tick = startup.handover_tick(self.topology)
        if self.backend is None:
            self.backend = build_backend(spec.weight_sync_backend, self.topology, **spec.weight_sync_options)
        # Adapters are no weights of the engine's model: every rank receives them whole (vLLM narrows them itself).
        self.backend.setup_generator(None if self.adapters is not None
                                     else lambda weights: loader_boxes(self.llm, weights))
        if spec.resume_dir:
            load_generator_side(self, spec.resume_dir)
        if self.topology.local_rank == 0:  # the rank that sends the rollouts scores them
            for model in spec.reward_models:
                model.load(self.topology.device_type)
        if spec.agent is not None:  # multi-turn ticks (tools run on the engine's first rank; every rank builds this)
            from hfllamarl.runtime.agents.multi_turn import MultiTurn

            self.agent = MultiTurn(spec.agent, self)
        if spec.unsampled:
            self._sample_unsampled(spec.unsampled)

    def _sample_unsampled(self, batches: list[int]) -> None:
        """Resumed from the last step of a shorter run (`checkpoint.unsampled_batches`): sample the batches an
        uninterrupted run would have in flight, under the checkpoint's policy, to the end (as many rounds as a batch
        takes, the same on every rank of the engine); they go to the trainer ranks with the first tick's rollouts."""
        for batch in list(batches) + [None] * (self.spec.schedule.generation_ticks - 1):
            if self.agent is not None:
                self.pending += self.agent.tick(batch)
            elif batch is not None or self.in_flight:
                self.pending += self.generate_tick(batch)

    def _build_engine(self):
        spec, topo = self.spec, self.topology
        # Each replica samples from a random stream of its own (the same seed would draw the same numbers on every
        # replica, at the same place of each batch); a resume with the same replicas draws the same streams again.
        return build_engine(spec.model_path, spec.tokenizer_path, dtype=spec.dtype, seed=spec.seed + topo.replica,
                            max_model_len=spec.max_model_len, tensor_parallel_size=spec.tensor_parallel_size,
                            distributed=topo.replica_size > 1, use_cpu=topo.use_cpu,
                            engine_id=(topo.engine_id(topo.replica)
                                       if topo.replica_size > 1 else ""),  # names its shared memory (engine.py)
                            enforce_eager=spec.enforce_eager, quantization=spec.quantization,
                            kv_cache_bytes=spec.kv_cache_bytes, gpu_memory_utilization=spec.gpu_memory_utilization,
                            model_impl=spec.model_impl,
                            **(engine_options(spec.lora_adapter["rank"]) if spec.lora_adapter is not None else {}))

    def sample(self, prompts: list, params):
        """The engine's `generate` for token prompts, under the live adapter when the policy's adapters sync alone."""
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False,
                                 lora_request=self.adapters.request if self.adapters is not None else None)

    @property
    def _engine_text(self) -> bool:
        """Whether a completion's text is the engine's own (generation_kwargs set how vLLM writes it:
        `skip_special_tokens`, `spaces_between_special_tokens`) rather than its ids decoded as TRL decodes them."""
        extra = self.spec.generation_kwargs or {}
        return extra.get("detokenize", True) is not False and any(
            k in extra for k in ("skip_special_tokens", "spaces_between_special_tokens"))

    def _sampling_params(self, n: int, max_tokens: int):
        from vllm import SamplingParams

        spec = self.spec
        extra = spec.generation_kwargs or {}
        kw = dict(n=n, max_tokens=max_tokens, logprobs=0,  # the sampled token's log-prob at every position
                  # The completion's text is decoded from its ids when it ends (`_extend`, as TRL decodes them),
                  # so the engine detokenizes only to find stop strings or to write the text as generation_kwargs
                  # ask; and it keeps the log-probs as flat lists (`FlatLogprobs`), not one dict of objects per
                  # token, where this vLLM has them.
                  detokenize=bool(extra.get("stop")) or self._engine_text, **spec.sampling.vllm_kwargs())
        if "flat_logprobs" in _fields(SamplingParams):
            kw["flat_logprobs"] = True
        kw.update(extra)  # (the user's generation_kwargs, `detokenize` included, win)
        return SamplingParams(**kw)

    # ------------------------------------------------------------------ channels
    def put_input(self, channel: str, value) -> None:
        if channel == REPLICAS:  # the live replicas this tick: which share of a batch is this replica's
            self.live = list(value)
            return None
        if channel == DATA_OFFSET:  # trainer replica groups: the batches this job samples from now on
            self.data_offset = int(value)
            return None
        if channel == HEAD_START:  # the trainer sampled the first tokens of this tick's batch
            self.head_start_rows = value
            return None
        if channel != POLICY_WEIGHTS:
            return super().put_input(channel, value)
        version, weights = value
        start = time.perf_counter()
        if self.adapters is not None:
            self.adapters.load(version, weights)
        else:
            load_weights(self.llm, weights)
        if self.spec.verify_weight_sync:
            directory = verify_dir(self.spec.output_dir, version)
            if self.adapters is not None:  # the adapter applied by the engine against the merged layers, loaded
                bad = self.adapters.verify(directory, self.spec.model_path,
                                           tolerance=1e-4 if self.spec.dtype in ("float32", "auto") else 5e-2)
            else:
                bad = verify_against_disk(self.llm, directory)
            if bad:
                raise WeightSyncMismatch(
                    f"verify_weight_sync: after the weight sync of policy version {version}, "
                    f"{self.topology.describe(self.topology.rank)} "
                    + ("computes, under the adapters it received, other log-probs than under the merged layers "
                       if self.adapters is not None else "holds parameters that differ from ")
                    + f"what vLLM's own loader makes of the same weights ({directory}): " + "; ".join(bad[:5])
                    + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""))
        self.version = version
        self.weight_load_seconds = time.perf_counter() - start  # (the sync's load into the engine; with
        # verify_weight_sync, its check too)

    def close(self) -> None:
        if self.adapters is not None:
            self.adapters.close()

    def get_output(self, channel: str):
        if channel != ROLLOUTS:
            return super().get_output(channel)
        # Only the first rank of the engine sends: with tensor parallelism every rank holds the same output.
        out, self.pending = (self.pending if self.topology.local_rank == 0 else []), []
        return out

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_due(self) -> bool:
        schedule = self.spec.schedule
        return self.tick < schedule.num_ticks and checkpoint.due(schedule.step_done(self.tick), self.spec.save_steps,
                                                                 schedule.num_steps)  # (not in evaluation ticks)

    def save_checkpoint(self) -> None:
        step = self.spec.schedule.step_done(self.tick)
        checkpoint.save_generator_side(self, checkpoint.partial_dir(self.spec.output_dir, step))
        checkpoint.commit(self.topology, self.spec.output_dir, step, self.tick, self.spec.save_total_limit)

    # ------------------------------------------------------------------ work
    def step(self) -> None:
        batch = self.spec.schedule.generator_batch(self.tick)
        if self.agent is not None:  # multi-turn: its tick generates, calls tools, evaluates when due
            self.pending = self.agent.tick(batch)
        else:
            if batch is not None or self.in_flight:
                self.pending = self.generate_tick(batch)
            if self.eval_due():
                self.pending += self.evaluate()
        if self.core_board is not None:  # idle until the next tick's channels: the trainer may use these cores
            self.core_board.finished(self.slot, self.tick)

    def generate_tick(self, batch_index: int | None) -> list[RolloutGroup]:
        """One tick of generation: continue every carried completion and start batch `batch_index`.

        Each completion samples at most `partial_rollout_tokens` tokens per tick with the weights of
        this tick; one that neither stops nor reaches `max_completion_length` is carried to the next
        tick. Returns the groups of the batches that finished this tick, oldest batch first.
        """
        spec = self.spec
        length = spec.max_completion_length
        budget = min(spec.partial_rollout_tokens or length, length)
        carried = [r for flight in self.in_flight for r in flight.unfinished()]
        asked = [min(budget, length - len(r.completion_ids)) for r in carried]
        requests = [(r.prompt_ids + r.completion_ids, self._sampling_params(1, n)) for r, n in zip(carried, asked)]
        new, head = None, None
        if batch_index is not None:  # this replica's share of the batch's prompts (`schedule.replica_share`)
            indices, rows, positions = self.batch_prompts(batch_index)
            new = (indices, rows, [self.encoder.encode(row["prompt"]) for row in rows])
            head = self._take_head_start(batch_index, indices)
            if head is None:
                requests += [(ids, self._sampling_params(spec.num_generations, budget)) for ids in new[2]]
            else:  # each completion goes on from the trainer's first tokens, one request each
                requests += [(ids + first, self._sampling_params(1, budget - len(first)))
                             for ids, streams in zip(new[2], head) for first, _, why in streams if why == UNFINISHED]
        start = time.perf_counter()
        outputs = self.sample([ids for ids, _ in requests], [params for _, params in requests]) if requests else []
        seconds = time.perf_counter() - start
        tokens = 0
        for r, n, out in zip(carried, asked, outputs[:len(carried)]):
            tokens += self._extend(r, out.outputs[0], n)
        if new is not None:
            groups, results = [], iter(outputs[len(carried):])
            for p, (index, row, ids) in enumerate(zip(*new)):
                columns = {k: v for k, v in row.items() if k != "prompt"}
                if head is None:
                    streams = [(([], [], UNFINISHED), comp) for comp in next(results).outputs]
                else:
                    streams = [(first, next(results).outputs[0] if first[2] == UNFINISHED else None) for first in head[p]]
                group = []
                for (first, logprobs, why), comp in streams:
                    r = Rollout(prompt=row["prompt"], prompt_ids=list(ids), completion_ids=list(first),
                                behavior_logprobs=list(logprobs), versions=[self.version] * len(first),
                                finish_reason=UNFINISHED, completion_text="", columns=columns, row_index=int(index),
                                segments=0)
                    if comp is not None:
                        tokens += self._extend(r, comp, budget - len(first))
                    else:  # it ended within the trainer's head start
                        r.segments, r.finish_reason = 1, why
                        r.completion_text = self.encoder.tokenizer.decode(r.completion_ids, skip_special_tokens=True)
                    group.append(r)
                groups.append(group)
            self.in_flight.append(InFlightBatch(batch_index, self.version, groups, positions, self.data_offset))
        return self.close_tick(seconds, tokens)

    def _take_head_start(self, batch_index: int, indices: list[int]) -> list[list[tuple]] | None:
        """The trainer's first tokens of batch `batch_index` (`runtime.training.head_start`), per prompt its
        `num_generations` streams (tokens, behaviour log-probs, "stop" / "length" / unfinished), when they were
        sampled for exactly these prompts with the version this engine holds; else None (sampled from scratch)."""
        head, self.head_start_rows = self.head_start_rows, None
        if head is None:
            return None
        n = self.spec.num_generations
        if (head.get("batch"), head.get("version"), head.get("indices")) != (batch_index, self.version, list(indices)) \
                or len(head.get("rows", ())) != n * len(indices):
            logger.warning("the trainer's head start of batch %s (policy version %s) is not this tick's batch %d at "
                           "version %d: sampled from scratch", head.get("batch"), head.get("version"), batch_index,
                           self.version)
            return None
        rows = [(list(map(int, first)), list(map(float, logprobs)), str(why)) for first, logprobs, why in head["rows"]]
        return [rows[p * n:(p + 1) * n] for p in range(len(indices))]

    def batch_prompts(self, batch_index: int) -> tuple[list[int], list[dict], list[int]]:
        """This replica's share of generation batch `batch_index` (`schedule.replica_share`): the dataset indices,
        the rows, and their positions in the batch."""
        spec = self.spec
        indices = self._rows(batch_index)
        positions = replica_share(spec.batch_prompts, self.live, batch_index).get(self.topology.replica, [])
        indices = [indices[p] for p in positions]
        return indices, [self.dataset[i] for i in indices], positions

    def _rows(self, batch_index: int) -> list[int]:
        """The dataset rows of this job's batch `batch_index` (with trainer replica groups: its group's share of
        global batch `batch_index + data_offset`)."""
        spec = self.spec
        if spec.shared_generators:  # (every group's share: the whole global batch, shares in group order)
            return group_batch_rows(len(self.dataset), spec.batch_prompts, batch_index + self.data_offset, spec.seed,
                                    spec.shuffle)
        return group_batch_rows(len(self.dataset), spec.prompts_per_batch, batch_index + self.data_offset, spec.seed,
                                spec.shuffle, spec.replica_group, spec.replica_groups)

    def close_tick(self, seconds: float, tokens: int) -> list[RolloutGroup]:
        """The groups of the batches whose rollouts all finished (oldest first), scored by the reward models; the
        others stay in flight. `seconds`, `tokens`: this tick's generation time and sampled tokens."""
        finished = [f for f in self.in_flight if not f.unfinished()]
        self.in_flight = [f for f in self.in_flight if f.unfinished()]
        now = time.process_time()
        cpu, self.cpu_mark = now - self.cpu_mark, now
        groups = [RolloutGroup(group, f.batch_index, f.policy_version, seconds, tokens, position=position,
                               replica=self.topology.replica, weights_load_seconds=self.weight_load_seconds,
                               cpu_seconds=cpu, data_offset=f.data_offset)
                  for f in finished for group, position in zip(f.groups, f.positions or range(len(f.groups)))]
        self._score_with_models(groups)
        return groups

    def generate_makeup(self, work: dict[int, list[int]]) -> list[RolloutGroup]:
        """Generate now, whole, the prompts of a lost replica that the trainer ranks never received
        (generator_failure="continue"): `work` maps a batch index to positions of it. Returns their groups,
        each with its position, sampled under the weights held now (fresher than the batch's own)."""
        spec, length = self.spec, self.spec.max_completion_length
        jobs = []  # (batch, position, dataset row index)
        for batch, positions in sorted(work.items()):
            indices = self._rows(batch)
            jobs += [(batch, p, indices[p]) for p in positions]
        rows = [self.dataset[i] for _, _, i in jobs]
        prompts = [self.encoder.encode(row["prompt"]) for row in rows]
        start = time.perf_counter()
        outputs = self.sample(prompts, self._sampling_params(spec.num_generations, length))
        seconds, tokens, groups = time.perf_counter() - start, 0, []
        for (batch, position, index), row, ids, out in zip(jobs, rows, prompts, outputs):
            group = []
            for comp in out.outputs:
                r = Rollout(prompt=row["prompt"], prompt_ids=list(ids), completion_ids=[], behavior_logprobs=[],
                            versions=[], finish_reason=UNFINISHED, completion_text="",
                            columns={k: v for k, v in row.items() if k != "prompt"}, row_index=int(index), segments=0)
                tokens += self._extend(r, comp, length)
                group.append(r)
            groups.append(RolloutGroup(group, batch, self.version, seconds, 0, position=position,
                                       replica=self.topology.replica))
        for g in groups:
            g.batch_tokens = tokens
        self._score_with_models(groups)
        return groups

    def eval_due(self) -> bool:
        """An evaluation of the policy version held now: one `Schedule.evaluates` (or the start, with
        `eval_on_start`) not evaluated yet, while its results still reach the trainer (the loop runs the ticks that
        carry the last one: `Schedule.total_ticks`)."""
        spec = self.spec
        due = spec.schedule.evaluates(self.version) or (self.version == 0 and spec.eval_on_start)
        return (self.eval_dataset is not None and spec.eval_every > 0 and self.version > self.evaluated and due
                and spec.schedule.results_arrive(self.tick)
                and self.topology.replica == self.live[0])  # one replica evaluates: the first live one

    def evaluate(self) -> list[RolloutGroup]:
        """`num_generations_eval` completions of every eval prompt under the weights held now, in one call
        between this tick's batch and the next; they go to the trainer ranks with the tick's rollouts."""
        spec = self.spec
        self.evaluated = self.version
        rows = [self.eval_dataset[i] for i in range(len(self.eval_dataset))]
        prompts = [self.encoder.encode(row["prompt"]) for row in rows]
        params = self._sampling_params(spec.num_generations_eval, spec.max_completion_length)
        start = time.perf_counter()
        outputs = self.sample(prompts, params)
        seconds = time.perf_counter() - start
        groups, tokens = [], 0
        for index, (row, ids, out) in enumerate(zip(rows, prompts, outputs)):
            columns = {k: v for k, v in row.items() if k != "prompt"}
            group = []
            for comp in out.outputs:
                r = Rollout(prompt=row["prompt"], prompt_ids=list(ids), completion_ids=[], behavior_logprobs=[],
                            versions=[], finish_reason=UNFINISHED, completion_text="", columns=columns,
                            row_index=index, segments=0)
                tokens += self._extend(r, comp, spec.max_completion_length)
                group.append(r)
            groups.append(group)
        evaluation = [RolloutGroup(g, -1 - self.version, self.version, seconds, tokens, eval_version=self.version)
                      for g in groups]
        self._score_with_models(evaluation)
        return evaluation

    def _score_with_models(self, groups: list[RolloutGroup]) -> None:
        """Reward models score the finished rollouts here, while the trainer trains (TRL's call: prompt and
        completion through each model's tokenizer); the scores travel in `Rollout.model_rewards`."""
        if not self.spec.reward_models or self.topology.local_rank != 0 or not groups:
            return
        rollouts = [r for g in groups for r in g.rollouts]
        prompts = [r.prompt for r in rollouts]
        chat = bool(prompts) and not isinstance(prompts[0], str)
        completions = [completion(r) for r in rollouts]  # a multi-turn rollout's messages, else its text
        if chat:
            completions = [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions]
        for model in self.spec.reward_models:
            for r, score in zip(rollouts, model(prompts=prompts, completions=completions)):
                r.model_rewards[model.__name__] = score

    def _extend(self, r: Rollout, comp, requested: int) -> int:
        """Append one generated segment to `r`, each token with its log-prob and this tick's version."""
        n = r.append_sampled(comp, self.version)
        r.segments += 1
        reason = str(comp.finish_reason or "length")
        # Carried on when it stopped only for this tick's budget (a shorter "length" means the engine
        # could not go on, e.g. the context is full: it ends there).
        if reason == "length" and n == requested and len(r.completion_ids) < self.spec.max_completion_length:
            return n
        r.finish_reason = reason
        r.completion_text = comp.text if r.segments == 1 and self._engine_text else self.encoder.tokenizer.decode(
            r.completion_ids, skip_special_tokens=True)  # (as TRL decodes a completion)
        return n


def _fields(cls) -> tuple[str, ...]:
    """The fields of vLLM's `SamplingParams` (a msgspec struct; a dataclass in older vLLMs)."""
    names = getattr(cls, "__struct_fields__", None)
    return tuple(names) if names is not None else tuple(getattr(cls, "__dataclass_fields__", {}))


def _loaded(dataset):
    """A `datasets.Dataset`, or None; a path (a child process's copy) is loaded from disk."""
    if isinstance(dataset, str):
        from datasets import load_from_disk

        return load_from_disk(dataset)
    return dataset
