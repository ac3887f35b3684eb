"""TRL's GRPOTrainer tests that construct a trainer, check an error, or call a pure function (no generator starts), run
under TRL's GRPOTrainer and AsyncAIPOTrainer with the same configuration and assertions; and the TRL cases left out
of the port, with why (`EXCLUDED`).

Where AsyncAIPOTrainer refuses a TRL setting on purpose (trainers/config_fields.py UNSUPPORTED, or a method it
does not offer), its side asserts that refusal and its reason instead of TRL's result.
"""

import logging

import pytest
import torch

from trl_port_support import (by_side, classes, make_args, port_models, run, sides, snapshot,  # noqa: F401
                              xfail_ours, zen)

SMALL = dict(per_device_train_batch_size=3, num_generations=3, max_completion_length=8)

# TRL 1.16 tests not ported, and why.
EXCLUDED = {
    "TestGRPOTrainer::test_train[non-Qwen2 ids]": "Hub-only architectures (Cohere2, Glm4Moe, GptOss, Qwen3Moe, "
                                                  "NemotronH); the Qwen2 case is ported",
    "test_trust_remote_code": "needs the Hub's tiny-RemoteForCausalLM (custom code)",
    "test_train_loss_types[liger]": "liger", "test_liger_kernel_with_peft_*": "liger",
    "test_train_with_off_policy_mask_with_liger": "liger", "test_compute_liger_loss_passes_vllm_is_ratio": "liger",
    "test_train_with_bias_correction_kl[liger]": "liger", "test_train_delta_clipping[liger]": "liger",
    "test_train_moe_peft_model": "needs the Hub's tiny GptOss (LoRA target_parameters on MoE experts)",
    "test_entropy_bonus_flows_gradients": "calls TRL's private _get_per_token_logps_and_entropies and flips private "
                                          "flags; no equivalent (entropy_coef is refused here)",
    "test_train_vllm_*": "vLLM server (skipped in TRL too)",
    "test_train_with_mask_truncated_completions": "patches transformers' generate(), which neither vLLM side uses",
    "test_prepare_input_called_with_correct_data": "patches TRL's training_step and uses steps_per_generation "
                                                   "(refused here: the generation batch is the train batch)",
    "test_train_with_tools, test_train_with_multiple_environments, test_train_with_environment_factory, "
    "test_train_with_environment_owned_reward, test_train_with_environment_owned_data, "
    "test_train_with_malformed_tool_calls": "patch trainer.model.generate() with scripted token ids of the Hub's Qwen3 "
                                            "tokenizer; hfllamarl generates with vLLM (no generate() to script)",
    "TestGRPORolloutDispatch": "mocks TRL's private _generate/_generate_single_turn/rollout_func dispatch; no "
                               "equivalent (hfllamarl's rollouts run on the generator ranks)",
    "TestTransformersContinuousBatchingContract": "transformers' continuous batching internals (TRL's non-vLLM "
                                                  "generation path); no equivalent",
    "TestGRPOTrainerVLM": "vision", "TestGRPOTrainerSlow": "GPU (and liger, kernels, bitsandbytes, vLLM)",
}


def construct(side, port_models, tmp_path, reward_funcs="reward", dataset="zen", **kwargs):
    Config, Trainer = classes(side)
    config = kwargs.pop("args", {})
    return Trainer(model=port_models["model"],
                   reward_funcs=port_models["reward"] if reward_funcs == "reward" else reward_funcs,
                   args=make_args(Config, tmp_path, **config), **({"train_dataset": zen()} if dataset == "zen" else {}),
                   **kwargs)


@pytest.mark.parametrize("side", sides())
def test_init_minimal(side, tmp_path, port_models):
    construct(side, port_models, tmp_path)


EVAL_TYPES = ("dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
              "dict_of_iterable_dataset")


def eval_set(kind):
    from datasets import DatasetDict, IterableDatasetDict

    streaming = "iterable" in kind
    split = zen(split="test", streaming=streaming)
    if kind in ("dataset", "iterable_dataset"):
        return split
    if kind in ("dataset_dict", "iterable_dataset_dict"):
        return (IterableDatasetDict if streaming else DatasetDict)({"data1": split, "data2": split})
    return {"data1": split, "data2": split}


