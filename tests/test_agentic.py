"""Tools, environments and rollout functions (TRL's `tools`, `environment_factory`, `rollout_func`): multi-turn
rollouts on the generator, tool tokens in the context but never trained, every tool call bounded in time."""

import asyncio
import json
import os
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest

from conftest import SCRIPTS, SIDE_BY_SIDE_ENV, assert_on_policy, popen_script, run_script, step_logs, tail

from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.agents.tool_calls import ToolRunner


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------------- the calculator
def test_the_calculator_computes_arithmetic_and_never_evaluates_python():
    from hfllamarl.plugins.environments.calculator import Calculator, evaluate

    assert evaluate("12+30") == "42" and evaluate(" (7 - 9) * 3 ") == "-6" and evaluate("7/2") == "3.5"
    assert evaluate("2**10") == "1024" and evaluate("17 // 5") == "3" and evaluate("17 % 5") == "2"
    for bad, why in [("__import__('os').system('true')", "unsupported"), ("1/0", "division by zero"),
                     ("9**9**9", "whole numbers of at most"), ("x + 1", "unsupported"), ("1" * 300, "longer than"),
                     ("2 +", "not an arithmetic")]:
        with pytest.raises(ValueError, match=why):
            evaluate(bad)
    env = Calculator()
    assert env.reset(prompt="q") is None and env.calculator("1+1") == "2" and env.calls == 1


# ---------------------------------------------------------------------------- running tools
def test_every_tool_call_is_bounded_and_its_failure_is_the_models_to_read():
    """TRL's results and order (a rollout's sync tools in order, then its async ones); a tool that hangs (sync, async,
    or blocking the event loop) is abandoned after the bound, and the next calls still run."""
    def add(a: int, b: int) -> int:
        return a + b

    def hang():
        time.sleep(3600)

    def boom():
        raise ValueError("bad input")

    async def slow_add(a: int, b: int) -> int:
        await asyncio.sleep(0.01)
        return a + b

    async def async_hang():
        await asyncio.sleep(3600)

    async def blocks_the_loop():
        time.sleep(3600)

    tools = {f.__name__: f for f in (add, hang, boom, slow_add, async_hang, blocks_the_loop)}
    runner = ToolRunner(timeout_s=1.0)
    start = time.monotonic()
    results = runner.run([
        ([call("slow_add", a=1, b=2), call("add", a=3, b=4), call("nope"), call("boom"), call("add", a=1)], tools),
        ([call("hang"), call("async_hang"), call("blocks_the_loop")], tools),
        ([{"type": "code", "name": "q"}], tools),
    ])
    elapsed = time.monotonic() - start
    first = [(r.name, r.content, r.failed) for r in results[0]]
    assert first[:3] == [("add", 7, False), ("nope", {"error": "Tool nope not found."}, True),
                         ("boom", {"error": "bad input"}, True)]
    assert first[3][0] == "add" and first[3][2] and "missing 1 required positional argument" in first[3][1]["error"]
    assert first[4] == ("slow_add", 3, False)  # async results come after the sync ones, as in TRL
    assert [r.timed_out for r in results[1]] == [True, True, True] and all("abandoned" in r.content["error"]
                                                                           for r in results[1])
    assert results[2][0].content == {"error": "Unsupported tool call type: code"}
    assert results[0][0].message() == {"role": "tool", "name": "add", "content": "7"}
    assert elapsed < 3 * 1.0 + 2.5, elapsed  # hang 1 s, then the stuck loop's calls share one wait of 1 s (+1)
    assert runner.abandoned == 2  # the hung thread and the blocked loop; the cancelled coroutine was not left
    assert runner.run([([call("slow_add", a=5, b=6)], tools)])[0][0].content == 11  # a new loop serves the next


def test_the_python_sandbox_bounds_time_and_memory_and_has_no_network():
    from hfllamarl.plugins.environments.python_sandbox import PythonSandbox

    box = PythonSandbox(timeout_s=2.0, memory_mb=512)
    assert box.python("print(sum(range(10)))") == "45\n"
    assert box.python("raise ValueError('nope')") == "ValueError: nope\n"
    assert box.python("x = bytearray(2 << 30)") == "MemoryError\n"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    out = box.python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert "connected" not in out and ("unreachable" in out or "disabled" in out), out
    assert box.network_isolation() == "namespaces"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="longer than 2 s"):
        box.python("while True: pass")
    assert time.monotonic() - start < 4.0
    assert box.python("print('still here')") == "still here\n"  # the stuck worker was replaced
    server.close()


