"""The two axes of the policy loss: every TRL loss_type x every behaviour-policy correction (AIPO's truncation, each
of TRL's four importance-sampling modes, none) x importance_sampling_level, against formulas written out here and
against TRL 1.16's own `GRPOTrainer._compute_loss`; and the advantages: scale_rewards="batch" over two trainer
ranks, unscored completions (NaN) as TRL's nanmean/nanstd, multi_objective_aggregation="normalize_then_sum"."""

import math
from datetime import timedelta

import pytest
import torch

from hfllamarl import load_plugin
from hfllamarl.losses import StepShape, group_advantages, normalize_then_sum_advantages
from conftest import free_port
from trl_loss_reference import trl_loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
RHO = 2.0
# name -> (TRL's mode, clip_min, clip_max) or None (no correction); "aipo" is AIPO's default min(pi_old/mu, rho)
CORRECTIONS = {"aipo": ("token_truncate", None, RHO), "token_truncate": ("token_truncate", 0.5, 1.5),
               "token_mask": ("token_mask", 0.6, 1.8), "sequence_truncate": ("sequence_truncate", 0.3, 2.5),
               "sequence_mask": ("sequence_mask", 0.2, 4.0), "off": None}
EPS_LOW, EPS_HIGH, MAX_LEN = 0.2, 0.28, 6

# Hand-picked: 3 completions of 4, 2 and 3 tokens. pi/pi_old spans PPO's clip regions (0.5, 1.1, 1.6, ...), pi_old/mu
# spans the correction's bounds, advantages of both signs and 0.
LOGP = torch.tensor([[-1.0, -0.4, -2.0, -0.7], [-0.3, -1.5, -1.0, -1.0], [-2.2, -0.9, -0.1, -3.0]])
OLD = torch.tensor([[-1.0, -0.4 - math.log(1.6), -2.0 + math.log(2.0), -0.7 - math.log(1.1)],
                    [-0.3 + math.log(1.3), -1.5 - math.log(0.7), -1.0, -1.0],
                    [-2.2 - math.log(0.9), -0.9 + math.log(1.25), -0.1, -3.0]])
MU = OLD - torch.tensor([[math.log(3.0), 0.0, math.log(0.4), math.log(1.2)], [math.log(0.55), math.log(1.7), 0, 0],
                         [math.log(2.2), math.log(0.9), math.log(1.05), 0]])  # pi_old/mu = 3, 1, 0.4, 1.2 | ...
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
ADV = torch.tensor([1.5, -0.8, 0.0])


