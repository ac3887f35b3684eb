"""What scripts call on a trainer besides train(), checked against transformers' own Trainer where it has one."""

import math

import pytest
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hfllamarl import AsyncAIPOConfig
from hfllamarl.runtime.training.reporting import Reporter
from hfllamarl.trainers.script_api import GeneratorRankModel
from hfllamarl.trainers.trainer_ranks import build_optimizer


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, attention_bias=True)
    return LlamaForCausalLM(config)


def test_weight_decay_spares_the_parameters_transformers_spares(tmp_path):
    model = tiny_llama()
    args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", weight_decay=0.1)
    optimizer = build_optimizer(model, args)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    spared = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    hf = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True))
    assert decayed == set(hf.get_decay_parameter_names(model))
    assert spared == set(names.values()) - decayed
    assert any("norm" in n for n in spared) and any(n.endswith("bias") for n in spared)  # (the case is exercised)


def test_adamw_torch_fused_is_the_fused_kernel_transformers_builds(tmp_path):
    """optim="adamw_torch_fused" (transformers' default) builds the fused AdamW transformers' Trainer builds; its step
    equals the default AdamW's to fp32 rounding."""
    import torch

    steps = []
    for optim in ("adamw_torch_fused", "adamw_torch"):
        torch.manual_seed(0)
        model = tiny_llama()
        args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", optim=optim, weight_decay=0.1)
        optimizer = build_optimizer(model, args)
        hf = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                                         optim=optim))
        ours, theirs = optimizer.defaults["fused"], hf.create_optimizer().defaults["fused"]
        assert bool(ours) == bool(theirs) == (optim == "adamw_torch_fused")
        for p in model.parameters():
            p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32)).reshape(p.shape)
        optimizer.step()
        steps.append([p.detach().clone() for p in model.parameters()])
    for fused, plain in zip(*steps):
        assert torch.allclose(fused, plain, atol=1e-6, rtol=1e-5)


def test_a_fraction_of_logging_steps_is_a_share_of_the_run(tmp_path):
    args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", logging_steps=0.25, disable_tqdm=True)
    reporter = Reporter(args, None, None, None, None, [], max_steps=10, is_world_zero=True)
    assert reporter.state.logging_steps == 3  # transformers: ceil(max_steps * logging_steps)


def test_a_generator_rank_model_has_config_and_generation_config(tmp_path):
    model = tiny_llama()
    model.generation_config = GenerationConfig(eos_token_id=5, max_new_tokens=9)
    model.save_pretrained(tmp_path)
    on_generator = GeneratorRankModel(model.config, str(tmp_path))
    assert on_generator.generation_config.max_new_tokens == 9
    on_generator.generation_config.eos_token_id = 7  # what open-r1's script does on every process
    assert on_generator.generation_config.eos_token_id == 7
    assert on_generator.config.hidden_size == 32
    with pytest.raises(AttributeError, match="generator rank, where the policy is held by vLLM"):
        on_generator.parameters()
    bare = GeneratorRankModel(model.config, str(tmp_path / "missing"))  # no generation_config.json: the default
    assert bare.generation_config.eos_token_id == model.config.eos_token_id


def test_epoch_logging_train_metrics_and_an_early_stop_request(tmp_path, caplog):
    """logging_strategy="epoch" logs at each pass's end (on_epoch_end, as transformers' Trainer); train_end returns
    transformers' metric names, train_loss the mean step loss; a callback's early stop is a stop request until the last
    step (the trainer ranks then end the run: `test_trl_parity` checks it against TRL)."""
    from transformers import TrainerCallback

    class StopAtOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", logging_strategy="epoch", disable_tqdm=True,
                           per_device_train_batch_size=8, num_generations=4)
    reporter = Reporter(args, None, None, None, None, [StopAtOne()], max_steps=4, is_world_zero=True,
                        batches_per_epoch=2)
    reporter.train_begin()
    stops = []
    with caplog.at_level("INFO"):
        for step, loss in zip(range(1, 5), (1.0, 2.0, 3.0, 6.0)):
            reporter.step_begin()
            reporter.step_end(step, {"loss": loss})
            stops.append(reporter.stop_requested())
    assert stops == [True, True, True, False]  # (at the last step the run ends anyway)
    assert [h["step"] for h in reporter.state.log_history] == [2, 4]
    assert sum("a callback ended training at step 1 of 4" in r.message for r in caplog.records) == 1
    summary = reporter.train_end()
    assert summary["train_loss"] == 3.0 and summary["epoch"] == 2.0
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second"} <= set(summary)