# hfllamarl evaluates an eval set only during train(), at eval_strategy's steps (trainer.evaluate() is refused), so
# an eval set with TRL's default eval_strategy='no' is refused with what to set instead.
EVAL_REFUSED = "eval_dataset is evaluated during training, at eval_strategy's steps, and eval_strategy is 'no'"
# A streamed data set is refused: the generators' schedule picks prompts by row index (and a resume depends on it).
STREAM_REFUSED = r"IterableDataset \(streamed\), which is not supported"


@pytest.mark.parametrize("kind,side", by_side((*EVAL_TYPES, "none")))
def test_init_with_eval_dataset(side, kind, tmp_path, port_models):
    eval_dataset = None if kind == "none" else eval_set(kind)
    if side == "hfllamarl" and kind != "none":
        # several named eval sets (a dict) are refused first: "not supported yet; pass one datasets.Dataset"
        with pytest.raises(ValueError, match="several named evaluation sets" if "dict" in kind else EVAL_REFUSED):
            construct(side, port_models, tmp_path, eval_dataset=eval_dataset)
        return
    trainer = construct(side, port_models, tmp_path, eval_dataset=eval_dataset)
    if kind == "none":
        assert trainer.eval_dataset is None
    elif isinstance(trainer.eval_dataset, dict):
        assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
    else:
        assert trainer.eval_dataset is eval_dataset


def refused(side, field, make):
    """TRL's check runs `make()`; hfllamarl refuses `field` (config_fields.UNSUPPORTED) with its reason."""
    from trainers.config_fields import UNSUPPORTED

    with pytest.raises(ValueError, match=field) as info:
        make()
    assert UNSUPPORTED[field][:40] in str(info.value)


@pytest.mark.parametrize("side", sides())
def test_iterable_dataset_requires_dispatch_batches_false(side, tmp_path, port_models):
    # hfllamarl: accelerator_config is refused (no Accelerate data loader here), so the refusal names that field.
    def make():
        construct(side, port_models, tmp_path, dataset=None, train_dataset=zen(streaming=True),
                  args={"accelerator_config": {"dispatch_batches": True}})

    if side == "hfllamarl":
        return refused(side, "accelerator_config", make)
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        make()


@pytest.mark.parametrize("side", sides())
def test_iterable_dataset_forces_num_workers_zero(side, tmp_path, port_models):
    if side == "hfllamarl":
        with pytest.raises(ValueError, match=STREAM_REFUSED):
            construct(side, port_models, tmp_path, dataset=None, train_dataset=zen(streaming=True))
        return
    trainer = construct(side, port_models, tmp_path, dataset=None, train_dataset=zen(streaming=True),
                        args={"dataloader_num_workers": 4, "max_steps": 1})
    assert trainer.args.dataloader_num_workers == 0


@pytest.mark.parametrize("side", sides())
def test_iterable_eval_keeps_map_style_train_workers(side, tmp_path, port_models):
    def make():
        return construct(side, port_models, tmp_path, eval_dataset=zen(split="test", streaming=True),
                         args=dict(per_device_train_batch_size=3, per_device_eval_batch_size=3, num_generations=3,
                                   dataloader_num_workers=4))

    if side == "hfllamarl":  # (there is no DataLoader here either: dataloader_num_workers is not read)
        with pytest.raises(ValueError, match=EVAL_REFUSED):
            make()
        return
    trainer = make()
    assert trainer.args.dataloader_num_workers == 4
    assert trainer.get_train_dataloader().num_workers == 4
    assert trainer.get_eval_dataloader().num_workers == 0
    assert trainer.args.dataloader_num_workers == 4