def hand_loss(loss_type, level, correction, logp, old, mu, adv, mask, delta=None, vespo=(2.0, 3.0, 3.0, 2.0),
              sapo=(1.0, 1.05)):
    """The loss written out from the papers' formulas (TRL's decomposition), independent of hfllamarl.losses."""
    A = adv[:, None]
    lengths = mask.sum(-1, keepdim=True)
    log_c = logp - old
    c = torch.exp(log_c) if level == "token" else torch.exp((log_c * mask).sum(-1, keepdim=True) / lengths)
    b = torch.ones(1, 1)
    if correction is not None:  # b = pi_old/mu, per token or per sequence (product), truncated or masked
        mode, lo, hi = correction
        d = (old - mu) * mask
        r = torch.exp(d.sum(-1, keepdim=True) if mode.startswith("sequence") else d)
        if mode.endswith("truncate"):
            b = torch.clamp(r, min=lo, max=hi)
        else:
            b = torch.where((r < (lo or -math.inf)) | (r > (hi or math.inf)), torch.zeros_like(r), r)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        unclipped = c if delta is None else torch.clamp(c, max=delta)
        obj = -torch.min(unclipped * A, torch.clamp(c, 1 - EPS_LOW, 1 + EPS_HIGH) * A)
    elif loss_type == "cispo":
        obj = -torch.clamp(c, max=EPS_HIGH).detach() * A * logp
    elif loss_type == "sapo":
        tau = torch.where(A > 0, sapo[0], sapo[1])
        obj = -torch.sigmoid(tau * (c - 1)) * 4 / tau * A
    else:  # vespo: phi(w) = exp(lambda + k log w - lambda w), w = prod pi/pi_old * prod b, no gradient
        log_w = (log_c.detach().clamp(-20, 20) * mask).sum(-1, keepdim=True)
        if correction is not None:
            log_w = log_w + torch.log(b).clamp(math.log(1e-8), 20).sum(-1, keepdim=True)
        log_w = log_w.clamp(math.log(1e-8), 20)
        k = torch.where(A >= 0, vespo[0], vespo[2])
        lam = torch.where(A >= 0, vespo[1], vespo[3])
        obj = -torch.exp(lam + k * log_w - lam * torch.exp(log_w)) * A * logp
        b = torch.ones(1, 1)  # (b is inside phi, not a factor)
    per = obj * b * mask
    if loss_type in ("grpo", "sapo"):
        return (per.sum(-1) / mask.sum(-1)).mean()
    if loss_type == "dr_grpo":
        return per.sum() / (per.shape[0] * MAX_LEN)
    if loss_type == "luspo":
        return per.sum(-1).mean()
    return per.sum() / mask.sum()  # bnpo, and dapo/cispo/vespo with one micro-batch on one rank




def aipo_plugin(loss_type, level, correction_name, **extra):
    """`aipo` (the default algorithm) with this objective and correction."""
    options = dict(rho=RHO, loss_type=loss_type, importance_sampling_level=level, epsilon=EPS_LOW,
                   epsilon_high=EPS_HIGH, **extra)
    if correction_name == "off":
        options.update(rho=4.0, vllm_importance_sampling_correction=False)
    elif correction_name != "aipo":  # TRL's mode: aipo_rho left at its default
        mode, lo, hi = CORRECTIONS[correction_name]
        options.update(rho=4.0, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=lo,
                       vllm_importance_sampling_clip_max=hi)
    return load_plugin("algorithms", "aipo")(**options)


CASES = [(lt, corr, level) for lt in LOSS_TYPES for corr in CORRECTIONS for level in ("token", "sequence")
         if not (lt == "vespo" and corr.startswith("sequence"))]


