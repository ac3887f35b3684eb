"""Off-policy corrections: how a loss treats tokens sampled by an older policy (group `hfllamarl.corrections`).

Three policies meet at each completion token t: pi (the policy being trained, with gradient), pi_old (the policy
before this batch's first optimizer step: the proximal policy of decoupled PPO) and mu (the policy that sampled t,
`max_staleness` versions older or less). A loss (`hfllamarl.policy_loss.PolicyLoss`) computes

    l_t = objective(c_t, A) * b_t,     c_t = pi_t / anchor_t

and a correction decides two things from log pi_old, log mu and each token's staleness:

- `weight` b (a constant): the behaviour weight pi_old/mu, truncated, masked, tempered, or None (1);
- `anchor`: the log-probs the objective's trust-region ratio c refers to (None: pi_old, decoupled PPO's
  proximal policy; mu: plain, "coupled" PPO).

and, optionally, a step size: a correction with `step_scale(sequence_log_weights)` scales the learning rate of the
optimizer step it is in (VCPO's effective-sample-size rule), given log(pi_old/mu) of every sequence of the step.

The built-ins and their papers' maths: docs/guides/algorithms.md, "Off-policy corrections".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hfllamarl.losses import IS_MODES, behavior_weight, check_choice


@dataclass
class Corrected:
    """What a correction returns for one micro-batch.

    weight: `[B, T]` or `[B, 1]` constant behaviour weight multiplying the per-token loss (None: 1).
    anchor: `[B, T]` log-probs the objective's ratio c = pi/anchor refers to (None: log pi_old).
    bounded: the share of tokens (sequences, for a sequence weight) whose weight was truncated or masked.
    metrics: logged as they are, averaged over micro-batches and ranks (`/max`, `/min`: the extreme).
    trust: (low, high): drop the tokens whose objective ratio c = pi/anchor has left [1 - low, 1 + high] on the side
        its advantage pushes (A > 0 and c > 1 + high, or A < 0 and c < 1 - low); None: no such mask.
    trust_reference: `[B, T]` log-probs the trust mask's ratio refers to instead of the anchor (None: the anchor),
        taken at the loss's importance-sampling level (per token, or GSPO's per-sequence geometric mean).
    """

    weight: torch.Tensor | None
    anchor: torch.Tensor | None = None
    bounded: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    trust: tuple[float, float] | None = None
    trust_reference: torch.Tensor | None = None


def log_weight(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` log(pi_old/mu) on completion tokens, 0 elsewhere (and where either side is NaN)."""
    return torch.nan_to_num((old_logprobs - behavior_logprobs) * mask, nan=0.0).detach()


def share(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of completion tokens (or of sequences with any, for `[B, 1]` flags) where `flags` is true."""
    valid = mask.bool() if flags.shape == mask.shape else (mask.sum(-1, keepdim=True) > 0)
    values = flags.expand_as(valid)[valid] if flags.shape == mask.shape else flags[valid]
    return values.float().mean().item() if values.numel() else 0.0


def sequence_log_weights(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
    """`[B]` log of each sequence's importance weight prod_t pi_old/mu (a sequence with no token: 0)."""
    return log_weight(old_logprobs, behavior_logprobs, mask).sum(-1)


class ImportanceSampling:
    """TRL's `vllm_importance_sampling_mode` as a correction: b = pi_old/mu per token (or the product over a
    sequence), truncated into [clip_min, clip_max] ("*_truncate") or set to 0 outside ("*_mask"); None: no bound
    on that side. The anchor is pi_old."""

    def __init__(self, mode: str, clip_min: float | None = None, clip_max: float | None = 3.0):
        check_choice("vllm_importance_sampling_mode", mode, IS_MODES)
        for name, bound in (("clip_min", clip_min), ("clip_max", clip_max)):
            if bound is not None and not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0):
                raise ValueError(f"{mode}: {name}={bound!r}; a bound of the weight pi_old/mu is a positive number "
                                 "(or None: no bound).")
        if clip_min is not None and clip_max is not None and clip_min >= clip_max:
            raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min}) must be below "
                             f"vllm_importance_sampling_clip_max ({clip_max}).")
        if mode.endswith("truncate") and clip_min is None and clip_max is None:
            raise ValueError(f"{mode} needs clip_min or clip_max (a truncation with no bound is no correction).")
        self.mode, self.clip_min = mode, None if clip_min is None else float(clip_min)
        self.clip_max = None if clip_max is None else float(clip_max)

    @property
    def level(self) -> str:
        return "sequence" if self.mode.startswith("sequence") else "token"

    def __eq__(self, other) -> bool:
        return (isinstance(other, ImportanceSampling)
                and (self.mode, self.clip_min, self.clip_max) == (other.mode, other.clip_min, other.clip_max))

    def __repr__(self) -> str:
        return f"ImportanceSampling({self.mode!r}, clip_min={self.clip_min}, clip_max={self.clip_max})"

    def __call__(self, old_logprobs, behavior_logprobs, mask, staleness=None) -> Corrected:
        weight = behavior_weight(old_logprobs, behavior_logprobs, mask, self.mode, self.clip_min, self.clip_max)
        raw = behavior_weight(old_logprobs, behavior_logprobs, mask, self.mode, None, None)
        if self.mode.endswith("truncate"):
            bounded = ~torch.isclose(raw, weight)
            metrics = {"correction/truncated_frac": share(bounded, mask)}
        else:
            bounded = (weight == 0) & (raw != 0)
            metrics = {"correction/masked_frac": share(bounded, mask)}
        return Corrected(weight, None, share(bounded, mask), metrics)


