"""Logging through transformers' Trainer machinery: `TrainerState`, callbacks, `report_to`.

The trainer ranks drive the same callback events a `transformers.Trainer` fires (train begin,
step begin/end, log, save, train end), so the tqdm bar, TensorBoard and any user callback work
as they do with TRL's trainers, and `state.log_history` holds every logged step.
"""

from __future__ import annotations

import logging
import math
import os
import time

from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    ExportableState,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
    TrainerState,
)

logger = logging.getLogger(__name__)


# What transformers' Trainer itself logs at a logging step (`_maybe_log_save_evaluate`), not TRL's gathered metrics.
TRAINER_STEP_LOGS = ("loss", "grad_norm", "learning_rate")


class Reporter:
    """Holds the `TrainerState` and fires callbacks; one per trainer rank."""

    def __init__(self, args, model, processing_class, optimizer, scheduler, callbacks, max_steps: int,
                 is_world_zero: bool, batches_per_epoch: int | None = None):
        integrations = get_reporting_integration_callbacks(args.report_to)
        default = [DefaultFlowCallback] + integrations
        default.append(PrinterCallback if args.disable_tqdm else ProgressCallback)
        self.handler = CallbackHandler(default + list(callbacks or []), model, processing_class, optimizer, scheduler)
        self.args = args
        self.control = TrainerControl()
        # EarlyStoppingCallback & co.: their state goes into each checkpoint's trainer_state.json, as transformers'
        self.state = TrainerState(stateful_callbacks=self._stateful())
        self.state.max_steps = max_steps
        self.batches_per_epoch = batches_per_epoch  # optimizer steps per pass over the dataset (state.epoch)
        if batches_per_epoch:
            self.state.num_train_epochs = -(-max_steps // batches_per_epoch)
        # (below 1: a share of the run's steps, as transformers' Trainer reads it)
        self.state.logging_steps = (math.ceil(max_steps * args.logging_steps) if 0 < args.logging_steps < 1
                                    else args.logging_steps)
        self.state.save_steps = args.save_steps
        self.state.is_world_process_zero = is_world_zero
        self.state.is_local_process_zero = is_world_zero
        self._pending: list[dict] = []
        self._start = None
        self._losses: list[float] = []  # every step's loss since train_begin (train_loss, as transformers' Trainer)
        self._stop_said = False
        self._samples: dict | None = None  # log_completions: the newest step's samples (first trainer rank)
        self.logged_samples: dict = {}  # ... and the last ones logged (TRL's `trainer._logs`)
        self.last_evaluated = -1  # the newest policy version whose evaluation arrived

    def train_begin(self) -> None:
        self._start = time.perf_counter()
        self.control = self.handler.on_train_begin(self.args, self.state, self.control)
        self.control = self.handler.on_epoch_begin(self.args, self.state, self.control)

    def step_begin(self) -> None:
        self.control = self.handler.on_step_begin(self.args, self.state, self.control)

    def step_end(self, step: int, metrics: dict) -> bool:
        """Record a finished optimizer step; returns whether a checkpoint save is due."""
        self.state.global_step = step
        if self.batches_per_epoch:
            self.state.epoch = step / self.batches_per_epoch
        self._pending.append(metrics)
        if "loss" in metrics:
            self._losses.append(float(metrics["loss"]))
        self.control = self.handler.on_step_end(self.args, self.state, self.control)
        epoch_ends = bool(self.batches_per_epoch) and step % self.batches_per_epoch == 0
        if epoch_ends:  # (logging_strategy="epoch" logs here, as transformers' Trainer)
            self.control = self.handler.on_epoch_end(self.args, self.state, self.control)
        if self.control.should_log:
            self.log(_mean_of(self._pending))
            self._pending = []
        due = self.control.should_save
        self.control.should_save = False
        if epoch_ends and step < self.state.max_steps:
            self.control = self.handler.on_epoch_begin(self.args, self.state, self.control)
        return due

    def log(self, logs: dict) -> None:
        logs = finite_logs(logs, self.state.global_step)
        if self.state.epoch is not None:  # as transformers' Trainer: the epoch with every log
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen not in ("no", False, None):  # (prompt + completion tokens)
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        output = {**logs, "step": self.state.global_step}
        self.state.log_history.append(output)
        self.control = self.handler.on_log(self.args, self.state, self.control, logs)
        self.control.should_log = False
        if self._samples is not None and self.state.is_world_process_zero:
            log_completions(self.args, self.state.global_step, self._samples)
            self.logged_samples, self._samples = self._samples, None

    def evaluate(self, metrics: dict) -> None:
        """An evaluation during training: its eval_* metrics go to `log_history`, `on_log` (report_to) and
        `on_evaluate`, at the current step."""
        raw, metrics = metrics, finite_logs(metrics, self.state.global_step)
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        self.control = self.handler.on_log(self.args, self.state, self.control, dict(metrics))
        self.control = self.handler.on_evaluate(self.args, self.state, self.control, metrics=dict(metrics))
        self.control.should_log = self.control.should_evaluate = False
        self.last_evaluated = max(self.last_evaluated, int(metrics.get("eval_policy_version", self.state.global_step)))
        self._track_best(raw)

    def _track_best(self, metrics: dict) -> None:
        """As transformers' Trainer after an evaluation (after `on_evaluate`, so EarlyStoppingCallback compares with
        the best before it): `metric_for_best_model` updates `state.best_metric`, and when checkpoints are saved
        `best_global_step` (here: the policy version evaluated, which may be older than the step it arrives at) and
        `best_model_checkpoint` (once that step's checkpoint exists; `save_total_limit` never deletes it)."""
        name = self.args.metric_for_best_model
        if name is None:
            return
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(f"metric_for_best_model={name!r}: the evaluation has no {key!r}; its metrics are "
                           f"{sorted(metrics)}. Set metric_for_best_model to one of them.")
        value, best = float(metrics[key]), self.state.best_metric
        if not math.isfinite(value):  # never the best (`finite_logs` warned about it)
            return
        if best is not None and not (value > best if self.args.greater_is_better else value < best):
            return
        self.state.best_metric = value
        if str(getattr(self.args.save_strategy, "value", self.args.save_strategy)) in ("steps", "epoch"):
            self.state.best_global_step = int(metrics.get("eval_policy_version", self.state.global_step))
            self.note_checkpoint(self.state.best_global_step)

    def note_checkpoint(self, step: int, saving: bool = False) -> None:
        """The checkpoint of `step` is being saved (`saving`), or may have been saved before an evaluation found its
        policy the best: it is `best_model_checkpoint` if it is the best step's."""
        from hfllamarl.runtime.weights.checkpoint import final_dir

        path = final_dir(self.args.output_dir, step)
        if step and step == self.state.best_global_step and (saving or os.path.isdir(path)):
            self.state.best_model_checkpoint = path

    def protected_checkpoints(self) -> list[str]:
        """What `save_total_limit` must not delete: the best checkpoint and, while evaluations pick it
        (metric_for_best_model), those of versions whose evaluation has not arrived yet (it comes a few steps
        after the checkpoint; the last versions of a run are never evaluated, so their checkpoints stay)."""
        from hfllamarl.runtime.weights.checkpoint import list_checkpoints

        keep = [self.state.best_model_checkpoint] if self.state.best_model_checkpoint else []
        strategy = str(getattr(self.args.eval_strategy, "value", self.args.eval_strategy))
        if self.args.metric_for_best_model is not None and strategy != "no":
            keep += [path for step, path in list_checkpoints(self.args.output_dir) if step > self.last_evaluated]
        return keep

    def _stateful(self) -> list:
        return [cb for cb in self.handler.callbacks + [self.control] if isinstance(cb, ExportableState)]

    def save_state(self, path: str) -> None:
        """trainer_state.json, with the callbacks' states as of now (`ExportableState`, as transformers saves them)."""
        states: dict = {}
        for cb in self._stateful():
            name = type(cb).__name__
            if name in states:
                states[name] = (states[name] if isinstance(states[name], list) else [states[name]]) + [cb.state()]
            else:
                states[name] = cb.state()
        self.state.stateful_callbacks = states
        self.state.save_to_json(path)

    def restore(self, loaded: TrainerState) -> None:
        """A resume: the checkpoint's state, and (`restore_callback_states_from_checkpoint`) its callbacks' states,
        each given to a new callback of its class as transformers' Trainer does."""
        state = self.state
        state.global_step, state.log_history, state.epoch = loaded.global_step, loaded.log_history, loaded.epoch
        state.num_input_tokens_seen = loaded.num_input_tokens_seen
        state.best_metric, state.best_global_step = loaded.best_metric, loaded.best_global_step
        state.best_model_checkpoint = loaded.best_model_checkpoint
        self.last_evaluated = max([int(h["eval_policy_version"]) for h in loaded.log_history
                                   if "eval_policy_version" in h] + [-1])
        if not self.args.restore_callback_states_from_checkpoint:
            return
        missing = []
        for name, data in (loaded.stateful_callbacks or {}).items():
            current = [cb for cb in self.handler.callbacks + [self.control] if type(cb).__name__ == name]
            if not current:
                missing.append(name)
            for cb, saved in zip(current, data if isinstance(data, list) else [data]):
                new = type(cb)(**saved.get("args", {}))
                for attribute, value in saved.get("attributes", {}).items():
                    setattr(new, attribute, value)
                if isinstance(cb, TrainerControl):
                    self.control = new
                else:
                    self.handler.callbacks[self.handler.callbacks.index(cb)] = new
        if missing:
            logger.warning("the checkpoint holds the state of callbacks this run does not have: %s (ignored)",
                           ", ".join(missing))

    def set_samples(self, samples: dict | None) -> None:
        """log_completions: the samples of the step just trained, shown at the next log."""
        self._samples = samples

    def saved(self) -> None:
        self.control = self.handler.on_save(self.args, self.state, self.control)

    def stop_requested(self) -> bool:
        """A callback set `control.should_training_stop` before the last step: as transformers' Trainer, the run
        ends after this step (the trainer ranks agree at the next tick and tell the generator ranks)."""
        stop = bool(self.control.should_training_stop) and 0 < self.state.global_step < self.state.max_steps
        if stop and not self._stop_said:
            self._stop_said = True
            logger.info("a callback ended training at step %d of %d (control.should_training_stop)",
                        self.state.global_step, self.state.max_steps)
        return stop

    def train_end(self) -> dict:
        """The metrics `train()` returns, as transformers' Trainer names them (train_loss: the mean loss of the
        steps run since train_begin; a sample is one completion)."""
        runtime = time.perf_counter() - (self._start or time.perf_counter())
        samples = self.state.global_step * self.args.prompts_per_step * self.args.num_generations
        summary = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(samples / runtime, 3) if runtime else 0.0,
                   "train_steps_per_second": round(self.state.global_step / runtime, 3) if runtime else 0.0,
                   "train_loss": sum(self._losses) / len(self._losses) if self._losses else 0.0}
        # As TRL's `log()`: the metrics gathered since the last logged step (a run shorter than logging_steps, or
        # its last steps) go into this entry, averaged; the Trainer's own per-step logs (loss, grad_norm,
        # learning_rate) are logged only at logging steps, as transformers' `_maybe_log_save_evaluate` does.
        # (TRL's log() updates the very dict train() returns: those metrics are in it too.) TRL merges the metrics of
        # the model's mode: after an evaluation of the last step the model is in eval mode and the training metrics
        # since the last log are left out, as here.
        if self.last_evaluated != self.state.global_step:
            summary.update({k: v for k, v in _mean_of(self._pending).items() if k not in TRAINER_STEP_LOGS})
        self._pending = []
        self.log(dict(summary))
        if self.state.epoch is not None:
            summary["epoch"] = self.state.epoch
        self.control = self.handler.on_train_end(self.args, self.state, self.control)
        return summary

    def abort(self) -> None:
        """The run failed: close the progress bar now, so that the error is the last thing printed."""
        for cb in self.handler.callbacks:
            bar = getattr(cb, "training_bar", None)
            if bar is not None:
                bar.close()
                cb.training_bar = None

    def integration(self, cls_name: str):
        for cb in self.handler.callbacks:
            if type(cb).__name__ == cls_name:
                return cb
        return None