@pytest.mark.parametrize("loss_type,correction,level", CASES)
def test_objective_x_correction_x_level_equals_the_hand_formula_and_trl(loss_type, correction, level):
    shape = StepShape(tokens=float(MASK.sum()), max_completion_length=MAX_LEN)
    algo = aipo_plugin(loss_type, level, correction)
    logp = LOGP.clone().requires_grad_()
    loss, metrics = algo.loss(logp, MU, ADV, MASK, shape=shape, old_logprobs=OLD)
    loss.backward()

    ref_logp = LOGP.clone().requires_grad_()
    expected = hand_loss(loss_type, level, CORRECTIONS[correction], ref_logp, OLD, MU, ADV, MASK)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(logp.grad, ref_logp.grad, rtol=1e-5, atol=1e-7)
    assert (logp.grad * (1 - MASK)).abs().sum() == 0  # padding gets nothing

    trl_options = dict(loss_type=loss_type, importance_sampling_level=level, epsilon=EPS_LOW, epsilon_high=EPS_HIGH,
                       max_completion_length=MAX_LEN)
    if CORRECTIONS[correction] is None:
        trl_options["vllm_importance_sampling_correction"] = False
    else:
        mode, lo, hi = CORRECTIONS[correction]
        trl_options.update(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=lo,
                           vllm_importance_sampling_clip_max=hi)
    trl_logp = LOGP.clone().requires_grad_()
    trl_value = trl_loss(trl_logp, MU, MASK, ADV[:, None], trl_options, old=OLD)
    trl_value.backward()
    assert loss.item() == pytest.approx(trl_value.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(logp.grad, trl_logp.grad, rtol=1e-5, atol=1e-7)


def test_vespo_with_a_sequence_correction_is_refused_as_trl_does():
    with pytest.raises(ValueError, match="loss_type='vespo' needs a per-token correction"):
        aipo_plugin("vespo", "token", "sequence_mask")


def test_aipo_default_gradient_is_todays_objective_by_hand():
    """algorithm='aipo', default loss_type (dapo), one optimizer step per batch (no old_logprobs): the gradient is
    that of -min(pi/mu, rho) * A * log pi summed over the tokens / their count, computed here number by number."""
    algo = load_plugin("algorithms", "aipo")(rho=RHO)
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, -9.0]], requires_grad=True)
    mu = torch.tensor([[-1.0, -2.0, -1.0], [-0.1, -3.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.5, -0.5])
    loss, metrics = algo.loss(logp, mu, adv, mask)
    loss.backward()
    # pi/mu = e^0, e^1.5 (> rho: 2), e^-1 | e^-0.1, e^0.5; d/dlog pi of -w A log pi / 5 is -w A / 5
    w = [[1.0, RHO, math.exp(-1.0)], [math.exp(-0.1), math.exp(0.5), 0.0]]
    grad = [[-w[i][j] * float(adv[i]) / 5 * float(mask[i, j]) for j in range(3)] for i in range(2)]
    assert torch.allclose(logp.grad, torch.tensor(grad), atol=1e-7)
    assert metrics["clipped_frac"] == pytest.approx(1 / 5)
    # the logged value is TRL's (c = 1): -sum w A / 5
    assert loss.item() == pytest.approx(-sum(w[i][j] * float(adv[i]) for i in range(2) for j in range(3)) / 5)


def test_delta_and_entropy_mask_and_uncorrected_warning(caplog):
    import hfllamarl.policy_loss as policy_loss

    shape = StepShape(tokens=float(MASK.sum()), max_completion_length=MAX_LEN)
    logp = LOGP.clone().requires_grad_()
    entropy_mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]])
    algo = aipo_plugin("grpo", "token", "aipo", delta=1.3)
    loss, _ = algo.loss(logp, MU, ADV, MASK, shape=shape, old_logprobs=OLD, entropy_mask=entropy_mask)
    loss.backward()
    ref_logp = LOGP.clone().requires_grad_()
    # grpo's per-sequence mean divides by the completion's length, not by the tokens the entropy mask keeps (TRL)
    expected = (hand_seq_sums(ref_logp, entropy_mask) / MASK.sum(-1)).mean()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(logp.grad, ref_logp.grad, atol=1e-7)
    assert (logp.grad * (1 - entropy_mask)).abs().sum() == 0  # masked tokens get nothing
    policy_loss._warned_uncorrected = False
    with caplog.at_level("WARNING", logger="hfllamarl.policy_loss"):
        aipo_plugin("dapo", "token", "off")
        aipo_plugin("dapo", "token", "off")
    assert sum("stale" in r.getMessage() or "older policy" in r.getMessage() for r in caplog.records) == 1


def hand_seq_sums(logp, entropy_mask):
    """Per-sequence sums of grpo's per-token loss with delta=1.3 and AIPO's weight, masked by `entropy_mask`."""
    A = ADV[:, None]
    c = torch.exp(logp - OLD)
    b = torch.clamp(torch.exp((OLD - MU) * MASK), max=RHO)
    obj = -torch.min(torch.clamp(c, max=1.3) * A, torch.clamp(c, 1 - EPS_LOW, 1 + EPS_HIGH) * A)
    return (obj * b * MASK * entropy_mask).sum(-1)