# ---------------------------------------------------------------------------- the loss mask
def test_the_loss_mask_excludes_tool_tokens_and_staleness_counts_sampled_tokens_only():
    """The trainer's loss mask (padded and packed layouts) is env_mask: tool tokens are in the input, not trained."""
    from hfllamarl.runtime.training.batching import pack_batch, pad_batch

    def rollout(prompt, completion, mask, versions):
        return Rollout(prompt="p", prompt_ids=prompt, completion_ids=completion, versions=versions,
                       behavior_logprobs=[-1.0] * len(completion), finish_reason="stop", completion_text="",
                       env_mask=mask)

    rows = [rollout([5, 6], [10, 11, 20, 21, 22, 12], [1, 1, 0, 0, 0, 1], [3, 3, 4, 4, 4, 4]),
            rollout([7], [13, 14], None, [2, 3])]
    batch = pad_batch(rows, 0, "cpu")
    assert batch["mask"].tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0]]
    assert batch["input_ids"].tolist() == [[5, 6, 10, 11, 20, 21, 22, 12], [0, 7, 13, 14, 0, 0, 0, 0]]
    packed = pack_batch(rows, 0, "cpu")  # the padding-free layout: the same loss side, tool tokens still context
    assert packed["mask"].tolist() == batch["mask"].tolist()
    assert packed["input_ids"].tolist() == [[5, 6, 10, 11, 20, 21, 22, 12], [7, 13, 14, 0, 0, 0, 0, 0]]
    assert rows[0].sampled == [0, 1, 5] and rows[0].num_sampled == 3 and rows[0].sampled_versions() == [3, 3, 4]
    assert rows[1].sampled_versions() == [2, 3] and rows[1].num_sampled == 2
    with pytest.raises(ValueError, match="env_mask"):
        rollout([1], [2, 3], [1], [0, 0])


def test_an_environment_that_cannot_be_pickled_is_explained():
    """Reward functions on the trainer get a stand-in whose use says why; a checkpoint with it in flight says how."""
    import pickle
    import threading

    from hfllamarl.runtime.data.episodes import Episode, snapshot, unpickled

    class Connected:
        def __init__(self):
            self.lock, self.calls = threading.Lock(), 3

    copy = unpickled(snapshot(Connected()))
    with pytest.raises(RuntimeError, match="environment Connected could not be pickled.*environments\\[i\\].calls"):
        copy.calls
    with pytest.raises(TypeError, match="cannot save the environment Connected.*__getstate__"):
        pickle.dumps(Episode(environment=Connected()))
    episode = pickle.loads(pickle.dumps(Episode(messages=[{"role": "tool", "content": "1"}], tool_calls=2,
                                                environment=SimpleNamespace(calls=5))))
    assert episode.tool_calls == 2 and unpickled(episode.environment).calls == 5


# ---------------------------------------------------------------------------- chat templates, against TRL itself
def test_prompts_and_tool_results_are_the_tokens_trls_trainer_builds(tool_model):
    """Our rendering of a prompt with tools, and of the tool results that follow a turn, against TRL's own
    GRPOTrainer methods (called on the attributes they read)."""
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from hfllamarl.runtime.agents.tool_chat import ToolChat
    from hfllamarl.testing.tiny_chat import calculator, calculator_rows

    ours = AutoTokenizer.from_pretrained(tool_model)
    kwargs = {"enable_thinking": False}
    chat = ToolChat(ours, kwargs)
    theirs = AutoTokenizer.from_pretrained(tool_model)
    from trl.chat_template_utils import add_response_schema, get_training_chat_template

    add_response_schema(theirs)
    trl = SimpleNamespace(processing_class=theirs, _tokenizer=theirs, chat_template=get_training_chat_template(theirs),
                          chat_template_kwargs=kwargs, _is_vlm=False, tools=[calculator], environment_factories=None)
    prompts = [row["prompt"] for row in calculator_rows(3, seed=1)]
    expected, _, _ = GRPOTrainer._tokenize_prompts(trl, prompts)
    assert [chat.encode_prompt(p, [calculator]) for p in prompts] == [list(ids) for ids in expected]
    for messages in ([{"role": "tool", "name": "calculator", "content": "42"}],
                     [{"role": "tool", "name": "calculator", "content": "{'error': 'x'}"},
                      {"role": "tool", "name": "calculator", "content": "7"}]):
        assert chat.suffix_ids(messages) == list(GRPOTrainer._get_tool_suffix_ids(trl, messages))
    turn = ours.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
                       '<|im_end|>', add_special_tokens=False)
    assert chat.parse(turn, expected[0], [calculator])["tool_calls"] == [call("calculator", expression="1+2")]


