"""The trainer's head start (`hfllamarl.runtime.training.head_start`): the first tokens it samples are those a whole
decode samples, with the log-probs of a plain forward; the setting says what it takes; and a single-process run
whose every generator batch goes on from the trainer's first tokens trains on-policy tokens only (learning rate 0:
pi/mu is 1 on the trainer's tokens and on the generator's, so each completion was put together in order)."""

import json
import os

import pytest
import torch

from conftest import run_script, step_logs, tail, trained_rows
from hfllamarl.runtime.data.prompts import batch_rows
from hfllamarl.runtime.loop.sampling import Sampling
from hfllamarl.runtime.training import bootstrap
from hfllamarl.runtime.training.head_start import tokens_of
from test_bootstrap import _model, _spec

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def test_the_setting_reads_auto_off_or_a_number_and_refuses_anything_else(tmp_path):
    from hfllamarl import AsyncAIPOConfig

    assert tokens_of("auto") is None and tokens_of("off") == 0 and tokens_of(False) == 0
    assert tokens_of(8) == 8 and tokens_of("8") == 8
    with pytest.raises(ValueError, match="trainer_head_start='eight': use 'auto', 'off' or a number"):
        tokens_of("eight")
    with pytest.raises(ValueError, match="AsyncAIPOConfig: trainer_head_start=-2"):
        AsyncAIPOConfig(output_dir=str(tmp_path), trainer_head_start=-2)
    assert AsyncAIPOConfig(output_dir=str(tmp_path), trainer_head_start=8).trainer_head_start == "8"
    assert AsyncAIPOConfig(output_dir=str(tmp_path)).trainer_head_start == "auto"


def test_the_first_tokens_are_a_whole_decodes_with_the_log_probs_of_a_plain_forward(tiny_model):
    """Temperature 0.7, left-padded prompts of different lengths: 4 tokens of each completion (fewer where one
    ended), each with log softmax(logits / 0.7) of a plain forward over its prompt and those tokens; a `stop()` that
    says yes after the second token cuts every completion there, with the same tokens (the same random stream)."""
    from datasets import Dataset

    model, tok = _model(tiny_model)
    rows = Dataset.from_dict({"prompt": ["What is 3 + 4?", "Add 12 and 30, then write the sum of both", "7 * 6 ="]})
    spec = _spec(sampling=Sampling(temperature=0.7), prompts_per_batch=3, num_generations=2)
    sampler = bootstrap.BootstrapSampler(model, tok, rows, spec, torch.device("cpu"), model.generation_config)
    head = sampler.head_start(0, 5, 4, lambda: False)
    assert (head["batch"], head["version"], head["indices"]) == (0, 5, batch_rows(3, 3, 0, 0, True))
    assert len(head["rows"]) == 6
    prompts = [sampler.encoder.encode(rows[i]["prompt"]) for i in head["indices"] for _ in range(2)]
    for ids, (first, logprobs, why) in zip(prompts, head["rows"]):
        ended = why == "stop"
        assert (ended and first[-1] in sampler.eos and len(first) <= 4) or (why == "" and len(first) == 4), (first, why)
        with torch.no_grad():
            logits = model(torch.tensor([ids + first])).logits[0].float()
        want = torch.log_softmax(logits[len(ids) - 1:len(ids) - 1 + len(first)] / 0.7, -1)
        want = want.gather(-1, torch.tensor(first)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-4), (logprobs, want)
    answers = iter([False, True])
    cut = sampler.head_start(0, 5, 10, lambda: next(answers))
    for (first, _, _), (shorter, _, why) in zip(head["rows"], cut["rows"]):
        assert shorter == first[:len(shorter)] and len(shorter) <= 2 and (why == "stop" or len(shorter) == 2)


@pytest.mark.slow
def test_a_run_whose_generator_goes_on_from_the_trainers_first_tokens_trains_on_policy_tokens(tiny_model, tmp_path):
    """`python train_tiny.py`, every batch from the generator, the trainer taking exactly 3 tokens of each completion
    of the generator's next batch in every tick but the first: at learning rate 0 every token of every step is
    on-policy (pi/mu 1: the trainer's own tokens and vLLM's continuation, put together in order), each step trains
    the rows the schedule names, and every step but the last logs the head start's 3 tokens."""
    out = str(tmp_path / "run")
    proc = run_script([os.path.join(SCRIPTS, "train_tiny.py"), tiny_model, out, "--steps", "6", "--report-to", "none",
                       "--learning-rate", "0", "--no-bootstrap", "--extra", json.dumps({"trainer_head_start": 3})])
    assert proc.returncode == 0, tail(proc)
    logs = step_logs(proc.stdout)
    assert [h["step"] for h in logs] == list(range(1, 7))
    for h in logs:
        assert abs(h["is_ratio/max"] - 1.0) < 1e-3 and abs(h["is_ratio/min"] - 1.0) < 1e-3, h
    took = [h.get("head_start/tokens") for h in logs]
    assert took == [3.0] * 5 + [0.0], took  # (step k trains batch k - 1 while batch k is sampled: none after 5)
    assert all(h["completions/mean_length"] > 3 for h in logs[1:]), [h["completions/mean_length"] for h in logs]
    assert trained_rows(out) == {step: batch_rows(64, 4, step - 1, seed=0) for step in range(1, 7)}
