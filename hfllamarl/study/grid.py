"""The staleness study's grid: which runs make it, how each is configured, and running them resumably.

A cell is (task, loss, correction, staleness); a run is a cell with a seed. Runs go to worker processes (one
thread each, `--jobs` at once) and each finished run is appended as one JSON line to `runs.jsonl` in the output
directory, so a cut-off grid restarts where it stopped (the runner is deterministic: a run done again gives the same
line).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import time
from dataclasses import dataclass

#: The losses of the study: AIPO and every TRL `loss_type`, and GSPO (TRL's sequence-level ratio), as config fields.
LOSSES = {
    "aipo": {"algorithm": "aipo"},
    **{name: {"algorithm": "grpo", "loss_type": name}
       for name in ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo", "vespo")},
    # ScaleRL's epsilon_max for CISPO's truncated weight, as TRL's docs recommend it
    "cispo": {"algorithm": "grpo", "loss_type": "cispo", "epsilon_high": 5.0},
    "gspo": {"algorithm": "grpo", "loss_type": "grpo", "importance_sampling_level": "sequence"},
    # GSPO as TRL's paper index configures it: the paper's clip range, sized for one batch's own drift
    "gspo_paper": {"algorithm": "grpo", "loss_type": "grpo", "importance_sampling_level": "sequence",
                   "epsilon": 3e-4, "epsilon_high": 4e-4},
}

#: The corrections of the study (`off_policy_correction` names; "none": no correction).
CORRECTIONS = ("none", "aipo", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "coupled",
               "decoupled", "a3po", "m2po", "ess")
SEQUENCE_LEVEL = ("sequence_truncate", "sequence_mask", "ess")  # (vespo takes token-level corrections only)
#: Every correction name the study takes: the above, each with VCPO's step rule on top ("<name>+ess") and each with
#: the trust-region mask on top, around the anchor ("<name>+trust") or the sampler ("<name>+sampler_trust").
KNOWN_CORRECTIONS = (CORRECTIONS + tuple(f"{c}+ess" for c in CORRECTIONS if c not in ("none", "ess"))
                     + tuple(f"{c}+{t}" for t in ("trust", "sampler_trust") for c in CORRECTIONS if c != "none"))

STALENESS = (0, 1, 2, 4, 8, 16)
COMPLETIONS_PER_STEP, GENERATIONS = 64, 8


#: The suffix of a study correction whose runs sample with the weights predicted for the version that trains them
#: (`sampler_lookahead='adamw'`, `hfllamarl.runtime.weights.lookahead`): "token_truncate@lookahead".
LOOKAHEAD = "@lookahead"


def split_lookahead(correction: str) -> tuple[str, bool]:
    """A study correction's `off_policy_correction`, and whether its runs sample with lookahead weights."""
    return (correction[:-len(LOOKAHEAD)], True) if correction.endswith(LOOKAHEAD) else (correction, False)


def sync_correction(loss: str) -> str:
    """The correction a synchronous run of `loss` gets ("auto" at max_staleness 0: TRL's fields, i.e. AIPO's
    truncation for aipo, TRL's sequence_mask at 3 for the others, token_truncate at 3 for vespo, which TRL requires
    a token-level correction for)."""
    return "aipo" if loss == "aipo" else "token_truncate" if loss == "vespo" else "sequence_mask"


def default_correction(loss: str, staleness: int) -> str:
    """The correction "auto" gives `loss` at `staleness` (`hfllamarl.corrections.STALENESS_DEFAULTS`)."""
    from hfllamarl.corrections import staleness_default, study_loss

    fields = LOSSES[loss]
    name = study_loss(fields["algorithm"], fields.get("loss_type"), fields.get("importance_sampling_level"))
    return (staleness_default(name, staleness) or sync_correction(loss)) if staleness else sync_correction(loss)


@dataclass(frozen=True)
class Cell:
    task: str
    loss: str
    correction: str
    staleness: int

    @property
    def key(self) -> str:
        return f"{self.task}/{self.loss}/{self.correction}/s{self.staleness}"

    def config(self, seed: int, steps: int, learning_rate: float, max_completion_length: int,
               output_dir: str) -> dict:
        """The `AsyncAIPOConfig` fields of this cell's run with `seed` (a correction named with LOOKAHEAD samples
        with `sampler_lookahead='adamw'`)."""
        correction, lookahead = split_lookahead(self.correction)
        extra = {"sampler_lookahead": "adamw"} if lookahead else {}
        return dict(LOSSES[self.loss], **extra, off_policy_correction=correction, max_staleness=self.staleness, seed=seed,
                    max_steps=steps, learning_rate=learning_rate, lr_scheduler_type="constant",
                    per_device_train_batch_size=COMPLETIONS_PER_STEP, num_generations=GENERATIONS,
                    max_completion_length=max_completion_length, output_dir=output_dir)


