"""TRL's own GRPOTrainer training tests (tests/test_grpo_trainer.py, TRL 1.16), each run under TRL's GRPOTrainer and
under AsyncAIPOTrainer with the same configuration and the same assertions.

The configurations are TRL's, plus `CPU` (no bf16 here) and `max_steps=2` where TRL trains a whole epoch of 17
steps: its assertions (train_loss logged, every parameter changed) hold after one optimizer step with
learning_rate=0.1. The cases that only construct a trainer or call a pure function are in
test_trl_grpo_port_checks.py; the TRL cases left out, and why, are listed there.
"""

import asyncio

import pytest
import torch

from trl_port_support import (assert_all_changed, by_side, classes, finish, make_args, port_models,  # noqa: F401
                              run, sides, snapshot, whole, zen)

pytestmark = pytest.mark.slow

# TRL's settings shared by most training cases ("reduce ... to reduce memory usage"), and the shortened run.
SMALL = dict(per_device_train_batch_size=3, num_generations=3, max_completion_length=8, max_steps=2)
LR = dict(learning_rate=0.1, **SMALL)  # "use higher lr because gradients are tiny"


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def unique_letters_reward(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def train_and_check(side, tmp_path, port_models, reward_funcs="reward", dataset=None, **config):
    """TRL's most common case body: construct, snapshot, train, then train_loss logged and every parameter changed."""
    Config, Trainer = classes(side)
    if reward_funcs == "reward":
        reward_funcs = port_models["reward"]
    trainer = Trainer(model=port_models["model"], reward_funcs=reward_funcs, args=make_args(Config, tmp_path, **config),
                      train_dataset=zen() if dataset is None else dataset)
    return run(trainer, snapshot(trainer))


@pytest.mark.parametrize("side", sides())
def test_train(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, **LR)


@pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
@pytest.mark.parametrize("side", sides())
def test_train_dataset_format(side, config_name, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, dataset=zen(config_name), **LR)


@pytest.mark.parametrize("loss_type,side", by_side(("bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")))
def test_train_loss_types(side, loss_type, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, loss_type=loss_type,
                    importance_sampling_level="sequence" if loss_type == "luspo" else "token",
                    gradient_accumulation_steps=2, **dict(LR, max_completion_length=32))


EVAL = dict(per_device_train_batch_size=3, per_device_eval_batch_size=3, num_generations=3, max_completion_length=8,
            eval_strategy="steps", eval_steps=2)


@pytest.mark.parametrize("extra", [{}, {"num_generations_eval": 1}, {"eval_on_start": True, "loss_type": "grpo",
                                                                      "learning_rate": 0.1}],
                         ids=["with_eval", "num_generations_eval", "eval_on_start"])
@pytest.mark.parametrize("side", sides())
def test_train_with_eval(side, extra, tmp_path, port_models):
    # TRL's test_train_with_eval, test_train_with_num_generations_eval and test_train_eval_on_start: train() with an
    # eval set completes (max_steps=2 so that the eval_steps=2 evaluation is inside the run).
    Config, Trainer = classes(side)
    data = zen(split=None)
    trainer = Trainer(model=port_models["model"], reward_funcs=port_models["reward"],
                      args=make_args(Config, tmp_path, max_steps=2, **EVAL, **extra),
                      train_dataset=data["train"], eval_dataset=data["test"])
    try:
        trainer.train()
    finally:
        finish(trainer)


@pytest.mark.parametrize("side", sides())
def test_train_with_iterable_dataset(side, tmp_path, port_models):
    Config, Trainer = classes(side)
    if side == "hfllamarl":  # refused: the generators' schedule picks prompts by row index (and a resume needs it)
        with pytest.raises(ValueError, match=r"IterableDataset \(streamed\), which is not supported"):
            Trainer(model=port_models["model"], reward_funcs=port_models["reward"], train_dataset=zen(streaming=True),
                    args=make_args(Config, tmp_path, **dict(LR, max_steps=4)))
        return
    trainer = Trainer(model=port_models["model"], reward_funcs=port_models["reward"],
                      args=make_args(Config, tmp_path, **dict(LR, max_steps=4)),
                      train_dataset=zen(streaming=True))
    assert trainer.args.accelerator_config.dispatch_batches is False
    run(trainer, snapshot(trainer))


@pytest.mark.parametrize("side", sides())
def test_train_multiple_iterations(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, num_iterations=2, **LR)


def peft_case(side, tmp_path, port_models, as_peft_model=False, **config):
    """TRL's LoRA cases: LoRA parameters change, the base model's do not."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    Config, Trainer = classes(side)
    model = AutoModelForCausalLM.from_pretrained(port_models["model"], dtype="float32")
    base_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    extra = {"peft_config": LoraConfig()}
    if as_peft_model:
        model, extra = get_peft_model(model, LoraConfig()), {}
    trainer = Trainer(model=model, reward_funcs=port_models["reward"], args=make_args(Config, tmp_path, **config),
                      train_dataset=zen(), **extra)
    before = snapshot(trainer)
    try:
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        for n, old in before.items():
            new = whole(trainer.model.get_parameter(n))
            if n in base_names:
                torch.testing.assert_close(old, new, msg=f"Parameter {n} has changed.")
            elif "base_layer" not in n and "ref" not in n:
                assert not torch.equal(old, new), f"Parameter {n} has not changed."
    finally:
        finish(trainer)


@pytest.mark.parametrize("side", sides())
def test_train_peft_config(side, tmp_path, port_models):
    peft_case(side, tmp_path, port_models, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_peft_model(side, tmp_path, port_models):
    peft_case(side, tmp_path, port_models, as_peft_model=True, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_peft_with_gradient_checkpointing(side, tmp_path, port_models):
    peft_case(side, tmp_path, port_models, gradient_checkpointing=True, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_different_reward_model(side, tmp_path, port_models):
    # TRL: a Llama reward model with its own tokenizer and a pad token distinct from its end of turn.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_model = AutoModelForSequenceClassification.from_pretrained(port_models["reward_llama"])
    reward_tokenizer = AutoTokenizer.from_pretrained(port_models["reward_llama"])
    Config, Trainer = classes(side)
    trainer = Trainer(model=port_models["model"], reward_funcs=reward_model, args=make_args(Config, tmp_path, **LR),
                      train_dataset=zen("conversational_prompt_only"), reward_processing_classes=reward_tokenizer)
    run(trainer, snapshot(trainer))


@pytest.mark.parametrize("side", sides())
def test_train_reward_func_standard(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, reward_funcs=length_reward, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_reward_func_conversational(side, tmp_path, port_models):
    def reward_func(completions, **kwargs):
        return [float(len(c[0]["content"])) for c in completions]

    train_and_check(side, tmp_path, port_models, reward_funcs=reward_func,
                    dataset=zen("conversational_prompt_only"), **LR)


@pytest.mark.parametrize("side", sides())
def test_train_multiple_reward_funcs(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, reward_funcs=[length_reward, unique_letters_reward], **LR)


@pytest.mark.parametrize("side", sides())
def test_train_sync_and_async_reward_funcs(side, tmp_path, port_models):
    def ones(completions, **kwargs):
        return [1 for _ in completions]

    async def async_unique(completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(set(c))) for c in completions]

    train_and_check(side, tmp_path, port_models, reward_funcs=[length_reward, ones, async_unique], **LR)


@pytest.mark.parametrize("side", sides())
def test_train_multiple_reward_funcs_with_None_output(side, tmp_path, port_models):
    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    Config, Trainer = classes(side)
    trainer = Trainer(model=port_models["model"], reward_funcs=[length_reward, not_applicable],
                      args=make_args(Config, tmp_path, **LR), train_dataset=zen())
    run(trainer, snapshot(trainer, trainable_only=True))


@pytest.mark.parametrize("side", sides())
def test_train_multiple_reward_funcs_with_weights(side, tmp_path, port_models):
    last = train_and_check(side, tmp_path, port_models, reward_funcs=[length_reward, unique_letters_reward],
                           reward_weights=[0.7, 0.3], **LR)
    for key in ("rewards/length_reward/mean", "rewards/length_reward/std", "rewards/unique_letters_reward/mean",
                "rewards/unique_letters_reward/std"):
        assert key in last, key


@pytest.mark.parametrize("aggregation,side", by_side(("sum_then_normalize", "normalize_then_sum")))
def test_reward_metric_reflects_reward_weights(side, aggregation, tmp_path, port_models):
    def one(completions, **kwargs):
        return [1.0] * len(completions)

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    Config, Trainer = classes(side)
    trainer = Trainer(model=port_models["model"], reward_funcs=[one, zero], train_dataset=zen(),
                      args=make_args(Config, tmp_path, reward_weights=[0.7, 0.3],
                                     multi_objective_aggregation=aggregation, **LR))
    try:
        trainer.train()
        assert abs(trainer.state.log_history[-1]["reward"] - 0.7) < 1e-5  # 0.7 * 1 + 0.3 * 0, weighted
    finally:
        finish(trainer)


@pytest.mark.parametrize("side", sides())
def test_train_multiple_mixed_reward_funcs(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, reward_funcs=[length_reward, port_models["reward"]], **LR)


@pytest.mark.parametrize("side", sides())
def test_train_reward_func_additional_column(side, tmp_path, port_models):
    dataset = zen()
    dataset = dataset.add_column("some_values", list(range(len(dataset))))

    def reward_func(completions, some_values, **kwargs):
        return [float(abs(len(c) - v)) for c, v in zip(completions, some_values, strict=True)]

    train_and_check(side, tmp_path, port_models, reward_funcs=reward_func, dataset=dataset, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_sync_ref_model(side, tmp_path, port_models):
    Config, Trainer = classes(side)
    trainer = Trainer(model=port_models["model"], reward_funcs=port_models["reward"], train_dataset=zen(),
                      args=make_args(Config, tmp_path, beta=0.1, sync_ref_model=True, ref_model_sync_steps=2, **LR))
    before = snapshot(trainer)
    assert trainer.ref_model is not None
    ref_before = {n: whole(p).detach().clone() for n, p in trainer.ref_model.named_parameters()}

    def ref_changed():
        for n in before:
            assert not torch.equal(ref_before[n], whole(trainer.ref_model.get_parameter(n))), n

    run_with(trainer, before, ref_changed)


def run_with(trainer, before, check):
    """`run` with one more check after TRL's, before the trainer is released."""
    try:
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_all_changed(trainer, before)
        check()
    finally:
        finish(trainer)


@pytest.mark.parametrize("side", sides())
def test_train_beta_non_zero(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, beta=0.1, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_bias_correction_kl(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, beta=0.1, use_bias_correction_kl=True, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_pad_to_multiple_of(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, pad_to_multiple_of=8, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_off_policy_mask(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, off_policy_mask_threshold=0.5, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_entropy_filter(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, top_entropy_quantile=0.2, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_additional_generation_kwargs(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_normalize_then_sum_aggregation(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, reward_funcs=[length_reward, unique_letters_reward],
                    multi_objective_aggregation="normalize_then_sum", **LR)


@pytest.mark.parametrize("scale_rewards,side", by_side((False, "group", "batch", True, "none")))
def test_train_scale_rewards(side, scale_rewards, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, scale_rewards=scale_rewards, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_mask_truncated_completions_all_masked(side, tmp_path, port_models):
    # The random-init model (TRL's too) practically never ends a completion within 8 tokens, so every completion is
    # truncated and masked: no learning signal, a zero loss, no parameter moves.
    Config, Trainer = classes(side)
    trainer = Trainer(model=port_models["model"], reward_funcs=port_models["reward"], train_dataset=zen(),
                      args=make_args(Config, tmp_path, mask_truncated_completions=True, loss_type="dapo", **LR))
    before = snapshot(trainer)
    try:
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(0.0)
        for n, old in before.items():
            assert torch.equal(old, whole(trainer.model.get_parameter(n))), f"Parameter {n} has changed."
    finally:
        finish(trainer)


@pytest.mark.parametrize("side", sides())
def test_warning_raised_all_rewards_none(side, tmp_path, port_models, caplog):
    def always_none(completions, **kwargs):
        return [None] * len(completions)

    Config, Trainer = classes(side)
    trainer = Trainer(model=port_models["model"], reward_funcs=always_none, train_dataset=zen(),
                      args=make_args(Config, tmp_path, **LR))
    try:
        with caplog.at_level("WARNING"):
            trainer.train()
    finally:
        finish(trainer)
    assert "All reward functions returned None for the following kwargs:" in caplog.text


@pytest.mark.parametrize("side", sides())
def test_train_num_generations_larger_than_batch_size(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, **dict(LR, num_generations=6, gradient_accumulation_steps=2))


@pytest.mark.parametrize("side", sides())
def test_train_delta_clipping(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, delta=2.0, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_multiple_dataloader_workers(side, tmp_path, port_models):
    torch.multiprocessing.set_start_method("spawn", force=True)  # as TRL's test: fork after threads may deadlock
    train_and_check(side, tmp_path, port_models, dataloader_num_workers=2, **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_generation_kwargs(side, tmp_path, port_models):
    kwargs = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}
    if side == "hfllamarl":  # refused: beam search is not sampling, so pi/mu would not be 1 even on-policy
        with pytest.raises(ValueError, match=r"generation_kwargs\['do_sample'\] is not supported: it changes which "
                                             "tokens can be sampled"):
            train_and_check(side, tmp_path, port_models, generation_kwargs=kwargs, **LR)
        return
    train_and_check(side, tmp_path, port_models, generation_kwargs=kwargs, **LR)


def reward_run(side, tmp_path, port_models, reward_func, **config):
    """TRL's reward-function hook cases: train() with one reward function; returns the trainer (released)."""
    Config, Trainer = classes(side)
    trainer = Trainer(model=port_models["model"], reward_funcs=reward_func, train_dataset=zen(),
                      args=make_args(Config, tmp_path, **SMALL, **config))
    try:
        trainer.train()
    finally:
        finish(trainer)
    return trainer


@pytest.mark.parametrize("side", sides())
def test_train_with_reward_func_accessing_trainer_state(side, tmp_path, port_models):
    def reward_func(completions, **kwargs):
        assert hasattr(kwargs.get("trainer_state"), "global_step")
        return [float(len(set(c))) for c in completions]

    reward_run(side, tmp_path, port_models, reward_func)


@pytest.mark.parametrize("side", sides())
def test_train_reward_func_with_log_extra(side, tmp_path, port_models):
    def reward_func(completions, **kwargs):
        kwargs["log_extra"]("test_column", [c[:5] for c in completions])
        return [float(len(c)) for c in completions]

    trainer = reward_run(side, tmp_path, port_models, reward_func, log_completions=True)
    assert "test_column" in trainer._logs["extra"]


@pytest.mark.parametrize("side", sides())
def test_train_reward_func_with_log_metric(side, tmp_path, port_models):
    def reward_func(completions, **kwargs):
        kwargs["log_metric"]("custom_accuracy", 0.75)
        return [float(len(c)) for c in completions]

    trainer = reward_run(side, tmp_path, port_models, reward_func)
    assert "custom_accuracy" in {k for entry in trainer.state.log_history for k in entry}


@pytest.mark.parametrize("side", sides())
def test_train_sequence_importance_sampling(side, tmp_path, port_models):
    train_and_check(side, tmp_path, port_models, num_iterations=2, importance_sampling_level="sequence", **LR)


@pytest.mark.parametrize("side", sides())
def test_train_with_chat_template_kwargs(side, tmp_path, port_models):
    # TRL uses its tiny Qwen3 (a template that reads enable_thinking); here a tiny Qwen3 with Qwen3's template.
    Config, Trainer = classes(side)
    trainer = Trainer(model=port_models["qwen3"], reward_funcs=port_models["reward"],
                      train_dataset=zen("conversational_prompt_only"),
                      args=make_args(Config, tmp_path, chat_template_kwargs={"enable_thinking": False}, **LR))
    run(trainer, snapshot(trainer))