def test_what_tools_return_is_made_valid_text_before_it_is_tokenized(tool_model):
    """A tool result ending in a lone surrogate (model code's `print(chr(0xd800))`) fails the tokenizer as it is;
    as the runner hands it on, the model reads U+FFFD there. A pair written as two escapes is its character."""
    from transformers import AutoTokenizer

    from hfllamarl.runtime.agents.tool_calls import ToolResult, valid_text
    from hfllamarl.runtime.agents.tool_chat import ToolChat

    chat = ToolChat(AutoTokenizer.from_pretrained(tool_model), {"enable_thinking": False})
    raw = {"role": "tool", "name": "calculator", "content": "42" + chr(0xD800)}
    with pytest.raises(Exception):  # (TypeError from the tokenizer: what ended the generator rank)
        chat.suffix_ids([raw])
    message = ToolResult("calculator", "42" + chr(0xD800)).message()
    assert message["content"] == "42\ufffd"
    assert chat.suffix_ids([message]) == chat.suffix_ids([{**raw, "content": "42\ufffd"}])
    blocks = ToolResult("calculator", [{"type": "text", "text": chr(0xDFFF)}]).message()["content"]
    assert blocks == [{"type": "text", "text": "\ufffd"}]
    assert valid_text({"a": (chr(0xD83D) + chr(0xDE00), 3)}) == {"a": ("\U0001F600", 3)}


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("kw,ctor,match", [
    ({"generation_kwargs": {"presence_penalty": 0.5}}, {"tools": "calc"}, "several calls"),
    ({}, {"tools": "calc", "rollout_func": "rf"}, "cannot be combined with tools"),
    ({"partial_rollout_tokens": 32, "max_staleness": 2}, {"rollout_func": "rf"}, "partial_rollout_tokens cannot"),
    ({"max_tool_calling_iterations": 2}, {}, "no tools and no environment_factory"),
    ({"max_tool_calling_iterations": -1}, {"tools": "calc"}, "whole number >= 0"),
    ({}, {"environment_factory": "no_such_env"}, "No environments plugin named 'no_such_env'"),
    ({}, {"environment_factory": {"a": object()}}, r"environment_factory\['a'\] must be a callable"),
    ({}, {"environment_factory": lambda: object()}, "has no `reset` method"),
    ({}, {"tools": "calc", "string_prompts": True}, "need chat prompts"),
    ({}, {"environment_factory": {"x": "calculator"}}, "`environment` column"),
    ({"generator_failure": "continue"}, {"tools": "calc"}, "single-turn"),
])
def test_settings_the_multi_turn_loop_cannot_honour_are_refused(tool_model, tmp_path, kw, ctor, match):
    from datasets import Dataset

    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
    from hfllamarl.testing.tiny_chat import calculator, calculator_rows

    rows = calculator_rows(8)
    if ctor.pop("string_prompts", False):
        rows = [{"prompt": "What is 1+2?", "answer": "3"}] * 8
    named = {"calc": [calculator], "rf": lambda prompts, trainer: {}}
    ctor = {k: named.get(v, v) if isinstance(v, str) and k != "environment_factory" else v for k, v in ctor.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4,
                               num_generations=2, max_completion_length=32, **kw)
        AsyncAIPOTrainer(model=tool_model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                         train_dataset=Dataset.from_list(rows), **ctor)


def test_an_environment_that_scores_itself_is_a_reward_and_may_stand_alone(tool_model, tmp_path):
    """TRL: get_reward makes the environment a reward source named after its class (weight 1, after the reward
    functions' weights), reward_funcs may then be omitted, and without a dataset reset() writes the prompts."""
    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer

    class Scored:
        def reset(self, **row):
            return "What is 1+2?"

        def get_reward(self):
            return 1.0

    args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4,
                           num_generations=2, max_completion_length=32, max_steps=2, reward_weights=[0.5])
    trainer = AsyncAIPOTrainer(model=tool_model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                               args=args, environment_factory=Scored)
    assert trainer.rewards.names[-1] == "Scored" and trainer.rewards.weights == [0.5, 1.0]
    assert trainer.train_dataset["prompt"] == [[{"role": "user", "content": ""}]] * 2
    args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4,
                           num_generations=2, max_completion_length=32, max_steps=2)
    trainer = AsyncAIPOTrainer(model=tool_model, args=args, environment_factory=Scored)
    assert trainer.rewards.names == ["Scored"]
    with pytest.raises(ValueError, match="reward_funcs is required"):
        AsyncAIPOTrainer(model=tool_model, args=args, environment_factory="calculator")


