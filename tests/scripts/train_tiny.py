"""A user script: a few AIPO steps on the tiny model. Runs under python, torchrun or accelerate launch.

    python tests/scripts/train_tiny.py MODEL_DIR OUTPUT_DIR [--steps 3] [--max-staleness 1]
        [--num-generators 1] [--generator-tp N] [--bad-reward raise|length] [--report-to tensorboard] [--reward math_sympy]
"""

import argparse
import json
import os
import time

from datasets import Dataset
from transformers import TrainerCallback

from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
from hfllamarl.testing.tiny import successor_rows


def broken(completions, **kwargs):
    raise RuntimeError("this reward is broken")


def short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def digits(completions, **kwargs):
    """A reward any random model earns unevenly (the share of digits in the completion): the policy moves."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def flat_zero(completions, answer, **kwargs):
    """1.0 whatever the completion for the prompts whose answer is 0 (their groups have no signal), else digits."""
    return [1.0 if a == "0" else score for a, score in zip(answer, digits(completions))]


def noise(completions, **kwargs):
    """A reward that is not the same in two calls (each process's own unseeded random stream, as an API judge or a
    sampled reward is); every call is appended to OUTPUT_DIR/noise-calls.jsonl with the calling process."""
    import random

    scores = [random.SystemRandom().random() for _ in completions]
    with open(os.path.join(NOISE_LOG[0], "noise-calls.jsonl"), "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "rank": int(os.environ.get("RANK", "0")), "n": len(scores)}) + "\n")
    return scores


NOISE_LOG = ["."]


def dump_replicated(trainer, output_dir: str) -> None:
    """Each trainer rank saves the parameters its tensor-parallel group holds whole (replicated over "tp") to
    OUTPUT_DIR/replicated-rank<R>.pt, to compare the peers' copies."""
    import torch
    from torch.distributed.tensor import DTensor

    if trainer.topology.role != "trainer":
        return
    out = {}
    for name, p in trainer.model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        names = p.device_mesh.mesh_dim_names or ()
        if "tp" not in names or p.placements[names.index("tp")].is_replicate():  # (dp has one rank: local is whole)
            out[name] = p.to_local().detach().clone()
    torch.save(out, os.path.join(output_dir, f"replicated-rank{trainer.topology.rank}.pt"))
    with open(os.path.join(output_dir, f"history-rank{trainer.topology.rank}.json"), "w") as fh:
        json.dump(trainer.state.log_history, fh)


