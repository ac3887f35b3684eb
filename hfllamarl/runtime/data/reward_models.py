"""Reward models: a sequence-classification model in `reward_funcs`, scored as TRL scores it.

TRL's `GRPOTrainer` takes a model path or a `PreTrainedModel` in `reward_funcs` (with an optional
tokenizer in `reward_processing_classes`) and scores each completion with the model's first logit on
the prompt + completion text (chat prompts: the conversation through the reward tokenizer's chat
template), right-padded, without added special tokens. `RewardModel` is that, as a reward function.

Where it runs: on the generator rank that sends the rollouts, as soon as a generation batch finishes
(`GeneratorExecutor.generate_tick`), so its forward passes take the generator's time, not the
trainer's; the scores travel with the rollouts (`Rollout.model_rewards`) and the trainer's
`RewardRunner` takes them from there. Called directly (e.g. by `hfllamarl eval`), it scores in process.
"""

from __future__ import annotations

import os
from typing import Any

#: completions scored per forward pass
SCORE_BATCH = 16


def is_model_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


class RewardModel:
    """A sequence-classification reward model with TRL's reward-function call.

    Args:
        model: the directory of a model saved with `save_pretrained` (an
            `AutoModelForSequenceClassification` with one label is built from it), or a `PreTrainedModel`.
        processing_class: its tokenizer (default: loaded from the model's directory).
        trust_remote_code: as for `from_pretrained`.
        init_kwargs: the rest of `from_pretrained`'s keyword arguments for a model given as a path (TRL's
            `model_init_kwargs`: dtype, attn_implementation, ...); the device is the generator's, so `device_map`
            is not passed, and `revision` chose the Hub snapshot already.
    """

    def __init__(self, model: Any, processing_class: Any = None, *, trust_remote_code: bool = False,
                 init_kwargs: dict | None = None):
        from transformers import PreTrainedModel

        if isinstance(model, PreTrainedModel):
            self.path, self._model = None, model
            source = getattr(model.config, "_name_or_path", "") or type(model).__name__
        elif isinstance(model, (str, os.PathLike)) and is_model_dir(os.fspath(model)):
            self.path, self._model = os.fspath(model), None
            source = self.path
        else:
            raise ValueError(f"{model!r} is neither a reward plugin name, nor the directory of a model saved with "
                             "save_pretrained() (holding config.json), nor a PreTrainedModel.")
        self.__name__ = os.path.basename(str(source).rstrip("/")) or "reward_model"
        self._tokenizer = processing_class
        self.trust_remote_code = trust_remote_code
        self.init_kwargs = {k: v for k, v in (init_kwargs or {}).items() if k not in ("device_map", "revision")}
        self.device = "cpu"
        self._ready = False  # loaded on its device, pad id set

    def __repr__(self) -> str:
        return f"RewardModel({self.path or self.__name__!r})"

    # ------------------------------------------------------------------ crossing processes
    def portable(self, directory: str) -> RewardModel:
        """A copy another process can load: the model (and a given tokenizer) saved under `directory`
        when they exist only in memory."""
        if self.path is not None and self._tokenizer is None:
            return self
        os.makedirs(directory, exist_ok=True)
        if self.path is None:
            self._model.save_pretrained(directory)
        tokenizer = self.tokenizer()
        tokenizer.save_pretrained(directory)
        copy = RewardModel(self.path or directory, None, trust_remote_code=self.trust_remote_code,
                           init_kwargs=self.init_kwargs)
        copy.__name__ = self.__name__
        copy._tokenizer_path = directory
        return copy

    def __getstate__(self) -> dict:
        if self.path is None:
            raise TypeError(f"{self!r} holds a model object only; call portable(directory) before sending it "
                            "to another process.")
        state = dict(self.__dict__)
        state["_model"], state["_ready"] = None, False
        if state["_tokenizer"] is not None:
            raise TypeError(f"{self!r} holds a tokenizer object; call portable(directory) first.")
        return state

    # ------------------------------------------------------------------ loading
    def load(self, device: str = "cpu") -> None:
        """Build the model (when given as a path) and its tokenizer, on `device`, in eval mode."""
        import torch
        from transformers import AutoModelForSequenceClassification

        if self._model is None:
            kwargs = {"trust_remote_code": self.trust_remote_code, **self.init_kwargs, "num_labels": 1}
            self._model = AutoModelForSequenceClassification.from_pretrained(self.path, **kwargs)
        tokenizer = self.tokenizer()
        # The model scores the last non-pad token: its pad id must be the tokenizer's.
        self._model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.device = str(device)
        self._model.to(torch.device(self.device)).eval()
        self._ready = True

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            where = getattr(self, "_tokenizer_path", None) or self.path or self._model.config._name_or_path
            self._tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=self.trust_remote_code)
        if self._tokenizer.pad_token_id is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        return self._tokenizer

    # ------------------------------------------------------------------ scoring
    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the model reads: prompt + completion, or the conversation through its chat template."""
        from trl.data_utils import apply_chat_template, is_conversational

        if prompts and is_conversational({"prompt": prompts[0]}):
            tokenizer = self.tokenizer()
            return [apply_chat_template({"messages": list(p) + _messages(c)}, tokenizer)["text"]
                    for p, c in zip(prompts, completions)]
        return [str(p) + (c if isinstance(c, str) else _messages(c)[-1]["content"])
                for p, c in zip(prompts, completions)]

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        """The first logit of each prompt + completion."""
        import torch

        if not self._ready:
            self.load(self.device)
        tokenizer, texts = self.tokenizer(), self.texts(prompts, completions)
        scores: list[float] = []
        for start in range(0, len(texts), SCORE_BATCH):
            inputs = tokenizer(text=texts[start:start + SCORE_BATCH], return_tensors="pt", padding=True,
                               padding_side="right", add_special_tokens=False).to(self.device)
            with torch.inference_mode():
                scores += self._model(**inputs).logits[:, 0].float().tolist()
        return scores


def _messages(completion: Any) -> list[dict]:
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    return list(completion)
