"""The policy chooses how many tool calls it makes and how slow they are: one rollout's tool work is bounded per turn
(`max_tool_calls_per_turn`) and over the rollout (`rollout_time_budget_s`), past either the rollout ends as TRL's
`_tool_call_loop` ends one at `max_tool_calling_iterations`, and no rollout waits for another's calls.

The policy here is scripted (the adversary's turns, as token ids of the real Qwen3 chat tokenizer), everything
else is the runtime's own: `MultiTurn.run`, a real `ToolRunner` with real sleeping tools, the chat template and
TRL's response parser, the environment pool and `get_reward`."""

import asyncio
import itertools
import json
import threading
import time
from types import SimpleNamespace

import pytest

from hfllamarl import AsyncAIPOConfig
from hfllamarl.runtime.data.episodes import completion, tool_counts, tool_metrics
from hfllamarl.runtime.agents.multi_turn import AgentSpec, MultiTurn
from hfllamarl.runtime.agents.tool_calls import ToolRunner

SLEEP_S, CALLS, TIMEOUT_S = 0.5, 50, 1.0
STARTED = []  # (tool, monotonic time) of every call that started, from any thread
LOCK = threading.Lock()


def slow(x: int) -> int:
    """Wait, then echo.

    Args:
        x: A number.
    """
    with LOCK:
        STARTED.append(("slow", time.monotonic()))
    time.sleep(SLEEP_S)
    return x


def quick(x: int) -> int:
    """Add one.

    Args:
        x: A number.
    """
    with LOCK:
        STARTED.append(("quick", time.monotonic()))
    return x + 1


class Slow:
    """An environment with one slow tool; its reward counts the calls that reached it."""

    def __init__(self):
        self.calls = 0

    def reset(self, **row):
        self.calls = 0

    def slow(self, x: int) -> int:
        """Wait, then echo.

        Args:
            x: A number.
        """
        self.calls += 1
        time.sleep(SLEEP_S)
        return x

    def get_reward(self) -> float:
        return float(self.calls)


def _turn(tool: str, count: int) -> str:
    return "".join(f'<tool_call>\n{{"name": "{tool}", "arguments": {{"x": {i}}}}}\n</tool_call>'
                   for i in range(count)) + "<|im_end|>"


class Scripted(MultiTurn):
    """The adversary: on a prompt saying "slow" it calls `slow` CALLS times in its first turn; on "block" it calls
    `blocks` once, on "dawdle" `dawdle` once, then answers; on "aquick", "atick" or "alocked" it calls the tool of that
    name (else `quick`) once per turn for three turns, then answers; on a prompt starting with "score" or "broken" it answers at once."""

    def generate_local(self, requests):
        tok = self.ex.encoder.tokenizer
        outputs = []
        for ids, _, _ in requests:
            context = tok.decode(ids)
            user = context.split("<|im_start|>user")[1].split("<|im_end|>")[0].strip()  # the prompt (tool results
            # come as later user turns)
            answered = context.count("<tool_response>")
            if "slow" in user:
                text = _turn("slow", CALLS)
            elif user in ("block", "dawdle"):
                text = _turn("blocks" if user == "block" else "dawdle", 1) if not answered else "done<|im_end|>"
            elif user.startswith(("score", "broken")):
                text = "done<|im_end|>"
            else:
                tool = user if user in ("aquick", "atick", "alocked") else "quick"
                text = _turn(tool, 1) if answered < 3 else "done<|im_end|>"
            token_ids = tok.encode(text, add_special_tokens=False)
            comp = SimpleNamespace(token_ids=token_ids, finish_reason="stop",
                                   logprobs=[{t: SimpleNamespace(logprob=-0.1)} for t in token_ids])
            outputs.append(SimpleNamespace(outputs=[comp]))
        return outputs


@pytest.fixture(scope="module")
def tokenizer():
    from hfllamarl.testing.chat_tokenizer import build_chat_tokenizer

    return build_chat_tokenizer("qwen3")


def _multi_turn(tokenizer, **spec_kw) -> Scripted:
    spec = AgentSpec(tool_call_timeout_s=TIMEOUT_S, **spec_kw)
    executor = SimpleNamespace(
        topology=SimpleNamespace(replica_size=1, local_rank=0, num_generators=1, timeout=None),
        encoder=SimpleNamespace(tokenizer=tokenizer), version=3,
        spec=SimpleNamespace(chat_template_kwargs={"enable_thinking": False}, max_completion_length=8000,
                             max_model_len=16000, partial_rollout_tokens=None))
    return Scripted(spec, executor)