class PrintEvaluations(TrainerCallback):
    """Says on stdout when `on_evaluate` fires (evaluation during training)."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero:
            print(f"ON_EVALUATE step={state.global_step} version={metrics['eval_policy_version']:.0f}", flush=True)


class KillAt(TrainerCallback):
    """SIGKILL (or another signal: SIGSTOP freezes it) this process at the end of a given step, once its line of
    that step is written (a SIGKILLed trainer's generator child then dies with it); the time goes to
    OUTPUT_DIR/killed_at."""

    def __init__(self, step, sig: str = "SIGKILL"):
        self.step, self.sig = step, sig

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            import os
            import signal

            with open(os.path.join(args.output_dir, "killed_at"), "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), getattr(signal, self.sig))


class SlowSteps(TrainerCallback):
    """Sleeps this many seconds after every step (a drill that needs the job to outlast a restart); with trainer
    replica groups only after a step that fewer than all groups trained (a survivor slows down while its peer is
    away, and runs at full speed with it)."""

    def __init__(self, seconds, groups=1):
        self.seconds, self.groups, self.trained_by = seconds, groups, 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.trained_by = int((logs or {}).get("replicas/trainer_groups", self.trained_by))

    def on_step_end(self, args, state, control, **kwargs):
        if self.groups == 1 or self.trained_by < self.groups:
            time.sleep(self.seconds)


def dump_trained(output_dir: str) -> None:
    """Trainer replica groups: after every committed step, what this group trained in it (each rollout's tokens and
    behaviour log-probs, its advantage, the shares it made up included; nothing when it took part without rows) goes to
    OUTPUT_DIR/trained-batches-group<G>-rank<R>.jsonl with the global step and the id of the quorum that committed
    it, for a replay of the same rows in one process."""
    from hfllamarl.runtime.training.trainer import TrainerExecutor

    original = TrainerExecutor._replica_gradients

    def replica_gradients(self, rollouts, advantages, old, sampled_offset, *more):
        out = original(self, rollouts, advantages, old, sampled_offset, *more)
        group = self.spec.replica_group
        trained, advantages = self.replica_trained  # (its own share, unless sampled under an old offset; made-up ones)
        line = {"global_step": group.global_step, "group": group.group, "quorum": group._quorum.quorum_id,
                "advantages": advantages.tolist(),
                "rollouts": [{"row": r.row_index, "prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids,
                              "behavior_logprobs": r.behavior_logprobs, "finish_reason": r.finish_reason}
                             for r in trained]}
        name = f"trained-batches-group{group.group}-rank{os.environ.get('RANK', '0')}.jsonl"
        with open(os.path.join(output_dir, name), "a") as fh:
            fh.write(json.dumps(line) + "\n")
        return out

    TrainerExecutor._replica_gradients = replica_gradients


class StopAt(TrainerCallback):
    """Ends training at the end of a given step, as a user's callback does (control.should_training_stop)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class SignalRankAt(TrainerCallback):
    """`STEP:RANK:SIGNAL`: at the end of that step, trainer rank 0 sends SIGNAL to the job's rank RANK (a generator
    child of this process, or a rank started by a launcher on this machine) and writes its pid to
    OUTPUT_DIR/victim.pid: a drill that strikes mid-run at a known step, however fast the steps go."""

    def __init__(self, spec: str, output_dir: str):
        step, rank, sig = spec.split(":")
        self.step, self.rank, self.sig, self.output_dir = int(step), rank, sig, os.path.abspath(output_dir)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or not state.is_world_process_zero:
            return
        import signal

        import psutil

        victim = None
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                mine = any(a == self.output_dir or a.startswith(self.output_dir + os.sep) for a in p.info["cmdline"] or [])
                env = p.environ() if mine and p.pid != os.getpid() else {}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if env.get("HFLLAMARL_RANK", env.get("RANK")) == self.rank:
                victim = p
        if victim is None:
            raise RuntimeError(f"no process of rank {self.rank} writes to {self.output_dir}")
        with open(os.path.join(self.output_dir, "victim.pid"), "w") as fh:
            fh.write(str(victim.pid))
        victim.send_signal(getattr(signal, self.sig))


TRAIN_CALLED = [0.0]  # when this script called train() (wall clock)


class PrintChildren(TrainerCallback):
    """Plain python: says on stdout which generator processes the trainer started ahead of train() and which run
    the job (at the first step)."""

    def __init__(self, topology):
        self.topology = topology
        prestarted = topology._prestarted
        pids = sorted(proc.pid for proc, _ in prestarted.children.values()) if prestarted is not None else []
        print(f"PRESTARTED {pids}", flush=True)
        from hfllamarl.runtime.world import preload

        if preload._OWN.get("proc") is not None:
            print(f"PRELOAD_SERVER {preload._OWN['proc'].pid}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and TRAIN_CALLED[0]:  # (the start-up profile's check, by this script's own clock)
            print(f"FIRST_STEP_AFTER_TRAIN {time.time() - TRAIN_CALLED[0]:.3f}", flush=True)
        if state.global_step == 1 and self.topology.mode == "single":
            print(f"GENERATORS {sorted(proc.pid for _, proc in self.topology._children)}", flush=True)
            print(f"GENERATOR_KINDS {sorted(type(proc).__name__ for _, proc in self.topology._children)}", flush=True)


def kill_inside_checkpoint(step):
    """SIGKILL this process while checkpoint `step` is half-written (its files are there, not yet committed)."""
    import os
    import signal

    from hfllamarl.runtime.weights import checkpoint

    commit = checkpoint.commit

    def commit_or_die(topology, output_dir, at_step, *args, **kwargs):
        if at_step == step and topology.role == "trainer":
            assert os.listdir(checkpoint.partial_dir(output_dir, at_step))
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(topology, output_dir, at_step, *args, **kwargs)

    checkpoint.commit = commit_or_die


def stop_after_checkpoint(step: int, rank: int, output_dir: str):
    """SIGSTOP the job's rank `rank` right after checkpoint `step` is committed (every rank has passed the commit's
    last barrier): that rank stops itself, or (plain python) the trainer stops its generator child, which runs no
    user script. The victim's pid goes to OUTPUT_DIR/victim.pid first."""
    import signal

    from hfllamarl.runtime.weights import checkpoint

    commit = checkpoint.commit

    def commit_then_stop(topology, output_dir_, at_step, *args, **kwargs):
        commit(topology, output_dir_, at_step, *args, **kwargs)
        if at_step != step:
            return
        if topology.rank == rank:
            victim = os.getpid()
        elif topology.mode == "single" and rank in dict(topology._children):
            victim = dict(topology._children)[rank].pid
        else:
            return
        with open(os.path.join(output_dir, "victim.pid"), "w") as fh:
            fh.write(str(victim))
        os.kill(victim, signal.SIGSTOP)

    checkpoint.commit = commit_then_stop


def stop_after_end(rank: int, output_dir: str):
    """SIGSTOP the job's rank `rank` (under a launcher) right after it passed the end-of-job rendezvous: all that is
    left for it is its process's exit. The victim's pid goes to OUTPUT_DIR/victim.pid first."""
    import signal

    from hfllamarl.runtime.world.liveness import Liveness

    finish = Liveness.finish

    def finish_then_stop(self):
        finish(self)
        if self.topology.rank == rank:
            with open(os.path.join(output_dir, "victim.pid"), "w") as fh:
                fh.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)

    Liveness.finish = finish_then_stop


def slow_bootstrap(seconds: float):
    """The trainer's bootstrap batch in progress when the generator becomes ready lasts `seconds` more (a batch
    longer than the generator's start-up wait)."""
    import time as clock

    from hfllamarl.runtime.training.bootstrap import BootstrapSampler
    from hfllamarl.runtime.world.liveness import STARTUP, _reached
    from hfllamarl.runtime.world.startup import generators_reached

    sample, slowed = BootstrapSampler.sample, [False]

    def slow(self, batch_index, version):
        if not slowed[0]:
            from hfllamarl.runtime.world.topology import _TOPOLOGY

            began = clock.monotonic()
            while clock.monotonic() - began < 300 and not generators_reached(_TOPOLOGY, _reached(STARTUP)):
                if generators_reached(_TOPOLOGY, "joining"):
                    _TOPOLOGY.join_bridges()  # (as the trainer does between batches; built once)
                clock.sleep(0.5)
            print(f"SLOW_BOOTSTRAP generator ready; this batch takes {seconds:.0f} s more", flush=True)
            slowed[0] = True
            clock.sleep(seconds)
        return sample(self, batch_index, version)

    BootstrapSampler.sample = slow


def generator_raises(spec: str):
    """`TICK:REPLICA`: the generator ranks of that replica raise at that tick (a replica that fails on its own)."""
    tick, replica = map(int, spec.split(":"))
    from hfllamarl.runtime.generation.generator import GeneratorExecutor

    step = GeneratorExecutor.step

    def failing(self):
        if self.tick == tick and self.topology.replica == replica:
            raise RuntimeError(f"replica {replica} fails at tick {tick}")
        return step(self)

    GeneratorExecutor.step = failing


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("output_dir")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--num-generators", type=int, default=1)
    p.add_argument("--generator-tp", type=int, default=None,
                   help="tensor-parallel size of the generator engine (default: all generator processes)")
    p.add_argument("--bad-reward", default=None)
    p.add_argument("--reward", default="math_sympy", help="reward plugin name used in place of math_sympy")
    p.add_argument("--report-to", default="tensorboard")
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--repeat", type=int, default=1, help="train() again in the same process, as a notebook would")
    p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True)")
    p.add_argument("--signal-rank-at", default=None, help="STEP:RANK:SIGNAL: trainer rank 0 signals that rank then")
    p.add_argument("--kill-at-step", type=int, default=0, help="SIGKILL this process (and so the job) at this step")
    p.add_argument("--freeze-at-step", type=int, default=0, help="SIGSTOP this process at the end of this step "
                   "(the first attempt under a launcher)")
    p.add_argument("--stop-at-step", type=int, default=0, help="a callback ends training at this step")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters on q_proj and v_proj")
    p.add_argument("--save-model", default=None, help="after train(): trainer.save_model(this directory)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient to the reference model")
    p.add_argument("--algorithm", default="aipo", help="algorithm plugin name")
    p.add_argument("--partial-rollout-tokens", type=int, default=None, help="per-tick token budget of a completion")
    p.add_argument("--kill-in-checkpoint", type=int, default=0, help="SIGKILL while this step's checkpoint is written")
    p.add_argument("--stop-after-checkpoint", default=None,
                   help="STEP:RANK: SIGSTOP that rank right after checkpoint STEP is committed")
    p.add_argument("--stop-after-end", type=int, default=None,
                   help="RANK: SIGSTOP that rank right after the end-of-job rendezvous (under a launcher)")
    p.add_argument("--dump-replicated", action="store_true",
                   help="after train(): each trainer rank saves its tensor-parallel-replicated parameters")
    p.add_argument("--slow-bootstrap", type=float, default=0,
                   help="the bootstrap batch in progress when the generator is ready lasts this many seconds more")
    p.add_argument("--generator-raises", default=None, help="TICK:REPLICA: that replica's ranks raise at that tick")
    p.add_argument("--verify-weight-sync", action="store_true", help="check every sync against vLLM's own loader")
    p.add_argument("--timeout", type=float, default=60, help="collective_timeout_s")
    p.add_argument("--startup-timeout", type=float, default=240, help="vllm_server_timeout (start-up budget)")
    p.add_argument("--transforms", action="store_true",
                   help="sample with temperature 0.9, top-k 20, top-p 0.95, min-p 0.02, repetition penalty 1.3")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="generator_kv_cache_bytes (tiny: vLLM fails to start)")
    p.add_argument("--no-bootstrap", action="store_true", help="bootstrap_generation=False: every batch from vLLM")
    p.add_argument("--step-sleep", type=float, default=0, help="sleep this many seconds after every step (with trainer replica groups: "
                   "every step fewer than all groups trained)")
    p.add_argument("--restart-delay", type=float, default=0,
                   help="on a launcher's restart, sleep this many seconds before anything (a slow machine's restart)")
    p.add_argument("--dump-trained", action="store_true",
                   help="replica groups: write what each committed step trained (dump_trained)")
    p.add_argument("--extra", default="{}", help="more AsyncAIPOConfig fields, as a JSON object")
    p.add_argument("--reward-model", default=None, help="also a reward model: the directory of a sequence classifier")
    p.add_argument("--rows", type=int, default=64, help="training dataset rows")
    p.add_argument("--eval-rows", type=int, default=0, help="an eval_dataset of this many rows (set eval_strategy too)")
    a = p.parse_args()
    if a.restart_delay and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        time.sleep(a.restart_delay)
    if a.kill_in_checkpoint:
        kill_inside_checkpoint(a.kill_in_checkpoint)
    if a.stop_after_checkpoint and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # (not on a restart)
        stop_step, stop_rank = map(int, a.stop_after_checkpoint.split(":"))
        stop_after_checkpoint(stop_step, stop_rank, a.output_dir)
    if a.stop_after_end is not None:
        stop_after_end(a.stop_after_end, a.output_dir)
    if a.slow_bootstrap:
        slow_bootstrap(a.slow_bootstrap)
    if a.generator_raises:
        generator_raises(a.generator_raises)
    if a.dump_trained:
        dump_trained(a.output_dir)
    NOISE_LOG[0] = a.output_dir
    rewards = [{"digits": digits, "flat_zero": flat_zero, "noise": noise}.get(a.reward, a.reward)] + ({"raise": [broken], "length": [short]}.get(a.bad_reward, []))
    if a.reward_model:
        rewards.insert(0, a.reward_model)
    config = AsyncAIPOConfig(**dict(dict(
        output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=16, num_generations=4,
        max_completion_length=4, learning_rate=a.learning_rate, logging_steps=1, report_to=a.report_to,
        max_staleness=a.max_staleness, num_generator_processes=a.num_generators, seed=0,
        generator_tensor_parallel_size=a.generator_tp,
        collective_timeout_s=a.timeout, vllm_server_timeout=a.startup_timeout, generator_kv_cache_bytes=a.kv_cache_bytes, save_steps=a.save_steps, beta=a.beta, partial_rollout_tokens=a.partial_rollout_tokens,
        algorithm=a.algorithm, bootstrap_generation=not a.no_bootstrap,
        verify_weight_sync=a.verify_weight_sync,
        **(dict(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.3) if a.transforms else {})),
        **json.loads(a.extra)))  # (--extra overrides)
    for _ in range(a.repeat):
        peft_config = None
        if a.lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                     task_type="CAUSAL_LM")
        eval_dataset = Dataset.from_list(successor_rows(a.eval_rows, seed=3)) if a.eval_rows else None
        trainer = AsyncAIPOTrainer(model=a.model, reward_funcs=rewards, args=config, peft_config=peft_config,
                                   train_dataset=Dataset.from_list(successor_rows(a.rows, seed=2)), eval_dataset=eval_dataset,
                                   callbacks=[PrintEvaluations()] if a.eval_rows else None)
        trainer.add_callback(PrintChildren(trainer.topology))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # (a launcher's restart: no drill)
        if a.kill_at_step and first_attempt:
            trainer.add_callback(KillAt(a.kill_at_step))
        if a.freeze_at_step and first_attempt:
            trainer.add_callback(KillAt(a.freeze_at_step, "SIGSTOP"))
        if a.signal_rank_at and first_attempt:
            trainer.add_callback(SignalRankAt(a.signal_rank_at, a.output_dir))
        if a.stop_at_step:
            trainer.add_callback(StopAt(a.stop_at_step))
        if a.step_sleep:
            trainer.add_callback(SlowSteps(a.step_sleep, int(json.loads(a.extra).get("trainer_replica_groups", 1))))
        TRAIN_CALLED[0] = time.time()
        out = trainer.train(resume_from_checkpoint=True if a.resume else None)
        # what open-r1's grpo.py does after train(), on every process (a generator rank included)
        trainer.log_metrics("train", dict(out.metrics, train_samples=a.rows))
        trainer.save_metrics("train", dict(out.metrics, train_samples=a.rows))
        trainer.save_state()
        if a.save_model:
            trainer.save_model(a.save_model)
        if a.dump_replicated:
            dump_replicated(trainer, a.output_dir)
        trainer.model.generation_config.eos_token_id = trainer.processing_class.eos_token_id
        if trainer.accelerator.is_main_process:
            trainer.create_model_card(dataset_name="successor", tags=["tiny"])
            trainer.model.config.use_cache = True
        if trainer.state is not None and trainer.state.is_world_process_zero:
            print("LOG_HISTORY " + json.dumps(trainer.state.log_history), flush=True)
            print("STARTUP " + json.dumps(trainer.startup_profile), flush=True)
            print(f"TRAINED global_step={out.global_step}", flush=True)


if __name__ == "__main__":
    main()
