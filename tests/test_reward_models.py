"""Reward models in `reward_funcs` (TRL's contract): how they are found, scored and sent to the generator."""

from __future__ import annotations

import pickle

import pytest
import torch

from hfllamarl.registry import PluginError
from hfllamarl.runtime.data.reward_models import RewardModel
from hfllamarl.runtime.data.rewards import RewardRunner, resolve_reward_funcs

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny Llama sequence classifier (random init, one logit) saved with a tokenizer that has a chat template."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    from hfllamarl.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("rm") / "model"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def alone(path: str, texts: list[str]) -> list[float]:
    """The reference: each text through the classifier by itself (no batch, no padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.inference_mode():
        return [model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for t in texts]


def test_scores_equal_one_unpadded_forward_per_sample(classifier):
    prompts = ["1+1=", "a much longer prompt of several words, 2+2="]
    completions = [r"\boxed{2}", "4 and some more words that pad the other row"]
    scores = RewardModel(classifier)(prompts=prompts, completions=completions)
    expected = alone(classifier, [p + c for p, c in zip(prompts, completions)])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 2  # the two rows are told apart


def test_chat_prompts_go_through_the_reward_tokenizers_template(classifier):
    from transformers import AutoTokenizer

    prompts = [[{"role": "user", "content": "2+2?"}], [{"role": "system", "content": "be short"},
                                                      {"role": "user", "content": "3+3?"}]]
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "6, as 3 and 3"}]]
    scores = RewardModel(classifier)(prompts=prompts, completions=completions)
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    assert texts[0] == "<|user|>2+2?\n<|assistant|>4\n"
    assert scores == pytest.approx(alone(classifier, texts), abs=1e-5)


def test_reward_funcs_resolve_plugins_directories_and_model_objects(classifier, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(classifier, num_labels=1)
    funcs = resolve_reward_funcs(["math_sympy", classifier, model])
    assert funcs[0].__name__ == "math_sympy"
    assert isinstance(funcs[1], RewardModel) and funcs[1].__name__ == "model" and funcs[1].path == classifier
    assert isinstance(funcs[2], RewardModel) and funcs[2].path is None
    with pytest.raises(PluginError, match="No rewards plugin named 'nonexistent'.*math_sympy"):
        resolve_reward_funcs(["nonexistent"])
    with pytest.raises(ValueError, match="reward_processing_classes has 1 entries for 2 reward functions"):
        resolve_reward_funcs(["math_sympy", classifier], [None])
    # a model object crosses to a generator process saved to a directory, with a given tokenizer
    with pytest.raises(TypeError, match="portable"):
        pickle.dumps(funcs[2])
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    given = resolve_reward_funcs([model], [tokenizer])[0]
    copy = pickle.loads(pickle.dumps(given.portable(str(tmp_path / "sent"))))
    prompts, completions = ["5+5="], ["10"]
    assert copy(prompts=prompts, completions=completions) == pytest.approx(
        given(prompts=prompts, completions=completions), abs=1e-6)


def test_scores_from_the_generator_are_used_as_they_are(classifier):
    """The trainer's runner takes a reward model's scores from the rollouts and does not load the model."""
    rm = RewardModel(classifier)
    runner = RewardRunner([rm, lambda completions, **kw: [1.0] * len(completions)], weights=[0.5, 1.0])
    total, per_func = runner(prompts=["p", "q"], completions=["a", "b"], completion_ids=[[1], [2]], columns={},
                             scored={"model": [2.0, -4.0]})
    assert per_func["model"] == [2.0, -4.0] and total == [2.0, -1.0]
    assert not rm._ready  # never loaded on this side


def test_a_name_that_is_neither_a_plugin_nor_a_directory_is_tried_as_a_hub_reward_model():
    """TRL loads a reward model given by its Hub id; here too (from its snapshot). One that cannot be fetched (no
    network here, or no such repository) is explained with both readings of the name."""
    with pytest.raises(PluginError, match=r"(?s)'nobody/no-such-reward-model' is not an installed reward plugin .*"
                                          r"could not be fetched .*Download the model first"):
        resolve_reward_funcs("nobody/no-such-reward-model")


def test_reward_models_are_loaded_with_model_init_kwargs_as_trl_loads_them(classifier, monkeypatch):
    """TRL passes `model_init_kwargs` to a reward model's from_pretrained: dtype, attn_implementation, ... reach it
    (not device_map: it runs on the generator's device), and `revision` picks the Hub snapshot, for the policy too.
    (No hub here: snapshot_download is replaced by one that records what it is asked and returns the local model.)"""
    import huggingface_hub

    asked = []

    def snapshot(repo_id, revision=None, **kwargs):
        asked.append((repo_id, revision))
        return classifier

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    init = {"dtype": "float64", "attn_implementation": "eager", "device_map": "auto", "revision": "v2"}
    local, hub = resolve_reward_funcs([classifier, "someone/reward-model"], model_init_kwargs=init)
    assert asked == [("someone/reward-model", "v2")]
    for rm in (local, pickle.loads(pickle.dumps(hub))):  # (as sent to a generator)
        rm.load()
        assert rm._model.dtype == torch.float64 and rm._model.config._attn_implementation == "eager"
        assert rm(prompts=["1+1="], completions=["2"]) == pytest.approx(alone(classifier, ["1+1=2"]), abs=1e-5)
    from types import SimpleNamespace

    from hfllamarl.trainers.model_io import resolve_model

    path, _, _ = resolve_model("someone/policy", SimpleNamespace(model_init_kwargs=init, trust_remote_code=False))
    assert asked[-1] == ("someone/policy", "v2") and path == classifier