def _run(mt: MultiTurn, prompts: list[str]) -> tuple[list, float]:
    rollouts = [mt.start({"prompt": [{"role": "user", "content": p}]}, i) for i, p in enumerate(prompts)]
    STARTED.clear()
    start = time.monotonic()
    mt.run(rollouts, 8000)
    return rollouts, time.monotonic() - start


def _ended_as_trl_ends_it(r, tokenizer) -> None:
    """TRL's `_tool_call_loop` past its last round: the calling turn is the completion's last message, its tool calls
    unanswered; the tokens are the sampled ones, ending with the end-of-turn token (not truncated); no tool token."""
    messages = completion(r)
    assert messages[-1]["role"] == "assistant" and len(messages[-1]["tool_calls"]) == CALLS
    assert all(m["role"] == "assistant" for m in messages) and r.finish_reason == "stop"
    assert r.completion_ids == tokenizer.encode(_turn("slow", CALLS), add_special_tokens=False)
    assert r.completion_ids[-1] == tokenizer.eos_token_id and set(r.env_mask) == {1}


def test_a_turn_of_too_many_calls_runs_none_and_ends_the_rollout(tokenizer):
    mt = _multi_turn(tokenizer, tools=[slow, quick], max_calls_per_turn=8, rollout_time_budget_s=30.0)
    (bad, good), seconds = _run(mt, ["slow", "quick"])
    assert seconds < 1.0 and not [s for s in STARTED if s[0] == "slow"], (seconds, STARTED)
    _ended_as_trl_ends_it(bad, tokenizer)
    assert bad.episode.calls_refused == CALLS and bad.episode.tool_calls == 0
    assert bad.episode.ended_by == "calls_per_turn"
    # the other rollout of the batch is untouched: three turns answered, then its answer
    assert [m.get("content") for m in completion(good) if m["role"] == "tool"] == ["1", "1", "1"]
    assert completion(good)[-1]["content"] == "done" and good.episode.ended_by is None
    metrics = tool_metrics(tool_counts([bad, good]), 2.0)
    assert metrics["tools/calls_refused"] == CALLS and metrics["tools/ended_by_budget"] == 1.0
    assert metrics["tools/call_frequency"] == 1.5  # the 3 calls that ran, per completion


@pytest.mark.timing  # (its turns' start times, to a fraction of a second)
def test_a_turn_of_many_slow_calls_ends_within_the_rollouts_budget(tokenizer):
    """50 calls of 0.5 s each (25 s in a row, each under its own 1 s bound): the 2 s budget ends the rollout in 2 s;
    the rollout beside it goes on through its three turns meanwhile, without waiting for the slow one."""
    budget = 2.0
    mt = _multi_turn(tokenizer, factories={None: Slow}, tools=[quick], max_calls_per_turn=64,
                     rollout_time_budget_s=budget)
    (bad, good), seconds = _run(mt, ["slow", "quick"])
    ran = mt._live(bad.episode)  # (finish() replaced it by its pickled copy: read that copy)
    assert seconds < budget + 0.5, seconds
    assert CALLS * SLEEP_S > 10 * budget  # without the budget the turn would have run for 25 s
    _ended_as_trl_ends_it(bad, tokenizer)
    # (+0.5 s: a loaded machine's scheduling; without the budget the calls would have run for 25 s)
    assert bad.episode.ended_by == "time_budget" and budget <= bad.episode.tool_seconds < budget + 0.5
    made = bad.episode.tool_calls
    assert made == int(budget / SLEEP_S) - 1 or made == int(budget / SLEEP_S), made  # ~4 calls fit in 2 s
    # +1: the one abandoned at the budget; none when the 4th call ended just as the budget ran out (no 5th started:
    # CI 65, made 4, 4 calls reached the environment)
    abandoned = ran.calls - made
    assert abandoned == 1 or (abandoned == 0 and made == int(budget / SLEEP_S)), (made, ran.calls)
    assert bad.episode.calls_refused == CALLS - made
    # scored as usual: get_reward ran on its environment, which is not handed to another rollout (a call was left
    # running in it, or the turn was cut by the budget)
    assert bad.model_rewards["Slow"] == float(ran.calls)
    assert all(env is not ran for env in mt.pool.free.get(None, []))
    # the other rollout finished its three quick turns long before the slow one's budget ran out
    quick_times = [t for name, t in STARTED if name == "quick"]
    # (a turn that waited for the slow one would start a budget, 2 s, after the previous; half of it leaves room for a
    # loaded machine's scheduling)
    assert len(quick_times) == 3 and max(quick_times) - min(quick_times) < budget / 2, STARTED
    assert completion(good)[-1]["content"] == "done" and good.episode.ended_by is None
    metrics = tool_metrics(tool_counts([bad, good]), 2.0)
    assert metrics["tools/calls_refused"] == CALLS - made and metrics["tools/ended_by_budget"] == 1.0
    # the job is unharmed: the same runner answers the next call at once
    assert mt.runner.call("quick", quick, {"x": 41}).content == 42


