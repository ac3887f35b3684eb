"""Bootstrap: the trainer samples the first batches itself while the generator process starts.

A single-process job (`python script.py`, a notebook) starts its generator as a child process, which imports
torch, transformers and vLLM and builds its engine before it can sample anything: on a small CPU machine that is
most of the time to the first step. Meanwhile the trainer would only wait. With bootstrapping it does instead
what TRL's GRPOTrainer does at every step: it samples the batch with its own policy (transformers, KV cache, on
its own cores), scores it and trains on it, one batch after the other, until every generator rank has its engine
up. The generator then takes over at the next batch, like a resume from that step: it receives the trainer's
weights in the first tick's weight sync and samples from there on, the trainer trains what it sends. A batch the
trainer was still sampling when the generator came up is trained by the loop's first tick, beside the generator's
first batch (`run`).

What a bootstrapped batch is: the same prompts (`prompts.batch_rows`), the same chat rendering, the same sampling
distribution (`loop.sampling.processed_logits`: what vLLM samples from, what the trainer computes pi under), the
behaviour log-prob of each token recorded as the generator records it, the version being the trainer's current
one (on-policy: pi/mu is 1 up to the kernels' rounding). It is a `RolloutGroup` like any other, trained by the
same `TrainerExecutor.train_on`.

Where it does not apply (`blocker` says why, logged once): a launcher's ranks, a resume, generator_failure=
"continue" (a replica lost while the others start is not survived), tools / environments /
rollout_func (multi-turn rollouts run on the generator), reward models (scored on the generator), partial
rollouts, dynamic sampling, penalties or generation_kwargs (vLLM-only options), an evaluation at the start. It
also stops before any step that is checkpointed or evaluated (those need the generator) and leaves the last batch
to the generator.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from hfllamarl.runtime.data.prompts import PromptEncoder, batch_rows
from hfllamarl.runtime.loop.rollout import ROLLOUTS, UNFINISHED, Rollout, RolloutGroup
from hfllamarl.runtime.loop.sampling import Sampling, processed_logits
from hfllamarl.runtime.weights import checkpoint

logger = logging.getLogger(__name__)

TOKENS_PER_CHUNK = 65536  # prompt + completion tokens sampled at once (the trainer's KV cache holds that many)


def cannot_sample(spec) -> list[str]:
    """What the trainer's sampler cannot do as the generators do, for the job's `GeneratorSpec` (empty: it samples
    the same distribution); its bootstrap and a replica group's missing shares (`replica_makeup`) both ask."""
    reasons = [
        (spec.agent is not None, "multi-turn rollouts (tools, environments, rollout_func) run on the generator"),
        (bool(spec.reward_models), "reward models score on the generator"),
        (spec.sampling.penalties, "repetition / presence / frequency penalties"),
        (bool(spec.generation_kwargs), f"generation_kwargs {sorted(spec.generation_kwargs or {})} are vLLM options"),
    ]
    return [text for hit, text in reasons if hit]


def blocker(args, spec, topology, resuming: bool) -> str | None:
    """Why this job cannot bootstrap (None: it can). `spec`: the job's `GeneratorSpec`."""
    if not args.bootstrap_generation:
        return "bootstrap_generation=False"
    reasons = [
        (topology.mode != "single", "its ranks were started by a launcher (each rank starts at once)"),
        (resuming, "it resumes from a checkpoint"),
        (topology.failure == "continue", "generator_failure='continue' survives a lost replica only once all are up"),
        (spec.schedule.generation_ticks > 1, "partial rollouts are carried by the generator"),
        (bool(args.drop_zero_variance_groups), "dynamic sampling draws from the generator's reserve"),
        (spec.eval_on_start, "eval_on_start evaluates the starting policy on the generator"),
        (spec.replica_groups > 1, "trainer replica groups take part in every step's quorum from the first"),
    ]
    why = cannot_sample(spec) + [text for hit, text in reasons if hit]
    return "; ".join(why) if why else None


def batch_limit(schedule, save_steps: int, eval_every: int) -> int:
    """How many batches the trainer may bootstrap: none whose steps are checkpointed or evaluated (both need the
    generator: its part of a checkpoint, its samples of an evaluation), and never the last batch."""
    limit = 0
    while limit < schedule.num_batches - 1:
        last = min((limit + 1) * schedule.iterations, schedule.num_steps)
        steps = range(limit * schedule.iterations + 1, last + 1)
        if any(checkpoint.due(s, save_steps, schedule.num_steps) for s in steps):
            break
        if eval_every and any(schedule.evaluates(s) for s in steps):
            break
        limit += 1
    return limit