class StepScaled:
    """Any correction with VCPO's step rule on top (`off_policy_correction="<name>+ess"`): the correction's weight and
    anchor as they are, and each optimizer step's learning rate times sqrt(min(1, ESS/N)) of the step's untruncated
    sequence weights (`plugins/corrections/ess.py`)."""

    def __init__(self, base, rule: str = "sqrt", base_ratio: float = 1.0):
        if rule not in ("sqrt", "linear"):
            raise ValueError(f"ess: rule={rule!r}; choose 'sqrt' or 'linear'.")
        self.base, self.rule, self.base_ratio = base, rule, float(base_ratio)
        self.level = getattr(base, "level", "token")

    def __call__(self, old_logprobs, behavior_logprobs, mask, staleness=None) -> Corrected:
        return self.base(old_logprobs, behavior_logprobs, mask, staleness)

    def __repr__(self) -> str:
        return f"StepScaled({self.base!r}, rule={self.rule!r})"

    def step_scale(self, sequence_log_weights) -> tuple[float, dict[str, float]]:
        """The learning-rate factor of a step whose sequences have these log weights, and its metrics."""
        ratio = effective_sample_ratio(sequence_log_weights)
        relative = min(1.0, ratio / self.base_ratio)
        scale = math.sqrt(relative) if self.rule == "sqrt" else relative
        return scale, {"correction/ess": ratio, "correction/step_scale": scale}


class TrustMasked:
    """Any correction with PPO's trust region as a mask on top (`off_policy_correction="<name>+trust"`): the
    correction's weight and anchor as they are, and a token whose ratio c = pi/anchor has left [1 - low, 1 + high]
    in the direction its advantage pushes gets no gradient. This is the token mask M_t of CISPO's general form
    (MiniMax-M1, arXiv 2506.13585, section 3.1): for PPO's clipped losses it changes nothing (their clip already
    zeroes exactly those tokens' gradient); for losses without a hard trust region (cispo's truncated weight, sapo's
    soft gate) it bounds how far a stale batch moves a token's probability away from the anchor.

    `reference="sampler"` (`"<name>+sampler_trust"`) draws the region around the sampler mu instead of the anchor:
    the mask's ratio is pi/mu (per sequence for GSPO: exp(mean_t log pi/mu)) while the objective keeps its own
    anchor. That is the form for an objective whose clip range is made for one batch's own drift (GSPO's 3e-4 and
    4e-4 around pi_old): anchored at a stale mu, such a clip leaves almost nothing to train on."""

    REFERENCES = ("anchor", "sampler")

    def __init__(self, base, low: float = 0.2, high: float = 0.28, reference: str = "anchor"):
        check_choice("trust reference", reference, self.REFERENCES)
        for key, value in (("trust_low", low), ("trust_high", high)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"+trust: {key}={value!r} must be a positive number (the trust region is "
                                 "[1 - trust_low, 1 + trust_high]).")
        if low >= 1:
            raise ValueError(f"+trust: trust_low={low!r} must be below 1 (the region's lower end 1 - trust_low > 0).")
        self.base, self.low, self.high, self.reference = base, float(low), float(high), reference
        self.level = getattr(base, "level", "token")
        if callable(getattr(base, "step_scale", None)):
            self.step_scale = base.step_scale

    def __repr__(self) -> str:
        return f"TrustMasked({self.base!r}, low={self.low}, high={self.high}, reference={self.reference!r})"

    def __call__(self, old_logprobs, behavior_logprobs, mask, staleness=None) -> Corrected:
        corrected = self.base(old_logprobs, behavior_logprobs, mask, staleness)
        corrected.trust = (self.low, self.high)
        if self.reference == "sampler":
            corrected.trust_reference = behavior_logprobs
        return corrected


