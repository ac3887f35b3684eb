"""What scripts call on a trainer besides train(), checked against transformers' own Trainer where it has one."""

import math

import pytest
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hfllamarl import AsyncAIPOConfig
from hfllamarl.runtime.reporting import Reporter
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

    from hfllamarl.runtime import checkpoint
    from hfllamarl.runtime.schedule import Schedule
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