# ---------------------------------------------------------------------------- real engine, real training
@pytest.mark.slow
def test_multi_turn_rollouts_on_a_real_engine(tool_model, tmp_path):
    """vLLM with tools, 5 policy versions over a partial multi-turn batch: every sampled token's mu equals the
    transformers pi of the version that sampled it (so the tool tokens sit exactly where the model saw them), every
    tool span is what Qwen3's template writes for that result, the loss mask is 1 on sampled tokens only;
    in-flight environments survive a checkpoint; hanging and raising tools end in errors the model reads; evaluation
    rollouts are multi-turn too."""
    proc = run_script([str(SCRIPTS / "agentic_checks.py"), tool_model, str(tmp_path)], timeout=600)
    assert proc.returncode == 0, tail(proc)
    res = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    rows, ckpt, hang = res["rows"], res["checkpoint"], res["hang"]
    assert rows["with_tool_calls"] >= 2 and rows["tool_spans"] >= 2, rows  # (a result that does not fit is dropped)
    assert rows["tool_spans_ok"] and rows["mask_ok"] and rows["turns_end_with_eos"] and rows["lengths_ok"], rows
    assert rows["max_error"] < 1e-4 and rows["sampled_tokens"] > 200, rows
    assert rows["multi_tick_with_tools"] >= 1 and rows["multi_version_with_tools"] >= 1, rows
    # a turn after tool results, cut by the length limit or not, is the last message (0 or 1 rollout is cut here)
    assert rows["last_turn_kept"], rows
    assert ckpt["carried_with_calls"] >= 1 and ckpt["finished"] == 16, ckpt
    assert ckpt["kept_earlier_calls"] and ckpt["env_calls_match"] and ckpt["reward_counts_calls"], ckpt
    assert hang["finished"] == 16 * hang["batches"], hang
    assert hang["timeouts"] >= 1 and hang["failures"] > hang["timeouts"], hang  # a call that hung, one that raised
    assert "abandoned" in hang["errors_seen"] and hang["seconds"] < 60 * hang["batches"], hang
    ev = res["evaluation"]
    assert ev["groups"] == 12 and ev["rollouts"] == 36 and ev["eval_versions"] == [0], ev
    assert ev["all_finished"] and ev["masks_ok"] and ev["with_tool_calls"] >= 1, ev


