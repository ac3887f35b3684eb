"""The tool work of one generator tick, bounded against collective_timeout_s (`AsyncAIPOConfig` and the agent set-up
check it)."""

from __future__ import annotations


# The share of collective_timeout_s that tool calls may take in one generator tick.
TOOL_SHARE = 0.5


def tool_tick_bound(iterations: int | None, calls_per_turn: int, call_timeout_s: float, budget_s: float,
                    runs: int, get_reward: bool = False) -> tuple[float, str]:
    """The longest tool calls (and environments' get_reward) can take in one generator tick, and the arithmetic as
    text.

    Each rollout's turns run in a thread of their own, concurrently with the other rollouts' turns and the generate
    calls, and no rollout waits for another's calls (`MultiTurn.run`): so a run of rollouts spends on tools at most
    what one rollout may, beyond its generate calls. One rollout may spend the smaller of its budget and
    max_tool_calling_iterations turns x (calls per turn x tool_call_timeout_s + 1 s for a stuck event loop; a
    turn's synchronous calls run one after the other). With `get_reward`, the get_reward calls of a run start as
    their rollouts finish and run together, each bounded by tool_call_timeout_s (+ 1 s for a stuck event loop): the
    last one ends at most that long after the run's last turn. A tick holds one run, two when an evaluation is due.
    """
    per_turn = calls_per_turn * call_timeout_s + 1.0
    if iterations is None:
        rollout, terms = budget_s, f"rollout_time_budget_s={budget_s:g}"
    else:
        rollout = min(budget_s, iterations * per_turn)
        terms = (f"min(rollout_time_budget_s={budget_s:g}, max_tool_calling_iterations={iterations} x "
                 f"(max_tool_calls_per_turn={calls_per_turn} x tool_call_timeout_s={call_timeout_s:g} + 1))")
    if get_reward:
        rollout += call_timeout_s + 1.0
        terms = f"({terms} + get_reward's tool_call_timeout_s={call_timeout_s:g} + 1)"
    if runs > 1:
        terms += f" x {runs} (an evaluation runs in the same tick as training)"
    return runs * rollout, terms


def _runs(args) -> int:
    return 2 if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no" else 1


def default_tool_budget(args) -> float:
    """rollout_time_budget_s left unset: what `TOOL_SHARE` of collective_timeout_s leaves per run of rollouts once the
    get_reward calls (tool_call_timeout_s + 1 s) are set aside; all of it when they do not fit (then an environment
    with get_reward is refused, `check_tool_tick`)."""
    per_run = TOOL_SHARE * args.collective_timeout_s / _runs(args)
    reward_s = args.tool_call_timeout_s + 1.0
    return per_run - reward_s if per_run > reward_s else per_run


def check_tool_tick(args, get_reward: bool) -> None:
    """Refuse settings under which the tool calls (and, with `get_reward`, the environments' get_reward calls) of one
    generator tick could take more than `TOOL_SHARE` of collective_timeout_s."""
    runs, share = _runs(args), TOOL_SHARE * args.collective_timeout_s
    worst, terms = tool_tick_bound(args.max_tool_calling_iterations, args.max_tool_calls_per_turn,
                                   args.tool_call_timeout_s, args.rollout_time_budget_s, runs, get_reward)
    if worst > share:
        room = share / runs - (args.tool_call_timeout_s + 1.0 if get_reward else 0.0)
        fix = (f"Set rollout_time_budget_s <= {room:g}, lower" if room > 0 else "Lower")
        what = "tool calls and get_reward" if get_reward else "tool calls"
        raise ValueError(
            f"AsyncAIPOConfig: {what} could take {worst:g} s of one generator tick ({terms}), more than "
            f"{TOOL_SHARE:g} x collective_timeout_s={args.collective_timeout_s:g} = {share:g} s (the rest of it is "
            f"left for generation and the weight sync; past collective_timeout_s the job fails). {fix} "
            "max_tool_calls_per_turn, tool_call_timeout_s or max_tool_calling_iterations, or raise "
            "collective_timeout_s.")