class BootstrapSampler:
    """Samples generation batches with the trainer's policy, as the generator would (see the module's text)."""

    def __init__(self, model, tokenizer, dataset, spec, device: torch.device, generation_config=None):
        self.model, self.tokenizer, self.dataset, self.spec, self.device = model, tokenizer, dataset, spec, device
        self.encoder = PromptEncoder(tokenizer, spec.chat_template_kwargs)
        self.sampling: Sampling = spec.sampling
        eos = {tokenizer.eos_token_id}
        configured = getattr(generation_config, "eos_token_id", None)  # vLLM adds the model's generation_config's
        eos |= set(configured if isinstance(configured, (list, tuple)) else [configured])
        self.eos = sorted(t for t in eos if t is not None)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos or [0])[0]

    def sample(self, batch_index: int, version: int) -> list[RolloutGroup] | None:
        """The groups of batch `batch_index`, sampled now by the policy at `version`; None when a prompt leaves no
        room for a whole completion (max_model_len: the generator decides what becomes of it)."""
        return self.sample_rows(self._rows(batch_index), batch_index, version,
                                self.spec.seed * 1_000_003 + batch_index)

    def _rows(self, batch_index: int) -> list[int]:
        """The dataset rows of batch `batch_index` (`prompts.batch_rows`, as the generator draws them)."""
        spec = self.spec
        return batch_rows(len(self.dataset), spec.prompts_per_batch, batch_index, spec.seed, spec.shuffle)

    def _room(self, prompts: list[list[int]]) -> bool:
        """Whether every prompt leaves room for a whole completion (max_model_len)."""
        return all(len(ids) + self.spec.max_completion_length <= self.spec.max_model_len for ids in prompts)

    def sample_rows(self, indices: list[int], batch_index: int, version: int, seed: int) -> list[RolloutGroup] | None:
        """`sample` of the dataset rows `indices` (positions 0, 1, ... of batch `batch_index`), the sampler's random
        stream seeded with `seed`."""
        spec = self.spec
        prompts = [(i, row, self.encoder.encode(row["prompt"])) for i, row in
                   zip(indices, (self.dataset[i] for i in indices))]
        if not self._room([ids for _, _, ids in prompts]):
            return None
        start = time.perf_counter()
        streams = [ids for _, _, ids in prompts for _ in range(spec.num_generations)]
        generator = torch.Generator(device=self.device).manual_seed(seed)
        # (in chunks of at most TOKENS_PER_CHUNK prompt and completion tokens: the KV cache stays bounded)
        per_chunk = max(1, TOKENS_PER_CHUNK // (max(len(s) for s in streams) + spec.max_completion_length))
        tokens, logprobs, reasons = [], [], []
        for start_at in range(0, len(streams), per_chunk):
            for out, part in zip((tokens, logprobs, reasons), self._decode(streams[start_at:start_at + per_chunk],
                                                                           generator)):
                out += part
        seconds = time.perf_counter() - start
        total = sum(len(t) for t in tokens)
        groups = []
        for position, (index, row, ids) in enumerate(prompts):
            columns = {k: v for k, v in row.items() if k != "prompt"}
            group = []
            for k in range(position * spec.num_generations, (position + 1) * spec.num_generations):
                group.append(Rollout(prompt=row["prompt"], prompt_ids=list(ids), completion_ids=tokens[k],
                                     behavior_logprobs=logprobs[k], versions=[version] * len(tokens[k]),
                                     finish_reason=reasons[k],
                                     completion_text=self.tokenizer.decode(tokens[k], skip_special_tokens=True),
                                     columns=columns, row_index=int(index), segments=1))
            groups.append(RolloutGroup(group, batch_index, version, seconds, total, position=position, replica=0))
        return groups

    def head_start(self, batch_index: int, version: int, tokens: int, stop) -> dict | None:
        """The first tokens of every completion of batch `batch_index` (its prompts as the generator encodes them,
        `num_generations` streams each), sampled now by the policy at `version`: `tokens` of them, fewer if `stop()`
        says so between two tokens (`runtime.training.head_start`). None when a prompt leaves no room for a whole
        completion or the batch needs more than one chunk. JSON-ready: the dataset rows, and per stream its tokens,
        their behaviour log-probs and why it ended ("stop", "length", or "" while it goes on)."""
        spec = self.spec
        indices = self._rows(batch_index)
        prompts = [self.encoder.encode(self.dataset[i]["prompt"]) for i in indices]
        streams = [ids for ids in prompts for _ in range(spec.num_generations)]
        longest = max((len(ids) for ids in prompts), default=0)
        if not streams or not self._room(prompts) \
                or len(streams) * (longest + spec.max_completion_length) > TOKENS_PER_CHUNK:
            return None
        generator = torch.Generator(device=self.device).manual_seed(spec.seed * 1_000_003 + batch_index + 500_009)
        ids, logprobs, reasons = self._decode(streams, generator, tokens, stop)
        return {"batch": batch_index, "version": version, "indices": [int(i) for i in indices],
                "rows": [[row, lps, why] for row, lps, why in zip(ids, logprobs, reasons)]}

    @torch.no_grad()
    def _decode(self, prompts: list[list[int]], generator: torch.Generator, first: int | None = None, stop=None):
        """Sample a completion of each prompt (left-padded, one forward per token with the KV cache): its tokens,
        their log-probs under the processed distribution, and why it ended ("stop": an end-of-sequence token,
        kept as vLLM keeps it; "length": max_completion_length). With `first` (and `stop()`, asked after each
        token), only the first tokens of each: a completion cut before its end has the reason "" (unfinished)."""
        model, n, length = self.model, len(prompts), self.spec.max_completion_length
        cut = min(first, length) if first is not None else length
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        eos = torch.tensor(self.eos, dtype=torch.long, device=self.device)
        chosen_ids, chosen_logprobs = [], []
        open_ = torch.ones(n, dtype=torch.bool, device=self.device)
        with _sampling(model):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            for _ in range(length):
                logits = processed_logits(out.logits[:, -1:, :].float(), self.sampling)[:, 0, :]
                logp = torch.log_softmax(logits, dim=-1)
                choice = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
                chosen_ids.append(choice)
                chosen_logprobs.append(logp.gather(-1, choice[:, None])[:, 0])
                open_ &= ~torch.isin(choice, eos)
                if len(chosen_ids) == cut or not bool(open_.any()) or (stop is not None and stop()):
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
                positions = positions[:, -1:] + 1
                out = model(input_ids=choice[:, None], attention_mask=mask, position_ids=positions,
                            past_key_values=out.past_key_values, use_cache=True)
        sampled = torch.stack(chosen_ids, dim=1).tolist()
        sampled_logprobs = torch.stack(chosen_logprobs, dim=1).tolist()
        tokens, logprobs, reasons = [], [], []
        for row, row_logprobs in zip(sampled, sampled_logprobs):
            end = next((t + 1 for t, token in enumerate(row) if token in self.eos), None)
            tokens.append(row[:end] if end else row)
            logprobs.append(row_logprobs[:end] if end else row_logprobs)
            reasons.append("stop" if end else "length" if len(row) == length else UNFINISHED)
        return tokens, logprobs, reasons


@contextlib.contextmanager
def _sampling(model):
    """The policy in eval mode, and FSDP2's decoder layers keeping their parameters gathered between forwards while
    this lasts (one forward per sampled token: gathering and freeing them each time doubled a tiny model's decoding
    time on a CPU); at its end they are freed, as after any forward, and the mode is the one before. (The root
    module keeps its own gathered after a forward anyway.)"""
    from torch.distributed.fsdp import FSDPModule

    was_training = model.training
    layers = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    model.eval()
    for m in layers:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in layers:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()
        model.train(was_training)


def run(executor, sampler: BootstrapSampler, limit: int, generator_ready) -> int:
    """Bootstrap batches 0, 1, ... on `executor` (the trainer's) until `generator_ready()` (called before each batch
    and after each sampling; it raises when a generator failed), `limit` batches, a prompt too long for the trainer
    to judge, or a callback's stop. Returns how many batches the trainer sampled (the generators' first batch).

    The generators usually come up in the middle of a batch. If that batch is still being sampled, it is not trained
    here: it waits in the executor's inbox, and the loop's first tick trains it while the generators sample the next
    batch (as every later tick overlaps the two), rather than the generators waiting for this step and the trainer
    then waiting for their first batch. `executor.bootstrapped` counts the batches trained here. (Not with
    max_staleness=0: there the loop trains each batch in the tick that samples it.)"""
    from hfllamarl.runtime.world import startup

    schedule, topology = executor.spec.schedule, executor.topology
    done = 0
    executor.bootstrapping = True
    try:
        while done < limit and not generator_ready():
            # (a generator that becomes ready meanwhile waits for this batch: it is bounded like any step)
            startup.bootstrapping(topology, topology.timeout_s)
            groups = sampler.sample(done, executor.version)
            if groups is None:
                break
            executor.set_step(done + schedule.max_staleness)  # the tick that trains batch `done` in the schedule
            executor.put_input(ROLLOUTS, groups)
            if schedule.max_staleness and generator_ready():  # (trained by the loop's first tick, see above)
                return done + 1
            executor.step()
            done += 1
            executor.bootstrapped = done
            if executor.spec.should_stop():
                break
    finally:
        executor.bootstrapping = False
        try:
            startup.bootstrapping(topology, None)
        except Exception:  # (the store's silence is the verdict's to judge; the generators' wait is bounded)
            pass
    return done
