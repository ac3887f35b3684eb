"""`rollout_func` (TRL's contract) on the generator: the user's function owns a batch's generation loop.

TRL calls `rollout_func(prompts, trainer)` with its batch's prompts (each prompt once per completion, as its
sampler repeats them) and expects a dict with `prompt_ids`, `completion_ids` and `logprobs` (one list per
completion), optionally `env_mask` (1: a token the model sampled, 0: one the function wrote, e.g. an
environment's reply), and any other field, one value per completion (or one for all), which reaches the
reward functions as a keyword argument.

Here the function runs on the generator's first rank, once per batch, and its `trainer` is a
`GeneratorTrainerView`: what a rollout function can use on the generator (the tokenizer, the config, the
sampling settings, and `vllm_generation.generate`, TRL's colocated call, backed by this job's engine and
returning the log-prob vLLM sampled each token with, so that on-policy pi/mu is 1). What lives on the trainer
ranks (the model, the accelerator, the optimizer) or would bypass the sampling settings (the raw engine) is
refused with the reason. The rollouts it returns are complete within the tick (no partial rollouts).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from hfllamarl.runtime.loop.rollout import Rollout, sampled_logprobs

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


class GeneratorTrainerView:
    """The `trainer` a rollout_func receives on the generator (see the module docstring)."""

    def __init__(self, runner: RolloutFuncRunner):
        ex = runner.ex
        view = runner.spec.rollout_view
        self._runner = runner
        self.processing_class = ex.encoder.tokenizer
        self.args = SimpleNamespace(**view.get("args", {}))
        self.state = SimpleNamespace(global_step=ex.version)  # the policy version generating now
        self.num_generations = ex.spec.num_generations
        self.num_generations_eval = ex.spec.num_generations_eval
        self.max_completion_length = ex.spec.max_completion_length
        sampling = ex.spec.sampling
        self.temperature, self.top_p, self.top_k = sampling.temperature, sampling.top_p, sampling.top_k
        self.min_p, self.repetition_penalty = sampling.min_p, sampling.repetition_penalty
        self.chat_template_kwargs = dict(ex.spec.chat_template_kwargs or {})
        self.chat_template, self.tools = None, []
        self.use_vllm, self.vllm_mode = True, "colocate"
        self.vllm_generation = _Generation(runner)

    def __getattr__(self, name):
        where = ("lives on the trainer ranks" if name in ("model", "accelerator", "optimizer", "lr_scheduler",
                                                          "ref_model", "reward_funcs") else "is not available there")
        raise AttributeError(
            f"rollout_func runs on the generator rank, where the trainer's `{name}` {where}. Its `trainer` offers: "
            "processing_class, args, state.global_step, num_generations, max_completion_length, the sampling "
            "settings (temperature, top_p, top_k, min_p, repetition_penalty), chat_template_kwargs, and "
            "vllm_generation.generate(prompt_ids, images=None, num_generations=1).")


class _Generation:
    """TRL's `trainer.vllm_generation`: `generate` backed by the job's engine; the raw engine is refused."""

    def __init__(self, runner: RolloutFuncRunner):
        self._runner = runner

    @property
    def llm(self):
        raise AttributeError(
            "rollout_func may not drive the vLLM engine directly: its sampling settings must be the job's (the "
            "trainer's pi applies the same ones, so pi/mu is 1 on-policy) and, with tensor parallelism, every rank "
            "of the engine must make the same calls. Use trainer.vllm_generation.generate(prompt_ids).")

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        """TRL's colocated call: one completion per entry of `prompts` (token ids; repeat a prompt for several).
        Returns (prompt_ids, completion_ids, logprobs `[B][T][1]`, logprob_token_ids `[B][T][1]`)."""
        if images is not None and any(image is not None for image in images):
            raise ValueError("rollout_func: images are not supported by this generator.")
        ex = self._runner.ex
        requests = []
        for ids in prompts:
            ids = [int(t) for t in ids]
            room = min(ex.spec.max_completion_length, ex.spec.max_model_len - len(ids))
            if room < 1:
                raise ValueError(f"rollout_func: a prompt of {len(ids)} tokens leaves no room in the model's context "
                                 f"of {ex.spec.max_model_len} tokens.")
            requests.append((ids, 1, room))
        outputs = self._runner.loop.lockstep.generate(self._runner.loop.generate_local, requests)
        completion_ids, logprobs, token_ids = [], [], []
        for out in outputs:
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            completion_ids.append(ids)
            logprobs.append([[lp] for lp in sampled_logprobs(comp.logprobs, ids)])
            token_ids.append([[t] for t in ids])
        return [list(ids) for ids, _, _ in requests], completion_ids, logprobs, token_ids


class RolloutFuncRunner:
    """Calls the user's rollout_func for a batch of dataset rows and turns its output into rollouts."""

    def __init__(self, spec, executor, loop):
        self.spec, self.ex, self.loop = spec, executor, loop

    def batch(self, indices: list[int], rows: list[dict], num_generations: int) -> list[list[Rollout]]:
        prompts = [row["prompt"] for row in rows for _ in range(num_generations)]
        out = self.spec.rollout_func(prompts, GeneratorTrainerView(self))
        if not isinstance(out, dict):
            raise TypeError(f"rollout_func returned {type(out).__name__}; it must return a dict with "
                            f"{list(REQUIRED)} (and optionally env_mask and fields for the reward functions).")
        missing = sorted(set(REQUIRED) - set(out))
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
        if out["logprobs"] is None:
            raise ValueError("rollout_func returned logprobs=None: the trainer's importance weight needs the log-prob "
                             "each sampled token was drawn with (mu); return the engine's (trainer.vllm_generation"
                             ".generate gives them).")
        n = len(prompts)
        for key in (*REQUIRED, "env_mask"):
            if key in out and len(out[key]) != n:
                raise ValueError(f"rollout_func returned {len(out[key])} entries of {key!r} for {n} completions "
                                 f"({len(rows)} prompts x num_generations={num_generations}): one per completion.")
        extras = {k: v for k, v in out.items() if k not in REQUIRED}  # (as TRL: env_mask and the rest reach rewards)
        groups = []
        for p, (index, row) in enumerate(zip(indices, rows)):
            group = []
            for g in range(num_generations):
                i = p * num_generations + g
                columns = {k: v for k, v in row.items() if k != "prompt"}
                # (as TRL: a list shorter than the completions leaves the later ones without that field)
                columns.update({k: (v[i] if isinstance(v, list) else v) for k, v in extras.items()
                                if not isinstance(v, list) or i < len(v)})
                group.append(self._rollout(out, i, row["prompt"], columns, int(index)))
            groups.append(group)
        return groups

    def _rollout(self, out: dict, i: int, prompt, columns: dict, index: int) -> Rollout:
        ids = [int(t) for t in out["completion_ids"][i]]
        mask = [int(bool(m)) for m in out["env_mask"][i]] if out.get("env_mask") is not None else None
        raw = list(out["logprobs"][i])
        if len(raw) != len(ids) or (mask is not None and len(mask) != len(ids)):
            raise ValueError(f"rollout_func: completion {i} has {len(ids)} tokens, {len(raw)} log-probs"
                             + (f" and {len(mask)} env_mask entries" if mask is not None else "")
                             + "; one each per token.")
        logprobs = []
        for t, value in enumerate(raw):
            value = value[0] if isinstance(value, (list, tuple)) else value
            trained = mask is None or mask[t]
            if trained and (value is None or not math.isfinite(float(value))):
                raise ValueError(f"rollout_func: completion {i} has log-prob {value!r} at sampled token {t}; every "
                                 "token with env_mask 1 needs the finite log-prob it was sampled with.")
            logprobs.append(float(value) if trained else 0.0)  # an unsampled token's log-prob is never read
        eos = self.ex.encoder.tokenizer.eos_token_id
        reason = "stop" if ids and ids[-1] == eos else "length"
        text = self.ex.encoder.tokenizer.decode(ids, skip_special_tokens=True)
        return Rollout(prompt=prompt, prompt_ids=[int(t) for t in out["prompt_ids"][i]], completion_ids=ids,
                       behavior_logprobs=logprobs, versions=[self.ex.version] * len(ids), finish_reason=reason,
                       completion_text=text, columns=columns, row_index=index, segments=1, env_mask=mask)
