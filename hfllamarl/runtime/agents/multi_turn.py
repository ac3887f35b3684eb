"""Multi-turn rollouts on the generator: tools, environments and custom rollout functions (TRL's contract).

Each tick, every rollout of the tick (carried from earlier ticks, or new: one per completion of each prompt,
with its own environment) goes through rounds on the engine's first rank:

1. one `generate` call for every active rollout, each for at most its allowance: the tick's per-completion
   budget (`partial_rollout_tokens`, else `max_completion_length`) less what it already sampled this tick, and
   never past `max_completion_length` or the context;
2. a turn that ended (end-of-turn or stop) is parsed with TRL's response template; if it calls tools (and
   `max_tool_calling_iterations` allows another round) the calls run, bounded in time
   (`hfllamarl.runtime.agents.tool_calls`), and the tool results are appended as tokens (`tool_chat.ToolChat.suffix_ids`)
   with env_mask 0; otherwise the rollout is finished. Each rollout's calls run in a thread of their own: a
   rollout whose results are in generates its next turn without waiting for another rollout's slow calls;
3. a rollout whose allowance is spent stops for this tick and is carried, as a partial rollout, to the next
   one, where it continues under the newer weights.

Every sampled token keeps its behaviour log-prob and the version that sampled it; tool tokens are context
(log-prob 0, this tick's version, env_mask 0). A tool result that would not fit ends the rollout with the turn
that called it, as TRL does.

The policy chooses how many calls it makes and how slow they are, so each rollout's tool work is bounded
(`max_tool_calls_per_turn`, `rollout_time_budget_s`). Past either bound the rollout ends exactly as TRL's
`_tool_call_loop` ends one that `max_tool_calling_iterations` stops: the turn that asked for the calls is its
last message (its `tool_calls` unanswered, no tool message after it), its tokens are the ones sampled (the turn
ends with its end-of-turn token, so it is not truncated), and the reward functions, and `get_reward`, score that
completion as they score any other. A turn with more calls than `max_tool_calls_per_turn` runs none of them (as
TRL runs none of the calls of the turn past its last round); a turn the time budget cuts short keeps no result
(the results of calls already made are dropped, as TRL drops tool results that would not fit). Both are counted
(`Episode.calls_refused`, `Episode.ended_by`: logged as `tools/calls_refused`, `tools/ended_by_budget`).
Since a rollout's own calls never take more than its budget, and no rollout waits for another's calls, one run
of rollouts spends at most `rollout_time_budget_s` on tools beyond its generate calls.

An environment's `async def` methods (and an async `get_reward`) run on an event loop of that instance's own,
which lives as long as the instance, through every turn and rollout it serves; the standalone async tools share
one loop, as in TRL (`hfllamarl.runtime.agents.event_loops`).

A rollout's `get_reward` starts in a thread of its own when the rollout finishes and is collected at the end of
the run, so the run's get_reward calls take one `tool_call_timeout_s` together, not one each; one that times out
leaves its rollout unscored (None, as TRL's NaN) rather than 0, and never stops the job (`_settle_rewards`).

Tools, environments, get_reward and rollout_func run on the engine's first rank
only; with tensor parallelism the other ranks follow its generate calls (`hfllamarl.runtime.agents.lockstep`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hfllamarl.runtime.data.episodes import Episode, snapshot, unpickled
from hfllamarl.runtime.agents.environments import EnvironmentPool, probe, reward_kinds, tool_methods
from hfllamarl.runtime.agents.lockstep import Lockstep
from hfllamarl.runtime.loop.rollout import UNFINISHED, InFlightBatch, Rollout, RolloutGroup
from hfllamarl.runtime.agents.tool_calls import ToolRunner, tool_name, valid_text
from hfllamarl.runtime.agents.tool_chat import ToolChatError

logger = logging.getLogger(__name__)
_GATHER_S = 0.1  # how long rollouts whose calls are done wait for the others' before generating without them


@dataclass
class AgentSpec:
    """The multi-turn settings of a job, built by the front-end; picklable (user callables by value)."""

    tools: list = field(default_factory=list)  # standalone tools (callables)
    factories: dict | None = None  # {environment name (None: the only one): factory}
    max_iterations: int | None = None  # max_tool_calling_iterations (None: no bound)
    tool_call_timeout_s: float = 60.0
    max_calls_per_turn: int | None = None  # max_tool_calls_per_turn (None: no bound)
    rollout_time_budget_s: float | None = None  # seconds of tool calls per rollout (None: no bound)
    reward_errors: str = "raise"
    rollout_func: Callable | None = None
    rollout_view: dict = field(default_factory=dict)  # what a rollout_func's `trainer` offers (see rollout_funcs)
    chat_template: str | None = None  # the processing_class's, which the generator's tokenizer (from disk) takes
    response_template: Any = None  # the processing_class's response template (or legacy schema), likewise
    response_schema: Any = None

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools or self.factories)

    def __getstate__(self):
        from hfllamarl.runtime.data.episodes import pickled

        try:
            return {"blob": pickled(dict(self.__dict__))}
        except Exception as exc:
            raise TypeError(
                f"the tools, environment_factory or rollout_func cannot be sent to the generator process "
                f"({type(exc).__name__}: {exc}): under plain `python script.py` the generator runs in a child process "
                "and receives them pickled (with cloudpickle, so functions and classes of the script travel by value, "
                "with the globals they use). "
                "Create what cannot be pickled (connections, locks, clients) inside the tool or the environment, or "
                "launch with torchrun / accelerate launch, where every process imports the script.") from exc

    def __setstate__(self, state):
        self.__dict__.update(unpickled(state["blob"]))


class MultiTurn:
    """The generator's tick when the job has tools, environments or a rollout_func (`GeneratorExecutor.step`)."""

    def __init__(self, spec: AgentSpec, executor):
        self.spec, self.ex = spec, executor
        self.lockstep = Lockstep(executor.topology)
        self.leader = self.lockstep.leader
        self.chat = None
        if spec.uses_tools:
            from hfllamarl.runtime.agents.tool_chat import ToolChat

            tokenizer = executor.encoder.tokenizer  # loaded from disk: give it what the trainer's tokenizer had
            for name in ("chat_template", "response_template", "response_schema"):
                if getattr(spec, name) is not None:
                    setattr(tokenizer, name, getattr(spec, name))
            self.chat = ToolChat(tokenizer, executor.spec.chat_template_kwargs)
        self.runner = ToolRunner(spec.tool_call_timeout_s) if self.leader else None
        self.pool, self.reward_classes = None, []
        if spec.factories and self.leader:  # environments live next to the tools, on the first rank only
            kinds, instances = probe(spec.factories)
            self.pool = EnvironmentPool(kinds)
            self.pool.seed(instances)
            self.reward_classes = reward_kinds(kinds)
        self.rollout_funcs = None
        if spec.rollout_func is not None and self.leader:
            from hfllamarl.runtime.agents.rollout_funcs import RolloutFuncRunner

            self.rollout_funcs = RolloutFuncRunner(spec, executor, self)
        self.reward_errors = 0  # get_reward calls that raised or returned no number, scored 0 (reward_errors="zero")
        self.reward_timeouts = 0  # get_reward calls past tool_call_timeout_s: their rollouts are unscored by it
        self._scoring: dict = {}  # get_reward future -> (rollout, its live environment, the class name)
        self._warned: set[str] = set()  # the kinds of model output already reported (`_warn_once`)

    # ------------------------------------------------------------------ the tick
    def tick(self, batch_index: int | None) -> list[RolloutGroup]:
        """One tick on this rank: the leader generates (and evaluates when due), the followers follow."""
        if not self.leader:
            self.lockstep.follow(self.generate_local)
            return []
        ex = self.ex
        groups = []
        if batch_index is not None or ex.in_flight:
            groups = self._training_tick(batch_index)
        if ex.eval_due():
            groups += self._evaluation()
        self.lockstep.done()
        return groups

    def _training_tick(self, batch_index: int | None) -> list[RolloutGroup]:
        ex, spec = self.ex, self.ex.spec
        length = spec.max_completion_length
        budget = min(spec.partial_rollout_tokens or length, length)
        carried = [r for flight in ex.in_flight for r in flight.unfinished()]
        new, positions, start = None, [], time.perf_counter()
        if batch_index is not None:  # this replica's share of the batch
            indices, rows, positions = ex.batch_prompts(batch_index)
            if self.rollout_funcs is not None:
                new = self.rollout_funcs.batch(indices, rows, spec.num_generations)
            else:
                new = [[self.start(row, index) for _ in range(spec.num_generations)]
                       for index, row in zip(indices, rows)]
        work = carried + ([r for group in new for r in group if r.finish_reason == UNFINISHED] if new else [])
        tokens = self.run(work, budget)
        if new is not None:
            tokens += sum(r.num_sampled for group in new for r in group if r.episode is None)  # rollout_func's
            ex.in_flight.append(InFlightBatch(batch_index, ex.version, new, positions, ex.data_offset))
        return ex.close_tick(time.perf_counter() - start, tokens)

    def _evaluation(self) -> list[RolloutGroup]:
        """The eval prompts, `num_generations_eval` rollouts each, run to the end in this tick."""
        ex, spec = self.ex, self.ex.spec
        ex.evaluated = ex.version
        rows = [ex.eval_dataset[i] for i in range(len(ex.eval_dataset))]
        start = time.perf_counter()
        if self.rollout_funcs is not None:
            groups = self.rollout_funcs.batch(list(range(len(rows))), rows, spec.num_generations_eval)
            tokens = sum(r.num_sampled for group in groups for r in group)
        else:
            groups = [[self.start(row, index) for _ in range(spec.num_generations_eval)]
                      for index, row in enumerate(rows)]
            tokens = self.run([r for group in groups for r in group], spec.max_completion_length)
        seconds = time.perf_counter() - start
        evaluation = [RolloutGroup(g, -1 - ex.version, ex.version, seconds, tokens, eval_version=ex.version)
                      for g in groups]
        ex._score_with_models(evaluation)
        return evaluation

    # ------------------------------------------------------------------ one rollout
    def start(self, row: dict, index: int) -> Rollout:
        """A new rollout of a dataset row: its environment (reset with the row; the text it returns appended to the
        prompt's last message, as TRL) and its prompt rendered with its tools."""
        prompt = row["prompt"]
        name = row.get("environment") if self.pool is not None and None not in self.pool.kinds else None
        episode = Episode(environment_name=name)
        if self.pool is not None:
            episode.environment = self.pool.take(name)
            reset_row = {k: v for k, v in row.items() if k != "environment"} if name is not None else dict(row)
            observation = episode.environment.reset(**reset_row)
            if observation is not None:
                prompt = _append_observation(prompt, valid_text(observation))
        prompt_ids = self.chat.encode_prompt(prompt, self.tools(episode))
        if len(prompt_ids) >= self.ex.spec.max_model_len:
            raise ValueError(f"dataset row {index}: its prompt is {len(prompt_ids)} tokens once rendered with its "
                             "tools (and its environment's reset text), which leaves no room in the model's context of "
                             f"{self.ex.spec.max_model_len} tokens.")
        columns = {k: v for k, v in row.items() if k != "prompt"}
        return Rollout(prompt=prompt, prompt_ids=prompt_ids, completion_ids=[], behavior_logprobs=[], versions=[],
                       finish_reason=UNFINISHED, completion_text="", columns=columns, row_index=int(index), segments=0,
                       env_mask=[], episode=episode)

    def tools(self, episode: Episode) -> list:
        """The tools a rollout may call: the standalone ones, then its environment's methods (TRL's order)."""
        env = self._live(episode)
        return list(self.spec.tools) + (tool_methods(env) if env is not None else [])

    @staticmethod
    def _live(episode: Episode):
        """The rollout's live environment (one restored from a checkpoint is unpickled on first use)."""
        if isinstance(episode.environment, bytes):
            episode.environment = unpickled(episode.environment)
        return episode.environment

    # ------------------------------------------------------------------ rounds
    def run(self, work: list[Rollout], budget: int) -> int:
        """Generate, parse and call tools in rounds until every rollout of `work` finished or spent `budget` sampled
        tokens this tick (those are carried). Returns the tokens sampled."""
        allowance = {id(r): budget for r in work}
        for r in work:
            r.segments += 1  # one more tick this rollout was generated in
        active, tokens, pending = [r for r in work if self._room(r, allowance)], 0, {}
        while active or pending:
            if active:
                tokens += self._generate(active, allowance, pending)
            active = self._collect(pending, allowance)
        self._settle_rewards()
        return tokens

    def _generate(self, active: list[Rollout], allowance: dict, pending: dict) -> int:
        """One generate call for `active`; each turn that ended is finished, or its tool calls are started (into
        `pending`: future -> rollout). Returns the tokens sampled."""
        requests = [(r.prompt_ids + r.completion_ids, 1, self._room(r, allowance)) for r in active]
        outputs = self.lockstep.generate(self.generate_local, requests)
        tokens = 0
        for r, (_, _, asked), out in zip(active, requests, outputs):
            comp = out.outputs[0]
            n = r.append_sampled(comp, self.ex.version)
            tokens, allowance[id(r)] = tokens + n, allowance[id(r)] - n
            reason = str(comp.finish_reason or "length")
            if reason == "length":
                if n < asked or not self._room(r, {id(r): 1}):  # the completion or the context is full
                    self._append_cut_turn(r)
                    self.finish(r, "length")
                continue  # else its allowance is spent mid-turn: carried to the next tick
            message, parsed = self._parse_turn(r)
            r.episode.messages.append(message)
            if not parsed:  # the turn's text as it is: no tool calls run, the rollout ends
                self.finish(r, reason)
                continue
            bound, calls = self.spec.max_iterations, message.get("tool_calls")
            if not calls or (bound is not None and r.episode.iterations >= bound):
                self.finish(r, reason)
                continue
            over = self._over_bound(r.episode, len(calls))
            if over:  # as TRL's last round: none of the turn's calls runs, the turn ends the rollout
                r.episode.calls_refused += len(calls)
                r.episode.ended_by = over
                self.finish(r, reason)
                continue
            tools = {tool_name(t): t for t in self.tools(r.episode)}
            pending[self.runner.submit(calls, tools, self._time_left(r.episode), self._live(r.episode))] = r
        return tokens

    def _parse_turn(self, r: Rollout) -> tuple[dict, bool]:
        """The rollout's finished turn as a message (its strings made valid text: a tool call's JSON may write a
        lone surrogate), and whether the parser took it. A turn the parser refuses is model output, not a fault of
        the job: its decoded text (the rollout ends there), with a warning the first time."""
        ids = r.completion_ids[r.episode.turn_start:]
        try:
            return valid_text(self.chat.parse(ids, r.prompt_ids + r.completion_ids[:r.episode.turn_start],
                                              self.tools(r.episode))), True
        except Exception as exc:  # noqa: BLE001 - the model's text, whatever the parser made of it
            self._warn_once("parse", f"a model turn the response parser refused ends its rollout ({exc!r}); "
                                     "further ones are not reported")
            text = self.ex.encoder.tokenizer.decode(ids, skip_special_tokens=True)
            return {"role": "assistant", "content": text}, False

    def _warn_once(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(text)

    def _over_bound(self, episode: Episode, num_calls: int) -> str | None:
        """Why a turn of `num_calls` calls may not run: too many calls, or the rollout's time budget is spent."""
        cap = self.spec.max_calls_per_turn
        if cap is not None and num_calls > cap:
            return "calls_per_turn"
        left = self._time_left(episode)
        return "time_budget" if left is not None and left <= 0 else None

    def _time_left(self, episode: Episode) -> float | None:
        budget = self.spec.rollout_time_budget_s
        return None if budget is None else budget - episode.tool_seconds

    def _collect(self, pending: dict, allowance: dict) -> list[Rollout]:
        """Wait for at least one rollout's tool calls (and, briefly, for the others: rollouts whose calls end together
        generate together), append their results; returns the rollouts that go on generating in this tick."""
        if not pending:
            return []
        import concurrent.futures as cf

        rollouts = list(pending.values())
        # Every turn ends by its bound (calls x timeout, or the rollout's budget); past that, a bug: fail loudly.
        bound = max(self.runner.turn_bound(self.spec.max_calls_per_turn or 1 << 16, self._time_left(r.episode))
                    for r in rollouts) + 10.0
        done, rest = cf.wait(pending, timeout=bound, return_when=cf.FIRST_COMPLETED)
        if not done:
            raise RuntimeError(f"no tool-calling turn of {len(pending)} rollouts returned within {bound:.0f} s, past "
                               "every turn's bound; the tool runner is stuck.")
        if rest:
            done |= cf.wait(rest, timeout=_GATHER_S)[0]
        return [r for r in (self._apply(pending.pop(f), f.result(), allowance) for f in list(pending) if f in done)
                if r is not None]

    def _apply(self, r: Rollout, turn, allowance: dict) -> Rollout | None:
        """Append a turn's tool results to `r` (None: the rollout ended or stops for this tick, else `r`)."""
        episode = r.episode
        results = turn.results
        episode.tool_calls += len(results)
        episode.tool_failures += sum(res.failed for res in results)
        episode.tool_timeouts += sum(res.timed_out for res in results)
        episode.tool_seconds += turn.seconds
        if turn.over_budget:  # the budget ran out during the turn: it ends the rollout, keeping no result
            episode.calls_refused += turn.refused
            episode.abandoned = True  # (a call was abandoned or never started; either way the turn is cut)
            episode.ended_by = "time_budget"
            self.finish(r, "stop")
            return None
        episode.abandoned = episode.abandoned or any(res.timed_out for res in results)
        messages = [res.message() for res in results]
        try:
            suffix = self.chat.suffix_ids(messages)
        except ToolChatError:
            raise  # the template's fault, on every rollout: the job's error
        except Exception as exc:  # noqa: BLE001 - what a tool returned (the model's doing) did not render
            self._warn_once("render", f"tool results the chat template could not render end their rollout ({exc!r}); "
                                      "further ones are not reported")
            self.finish(r, "stop")
            return None
        if len(suffix) >= self._room(r, {id(r): len(suffix) + 1}):  # no room for the results and an answer
            self.finish(r, "stop")
            return None
        r.completion_ids += suffix
        r.behavior_logprobs += [0.0] * len(suffix)
        r.versions += [self.ex.version] * len(suffix)
        r.env_mask += [0] * len(suffix)
        episode.messages += messages
        episode.iterations += 1
        episode.turn_start = len(r.completion_ids)
        return r if self._room(r, allowance) else None

    def _append_cut_turn(self, r: Rollout) -> None:
        """A turn that the length limit cut after tool calls is still the rollout's last assistant message, as in
        TRL (reward functions read `completions[i][-1]`). (A cut first turn is the completion's text itself.)"""
        episode = r.episode
        ids = r.completion_ids[episode.turn_start:]
        if not ids or not episode.messages:
            return
        try:
            message = self.chat.parse(ids, r.prompt_ids + r.completion_ids[:episode.turn_start], self.tools(episode))
        except Exception:  # noqa: BLE001 - a cut tool call that does not parse: the turn's text
            message = {"role": "assistant",
                       "content": self.ex.encoder.tokenizer.decode(ids, skip_special_tokens=True)}
        episode.messages.append(message)

    def _room(self, r: Rollout, allowance: dict) -> int:
        """How many tokens `r` may still sample this tick: its allowance, the completion length, the context."""
        spec = self.ex.spec
        used = len(r.completion_ids)
        return max(0, min(allowance[id(r)], spec.max_completion_length - used,
                          spec.max_model_len - len(r.prompt_ids) - used))

    def finish(self, r: Rollout, reason: str) -> None:
        """The rollout is complete: its text, and its environment's reward, started here in a thread of its own next to
        the live environment (`_settle_rewards` collects it, then pickles the environment for the trainer ranks and
        returns the live instance to the pool)."""
        r.finish_reason = reason
        r.completion_text = self.ex.encoder.tokenizer.decode(r.completion_ids, skip_special_tokens=True)
        episode = r.episode
        env = self._live(episode) if episode is not None else None
        if env is None:
            return
        kind = self.pool.kinds[episode.environment_name]
        for name in self.reward_classes:
            r.model_rewards[name] = None
        if kind.has_reward:  # the finishing rollouts' get_reward calls run together, each in a thread of its own
            future = self.runner.submit_call("get_reward", env.get_reward, {}, env)  # async: on env's own loop
            self._scoring[future] = (r, env, kind.class_name)
        else:
            self._release(r, env)

    def _settle_rewards(self) -> None:
        """Wait for the get_reward calls of this run (they started as their rollouts finished, so the last one ends
        at most tool_call_timeout_s + 1 s after the run's last turn) and store their scores.

        A get_reward that times out leaves its rollout unscored by it (None: as TRL's NaN, the rollout is left out of
        its group's baseline if no other reward function scores it), whatever `reward_errors` says: the policy can
        make an environment slow to score, which is no bug of the user's code, and neither a made-up 0 nor a stopped
        job would be right. Its environment is not reused (the call may still change it). A get_reward that raises
        or returns no number follows `reward_errors`."""
        import concurrent.futures as cf

        scoring, self._scoring = self._scoring, {}
        if not scoring:
            return
        bound = self.runner.timeout_s + 1.0 + 10.0  # each ends by its bound; past it, a bug: fail loudly
        _, late = cf.wait(scoring, timeout=bound)
        if late:
            raise RuntimeError(f"{len(late)} get_reward calls did not return within {bound:.0f} s, past their bound; "
                               "the tool runner is stuck.")
        for future, (r, env, class_name) in scoring.items():
            result = future.result()
            if result.timed_out:
                self.reward_timeouts += 1
                r.episode.abandoned = True
            else:
                r.model_rewards[class_name] = self._environment_reward(result, class_name, r.row_index)
            self._release(r, env)

    def _release(self, r: Rollout, env) -> None:
        """The environment's pickled copy for the trainer ranks; the live instance goes back to the pool."""
        episode = r.episode
        episode.environment = snapshot(env)
        if not episode.abandoned:  # a call left running could still change it, in the next rollout that took it
            self.pool.give_back(episode.environment_name, env)
        else:  # dropped: its event loop (abandoned, or free) goes with it
            self.runner.release(env)

    def _environment_reward(self, result, class_name: str, row: int) -> float:
        """A get_reward call's score; one that raised or gave no number follows `reward_errors`."""
        if not result.failed:
            try:
                return float(result.content)
            except (TypeError, ValueError):
                result.content = {"error": f"get_reward returned {result.content!r}, not a number"}
        if self.spec.reward_errors == "zero":
            self.reward_errors += 1
            return 0.0
        raise RuntimeError(f"{class_name}.get_reward() failed for a rollout of dataset row {row}: "
                           f"{result.content['error']} Set reward_errors='zero' to score such rollouts 0 and go on.")

    # ------------------------------------------------------------------ the engine
    def generate_local(self, requests: list) -> list:
        """This rank's engine call for `requests` [(prompt ids, n, max tokens)] (every rank of the engine makes it)."""
        ex = self.ex
        return ex.sample([ids for ids, _, _ in requests],
                         [ex._sampling_params(n, max_tokens) for _, n, max_tokens in requests])


def _append_observation(prompt, observation: Any):
    """TRL: the text `reset()` returns is appended to the content of the prompt's last message."""
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("environments need chat prompts (a list of messages) to append reset()'s text to.")
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]
