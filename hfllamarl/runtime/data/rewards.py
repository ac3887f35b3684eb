"""Reward functions with TRL's contract, run on the trainer ranks.

A reward function is called as

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_metric=..., log_extra=...,
       **dataset_columns)

and returns one `float | None` per completion (`None`: this function does not score that sample).
As in TRL, `log_metric(name, value)` logs a scalar (averaged over the step's calls on every trainer rank)
and `log_extra(column, values)` adds a column to the completions table (`log_completions`).
Completions are strings, or `[{"role": "assistant", "content": ...}]` when the prompts are chat
messages (a multi-turn rollout's: its assistant and tool messages); with environments, `environments` holds
each rollout's environment, as TRL passes it. `async def` functions run concurrently. Rewards are summed with
`reward_weights`, ignoring `None`s.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Sequence

from hfllamarl.runtime.data.prompts import is_conversational
from hfllamarl.registry import PluginError, installed, load_plugin

logger = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something other than one float|None per completion."""


def resolve_reward_funcs(reward_funcs, processing_classes=None, *, trust_remote_code: bool = False,
                         model_init_kwargs: dict | None = None) -> list[Callable]:
    """Turn a callable, a reward plugin name, a reward model (a directory, a Hub id or a `PreTrainedModel`), or a
    list mixing them, into a list of callables. `processing_classes` (TRL's `reward_processing_classes`): one
    tokenizer or None per reward function, used by the reward models; `model_init_kwargs`: what the reward models
    given by name are loaded with (`from_pretrained`'s keyword arguments, as TRL loads them)."""
    from transformers import PreTrainedModel

    from hfllamarl.runtime.weights.loading import looks_like_hub_id
    from hfllamarl.runtime.data.reward_models import RewardModel, is_model_dir

    if reward_funcs is None:
        raise ValueError("No reward source provided: reward_funcs is required (a callable, a reward plugin name, or a "
                         "list of them).")
    items = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not items:
        raise ValueError("reward_funcs is an empty list: give at least one reward function.")
    if processing_classes is None:
        processing_classes = [None] * len(items)
    elif not isinstance(processing_classes, (list, tuple)):
        processing_classes = [processing_classes]
    if len(processing_classes) != len(items):
        raise ValueError(f"reward_processing_classes has {len(processing_classes)} entries for {len(items)} reward "
                         "functions; the two must match: give one per reward function (None for the functions that are not models).")
    funcs = []
    for item, tokenizer in zip(items, processing_classes):
        if isinstance(item, (str, os.PathLike)) and os.fspath(item) not in installed("rewards") \
                and is_model_dir(os.fspath(item)):
            item = RewardModel(os.fspath(item), tokenizer, trust_remote_code=trust_remote_code,
                               init_kwargs=model_init_kwargs)
        elif isinstance(item, PreTrainedModel):
            item = RewardModel(item, tokenizer, trust_remote_code=trust_remote_code)
        elif isinstance(item, str) and item not in installed("rewards") and looks_like_hub_id(item):
            item = _hub_reward_model(item, tokenizer, trust_remote_code, model_init_kwargs)
        elif isinstance(item, str):
            try:
                item = load_plugin("rewards", item)
            except PluginError as exc:
                if item in installed("rewards"):
                    raise
                raise PluginError(f"{exc} A reward model is given as the local directory of a sequence-classification "
                                  f"model saved with save_pretrained() (with config.json), its Hub id, or a "
                                  f"PreTrainedModel; {item!r} is none of these.") from None
        if not callable(item):
            raise TypeError(f"reward_funcs items must be callables, plugin names, model directories or "
                            f"PreTrainedModels, got {type(item).__name__}")
        funcs.append(item)
    return funcs


def _hub_reward_model(repo_id: str, tokenizer, trust_remote_code: bool, init_kwargs: dict | None):
    """A reward model given by its Hub id (as TRL loads one), from its local snapshot."""
    from hfllamarl.runtime.weights.loading import hub_snapshot
    from hfllamarl.runtime.data.reward_models import RewardModel, is_model_dir

    try:
        path = hub_snapshot(repo_id, (init_kwargs or {}).get("revision"))
    except Exception as exc:  # noqa: BLE001 - offline, unknown repository, ...: say both readings of the name
        raise PluginError(f"reward function {repo_id!r} is not an installed reward plugin (installed: "
                          f"{sorted(installed('rewards'))}), and as a Hub id of a reward model it could not be "
                          f"fetched ({type(exc).__name__}: {exc}). Download the model first and pass its "
                          "directory.") from None
    if not is_model_dir(path):
        raise PluginError(f"reward model {repo_id!r}: its Hub snapshot {path} has no config.json and weights.")
    return RewardModel(path, tokenizer, trust_remote_code=trust_remote_code, init_kwargs=init_kwargs)