def test_a_budget_cuts_async_calls_and_a_stuck_event_loop():
    import asyncio

    async def nap(x: int) -> int:
        await asyncio.sleep(5)
        return x

    async def blocks_the_loop(x: int) -> int:
        time.sleep(3)  # never yields: wait_for cannot end it
        return x

    async def add_one(x: int) -> int:
        return x + 1

    runner = ToolRunner(timeout_s=10.0)
    call = [{"type": "function", "function": {"name": "nap", "arguments": {"x": i}}} for i in range(20)]
    stuck = [{"type": "function", "function": {"name": "blocks_the_loop", "arguments": {"x": 1}}}]
    tools = {"nap": nap, "blocks_the_loop": blocks_the_loop}
    for calls in (call, stuck):
        start = time.monotonic()
        turn = runner.submit(calls, tools, budget_s=0.5).result(5)
        # the 0.5 s budget, not the calls' 5 s or 3 s (+1 s: a loaded machine's scheduling)
        assert time.monotonic() - start < 1.5 and turn.over_budget and turn.refused == len(calls) and not turn.results
    assert runner.call("add_one", add_one, {"x": 1}).content == 2  # a new event loop serves what comes next


def _make(**kw):
    return AsyncAIPOConfig(output_dir="/tmp/hfllamarl-test-budget", report_to="none", per_device_train_batch_size=4,
                           num_generations=2, **kw)


