"""Which rows each batch holds, and dataset validation before any work starts."""

import pytest
from datasets import Dataset

from hfllamarl.runtime.data.prompts import PromptEncoder, batch_rows, validate_dataset
from hfllamarl.testing.tiny import build_tokenizer


def test_batches_cover_each_epoch_once_and_are_reproducible():
    rows = [batch_rows(10, 5, b, seed=3) for b in range(4)]
    assert sorted(rows[0] + rows[1]) == list(range(10))  # epoch 0
    assert sorted(rows[2] + rows[3]) == list(range(10))  # epoch 1
    assert rows[0] + rows[1] != rows[2] + rows[3]  # a new permutation each epoch
    assert rows == [batch_rows(10, 5, b, seed=3) for b in range(4)]
    assert batch_rows(10, 5, 0, seed=4) != rows[0]
    # 10 rows fill two batches of 4: rows 8 and 9 of each pass are left out, as TRL's sampler drops a partial batch
    assert [batch_rows(10, 4, b, seed=0, shuffle=False) for b in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert [batch_rows(3, 4, b, seed=0, shuffle=False) for b in range(2)] == [[0, 1, 2, 0], [1, 2, 0, 1]]


def test_a_run_by_epochs_is_as_many_steps_as_trls(tmp_path):
    """num_train_epochs (whole or not) over a data set that does not fill its last batch: the steps TRL's
    GRPOTrainer computes for the same data set and batch (its sampler drops the partial batch)."""
    import warnings

    from trl import GRPOConfig, GRPOTrainer

    from hfllamarl import AsyncAIPOConfig
    from hfllamarl.testing.tiny import build_tiny_model
    from hfllamarl.trainers.async_aipo_trainer import run_length

    model = build_tiny_model(str(tmp_path / "model"))
    for rows, epochs in [(10, 1), (12, 1), (7, 1), (10, 2.5), (30, 0.5)]:
        common = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=2,
                      num_train_epochs=epochs, report_to="none", max_completion_length=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = GRPOConfig(**common, use_cpu=True, bf16=False)
            trl = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              train_dataset=Dataset.from_list([{"prompt": f"{i}?"} for i in range(rows)]), args=args)
            theirs = trl.set_initial_training_values(args, trl.get_train_dataloader())[-1]  # max_steps
        ours = AsyncAIPOConfig(**common)
        assert run_length(rows, ours.prompts_per_generation, ours)[0] == theirs, (rows, epochs, theirs)


@pytest.fixture
def encoder():
    return PromptEncoder(build_tokenizer())


def test_missing_prompt_column(encoder):
    with pytest.raises(ValueError, match="`prompt` column"):
        validate_dataset(Dataset.from_dict({"question": ["1+1="]}), encoder, 4, 64)


def test_image_prompts_are_refused(encoder):
    with pytest.raises(ValueError, match="an 'image' column: image prompts .vision-language policies. are not supported"):
        validate_dataset(Dataset.from_dict({"prompt": ["1+1="], "image": [None]}), encoder, 4, 64)


def test_empty_and_too_long_prompts_name_the_row(encoder):
    with pytest.raises(ValueError, match="Row 1 .* empty prompt"):
        validate_dataset(Dataset.from_dict({"prompt": ["1+1=", ""]}), encoder, 4, 64)
    with pytest.raises(ValueError, match="Row 0 .*exceeds the model's context"):
        validate_dataset(Dataset.from_dict({"prompt": ["1" * 70]}), encoder, 4, 64)
    with pytest.raises(ValueError, match="Row 0 .*cannot encode"):
        validate_dataset(Dataset.from_dict({"prompt": [[1, 2]]}), encoder, 4, 64)
    assert validate_dataset(Dataset.from_dict({"prompt": ["1+1=", "22+1="]}), encoder, 4, 64) == 5
