"""Agentic rollouts: multi-turn generation (multi_turn), tool-call parsing and budgets (tool_calls), each
rollout's event loop (event_loops), chat rendering with tools (tool_chat), environments and their factories
(environments), lockstep turns (lockstep), TRL's rollout_func (rollout_funcs). Imports the layers below it."""