@pytest.mark.parametrize("kind,side", by_side(EVAL_TYPES))
def test_evaluate_with_eval_dataset(side, kind, tmp_path, port_models):
    trainer = construct(side, port_models, tmp_path, args=dict(SMALL, per_device_eval_batch_size=3))
    if side == "hfllamarl":  # evaluation runs on the generator during train(); evaluate() says so and what to do
        with pytest.raises(NotImplementedError, match="evaluation runs on the generator ranks during train"):
            trainer.evaluate(eval_dataset=eval_set(kind))
        return
    metrics = trainer.evaluate(eval_dataset=eval_set(kind))
    if kind in ("dataset", "iterable_dataset"):
        assert metrics["eval_loss"] is not None
    else:
        assert metrics["eval_data1_loss"] is not None and metrics["eval_data2_loss"] is not None


@pytest.mark.parametrize("side", sides())
def test_train_with_cast_lm_head_to_fp32(side, tmp_path, port_models):
    # TRL trains Qwen3 and Gemma2 (Hub); the local Qwen2 has an untied head as Qwen3's. Refused here.
    Config, Trainer = classes(side)

    def make():
        return construct(side, port_models, tmp_path, args=dict(SMALL, learning_rate=0.1, max_steps=1,
                                                                cast_lm_head_to_fp32=True))

    if side == "hfllamarl":
        return refused(side, "cast_lm_head_to_fp32", make)
    trainer = make()
    before = snapshot(trainer)
    run(trainer, before)
    assert trainer.model.lm_head.weight.dtype == torch.float32


ENTROPY = {"static": dict(entropy_coef=0.1), "adaptive": dict(entropy_coef=0.01, use_adaptive_entropy=True,
                                                              entropy_target=15.0)}


@pytest.mark.parametrize("kind,side", by_side(("static", "adaptive")))
def test_train_with_entropy_bonus(side, kind, tmp_path, port_models):
    # TRL's test_train_with_static_entropy / test_train_with_adaptive_entropy. Refused here: the trainer computes the
    # sampled tokens' log-probs, not each distribution's entropy (max_steps=2 on TRL's side).
    def make():
        return construct(side, port_models, tmp_path, args=dict(SMALL, learning_rate=0.1, max_steps=2,
                                                                **ENTROPY[kind]))

    if side == "hfllamarl":
        return refused(side, "entropy_coef", make)  # (named first of the two adaptive fields)
    trainer = make()
    before = snapshot(trainer)
    last = run(trainer, before)
    assert last["policy_loss"] is not None and last["entropy_coef"] is not None
    if kind == "adaptive":
        assert trainer.entropy_coef > 0.01


# ---------------------------------------------------------------------------------------------- pure functions
def off_policy_mask(side):
    if side == "trl":
        from trl import GRPOTrainer

        return GRPOTrainer.get_off_policy_mask
    from hfllamarl.losses import off_policy_mask as ours

    return ours


@pytest.mark.parametrize("side", sides())
def test_get_off_policy_mask(side):
    # keep if advantage >= 0 or mean KL <= threshold; drop if advantage < 0 and KL > threshold
    mask = torch.ones((3, 4))
    advantages = torch.tensor([1.0, -1.0, -1.0]).unsqueeze(-1)
    sampling, logps = torch.zeros((3, 4)), torch.zeros((3, 4))
    logps[0, :], logps[1, :], logps[2, :] = -2.0, -0.5, -2.0
    got = off_policy_mask(side)(advantages, logps, sampling, mask, 1.0)
    torch.testing.assert_close(got, torch.tensor([[1.0], [1.0], [0.0]]))


@pytest.mark.parametrize("side", sides())
def test_get_off_policy_mask_padding(side):
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    advantages = torch.tensor([[-1.0]])
    sampling, logps = torch.zeros((1, 4)), torch.zeros((1, 4))
    logps[0, 0] = logps[0, 1] = -2.0
    logps[0, 2], logps[0, 3] = -10_000.0, 10_000.0  # padding: ignored
    fn = off_policy_mask(side)
    torch.testing.assert_close(fn(advantages, logps, sampling, mask, 1.0), torch.tensor([[0.0]]))
    logps[0, 0] = logps[0, 1] = -0.5
    torch.testing.assert_close(fn(advantages, logps, sampling, mask, 1.0), torch.tensor([[1.0]]))