def _unwrapped(fn: Callable) -> Callable:
    """The callable a `functools.partial` wraps (partials of partials too), as TRL names and awaits it."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def reward_name(fn: Callable) -> str:
    fn = _unwrapped(fn)
    return getattr(fn, "__name__", None) or type(fn).__name__


def _is_async(fn: Callable) -> bool:
    fn = _unwrapped(fn)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class RewardRunner:
    """Scores a batch of completions with every reward function and combines them."""

    def __init__(self, funcs: list[Callable], weights: Sequence[float] | None = None, on_error: str = "raise",
                 aggregation: str = "sum_then_normalize"):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"multi_objective_aggregation={aggregation!r}; choose one of "
                             f"{', '.join(map(repr, AGGREGATIONS))}.")
        self.aggregation = aggregation  # TRL's multi_objective_aggregation (how the trainer makes advantages)
        self.funcs = funcs
        self.names = [reward_name(f) for f in funcs]
        if weights is None:
            weights = [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} entries but there are {len(funcs)} reward functions.")
        self.weights = [float(w) for w in weights]
        self.on_error = on_error
        self.error_count = 0
        self.nonfinite_count = 0  # NaN/inf rewards, scored as None
        self.unscored_count = 0  # completions no function scored (see _fill_unscored)
        self._metrics: dict[str, list[float]] = {}  # what reward functions gave `log_metric` since the last drain
        self._extra: dict[str, list] = {}  # what they gave `log_extra` (completions-table columns)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` kwarg: a scalar a reward function logs for this step (averaged with its other calls)."""
        self._metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra` kwarg: a column of the completions table, one value per completion of the call."""
        self._extra.setdefault(str(column), []).extend(list(values))

    def drain(self, n: int) -> tuple[dict[str, tuple[float, int]], dict[str, list]]:
        """What reward functions logged since the last drain: each metric's (sum, count), and each extra column
        fitted to the `n` completions scored (missing values None)."""
        metrics = {k: (sum(v), len(v)) for k, v in self._metrics.items()}
        extra = {k: (v + [None] * n)[:n] for k, v in self._extra.items()}
        self._metrics, self._extra = {}, {}
        return metrics, extra

    def __call__(self, prompts: list, completions: list[str], completion_ids: list[list[int]], columns: dict,
                 trainer_state=None, scored: dict[str, list] | None = None, group_sizes: list[int] | None = None,
                 ) -> tuple[list[float], dict[str, list[float | None]]]:
        """Return (combined reward per completion, each function's scores by name). `scored`: scores already
        computed elsewhere (reward models, on the generator), by function name; those functions are not called.
        A completion that every function scored None (or NaN) has no reward: 0, or with `group_sizes` (the
        completions in group order, i.e. for training) NaN, as TRL (see `_mark_unscored`)."""
        n = len(completions)
        if prompts and is_conversational(prompts[0]):  # a multi-turn rollout's messages are already a list
            completions = [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions]
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      trainer_state=trainer_state, log_metric=self.log_metric, log_extra=self.log_extra, **columns)
        results = self._call_all(kwargs, n, scored or {})
        per_func = {}
        for name, scores in zip(self.names, results):
            per_func[name] = scores
        total: list[float | None] = []
        for i in range(n):
            vals = [w * s[i] for w, s in zip(self.weights, results) if s[i] is not None]
            total.append(float(sum(vals)) if vals else None)
        if group_sizes is not None:
            return self._mark_unscored(total), per_func
        return [0.0 if t is None else t for t in total], per_func

    def _mark_unscored(self, total: list[float | None]) -> list[float]:
        """As TRL, an unscored completion (None) gets reward NaN: the advantages leave it out of every mean and std
        and give it 0 (`hfllamarl.losses.group_advantages`), and the logged reward statistics leave it out.
        Counted as reward_unscored, with a warning."""
        missing = total.count(None)
        if missing:
            self.unscored_count += missing
            # TRL's wording first, so that a check for TRL's warning finds this one
            logger.warning("All reward functions returned None for the following kwargs: those of %d of %d "
                           "completions (they got no reward); they are left out of the baselines and reward "
                           "statistics and get advantage 0. Make at least one reward function score every "
                           "completion.", missing, len(total))
        return [math.nan if t is None else t for t in total]

    def counters(self) -> dict[str, float]:
        """What each reward function reports through `.stats()` (e.g. math_sympy's timeouts), every number as
        `rewards/<function>/<key>`."""
        out = {}
        for name, fn in zip(self.names, self.funcs):
            stats = getattr(fn, "stats", None)
            if callable(stats):
                try:
                    for key, value in (stats() or {}).items():
                        out[f"rewards/{name}/{key}"] = float(value)
                except Exception:  # counters are informative only (a non-number is left out)
                    pass
        if self.error_count:
            out["reward_errors"] = float(self.error_count)
        if self.nonfinite_count:
            out["reward_nonfinite"] = float(self.nonfinite_count)
        if self.unscored_count:
            out["reward_unscored"] = float(self.unscored_count)
        return out

    def _call_all(self, kwargs: dict, n: int, scored: dict[str, list]) -> list[list[float | None]]:
        results: list = [None] * len(self.funcs)
        coros = {}
        for i, fn in enumerate(self.funcs):
            if self.names[i] in scored:
                results[i] = self._check(self.names[i], scored[self.names[i]], n)
            elif _is_async(fn):
                coros[i] = fn(**kwargs)
            else:
                results[i] = self._guard(i, lambda fn=fn: fn(**kwargs), n, kwargs, fn=fn)
        if coros:
            async def gather():
                return await asyncio.gather(*coros.values(), return_exceptions=True)

            for i, out in zip(coros, _run_async(gather())):
                results[i] = self._guard(i, lambda out=out: _reraise(out), n, kwargs)
        return results

    def _guard(self, i: int, call: Callable, n: int, kwargs: dict, fn: Callable | None = None) -> list[float | None]:
        """Run `call`; when it raises, explain (naming the failing sample when `fn` is given) or score 0."""
        name = self.names[i]
        try:
            out = call()
        except Exception as exc:
            if self.on_error == "zero":
                self.error_count += 1
                return [0.0] * n
            first = kwargs["prompts"][0] if kwargs["prompts"] else None
            msg = (f"reward function {name!r} raised {type(exc).__name__}: {exc} (batch of {n} completions; "
                   f"first prompt: {_short(first)}).")
            if fn is not None:
                msg += " " + _find_failing_sample(fn, kwargs, n)
            raise RewardFunctionError(msg + " Set reward_errors='zero' to score such batches 0 and go on.") from exc
        return self._check(name, out, n)

    def _check(self, name: str, out, n: int) -> list[float | None]:
        if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
            raise RewardFunctionError(f"reward function {name!r} returned {type(out).__name__}; it must return a list "
                                      f"of {n} floats (or None).")
        out = out.tolist() if hasattr(out, "tolist") else list(out)
        if len(out) != n:
            raise RewardFunctionError(f"reward function {name!r} returned {len(out)} values for {n} completions; it "
                                      "must return exactly one float (or None) per completion.")
        clean, nonfinite = [], []
        for j, v in enumerate(out):
            if v is None:
                clean.append(None)
                continue
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise RewardFunctionError(f"reward function {name!r} returned {v!r} for completion {j}; "
                                          "expected a float or None.") from None
            if math.isnan(v) or math.isinf(v):
                nonfinite.append(j)
                v = None  # treated like None (not scored), and counted
            clean.append(v)
        self.nonfinite_count += len(nonfinite)
        return clean


#: How many samples, and for how long, a raising reward function is re-run one sample at a time.
PROBE_MAX_SAMPLES = 64
PROBE_MAX_SECONDS = 60.0


def _short(value, limit: int = 200) -> str:
    text = str(value)
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _find_failing_sample(fn: Callable, kwargs: dict, n: int) -> str:
    """Call `fn` on each sample alone (every per-sample argument sliced to length 1) and describe the
    first sample that raises. Bounded by PROBE_MAX_SAMPLES samples and PROBE_MAX_SECONDS seconds."""
    per_sample = {k for k, v in kwargs.items()
                  if not isinstance(v, (str, bytes, dict)) and hasattr(v, "__getitem__") and _len(v) == n}
    deadline = time.monotonic() + PROBE_MAX_SECONDS
    limit = min(n, PROBE_MAX_SAMPLES)
    for j in range(limit):
        if time.monotonic() > deadline:
            return (f"Called on each sample alone, samples 0..{j - 1} did not raise; stopped after "
                    f"{PROBE_MAX_SECONDS:.0f} s.")
        one = {k: (v[j:j + 1] if k in per_sample else v) for k, v in kwargs.items()}
        try:
            fn(**one)
        except Exception as exc:
            prompt = kwargs["prompts"][j] if "prompts" in per_sample else None
            return (f"Called on each sample alone, it first raises on sample {j} ({type(exc).__name__}: "
                    f"{str(exc)[:200]}): prompt {_short(prompt)}, completion {_short(kwargs['completions'][j])}.")
    scope = f"the first {limit} of {n}" if limit < n else f"all {n}"
    return (f"Called on each sample alone ({scope} samples), no single sample raised: the error needs the "
            "samples together (e.g. batch size or an interaction between samples).")


def _len(value) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None


def _reraise(out):
    if isinstance(out, BaseException):
        raise out
    return out


def _run_async(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from inside a running loop (a notebook): run in a helper thread with its own loop.
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