def test_the_budget_defaults_to_a_share_of_the_collective_timeout_and_sums_that_pass_it_are_refused():
    # half of it, less get_reward's bound (tool_call_timeout_s=60 + 1 s): 300 - 61
    assert _make(collective_timeout_s=600).rollout_time_budget_s == 239
    assert _make(collective_timeout_s=600, eval_strategy="steps", eval_steps=2).rollout_time_budget_s == 150 - 61
    # get_reward's bound does not fit (60 + 1 > 30): all of the half, refused only for an environment with get_reward
    assert _make(collective_timeout_s=60).rollout_time_budget_s == 30
    assert _make().max_tool_calls_per_turn == 8
    # 2 rounds x (4 calls x 100 s + 1) = 802 s <= 900: the rounds bound it even past a 1000 s budget
    assert _make(rollout_time_budget_s=1000, max_tool_calling_iterations=2, max_tool_calls_per_turn=4,
                 tool_call_timeout_s=100).rollout_time_budget_s == 1000
    cases = [
        (dict(rollout_time_budget_s=1000), "take 1000 s of one generator tick .rollout_time_budget_s=1000., more "
         "than 0.5 x collective_timeout_s=1800 = 900 s"),
        (dict(rollout_time_budget_s=1000, max_tool_calling_iterations=3, max_tool_calls_per_turn=4,
              tool_call_timeout_s=100), r"take 1000 s .*min\(rollout_time_budget_s=1000, max_tool_calling_iterations=3 "
         r"x \(max_tool_calls_per_turn=4 x tool_call_timeout_s=100 \+ 1\)\)"),
        (dict(rollout_time_budget_s=200, collective_timeout_s=600, eval_strategy="steps", eval_steps=2),
         r"take 400 s .*x 2 \(an evaluation runs in the same tick as training\)\), more than 0.5 x "
         "collective_timeout_s=600 = 300 s.*Set rollout_time_budget_s <= 150"),
        (dict(max_tool_calls_per_turn=0), "max_tool_calls_per_turn=0; it must be a whole number >= 1"),
        (dict(max_tool_calls_per_turn=2.5), "max_tool_calls_per_turn=2.5"),
        (dict(rollout_time_budget_s=0), "rollout_time_budget_s=0; it must be a number of seconds > 0"),
        (dict(rollout_time_budget_s=float("inf")), "rollout_time_budget_s=inf"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            _make(**kw)


def test_the_trainer_hands_the_bounds_to_the_generator():
    from hfllamarl.trainers.agent_setup import build_agent

    args = _make(max_tool_calls_per_turn=3, rollout_time_budget_s=12.5)
    spec = build_agent(args, [quick], None, None).spec
    assert (spec.max_calls_per_turn, spec.rollout_time_budget_s) == (3, 12.5)
    assert json.loads(json.dumps(args.to_dict()))["rollout_time_budget_s"] == 12.5


class Agentic:
    """An environment whose async tools are its methods: one blocks the event loop it runs on, one answers at once."""

    def reset(self, **row):
        pass

    async def blocks(self, x: int) -> int:
        """Block the event loop it runs on (it never yields).

        Args:
            x: A number.
        """
        time.sleep(3 * TIMEOUT_S)
        return x

    async def aquick(self, x: int) -> int:
        """Add one, asynchronously.

        Args:
            x: A number.
        """
        await asyncio.sleep(0.01)
        return x + 1


def test_a_coroutine_blocking_its_event_loop_does_not_touch_another_rollouts_async_calls(tokenizer):
    """Rollout A's async tool blocks its environment's event loop for 3 s (3 x its bound); rollout B's async calls,
    made meanwhile, return their right results at once: each environment instance has an event loop of its own."""
    mt = _multi_turn(tokenizer, factories={None: Agentic}, max_calls_per_turn=8, rollout_time_budget_s=30.0)
    start = time.monotonic()
    rollouts = [mt.start({"prompt": [{"role": "user", "content": p}]}, i) for i, p in enumerate(["block", "aquick"])]
    envs = [r.episode.environment for r in rollouts]
    done = {}
    original = mt._apply

    def apply(r, turn, allowance):  # when each turn's results arrived
        done.setdefault(r.prompt[-1]["content"], []).append(time.monotonic() - start)
        return original(r, turn, allowance)

    mt._apply = apply
    mt.run(rollouts, 8000)
    a, b = rollouts
    # B: three turns, each answered with x + 1 for x = 0, well before A's blocked loop is given up (at 2 s)
    assert [m.get("content") for m in completion(b) if m["role"] == "tool"] == ["1", "1", "1"], completion(b)
    assert b.episode.tool_failures == 0 and b.episode.tool_timeouts == 0
    assert max(done["aquick"]) < TIMEOUT_S, done
    # A: its own call timed out (the loop it blocked was abandoned at the bound: 1 s, + 1 s for a stuck loop)
    assert [m["content"] for m in completion(a) if m["role"] == "tool"] == [
        f"{{'error': 'Tool blocks did not finish within {TIMEOUT_S:g} s and was abandoned.'}}"]
    assert a.episode.tool_timeouts == 1 and 2 * TIMEOUT_S <= done["block"][0] < 2 * TIMEOUT_S + 0.5, done
    assert mt.runner.abandoned == 1
    # A's environment is dropped with its loop; B's goes back to the pool and keeps its loop (the only one left)
    assert mt.pool.free[None][-1] is envs[1] and all(env is not envs[0] for env in mt.pool.free[None])
    assert len(mt.runner.loops) == 1 and mt.runner.loops.get(envs[1]) is mt.runner.loops.get(envs[1])


class Stateful:
    """Keeps loop-bound objects between calls, as environments written for TRL do: a lock and a queue made in
    __init__ (each waited on, so bound to the loop it ran on), and the queue's producer, a task the first call starts
    and that lives on through turns, rollouts and reset()."""

    def __init__(self):
        self.lock, self.queue, self.producer, self.seen = asyncio.Lock(), asyncio.Queue(maxsize=1), None, []

    def __getstate__(self):  # what travels to the trainer ranks (a lock, a queue and a task cannot be pickled)
        return {"seen": self.seen}

    def reset(self, **row):
        self.seen = []

    async def _produce(self):
        for i in itertools.count():
            await self.queue.put(i)  # waits while the queue is full

    async def atick(self, x: int) -> int:
        """The next number of this environment's producer.

        Args:
            x: Ignored.
        """
        if self.producer is None:
            self.producer = asyncio.ensure_future(self._produce())
        async with self.lock:
            contender = asyncio.ensure_future(self.lock.acquire())  # waits for the lock
            item = await self.queue.get()  # waits for the producer
        await contender
        self.lock.release()
        self.seen.append(item)
        return item

    async def get_reward(self) -> float:
        async with self.lock:
            return float(sum(self.seen))


def test_an_environments_loop_bound_objects_work_across_turns_rollouts_and_reset(tokenizer):
    """Three turns of `atick` read 0, 1, 2 from the producer the first call started (with an event loop per turn the
    second call fails: the lock and the queue belong to the first turn's closed loop, and the producer was cancelled
    with it); the next rollout on the same instance, after reset(), reads 3, 4, 5; the async get_reward uses the same
    lock. The loop is not an attribute of the instance, so the environment's pickled copy travels as before."""
    mt = _multi_turn(tokenizer, factories={None: Stateful}, max_calls_per_turn=8, rollout_time_budget_s=30.0)
    env = mt.pool.free[None][0]
    for expected in (["0", "1", "2"], ["3", "4", "5"]):
        (r,), _ = _run(mt, ["atick"])
        assert [m["content"] for m in completion(r) if m["role"] == "tool"] == expected, completion(r)
        assert r.model_rewards["Stateful"] == float(sum(map(int, expected)))
        assert mt.pool.free[None] == [env]  # the same instance served both rollouts
        copy = mt._live(r.episode)  # the pickled copy the trainer ranks receive
        assert type(copy).__name__ == "Stateful" and copy.seen == [int(v) for v in expected]
    assert set(vars(env)) == {"lock", "queue", "producer", "seen"}
    assert len(mt.runner.loops) == 1 and mt.runner.abandoned == 0  # one loop: the environment's, no shared one
    names = {t.name for t in threading.enumerate()}
    assert "hfllamarl-loop-Stateful" in names
    mt.runner.close()  # the runner closes: the loop stops, cancels the producer and closes; its thread ends
    deadline = time.monotonic() + 5.0
    while "hfllamarl-loop-Stateful" in {t.name for t in threading.enumerate()} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "hfllamarl-loop-Stateful" not in {t.name for t in threading.enumerate()}
    assert env.producer.cancelled() and len(mt.runner.loops) == 0


MODULE_LOCK = asyncio.Lock()  # made at import, used by every call of every rollout, as TRL users write module state


async def alocked(x: int) -> int:
    """Add one under the module's lock.

    Args:
        x: A number.
    """
    async with MODULE_LOCK:
        contender = asyncio.ensure_future(MODULE_LOCK.acquire())  # waits for the lock
        await asyncio.sleep(0.01)
    await contender
    MODULE_LOCK.release()
    return x + 1


def test_standalone_async_tools_share_one_loop_so_module_level_loop_bound_objects_work(tokenizer):
    """Two rollouts call `alocked` (a module-level asyncio.Lock, waited on) three turns each, then two more rollouts
    do: every call answers x + 1 (with an event loop per turn the second turn fails: the lock belongs to the first
    turn's loop). The standalone tools run on one loop, as TRL runs them."""
    mt = _multi_turn(tokenizer, tools=[alocked], max_calls_per_turn=8, rollout_time_budget_s=30.0)
    for _ in range(2):
        rollouts, _ = _run(mt, ["alocked", "alocked"])
        for r in rollouts:
            assert [m["content"] for m in completion(r) if m["role"] == "tool"] == ["1", "1", "1"], completion(r)
    assert len(mt.runner.loops) == 1 and mt.runner.abandoned == 0
    mt.runner.close()


class Dawdle:
    """An environment whose reward is the number in its prompt ("score 2"); the policy can make get_reward hang
    (tool `dawdle`, on prompt "dawdle"), and on "broken ..." get_reward raises."""

    def reset(self, prompt, **row):
        self.text, self.slow = prompt[-1]["content"], False

    def dawdle(self, x: int) -> str:
        """Make scoring slow.

        Args:
            x: Ignored.

        Returns:
            A confirmation.
        """
        self.slow = True
        return "ok"

    def get_reward(self) -> float:
        if self.slow:
            time.sleep(3 * TIMEOUT_S)
        if self.text.startswith("broken"):
            raise ValueError("no score for a broken answer")
        return float(self.text.split()[-1])


def test_get_rewards_that_time_out_run_together_leave_their_rollouts_unscored_and_the_job_goes_on(tokenizer):
    """Three rollouts make their get_reward sleep 3 s (3 x the 1 s bound): the three calls run together, so the run
    ends within one bound (three in a row without); they are unscored (None), not 0, and left out of their group's
    baseline (TRL's NaN: advantage 0), the other two keep their scores; reward_errors='raise' does not stop the job
    for a timeout. A get_reward that raises still follows reward_errors."""
    from hfllamarl.runtime.agents.environments import EnvironmentReward
    from hfllamarl.runtime.data.episodes import reward_arguments
    from hfllamarl.runtime.data.rewards import RewardRunner

    mt = _multi_turn(tokenizer, factories={None: Dawdle}, reward_errors="raise", rollout_time_budget_s=30.0)
    rollouts, seconds = _run(mt, ["dawdle", "dawdle", "dawdle", "score 2", "score 4"])
    assert TIMEOUT_S <= seconds < 2 * TIMEOUT_S, seconds  # one bound (+ 1 s slack), not 3 x TIMEOUT_S in a row
    assert [r.model_rewards["Dawdle"] for r in rollouts] == [None, None, None, 2.0, 4.0]
    assert mt.reward_timeouts == 3 and mt.reward_errors == 0
    free = mt.pool.free.get(None, [])
    assert len(free) == 2 and all(not env.slow for env in free)  # the three still running in get_reward are not reused
    # the trainer's reward path, as TRL: the unscored ones get reward NaN (out of the nanmean baseline 3.0, advantage 0);
    # the scored keep 2.0 and 4.0
    runner = RewardRunner([EnvironmentReward("Dawdle")])
    total, per_func = runner(**reward_arguments(rollouts), group_sizes=[5])
    assert per_func["Dawdle"] == [None, None, None, 2.0, 4.0] and str(total) == str([float("nan")] * 3 + [2.0, 4.0])
    assert runner.unscored_count == 3
    # the job goes on: the next run is scored as usual
    again, _ = _run(mt, ["score 7"])
    assert again[0].model_rewards["Dawdle"] == 7.0
    # a get_reward that raises follows reward_errors: 'raise' stops the job naming it, 'zero' scores 0 and counts it
    with pytest.raises(RuntimeError, match=r"Dawdle.get_reward\(\) failed .* no score for a broken answer"):
        _run(mt, ["broken 1"])
    zero = _multi_turn(tokenizer, factories={None: Dawdle}, reward_errors="zero", rollout_time_budget_s=30.0)
    broken, _ = _run(zero, ["broken 1", "score 5"])
    assert [r.model_rewards["Dawdle"] for r in broken] == [0.0, 5.0] and zero.reward_errors == 1


def test_get_reward_is_part_of_the_ticks_arithmetic_for_environments_that_have_it():
    from hfllamarl.trainers.agent_setup import build_agent

    class Plain:
        def reset(self, **row):
            pass

    # 2 rounds x (4 calls x 100 s + 1) + get_reward's 100 + 1 = 903 s > 900: refused with get_reward, not without
    args = _make(rollout_time_budget_s=1000, max_tool_calling_iterations=2, max_tool_calls_per_turn=4,
                 tool_call_timeout_s=100)
    assert build_agent(args, [], Plain, None).spec.rollout_time_budget_s == 1000
    with pytest.raises(ValueError, match=r"tool calls and get_reward could take 903 s of one generator tick \(\(min\("
                       r"rollout_time_budget_s=1000, max_tool_calling_iterations=2 x \(max_tool_calls_per_turn=4 x "
                       r"tool_call_timeout_s=100 \+ 1\)\) \+ get_reward's tool_call_timeout_s=100 \+ 1\)\), more "
                       r"than 0.5 x collective_timeout_s=1800 = 900 s.*Set rollout_time_budget_s <= 799"):
        build_agent(args, [], Slow, None)
    with pytest.raises(ValueError, match=r"could take 91 s .*= 30 s.*Lower max_tool_calls_per_turn"):
        build_agent(_make(collective_timeout_s=60), [], Slow, None)  # 30 s of tools + 61 s of get_reward
    assert build_agent(_make(), [], Slow, None).spec.rollout_time_budget_s == 839  # 900 - 61 fits: 839 + 61