def high_entropy_mask(side, entropies, mask, threshold):
    if side == "trl":
        from unittest.mock import Mock

        from trl import GRPOTrainer

        trainer = Mock(spec=GRPOTrainer)  # TRL's test calls the method on a single-process stand-in
        trainer.accelerator = Mock(num_processes=1)
        trainer.accelerator.gather = lambda x: x
        trainer.accelerator.pad_across_processes = lambda x, dim, pad_index: x
        return GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold)
    from hfllamarl.runtime.training.iterations import high_entropy_mask as ours

    # TRL's method takes the quantile of the threshold (1 - top_entropy_quantile); ours the share of tokens kept
    return ours(entropies, mask, 1.0 - threshold).bool()


ENT = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
ENT_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
ENTROPY_CASES = {  # TRL's TestGetHighEntropyMask: (entropies, mask, threshold, expected)
    "mask_0": (ENT, ENT_MASK, 0.8, [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]]),
    "mask_1": (torch.tensor([[0.1, 0.2, 0.3, 1.4, 0.5, 0.14], [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]]),
               torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]), 0.8,
               [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0]]),
    "lower_threshold": (ENT, ENT_MASK, 0.5, [[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0]]),
    "threshold_0": (ENT, ENT_MASK, 0.0, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
    "threshold_1": (ENT, ENT_MASK, 1.0, [[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]]),
    "all_masked": (ENT, torch.zeros((2, 6), dtype=torch.long), 0.5, [[0] * 6, [0] * 6]),
}


@pytest.mark.parametrize("case,side", by_side(ENTROPY_CASES))
def test_high_entropy_mask(side, case):
    entropies, mask, threshold, expected = ENTROPY_CASES[case]
    got = high_entropy_mask(side, entropies, mask, threshold)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------- construction errors
def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize("loss_type,side", by_side(("grpo", "bnpo", "dr_grpo", "dapo", "cispo")))
def test_warning_raised_sequence_level_with_token_summed_loss(side, loss_type, caplog, tmp_path, port_models):
    with caplog.at_level(logging.WARNING):
        construct(side, port_models, tmp_path, reward_funcs=zero_reward,
                  args=dict(SMALL, importance_sampling_level="sequence", loss_type=loss_type))
    assert ("weights each sequence by its completion length" in caplog.text) == (loss_type != "grpo")


@pytest.mark.parametrize("side", sides())
def test_no_reward_source_raises(side, tmp_path, port_models):
    with pytest.raises(ValueError, match="No reward source provided"):
        Config, Trainer = classes(side)
        Trainer(model=port_models["model"], args=make_args(Config, tmp_path), train_dataset=zen())


@pytest.mark.parametrize("side", sides())
def test_dataset_required_without_environment(side, tmp_path, port_models):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        construct(side, port_models, tmp_path, dataset=None)


def two_reward_models(port_models):
    from transformers import AutoTokenizer

    paths = [port_models["reward"], port_models["reward_llama"]]
    return paths, [AutoTokenizer.from_pretrained(p) for p in paths]


@pytest.mark.parametrize("side", sides())
def test_mismatched_reward_processing_classes_length(side, tmp_path, port_models):
    paths, tokenizers = two_reward_models(port_models)
    with pytest.raises(ValueError, match="must match"):
        construct(side, port_models, tmp_path, reward_funcs=paths, reward_processing_classes=tokenizers[0])


@pytest.mark.parametrize("side", sides())
def test_correct_reward_processing_classes_list(side, tmp_path, port_models):
    paths, tokenizers = two_reward_models(port_models)
    trainer = construct(side, port_models, tmp_path, reward_funcs=paths, reward_processing_classes=tokenizers)
    assert len(trainer.reward_processing_classes) == len(paths)


@pytest.mark.parametrize("side", sides())
def test_single_reward_model_with_single_processing_class(side, tmp_path, port_models):
    paths, tokenizers = two_reward_models(port_models)
    trainer = construct(side, port_models, tmp_path, reward_funcs=paths[0], reward_processing_classes=tokenizers[0])
    assert len(trainer.reward_processing_classes) == 1
    assert trainer.reward_processing_classes[0] == tokenizers[0]


