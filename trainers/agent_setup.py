"""`AsyncAIPOTrainer`'s `tools`, `environment_factory` and `rollout_func`, checked and turned into an `AgentSpec`.

What TRL's `GRPOTrainer.__init__` does with them, on the process that builds the trainer: the chat template
must render tool calls and have a response template (`ToolChat`), one instance of each environment is probed
(its `reset`, its tools, whether it has `get_reward`: then it is a reward source named after its class, weight
1, and `reward_funcs` may be omitted), and without a `train_dataset` an environment provides the prompts.
Settings the multi-turn loop cannot honour are refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hfllamarl.runtime.agents.environments import EnvironmentReward, probe, resolve_factories, reward_kinds, tool_methods
from hfllamarl.runtime.agents.multi_turn import AgentSpec
from hfllamarl.runtime.data.prompts import is_conversational


@dataclass
class Agent:
    """The multi-turn side of a trainer: `spec` for the generator (None: plain single-turn generation)."""

    spec: AgentSpec | None = None
    env_rewards: list = field(default_factory=list)  # `EnvironmentReward`s, appended to the reward functions
    tools: list = field(default_factory=list)  # every tool a prompt may be rendered with (validation)
    chat_template: str | None = None  # TRL's training variant of the template, when the tokenizer's is not one

    @property
    def uses_tools(self) -> bool:
        return self.spec is not None and self.spec.uses_tools


def build_agent(args, tools, environment_factory, rollout_func) -> Agent:
    """Check the three arguments against each other and the config; probe the environments."""
    tools = list(tools or [])
    for tool in tools:
        if not callable(tool):
            raise TypeError(f"tools must be callables (functions with type hints and a Google-style docstring), got "
                            f"{type(tool).__name__}.")
    factories = resolve_factories(environment_factory)
    if rollout_func is not None and (tools or factories):
        raise ValueError("rollout_func owns a batch's whole generation loop, so it cannot be combined with tools or "
                         "environment_factory: call your tools inside rollout_func, or drop rollout_func.")
    if rollout_func is not None and not callable(rollout_func):
        raise TypeError(f"rollout_func must be a callable (prompts, trainer) -> dict, got "
                        f"{type(rollout_func).__name__}.")
    if not (tools or factories or rollout_func):
        if args.max_tool_calling_iterations is not None:
            raise ValueError("AsyncAIPOConfig: max_tool_calling_iterations is set, but the trainer has no tools and no "
                             "environment_factory: pass tools=[...] or environment_factory=..., or remove it.")
        return Agent()
    _check_config(args, bool(tools or factories), rollout_func is not None)
    agent = Agent(tools=list(tools))
    if factories:
        kinds, instances = probe(factories)
        for name, instance in instances.items():
            agent.tools += [m for m in tool_methods(instance) if m.__name__ not in {t.__name__ for t in agent.tools}]
        agent.env_rewards = [EnvironmentReward(name) for name in reward_kinds(kinds)]
        if agent.env_rewards:  # their get_reward calls take part of the generator's tick too
            from .tool_budget import check_tool_tick

            check_tool_tick(args, get_reward=True)
    agent.spec = AgentSpec(
        tools=tools, factories=factories, max_iterations=args.max_tool_calling_iterations,
        tool_call_timeout_s=args.tool_call_timeout_s, max_calls_per_turn=args.max_tool_calls_per_turn,
        rollout_time_budget_s=args.rollout_time_budget_s, reward_errors=args.reward_errors, rollout_func=rollout_func,
        rollout_view={"args": args.to_dict()} if rollout_func is not None else {})
    return agent


def _check_config(args, uses_tools: bool, uses_rollout_func: bool) -> None:
    kwargs = args.generation_kwargs or {}
    if uses_tools:
        per_turn = [k for k in ("presence_penalty", "frequency_penalty") if kwargs.get(k)]
        if per_turn:
            raise ValueError(f"AsyncAIPOConfig: generation_kwargs {per_turn} count the tokens of each generation call, "
                             "and a multi-turn rollout is generated in several calls (one per turn), so the trainer's "
                             "pi could not follow them; remove them (repetition_penalty works).")
        bound = args.max_tool_calling_iterations
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
            raise ValueError(f"AsyncAIPOConfig: max_tool_calling_iterations={bound!r}; it must be a whole number >= 0, "
                             "or None (no bound).")
    if getattr(args, "generator_failure", "stop") == "continue":
        raise ValueError("AsyncAIPOConfig: generator_failure='continue' makes up a lost replica's prompts on the "
                         "survivors in one single-turn generation call, which would drop the tool calls of those "
                         "rollouts; with tools, environment_factory or rollout_func use generator_failure='stop'.")
    if uses_rollout_func and args.partial_rollout_tokens is not None:
        raise ValueError("AsyncAIPOConfig: partial_rollout_tokens cannot apply to a rollout_func, which generates a "
                         "batch's rollouts to the end in one call; remove partial_rollout_tokens.")


def prepare_tokenizer(agent: Agent, processing_class, args) -> None:
    """Tools need a chat template that renders tool calls and a response template to read them (set here when TRL
    knows the template); the spec carries both to the generator, whose tokenizer is loaded from disk."""
    if not agent.uses_tools:
        return
    from hfllamarl.runtime.agents.tool_chat import ToolChat

    chat = ToolChat(processing_class, args.chat_template_kwargs)
    agent.chat_template = chat.chat_template
    agent.spec.chat_template = processing_class.chat_template
    agent.spec.response_template = getattr(processing_class, "response_template", None)
    agent.spec.response_schema = getattr(processing_class, "response_schema", None)


def check_dataset(agent: Agent, dataset) -> None:
    """Tools need chat prompts; several environments need an `environment` column naming known ones."""
    if agent.spec is None:
        return
    first = dataset[0]["prompt"]
    if agent.uses_tools and not is_conversational(first):
        raise ValueError("tools and environment_factory need chat prompts (a list of {'role', 'content'} messages) "
                         f"in the `prompt` column: the model's tool calls are read as chat turns. Row 0 has "
                         f"{type(first).__name__}.")
    factories = agent.spec.factories or {}
    if factories and None not in factories:
        if "environment" not in dataset.column_names:
            raise ValueError("environment_factory is a dict, so each dataset row must name its environment in an "
                             f"`environment` column (one of {sorted(map(str, factories))}); the dataset has columns "
                             f"{dataset.column_names}.")
        unknown = sorted({str(e) for e in dataset["environment"]} - set(map(str, factories)))
        if unknown:
            raise ValueError(f"dataset rows name environments {unknown}, not among the environments of "
                             f"environment_factory ({sorted(map(str, factories))}).")


def placeholder_dataset(agent: Agent, args, prompts_per_step: int):
    """TRL: with an environment and no train_dataset, the environment's `reset()` writes each prompt; the rows are
    empty user messages and `max_steps` sets the length."""
    factories = agent.spec.factories if agent.spec is not None else None
    if not factories:
        raise ValueError("`train_dataset` is required unless an `environment_factory` is provided.")
    if None not in factories:
        raise ValueError("A dict environment_factory (several environments) requires a `train_dataset` with an "
                         "`environment` column to route each row to its environment.")
    if not args.max_steps or args.max_steps <= 0:
        raise ValueError("Without a train_dataset (the environment's reset() writes the prompts), set max_steps to "
                         "the number of steps to train.")
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * prompts_per_step})


def reward_weights(args, num_user_funcs: int, agent: Agent) -> list[float] | None:
    """The config's reward_weights (for the reward functions given) and weight 1 for each environment reward."""
    if not agent.env_rewards:
        return args.reward_weights
    weights = list(args.reward_weights) if args.reward_weights is not None else [1.0] * num_user_funcs
    return weights + [1.0] * len(agent.env_rewards)