@pytest.mark.parametrize("max_steps,save_steps", [(10, 4), (12, 4), (5, 0.5), (3, 500), (7, 1)])
def test_the_steps_checkpointed_are_those_transformers_trainer_saves(tmp_path, max_steps, save_steps):
    """save_strategy="steps": every save_steps steps (a fraction: a share of the run) and the last step, as
    transformers' DefaultFlowCallback decides step by step; the generator asks the same question of its clock."""
    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

    from hfllamarl.runtime.weights import checkpoint
    from hfllamarl.runtime.loop.schedule import Schedule
    from hfllamarl.trainers.trainer_ranks import save_every

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", save_strategy="steps",
                             save_steps=save_steps, use_cpu=True)
    state = TrainerState(max_steps=max_steps)
    state.save_steps = math.ceil(max_steps * save_steps) if save_steps < 1 else save_steps  # (as train() sets it)
    flow, theirs = DefaultFlowCallback(), []
    for step in range(1, max_steps + 1):
        state.global_step = step
        if flow.on_step_end(args, state, TrainerControl()).should_save:
            theirs.append(step)
    every = save_every(AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", save_steps=save_steps),
                       max_steps)
    ours = [step for step in range(1, max_steps + 1) if checkpoint.due(step, every, max_steps)]
    assert ours == theirs and theirs[-1] == max_steps
    schedule = Schedule(max_steps, max_staleness=2)  # the generator: the step complete at each of its ticks
    assert [schedule.step_done(t) for t in range(schedule.num_ticks)
            if checkpoint.due(schedule.step_done(t), every, max_steps)] == theirs


def test_early_stopping_callback_stops_where_transformers_trainer_would(tmp_path):
    """EarlyStoppingCallback with metric_for_best_model: after each evaluation the best metric is updated as
    transformers' `Trainer._determine_best_metric` does (after on_evaluate); the run stops at the same evaluation;
    the callback's patience counter is saved in trainer_state.json and, on resume
    (restore_callback_states_from_checkpoint), given back to the run's callback; the best checkpoint survives
    save_total_limit."""
    from types import SimpleNamespace

    from transformers import EarlyStoppingCallback
    from transformers.trainer_callback import TrainerControl, TrainerState
    from transformers.trainer_utils import rotate_checkpoints

    from hfllamarl.runtime.weights import checkpoint

    rewards = [0.2, 0.5, 0.4, 0.5, 0.45, 0.6]  # eval_reward at versions 1..6: best 0.5 at 2, then 3 evaluations worse
    args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, save_steps=1,
                           save_total_limit=1, metric_for_best_model="reward", eval_strategy="steps", eval_steps=1,
                           restore_callback_states_from_checkpoint=True)
    assert args.greater_is_better  # (TrainingArguments: a metric not ending in "loss")
    # transformers: on_evaluate, then _determine_best_metric
    theirs = SimpleNamespace(args=args, state=TrainerState(), callback=EarlyStoppingCallback(early_stopping_patience=3))
    their_stop = their_best = None
    for version, value in enumerate(rewards, 1):
        theirs.state.global_step = version
        control = TrainerControl()
        theirs.callback.on_evaluate(args, theirs.state, control, metrics={"eval_reward": value})
        Trainer._determine_best_metric(theirs, {"eval_reward": value}, None)
        if control.should_training_stop and their_stop is None:
            their_stop, their_best = version, (theirs.state.best_metric, theirs.state.best_global_step)

    reporter = Reporter(args, None, None, None, None, [EarlyStoppingCallback(early_stopping_patience=3)], max_steps=9,
                        is_world_zero=True)
    reporter.train_begin()
    ours = None
    for version, value in enumerate(rewards, 1):
        reporter.step_begin()
        reporter.step_end(version, {"loss": 0.0})
        reporter.evaluate({"eval_reward": value, "eval_policy_version": version})
        (tmp_path / f"checkpoint-{version}").mkdir()
        (tmp_path / f"checkpoint-{version}" / checkpoint.MARKER).write_text("{}")
        reporter.note_checkpoint(version, saving=True)
        rotate_checkpoints(str(tmp_path), 1, best_model_checkpoint=reporter.state.best_model_checkpoint)
        if version == 3:
            reporter.save_state(str(tmp_path / "trainer_state.json"))
        if reporter.stop_requested():
            ours = version
            break
    assert ours == their_stop == 5 and their_best == (0.5, 2)
    assert (reporter.state.best_metric, reporter.state.best_global_step) == their_best
    assert reporter.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5"]
    # a resume from version 3: the callback has seen one worse evaluation, so two more stop the run
    resumed = Reporter(args, None, None, None, None, [EarlyStoppingCallback(early_stopping_patience=3)],
                       max_steps=9, is_world_zero=True)
    resumed.restore(TrainerState.load_from_json(str(tmp_path / "trainer_state.json")))
    early = [cb for cb in resumed.handler.callbacks if isinstance(cb, EarlyStoppingCallback)]
    assert len(early) == 1 and early[0].early_stopping_patience_counter == 1
    assert (resumed.state.best_metric, resumed.state.best_global_step) == (0.5, 2)
    with pytest.raises(KeyError, match="metric_for_best_model='reward': the evaluation has no 'eval_reward'"):
        resumed.evaluate({"eval_accuracy": 1.0})


