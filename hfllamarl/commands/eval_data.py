"""Data side of `hfllamarl eval`: reading a JSONL file, telling its shape, building prompts,
scoring completions with a reward function.

Shapes, told from the columns (the first that matches wins):

    prompt   a `prompt` column (text, or a list of chat messages), used as it is
    math     `problem` + `answer` (MATH, MATH-500); default reward `math_sympy`
    gsm8k    `question` + `answer`, the answer a worked solution ending in `#### N`; default reward `gsm8k`

For `math` and `gsm8k` the question is followed by :data:`INSTRUCTION`. With a tokenizer that has a
chat template the text is the content of one user message (rendered with the generation prompt);
without one it is plain text ending in a "Solution:" cue (see :func:`build_prompt`).
Nothing here imports vLLM, torch or transformers.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

#: Appended to every MATH / GSM8K question.
INSTRUCTION = "Solve the problem step by step. Put your final answer within \\boxed{}."

#: Shape name -> the column holding the question, in the order shapes are tried.
QUESTION_COLUMN = {"prompt": "prompt", "math": "problem", "gsm8k": "question"}
DEFAULT_REWARD = {"math": "math_sympy", "gsm8k": "gsm8k"}


class EvalDataError(ValueError):
    """A data file `hfllamarl eval` cannot read: bad JSON, an unknown shape, a missing column."""


def read_jsonl(path: str, limit: int | None = None) -> list[dict]:
    """The first `limit` rows (all when None) of a JSONL file; blank lines are skipped.

    Raises:
        EvalDataError: the file is missing or empty, or a line is not a JSON object (the message
            names the line number, counting from 1).
    """
    rows: list[dict] = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise EvalDataError(f"Cannot read data file {path}: {exc.strerror or exc}") from exc
    with handle:
        for number, line in enumerate(handle, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalDataError(f"{path}, line {number}: not valid JSON ({exc.msg}).") from exc
            if not isinstance(row, dict):
                raise EvalDataError(
                    f"{path}, line {number}: expected a JSON object (one row), got {type(row).__name__}."
                )
            rows.append(row)
    if not rows:
        raise EvalDataError(f"{path} has no rows.")
    return rows


def columns_of(rows: Sequence[dict]) -> list[str]:
    """Every column that appears in any row, in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def detect_shape(columns: Sequence[str]) -> str:
    """"prompt", "math" or "gsm8k" from a file's columns (see the module docstring).

    Raises:
        EvalDataError: none of the shapes fits; the message lists the columns the file has.
    """
    cols = set(columns)
    if "prompt" in cols:
        return "prompt"
    if {"problem", "answer"} <= cols:
        return "math"
    if {"question", "answer"} <= cols:
        return "gsm8k"
    raise EvalDataError(
        f"Cannot tell the data set's shape from its columns {sorted(cols)}. hfllamarl eval reads MATH-style rows "
        "(`problem` + `answer`), GSM8K-style rows (`question` + `answer`), or rows with a `prompt` column "
        "(text or chat messages; add an `answer` column for the math rewards)."
    )


def check_rows(rows: Sequence[dict], shape: str) -> None:
    """Every row has its shape's question column, non-empty.

    Raises:
        EvalDataError: naming the first bad row (0-based index among the rows read).
    """
    column = QUESTION_COLUMN[shape]
    for i, row in enumerate(rows):
        value = row.get(column)
        if value is None or (isinstance(value, (str, list)) and not value):
            raise EvalDataError(f"Row {i} has no `{column}` (or an empty one); its columns are {sorted(row)}.")
        if not isinstance(value, (str, list)):
            raise EvalDataError(f"Row {i}: `{column}` must be text (or chat messages), got {type(value).__name__}.")


def default_reward(shape: str, rows: Sequence[dict]) -> str:
    """The reward used when `--reward` is not given.

    `math` -> math_sympy, `gsm8k` -> gsm8k. A `prompt` file gets gsm8k when every gold `answer` has a
    `####` line, else math_sympy.

    Raises:
        EvalDataError: a `prompt` file without an `answer` column (say which reward to use).
    """
    if shape in DEFAULT_REWARD:
        return DEFAULT_REWARD[shape]
    answers = [row.get("answer") for row in rows]
    if any(a is None for a in answers):
        raise EvalDataError(
            "The rows have a `prompt` but not every row has an `answer`, so there is no default reward: add an "
            "`answer` column or name a reward with --reward (`hfllamarl plugins list` shows the installed ones)."
        )
    return "gsm8k" if all("####" in str(a) for a in answers) else "math_sympy"


def gold_answer(row: dict) -> Any:
    """The gold answer as shown in the results: the text after the last `####` for GSM8K solutions."""
    answer = row.get("answer")
    if isinstance(answer, str) and "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    return answer


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt(row: dict, shape: str, tokenizer) -> tuple[Any, str]:
    """The prompt of a row as a training data set holds it, and the text the model reads: `(prompt, text)`.

    `prompt` is what the reward function receives and what `PromptEncoder` (the training path) turns into token
    ids; `text` is those ids decoded, for the results file.

    - `math` / `gsm8k`: `"{question}\n\n{INSTRUCTION}"` as a user message; without a chat
      template, that text followed by `"\nSolution:"`.
    - `prompt`: used as training uses it: a string as it is, chat messages through the chat template (which the
      tokenizer must have).
    """
    from hfllamarl.runtime.data.prompts import PromptEncoder, is_conversational

    chat = has_chat_template(tokenizer)
    question = row[QUESTION_COLUMN[shape]]
    if shape == "prompt":
        if is_conversational(question) and not chat:
            raise EvalDataError("The prompts are chat messages but the tokenizer has no chat template.")
        prompt = question
    else:
        content = f"{str(question).strip()}\n\n{INSTRUCTION}"
        prompt = [{"role": "user", "content": content}] if chat else f"{content}\nSolution:"
    return prompt, PromptEncoder(tokenizer).render(prompt)


def score_completions(
    reward_fn: Callable,
    rows: Sequence[dict],
    prompts: Sequence[Any],
    completions: Sequence[Sequence[str]],
    completion_ids: Sequence[Sequence[Sequence[int]]] | None = None,
) -> list[list[float | None]]:
    """Rewards of every completion, one call of `reward_fn` per problem, through the training's reward path
    (`hfllamarl.runtime.data.rewards.RewardRunner`: TRL's call, chat-style completions for chat prompts, every column
    of the row but `prompt` as a keyword, the values checked).

    `completions[i]` are the texts sampled for `rows[i]` / `prompts[i]`. Returns `rewards[i][j]` for completion j
    of problem i; None where the reward does not score (or scored NaN/inf).
    """
    from hfllamarl.runtime.data.rewards import RewardRunner, reward_name

    runner = RewardRunner([reward_fn])
    out: list[list[float | None]] = []
    for i, (row, prompt, texts) in enumerate(zip(rows, prompts, completions)):
        if not texts:
            out.append([])
            continue
        n = len(texts)
        columns = {k: [v] * n for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        ids = [list(c) for c in completion_ids[i]] if completion_ids is not None else None
        _, per_func = runner(prompts=[prompt] * n, completions=list(texts), completion_ids=ids, columns=columns)
        out.append(per_func[reward_name(reward_fn)])
    return out
