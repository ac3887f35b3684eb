"""Statistics of the staleness study: a run's final reward and area under the curve, a cell's mean over seeds with
its 95 % confidence interval (Student's t), and the ratio of two cells' means with a bootstrap interval."""

from __future__ import annotations

import math
import random

# Two-sided 95 % quantiles of Student's t by degrees of freedom (1..30); above 30 the normal's 1.96 is within 2 %.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        return math.inf
    return _T95[df - 1] if df <= len(_T95) else 1.96


def final_reward(rewards: list[float]) -> float:
    """Mean reward of the last tenth of the steps (at least 10, all of them in a shorter run)."""
    tail = rewards[-max(10, len(rewards) // 10):]
    return sum(tail) / len(tail)


def area(rewards: list[float]) -> float:
    """The area under the reward curve over the run, as a mean reward per step (1.0: reward 1 from the start)."""
    return sum(rewards) / len(rewards) if rewards else math.nan


def mean_ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95 % confidence interval); the half-width is inf with fewer than two values."""
    n = len(values)
    if not n:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.inf
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t95(n - 1) * sd / math.sqrt(n)


def ratio_ci(values: list[float], reference: list[float], resamples: int = 4000, seed: int = 0
             ) -> tuple[float, float, float]:
    """mean(values) / mean(reference) and its 95 % percentile-bootstrap interval (each side's seeds resampled
    independently; the same draws every call). NaN where the reference's mean is not positive."""
    if not values or not reference:
        return math.nan, math.nan, math.nan
    ref = sum(reference) / len(reference)
    if ref <= 0:
        return math.nan, math.nan, math.nan
    point = (sum(values) / len(values)) / ref
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        a = sum(rng.choice(values) for _ in values) / len(values)
        b = sum(rng.choice(reference) for _ in reference) / len(reference)
        if b > 0:
            ratios.append(a / b)
    ratios.sort()
    if not ratios:
        return point, math.nan, math.nan
    return point, ratios[int(0.025 * (len(ratios) - 1))], ratios[int(0.975 * (len(ratios) - 1))]


def mean_curve(curves: list[list[float]]) -> list[float]:
    """The step-wise mean of several runs' curves (as long as the shortest)."""
    if not curves:
        return []
    return [sum(c[i] for c in curves) / len(curves) for i in range(min(map(len, curves)))]


def smooth(values: list[float], window: int = 10) -> list[float]:
    """A trailing moving average over `window` steps."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out