def rowwise(correction) -> bool:
    """Whether `correction` weighs each row (sequence) from that row's own log-probs alone: none, TRL's importance
    weights, or a plugin that says so (`rowwise = True`), with a trust mask on top or not; a step rule (`+ess`) or a
    bound over the whole micro-batch (m2po) is not."""
    if correction is None or isinstance(correction, ImportanceSampling):
        return True
    if isinstance(correction, TrustMasked):
        return rowwise(correction.base)
    return not isinstance(correction, StepScaled) and bool(getattr(correction, "rowwise", False))


def trust_mask(coef_1: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`TrustMasked`'s keep mask (1.0 / 0.0) for objective ratios `coef_1` (`[B, T]` or `[B, 1]`) and `[B, 1]`
    advantages: 0 where A > 0 and c > 1 + high, or A < 0 and c < 1 - low."""
    out = ((advantages > 0) & (coef_1 > 1 + high)) | ((advantages < 0) & (coef_1 < 1 - low))
    return (~out).to(coef_1.dtype).detach()


def effective_sample_ratio(log_weights: torch.Tensor) -> float:
    """ESS / N = (sum w)^2 / (N sum w^2) of N importance weights given by their logs (1.0: all equal)."""
    log_weights = log_weights.double().flatten()
    if not log_weights.numel():
        return 1.0
    w = torch.exp(log_weights - log_weights.max())  # (ESS is scale-free: the largest weight is 1)
    return float(w.sum() ** 2 / (w.numel() * (w ** 2).sum()))


# ---------------------------------------------------------------------------------------------------------------
# Which correction a loss uses. "trl" is the correction TRL's `vllm_importance_sampling_*` fields describe (for
# `aipo` and `rloo`: AIPO's truncation at aipo_rho while those fields keep TRL's defaults); "none" is no correction.

#: The correction each loss takes on stale samples (max_staleness >= 1) when none is named: the one the staleness
#: study holds best for it (docs/operations/staleness.md). Keys: `study_loss` names; a value is a name, or
#: (up to staleness, name) pairs. The clipped objectives (and vespo): A-3PO with its proximal policy 8 versions back,
#: i.e. plain PPO against the sampler's log-probs up to staleness 8 and a trust region spanning 8 versions beyond.
#: cispo and sapo have no hard trust region of their own (a truncated weight that always passes gradient, a soft
#: gate): the same A-3PO anchor with PPO's region as a token mask on top (`+trust`, CISPO's general-form mask).
#: GSPO keeps TRL's own correction for a sequence-level ratio (sequence_mask) and its objective anchored at pi_old,
#: with a region around the sampler as a sequence mask on top, [0.9, 1.1] on the sequence's geometric-mean ratio
#: pi/mu: anchored at a stale mu, the clip range TRL's docs give GSPO (3e-4, 4e-4) stops nearly every sequence;
#: around the sampler the result does not depend on GSPO's clip range.
#: At max_staleness 1 the token-level clipped losses take TRL's token-level truncated weight instead, no trust region:
#: a synchronous run (one pass) has none either, and one version back the region only slows a run whose steps move
#: the policy by more than its width (the vs-TRL bench: 96 % of TRL's final reward with it, 100 % without).
STALENESS_DEFAULTS: dict[str, str | tuple[tuple[float, str], ...]] = {
    **{loss: ((1, "token_truncate"), (math.inf, "a3po:lag=8"))
       for loss in ("aipo", "grpo", "bnpo", "dr_grpo", "dapo", "luspo")},
    "vespo": "a3po:lag=8", "gspo": "sequence_mask+sampler_trust:trust_low=0.1,trust_high=0.1",
    **{loss: "a3po+trust:lag=8" for loss in ("cispo", "sapo")}}

SPECIAL = ("auto", "trl", "none")


def study_loss(algorithm: str, loss_type: str | None, level: str | None) -> str | None:
    """The study's name of a built-in algorithm's loss ("aipo", a TRL loss_type, or "gspo" for a sequence-level
    ratio), or None for an algorithm the study does not cover."""
    if algorithm in ("aipo", "rloo"):
        return "aipo" if level != "sequence" else "gspo"
    if algorithm == "grpo":
        return "gspo" if level == "sequence" else loss_type
    return None


def resolve(name: str, *, algorithm: str, loss_type: str | None, level: str | None, max_staleness: int,
            trl_fields_set: bool) -> str:
    """The concrete correction `off_policy_correction=name` means for this job: a named one as it is; "auto" is
    the TRL fields' correction ("trl") when any of them (or aipo_rho) is set or the job is synchronous, else the
    loss's `STALENESS_DEFAULTS` entry."""
    if name != "auto":
        return name
    if trl_fields_set or max_staleness == 0:
        return "trl"
    return staleness_default(study_loss(algorithm, loss_type, level), max_staleness) or "trl"


def staleness_default(loss: str | None, staleness: int) -> str | None:
    """`STALENESS_DEFAULTS`' correction for `loss` at `staleness` (an entry is a name, or (up to staleness, name)
    pairs in order, the last one open-ended); None for a loss it has no entry for."""
    entry = STALENESS_DEFAULTS.get(loss or "")
    if entry is None or isinstance(entry, str):
        return entry
    return next((name for bound, name in entry if staleness <= bound), entry[-1][1])


#: The config fields of the corrections "trl" reads (setting one away from its default makes "auto" mean "trl").
TRL_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
              "vllm_importance_sampling_clip_max", "aipo_rho")