# ----------------------------------------------------------------------------- advantages
def test_unscored_rewards_are_out_of_mean_and_std_as_trls_nanmean_nanstd():
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 2.0, nan, nan, nan, 3.0, 5.0, nan, nan, nan])
    # group 1: scored 1, 0, 2 -> mean 1, sample std 1; group 2: one scored -> std NaN -> advantage 0 (TRL);
    # group 3: one scored (5): r - mean = 0
    expected_group = [0.0, 0.0, -1 / (1 + 1e-4), 1 / (1 + 1e-4), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(expected_group, abs=1e-6)
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx(
        [0.0, 0.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], abs=1e-6)
    # batch: scored 1, 0, 2, 3, 5 -> mean 2.2, sample variance (1.44 + 4.84 + 0.04 + 0.64 + 7.84) / 4 = 3.7
    std = math.sqrt(3.7)
    batch = group_advantages(rewards, 4, "batch").tolist()
    assert batch[:4] == pytest.approx([0.0, 0.0, -1 / (std + 1e-4), 1 / (std + 1e-4)], abs=1e-6)
    assert batch[4:] == pytest.approx([0.0] * 8, abs=1e-6)
    from trl.trainer.utils import nanstd

    assert float(nanstd(rewards)) == pytest.approx(std, rel=1e-6)  # TRL's own nanstd agrees


def test_rloo_leaves_unscored_completions_out_of_the_baseline():
    rloo = load_plugin("algorithms", "rloo")()
    adv = rloo.advantages(torch.tensor([1.0, math.nan, 0.0, 2.0, 4.0, math.nan]), 3)
    # group 1: 1 - 0, nan -> 0, 0 - 1; group 2: 2 - 4, 4 - 2, nan -> 0
    assert adv.tolist() == pytest.approx([1.0, 0.0, -1.0, -2.0, 2.0, 0.0])


def test_normalize_then_sum_by_hand():
    nan = math.nan
    scores = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 2.0], [1.0, 0.0], [nan, nan], [nan, nan]])
    adv = normalize_then_sum_advantages(scores, [1.0, 2.0], 2)
    # function 1, group 1: 1, 0 -> mean 0.5, std sqrt(0.5); group 2: 1, 1 -> std 0 -> 0. function 2, group 1: one
    # score -> std NaN -> left out of the sum; group 2: 2, 0 -> mean 1, std sqrt(2), weight 2. Group 3 unscored.
    s1, s2 = math.sqrt(0.5) + 1e-4, math.sqrt(2.0) + 1e-4
    R = [0.5 / s1, -0.5 / s1, 2 * 1 / s2, 2 * -1 / s2]
    mean = sum(R) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in R) / 3)
    expected = [(x - mean) / (std + 1e-4) for x in R] + [0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def _batch_rank(rank: int, port: int, rewards: list, out) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=60))
    try:
        out.put((rank, group_advantages(torch.tensor(rewards), 2, "batch").tolist()))
    finally:
        torch.distributed.destroy_process_group()


def test_batch_scaling_uses_the_std_over_every_trainer_rank():
    """Two trainer ranks (gloo), each with its own groups: each divides by the std of the concatenated batch."""
    ctx = torch.multiprocessing.get_context("spawn")
    parts = [[1.0, 3.0, 0.0, math.nan], [10.0, 2.0, 4.0, 4.0]]
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_batch_rank, args=(r, port, parts[r], out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    scored = [x for part in parts for x in part if not math.isnan(x)]
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((x - mean) ** 2 for x in scored) / (len(scored) - 1))  # the concatenated batch's
    for rank, part in enumerate(parts):
        expected = []
        for g in range(0, 4, 2):
            group = [x for x in part[g:g + 2] if not math.isnan(x)]
            m = sum(group) / len(group)
            expected += [0.0 if math.isnan(x) else (x - m) / (std + 1e-4) for x in part[g:g + 2]]
        assert results[rank] == pytest.approx(expected, abs=1e-6), rank
    local_std = torch.tensor(parts[1]).std().item()
    assert abs(local_std - std) > 0.1  # (a rank's own std would have given other advantages)