def plan(tasks: list[str], losses: list[str], staleness: list[int], correction_task: str | None,
         correction_losses: list[str], corrections: list[str], correction_staleness: list[int]) -> list[Cell]:
    """The cells the study needs (not a full cross product):

    (a) on every task, each loss synchronous and with its default correction at each of `staleness`, and AIPO
        without any correction at the largest;
    (b) on `correction_task`, each of `correction_losses` with every one of `corrections` and its default at each
        of `correction_staleness` (and synchronous).
    """
    cells: list[Cell] = []
    for task in tasks:
        for loss in losses:
            cells.append(Cell(task, loss, sync_correction(loss), 0))
            cells += [Cell(task, loss, default_correction(loss, s), s) for s in staleness if s]
        if staleness and "aipo" in losses:
            cells.append(Cell(task, "aipo", "none", max(staleness)))
    if correction_task:
        for loss in correction_losses:
            cells.append(Cell(correction_task, loss, sync_correction(loss), 0))
            for s in filter(None, correction_staleness):
                chosen = list(corrections) + [c for c in (default_correction(loss, s),) if c not in corrections]
                cells += [Cell(correction_task, loss, c, s) for c in chosen
                          if not (loss == "vespo" and split_lookahead(c)[0].split(":")[0].split("+")[0] in SEQUENCE_LEVEL)]
    seen, out = set(), []
    for cell in cells:
        if cell.key not in seen:
            seen.add(cell.key)
            out.append(cell)
    return out


def _run_one(job: dict) -> dict:
    """Worker process: one run (see `hfllamarl.study.lockstep`)."""
    import torch

    torch.set_num_threads(job["threads"])
    from hfllamarl.study.lockstep import run
    from hfllamarl.study.tasks import TASKS

    task = TASKS[job["task"]]
    start = time.perf_counter()
    try:
        record = run(job["model"], task.rows(), task.reward, job["config"])
    except Exception as exc:  # (a run that fails is recorded as such; the grid goes on)
        return {**job["id"], "error": f"{type(exc).__name__}: {exc}", "wall_seconds": time.perf_counter() - start}
    return {**job["id"], **record, "wall_seconds": time.perf_counter() - start}


def done_runs(path: str) -> dict[tuple[str, int], dict]:
    """The runs `runs.jsonl` holds, by (cell key, seed) (a line cut off mid-write is ignored)."""
    runs = {}
    if os.path.isfile(path):
        with open(path) as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "error" not in record:  # (a run that failed is run again)
                    runs[(record["cell"], record["seed"])] = record
    return runs


def run_grid(cells: list[Cell], seeds: list[int], output_dir: str, models: dict[str, str], budgets: dict[str, dict],
             jobs: int, threads: int = 1, log=print, stall_s: float = 3600.0) -> dict[tuple[str, int], dict]:
    """Run every (cell, seed) not in `output_dir/runs.jsonl` yet, `jobs` at once; returns all the runs.

    Args:
        models: the model directory of each task.
        budgets: per task {"steps", "learning_rate", "max_completion_length"}.
        stall_s: how long the grid waits for the next run to finish before it stops, naming the runs in flight.
    """
    path = os.path.join(output_dir, "runs.jsonl")
    runs = done_runs(path)
    todo = [(cell, seed) for seed in seeds for cell in cells if (cell.key, seed) not in runs]
    if runs:
        log(f"resuming: {len(runs)} run(s) in {path}, {len(todo)} to go")
    if not todo:
        return runs
    pending = []
    for cell, seed in todo:
        budget = budgets[cell.task]
        scratch = os.path.join(output_dir, "scratch", cell.key.replace("/", "-") + f"-seed{seed}")
        pending.append({"id": {"cell": cell.key, "task": cell.task, "loss": cell.loss, "correction": cell.correction,
                               "staleness": cell.staleness, "seed": seed, "steps": budget["steps"]},
                        "task": cell.task, "model": models[cell.task], "threads": threads,
                        "config": cell.config(seed, budget["steps"], budget["learning_rate"],
                                              budget["max_completion_length"], scratch)})
    started, finished = time.perf_counter(), 0
    context = multiprocessing.get_context("spawn")
    # (no max_tasks_per_child: Python 3.11's pool can hang replacing a retired worker)
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context)
    try:
        futures = {pool.submit(_run_one, job): job for job in pending}
        remaining = set(futures)
        with open(path, "a") as out:
            while remaining:
                done, remaining = concurrent.futures.wait(remaining, timeout=stall_s,
                                                          return_when=concurrent.futures.FIRST_COMPLETED)
                if not done:
                    running = [f"{futures[f]['id']['cell']} seed {futures[f]['id']['seed']}" for f in remaining
                               if f.running()]
                    raise SystemExit(f"the grid stalled: no run finished in {stall_s:.0f} s; in flight: {running}. The "
                                     f"finished runs are in {path}: the same command resumes from them.")
                for future in done:
                    record = future.result()
                    _append(out, runs, record)
                    finished += 1
                    elapsed = time.perf_counter() - started
                    status = record.get("error") or f"final reward {_final(record):.3f}"
                    log(f"[{finished}/{len(pending)}] {record['cell']} seed {record['seed']}: {status} "
                        f"({record['wall_seconds']:.0f} s; {elapsed / finished * (len(pending) - finished) / 60:.0f} "
                        "min left)")
    except concurrent.futures.process.BrokenProcessPool as exc:
        raise SystemExit(f"a run's worker process died ({exc}); the finished runs are in {path}: the same command "
                         "resumes from them.") from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return runs


def _append(out, runs: dict, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()
    runs[(record["cell"], record["seed"])] = record


def _final(record: dict) -> float:
    from hfllamarl.study.stats import final_reward

    return final_reward(record["series"]["reward"])