def _launch(args: list[str], log) -> subprocess.Popen:
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", **SIDE_BY_SIDE_ENV)  # (the scripts run side by side)
    env.pop("WORLD_SIZE", None), env.pop("RANK", None)
    return popen_script([str(SCRIPTS / "agentic_user.py"), *args], env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_user_scripts_train_under_trl_and_under_async_aipo(tool_model, tmp_path):
    """The same scripts (tools=[fn]; environment_factory=Env with reset text, get_reward and a reward reading
    `environments`) train 3 steps from plain python under TRL's GRPOTrainer and under AsyncAIPOTrainer, the reward
    functions receiving the same things; with max_staleness=0 pi == mu on every trained token; a rollout_func
    generating through the trainer view trains too; a calculator that hangs or raises does not stop the job (the
    environment run: partial multi-turn rollouts at staleness up to 2), nor one whose results end in a lone surrogate
    (the tools run)."""
    # The hanging/raising calculator under AsyncAIPOTrainer only: TRL's would wait for it forever. The on-policy
    # tools run samples 12 completions a step: the model calls the tool in about one answer of five, and 3 steps of 4
    # completions had none at all in one run of the suite.
    runs = {
        "trl_tools": ["tools", "--trl"],
        "ours_tools": ["tools", "--max-staleness", "0", "--batch", "12", "--surrogate"],
        "trl_env": ["env", "--trl"],
        "ours_env": ["env", "--partial", "32", "--max-staleness", "3", "--batch", "8", "--hang", "--timeout", "2"],
        "ours_rollout_func": ["rollout_func"],
    }
    procs = {}
    for name, (mode, *rest) in runs.items():
        log = open(tmp_path / f"{name}.log", "w")
        procs[name] = (_launch([mode, tool_model, str(tmp_path / name), "--summary", str(tmp_path / f"{name}.jsonl"),
                                *rest], log), log)
    out = {}
    for name, (proc, log) in procs.items():
        proc.wait(timeout=600)
        log.close()
        text = (tmp_path / f"{name}.log").read_text()
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{text[-4000:]}"
        path = tmp_path / f"{name}.jsonl"
        summary = [json.loads(line) for line in open(path)] if path.exists() else []
        out[name] = (step_logs(text) if not name.startswith("trl") else _trl_steps(text), summary)

    for mode in ("tools", "env"):
        (trl_steps, trl_calls), (ours, our_calls) = out[f"trl_{mode}"], out[f"ours_{mode}"]
        assert len(trl_steps) == len(ours) == 3
        for names in (["tools/call_frequency", "tools/failure_frequency", "completions/mean_length"],
                      ["rewards/CalculatorEnv/mean", "rewards/used_the_tool/mean"] if mode == "env" else []):
            assert all(k in h for h in trl_steps + ours for k in names), names
        trl_kwargs = {k for c in trl_calls for k in c["kwargs"]}
        assert trl_kwargs == {k for c in our_calls for k in c["kwargs"]}, (trl_kwargs, our_calls[0]["kwargs"])
        for calls in (trl_calls, our_calls):  # completions: assistant turns, tool results after a calling turn
            assert all(r[0] == "assistant" and all(b == "assistant" or a in ("assistant", "tool")
                                                   for a, b in zip(r, r[1:])) for c in calls for r in c["roles"])
    ours = out["ours_tools"][0]
    assert all(assert_on_policy(h) is None for h in ours)  # pi == mu on every trained token, tool turns included
    # every result the calculator gave ended in a lone surrogate (the job trained on): the model read U+FFFD there
    contents = [t for c in out["ours_tools"][1] for t in c["tool_contents"]]
    results = [t for t in contents if not t.startswith("{'error'")]  # (a call to no such tool: TRL's error text)
    assert all(t.endswith("\ufffd") for t in results), contents
    assert not any(0xD800 <= ord(ch) < 0xE000 for t in contents for ch in t), contents
    assert sum(h["tools/call_frequency"] for h in ours) > 0 and any("tool" in r for c in out["ours_tools"][1]
                                                                   for r in c["roles"])
    for name in ("trl_env", "ours_env"):
        calls = out[name][1]
        assert all(e.endswith(" Use the calculator.") for c in calls for e in c["prompt_ends"]), name
        assert all(kind == "CalculatorEnv" for c in calls for kind, _ in c["environments"]), name
    env_steps = out["ours_env"][0]
    assert [h["staleness/max"] for h in env_steps] == [0, 1, 2]
    assert any(h["tools/call_frequency"] > 0 for h in env_steps)
    assert any(h["partial_rollouts/count"] > 0 for h in env_steps)
    rf_steps, rf_calls = out["ours_rollout_func"]
    assert len(rf_steps) == 3 and assert_on_policy(rf_steps[0]) is None
    # the rollout_func's other fields reach the reward functions, env_mask too (TRL passes every key but the three)
    assert all(c["extra"] == [1] * c["n"] and {"turns", "env_mask"} <= set(c["kwargs"]) for c in rf_calls)
    assert sum(h["tools/timeout_frequency"] for h in env_steps) > 0, env_steps  # the hanging call: abandoned
    assert sum(h["tools/failure_frequency"] for h in env_steps) > sum(h["tools/timeout_frequency"] for h in env_steps)


def _trl_steps(text: str) -> list[dict]:
    line = [l for l in text.splitlines() if l.startswith("LOG_HISTORY ")][-1]
    return [h for h in json.loads(line[len("LOG_HISTORY "):]) if "reward" in h]


@pytest.mark.slow
def test_tools_run_once_on_a_tensor_parallel_generator(tool_model, tmp_path):
    """torchrun with 3 processes: one trainer and one engine over 2 generator ranks (TP=2). Every rank of the engine
    makes the same generate calls, but each tool call runs once, on the engine's first rank, and the other rank
    continues with its result: on-policy pi == mu holds on every trained token."""
    calls = tmp_path / "calls.jsonl"
    proc = run_script([str(SCRIPTS / "agentic_user.py"), "tools", tool_model, str(tmp_path / "out"), "--generators",
                       "2", "--max-staleness", "0", "--batch", "8", "--calls", str(calls)], nproc=3, timeout=600)
    assert proc.returncode == 0, tail(proc)
    steps = step_logs(proc.stdout)
    assert len(steps) == 3 and all(assert_on_policy(h) is None for h in steps)
    made = [json.loads(line) for line in open(calls)] if calls.exists() else []
    logged = [round(h["tools/call_frequency"] * 8) for h in steps]  # calls per completion x 8 completions
    failed = [round(h["tools/failure_frequency"] * n) for h, n in zip(steps, logged)]
    # every counted call ran once, except failures that never reached the tool (a tool it did not name, arguments
    # that do not bind); a call that reached it and raised ran
    not_run = sum(failed) - sum(m["failed"] for m in made)
    assert made and not_run >= 0 and len(made) == sum(logged) - not_run, (len(made), logged, failed, made)
    assert len({m["pid"] for m in made}) == 1  # one rank ran them all