def finite_logs(logs: dict, step: int) -> dict:
    """`logs` without its NaN/inf values, each one named in a warning: the one place every logged metric passes
    (training and evaluation), so no log, callback or `report_to` integration receives a non-finite number. (A
    NaN/inf in what trains the policy never gets this far: the non-finite guard, `runtime.finite`, stops the
    step before the optimizer.)"""
    out = {}
    for key, value in logs.items():
        if isinstance(value, float) and not math.isfinite(value):
            logger.warning("metric %r is %s at step %d: left out of the logs. A metric that can be NaN/inf is a bug "
                           "to report (every metric is guarded where it is computed).", key, value, step)
            continue
        out[key] = value
    return out


def _mean_of(rows: list[dict]) -> dict:
    """Average the steps since the last log (max for `*/max` keys, min for `*/min`)."""
    out = {}
    for key in rows[-1] if rows else []:
        vals = [r[key] for r in rows if key in r and isinstance(r[key], (int, float))]
        if not vals:
            continue
        if key.endswith("/max"):
            out[key] = max(vals)
        elif key.endswith("/min"):
            out[key] = min(vals)
        elif key in ("learning_rate", "reward_errors", "reward_nonfinite", "reward_unscored", "num_tokens") \
                or key.endswith(("/timeouts", "/worker_errors", "/unscored", "/excessive")):  # running totals
            out[key] = vals[-1]
        else:
            out[key] = sum(vals) / len(vals)
    return out