def test_remove_unused_columns_keeps_the_columns_trls_trainer_keeps(tmp_path):
    """remove_unused_columns=True: the columns left are those TRL's GRPOTrainer leaves (transformers'
    `_remove_unused_columns` with GRPOTrainer's signature columns), so reward functions see the same; False: all."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from hfllamarl.trainers.async_aipo_trainer import _used_columns

    data = Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"], "level": [3]})
    for remove in (True, False):
        args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, remove_unused_columns=remove)
        trl = SimpleNamespace(args=args, _signature_columns=None, model=None)
        trl._set_signature_columns_if_needed = lambda: GRPOTrainer._set_signature_columns_if_needed(trl)
        theirs = Trainer._remove_unused_columns(trl, data)
        assert _used_columns(data, args).column_names == theirs.column_names == (
            ["prompt"] if remove else ["prompt", "answer", "level"])


@pytest.mark.parametrize("strategy,eval_steps,delay", [("steps", 2, 3), ("steps", 1, 0), ("steps", 3, 7.5),
                                                        ("epoch", None, 2)])
def test_evaluations_wait_for_eval_delay_as_transformers_trainer(tmp_path, strategy, eval_steps, delay):
    """The policy versions the generator evaluates are the steps DefaultFlowCallback asks an evaluation at."""
    from types import SimpleNamespace

    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

    from hfllamarl.runtime.generation.generator import GeneratorExecutor
    from hfllamarl.runtime.loop.schedule import Schedule
    from hfllamarl.trainers.trainer_ranks import eval_delay, eval_every

    steps, per_epoch = 12, 3
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", eval_strategy=strategy, eval_steps=eval_steps,
                             eval_delay=delay, use_cpu=True)
    state = TrainerState(max_steps=steps)
    state.eval_steps = eval_steps
    flow, theirs = DefaultFlowCallback(), []
    for step in range(1, steps + 1):
        state.global_step, state.epoch = step, step / per_epoch
        control = TrainerControl()
        flow.on_step_end(args, state, control)
        if strategy == "epoch" and step % per_epoch == 0:
            flow.on_epoch_end(args, state, control)
        if control.should_evaluate:
            theirs.append(step)
    every, delay_versions = eval_every(args, steps, per_epoch), eval_delay(args, per_epoch)
    spec = SimpleNamespace(eval_every=every, eval_on_start=False,
                           schedule=Schedule(steps, 0, eval_every=every, eval_delay=delay_versions, eval_last=True))
    ours = []
    for version in range(1, steps + 1):
        gen = SimpleNamespace(eval_dataset=[1], spec=spec, version=version, evaluated=version - 1, tick=version,
                              topology=SimpleNamespace(replica=0), live=[0])
        if GeneratorExecutor.eval_due(gen):
            ours.append(version)
    assert ours == theirs and (theirs or delay > steps)


def test_num_input_tokens_seen_is_logged_when_asked(tmp_path):
    for asked in ("all", "no"):
        args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, logging_steps=1,
                               include_num_input_tokens_seen=asked)
        reporter = Reporter(args, None, None, None, None, [], max_steps=2, is_world_zero=True)
        reporter.state.num_input_tokens_seen = 123  # (the trainer adds each step's prompt + completion tokens)
        reporter.step_end(2, {"loss": 0.5})  # (a logging step)
        assert reporter.state.log_history[-1].get("num_input_tokens_seen") == (123 if asked == "all" else None)


@pytest.mark.parametrize("limit,best", [(1, None), (1, 2), (2, 3), (3, 5), (2, 6)])
def test_checkpoint_rotation_is_transformers_and_keeps_pending_evaluations(tmp_path, limit, best):
    """save_total_limit: the checkpoints left are those transformers' rotate_checkpoints leaves (the newest and the
    best kept); a checkpoint whose evaluation has not arrived yet is kept too."""
    from transformers.trainer_utils import rotate_checkpoints

    from hfllamarl.runtime.weights import checkpoint

    def make(root):
        for step in range(1, 7):
            (root / f"checkpoint-{step}").mkdir(parents=True)
            (root / f"checkpoint-{step}" / checkpoint.MARKER).write_text("{}")
        return str(root / f"checkpoint-{best}") if best else None

    keep = make(tmp_path / "ours")
    checkpoint.prune(str(tmp_path / "ours"), limit, [keep])
    rotate_checkpoints(str(tmp_path / "theirs"), limit, best_model_checkpoint=make(tmp_path / "theirs"))
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(p.name for p in (tmp_path / "theirs").iterdir())
    pending = make(tmp_path / "pending")
    checkpoint.prune(str(tmp_path / "pending"), limit, [pending, str(tmp_path / "pending" / "checkpoint-5")])
    left = {p.name for p in (tmp_path / "pending").iterdir()}
    assert {"checkpoint-5", "checkpoint-6"} <= left and len(left) == max(limit, 2 + (best not in (None, 5, 6)))
