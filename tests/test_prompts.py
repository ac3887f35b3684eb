"""Which rows each batch holds, and dataset validation before any work starts."""

import pytest
from datasets import Dataset

from hfllamarl.runtime.prompts import PromptEncoder, batch_rows, validate_dataset
from hfllamarl.tools.tiny import build_tokenizer


def test_batches_cover_each_epoch_once_and_are_reproducible():
    rows = [batch_rows(10, 5, b, seed=3) for b in range(4)]
    assert sorted(rows[0] + rows[1]) == list(range(10))  # epoch 0
    assert sorted(rows[2] + rows[3]) == list(range(10))  # epoch 1
    assert rows[0] + rows[1] != rows[2] + rows[3]  # a new permutation each epoch
    assert rows == [batch_rows(10, 5, b, seed=3) for b in range(4)]
    assert batch_rows(10, 5, 0, seed=4) != rows[0]
    assert batch_rows(10, 4, 2, seed=0, shuffle=False) == [8, 9, 0, 1]


@pytest.fixture
def encoder():
    return PromptEncoder(build_tokenizer())


def test_missing_prompt_column(encoder):
    with pytest.raises(ValueError, match="`prompt` column"):
        validate_dataset(Dataset.from_dict({"question": ["1+1="]}), encoder, 4, 64)


def test_empty_and_too_long_prompts_name_the_row(encoder):
    with pytest.raises(ValueError, match="Row 1 .* empty prompt"):
        validate_dataset(Dataset.from_dict({"prompt": ["1+1=", ""]}), encoder, 4, 64)
    with pytest.raises(ValueError, match="Row 0 .*exceeds the model's context"):
        validate_dataset(Dataset.from_dict({"prompt": ["1" * 70]}), encoder, 4, 64)
    with pytest.raises(ValueError, match="Row 0 .*cannot encode"):
        validate_dataset(Dataset.from_dict({"prompt": [[1, 2]]}), encoder, 4, 64)
    assert validate_dataset(Dataset.from_dict({"prompt": ["1+1=", "22+1="]}), encoder, 4, 64) == 5
