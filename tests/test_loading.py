"""Loading at real sizes: each trainer rank reads only its rows; measured side by side with a whole load."""

import json

import pytest
import torch

from hfllamarl.runtime.weights.loading import SafetensorsRows


def test_rows_are_read_at_their_offsets_in_any_dtype(tmp_path):
    from safetensors.torch import save_file

    a = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    b = (torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3) / 8).to(torch.bfloat16)  # exact in bf16
    save_file({"a": a, "b": b, "s": torch.tensor(2.5)}, str(tmp_path / "model.safetensors"))
    rows = SafetensorsRows(str(tmp_path))
    assert torch.equal(rows.read_rows("a", 2, 5), a[2:5])
    out = torch.empty(4, 3, dtype=torch.float32)  # a bf16 checkpoint into fp32 parameters, in blocks of one row
    rows.read_rows_into("b", 1, out, block_bytes=1)
    assert torch.equal(out, b[1:5].float())
    assert rows.read_rows("s", 0, 1).item() == 2.5 and rows.read_rows("a", 3, 3).shape == (0, 5)


@pytest.mark.slow
def test_each_trainer_rank_grows_by_its_shard_not_the_model():
    """2 trainer ranks: the sharded load peaks well under the whole load, below 0.75x the fp32 model per rank,
    and every rank holds exactly the file's values (a checksum over all shards)."""
    from conftest import run_script, tail

    proc = run_script(["-m", "hfllamarl.cli", "bench", "load", "--params", "3e7", "--trainers", "2"], timeout=600)
    assert proc.returncode == 0, tail(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sharded_weights_match"] and result["whole_weights_match"], result
    assert result["sharded_peak_over_model"] <= 0.75, result
    assert result["whole_peak_over_model"] >= 1.0 and result["whole_over_sharded"] >= 1.5, result