def resolve_config(config, defaults: dict, written=frozenset()) -> str:
    """`resolve` for an `AsyncAIPOConfig` whose fields have these `defaults` (by name); `written`: the fields its
    caller wrote (one of TRL's written with TRL's default value still asks for TRL's correction)."""
    return resolve(config.off_policy_correction, algorithm=config.algorithm, loss_type=config.loss_type,
                   level=config.importance_sampling_level, max_staleness=config.max_staleness,
                   trl_fields_set=any(f in written or getattr(config, f) != defaults[f] for f in TRL_FIELDS))


def parse(spec: str) -> tuple[str, dict]:
    """A correction written as `name` or `name:option=value,...` (numbers; e.g. "a3po:lag=4"): its name and options."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        try:
            options[key.strip()] = float(value)
        except ValueError:
            eq = ""
        if not eq:
            raise ValueError(f"off_policy_correction={spec!r}: write a correction's options as name:option=value,... "
                             "with numbers (or give them in off_policy_correction_kwargs).")
    return name.strip(), options


def build(name: str, kwargs: dict | None, trl_correction, trl_fields_set: bool, rho: float | None = None):
    """The correction object `name` names (None: no correction). `trl_correction`: what "trl" means for this
    algorithm; `trl_fields_set`: the user set TRL's correction fields (or aipo_rho), which only "trl" reads."""
    from hfllamarl.registry import load_plugin

    if isinstance(kwargs, str):  # (a recipe or the command line: JSON)
        import json

        try:
            kwargs = json.loads(kwargs) if kwargs.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"off_policy_correction_kwargs={kwargs!r} is not JSON ({exc}); give an object, e.g. "
                             '\'{"tau": 0.04}\'.') from None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"off_policy_correction_kwargs must be a dict of the correction's options, not "
                         f"{type(kwargs).__name__}.")
    if not isinstance(name, str):
        raise ValueError(f"off_policy_correction must be a name, not {type(name).__name__}.")
    if ":" in name:  # options written into the name ("a3po:lag=4"), merged under the explicit kwargs
        name, options = parse(name)
        kwargs = {**options, **(kwargs or {})}
    if name.endswith("+ess") and name != "+ess":  # any correction with VCPO's step rule on top
        return StepScaled(build(name[:-len("+ess")], kwargs, trl_correction, trl_fields_set, rho))
    for suffix, reference in (("+trust", "anchor"), ("+sampler_trust", "sampler")):
        if name.endswith(suffix) and name != suffix:  # any correction with the trust-region mask on top
            kwargs = dict(kwargs or {})
            low, high = kwargs.pop("trust_low", 0.2), kwargs.pop("trust_high", 0.28)
            base = build(name[:-len(suffix)], kwargs or None, trl_correction, trl_fields_set, rho)
            return TrustMasked(base, low, high, reference)
    if name == "auto":
        name = "trl"
    if name in ("trl", "none"):
        if kwargs:
            raise ValueError(f"off_policy_correction_kwargs={kwargs!r} configure a named correction, not "
                             f"off_policy_correction={name!r}: name the correction they are for.")
        return trl_correction if name == "trl" else None
    if trl_fields_set:
        raise ValueError(f"off_policy_correction={name!r} and the vllm_importance_sampling_* fields (or aipo_rho) are "
                         "two different corrections: set the fields and leave off_policy_correction unset ('auto'), or "
                         "name the correction and give its options in off_policy_correction_kwargs.")
    options = dict(kwargs or {})
    if name == "aipo" and rho is not None:
        options.setdefault("rho", rho)
    from hfllamarl.registry import PluginError

    try:
        cls = load_plugin("corrections", name)
    except PluginError as exc:
        raise PluginError(f"off_policy_correction={name!r}: {exc} Besides the plugins it takes 'auto', 'trl', 'none', "
                          "'<plugin>+ess' (VCPO's step rule on top of one), '<plugin>+trust' (PPO's trust region "
                          "around its anchor as a mask) and '<plugin>+sampler_trust' (around the sampler).") from None
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"off_policy_correction={name!r}: {exc} (off_policy_correction_kwargs={options!r})") from None