# ---------------------------------------------------------------------------------------------- environments
# TRL's environment cases that need no scripted generate(): construction checks, and one train() that fails early.
# TRL uses its tiny Qwen3 (MoE) for its tool-calling chat template; here the tiny Qwen3 with Qwen3's template.
def construct_env(side, port_models, tmp_path, monkeypatch, **kwargs):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Config, Trainer = classes(side)
    config = kwargs.pop("args", {})
    return Trainer(model=port_models["qwen3"], args=make_args(Config, tmp_path, **config), **kwargs)


class Guesser:
    def reset(self, **kwargs):
        self._solved = False

    def guess(self, word: str) -> str:
        """
        Submit a guess.

        Args:
            word: The guessed word.

        Returns:
            Feedback about the guess.
        """
        return "nope"

    def get_reward(self) -> float:
        return 1.0 if self._solved else 0.0


class Scored:
    def reset(self, **kwargs): ...

    def act(self, x: int) -> int:
        """
        Act.

        Args:
            x: A value.

        Returns:
            The value.
        """
        return x

    def get_reward(self) -> float:
        return 1.0


class Plain:
    def reset(self, **kwargs): ...

    def play(self, x: int) -> int:
        """
        Play.

        Args:
            x: A value.

        Returns:
            The value.
        """
        return x


def format_reward(completions, **kwargs):
    return [0.0 for _ in completions]


@pytest.mark.parametrize("side", sides())
def test_environment_owned_reward_coexists_with_reward_funcs(side, tmp_path, port_models, monkeypatch):
    trainer = construct_env(side, port_models, tmp_path, monkeypatch, reward_funcs=format_reward,
                            environment_factory=Guesser, args=dict(SMALL, max_steps=5, reward_weights=[0.5]))
    assert trainer.reward_func_names == ["format_reward", "Guesser"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert len(trainer.reward_funcs) == 2
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "guess" in tool_names and "get_reward" not in tool_names


@pytest.mark.parametrize("side", sides())
def test_environment_owned_reward_mixed_environments(side, tmp_path, port_models, monkeypatch):
    from datasets import Dataset

    trainer = construct_env(side, port_models, tmp_path, monkeypatch, reward_funcs=format_reward, args=SMALL,
                            train_dataset=Dataset.from_dict({"environment": ["scored", "scored2", "plain"]}),
                            environment_factory={"scored": Scored, "scored2": Scored, "plain": Plain})
    assert trainer.reward_func_names == ["format_reward", "Scored"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    assert trainer.reward_funcs[-1](environments=[Scored(), Plain()]) == [1.0, None]


@pytest.mark.parametrize("side", sides())
def test_train_with_unknown_environment_raises(side, tmp_path, port_models, monkeypatch):
    class Counter:
        def reset(self, **kwargs): ...

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            return step

    dataset = zen("conversational_prompt_only").map(lambda row: {"environment": "unknown"})
    # TRL raises in train(); hfllamarl checks the rows' environments already at construction, so both are inside
    with pytest.raises(ValueError, match="not among the environments"):
        trainer = construct_env(side, port_models, tmp_path, monkeypatch, reward_funcs=port_models["reward"],
                                train_dataset=dataset, environment_factory={"counter": Counter},
                                args=dict(per_device_train_batch_size=3, num_generations=3, max_steps=1))
        try:
            trainer.train()
        finally:
            trainer.end()


@pytest.mark.parametrize("side", sides())
def test_environment_owned_data_requires_max_steps(side, tmp_path, port_models, monkeypatch):
    class Wordle:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."

    with pytest.raises(ValueError, match="max_steps"):
        construct_env(side, port_models, tmp_path, monkeypatch, reward_funcs=port_models["reward"],
                      environment_factory=Wordle)


@pytest.mark.parametrize("side", sides())
def test_multiple_environments_without_dataset_raises(side, tmp_path, port_models, monkeypatch):
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        construct_env(side, port_models, tmp_path, monkeypatch, reward_funcs=port_models["reward"],
                      environment_factory={"a": Scored, "b": Plain}, args={"max_steps": 1})