def log_completions(args, step: int, samples: dict) -> None:
    """TRL's `log_completions`: a table of the step's prompts, completions, rewards (one column per function) and
    advantages, printed with rich (`num_completions_to_print` random rows), written to
    `output_dir/completions/completions_{step:05d}.parquet`, and logged as a table to Weights & Biases when
    `report_to` has it."""
    import os

    import pandas as pd
    from transformers.utils import is_rich_available

    extra = samples.get("extra") or {}  # columns reward functions added with log_extra
    rewards = {k: v for k, v in samples.items() if k not in ("prompt", "completion", "advantage", "extra")}
    if is_rich_available():
        from trl.trainer.utils import print_prompt_completions_sample

        print_prompt_completions_sample(samples["prompt"], samples["completion"], rewards, samples["advantage"], step,
                                        args.num_completions_to_print)
    table = pd.DataFrame({"step": [step] * len(samples["prompt"]), "prompt": samples["prompt"],
                          "completion": samples["completion"], **rewards, "advantage": samples["advantage"],
                          **{c: v for c, v in extra.items() if c not in rewards}})
    directory = os.path.join(args.output_dir, "completions")
    os.makedirs(directory, exist_ok=True)
    table.to_parquet(os.path.join(directory, f"completions_{step:05d}.parquet"))
    if args.report_to and "wandb" in args.report_to:
        import wandb

        if wandb.run is not None:
            if args.log_unique_prompts:
                table = table[~table["prompt"].astype(str).duplicated()]
            wandb.log({"completions": wandb.Table(dataframe=table)})
