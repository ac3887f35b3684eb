"""The load-balancing auxiliary loss of a Mixture-of-Experts policy, as TRL's `GRPOTrainer` adds it.

TRL adds `router_aux_loss_coef x aux_loss` to every micro-batch's loss when the model's config declares
`output_router_logits` (an MoE architecture of transformers) and the coefficient is not 0; an unset
`router_aux_loss_coef` takes the architecture's own (`config.router_aux_loss_coef`). `aux_loss` is the
architecture's own `load_balancing_loss_func` (Switch Transformer's, in each MoE model file) over the real tokens
(prompt and completion) of the micro-batch. transformers computes it inside the model's forward from the
attention mask; the trainer's packed micro-batches have none (sequences are told apart by their position ids),
so the loss is computed here from the routers' logits and a mask of the real tokens, with the same function.
"""

from __future__ import annotations

import sys

import torch


def aux_loss_coef(config, coef: float | None) -> float:
    """The weight of the load-balancing loss for a model of `config` (0.0: none), as TRL 1.16 decides it.

    Raises:
        ValueError: `coef` is set (not 0) and the model is not an MoE model that returns its routers' logits.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if coef and not hasattr(text, "output_router_logits"):
        raise ValueError(f"router_aux_loss_coef={coef}, but the model ({getattr(config, 'model_type', '?')}) is not a "
                         "Mixture-of-Experts model that returns its router logits, so there is no auxiliary loss to "
                         "weight. Leave router_aux_loss_coef unset (or 0.0).")
    value = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    return float(value or 0.0) if hasattr(text, "output_router_logits") else 0.0


def balancing_loss_fn(model):
    """`(router_logits, token_mask) -> aux_loss` with the architecture's own function and expert counts.

    Raises:
        ValueError: the model's code has no `load_balancing_loss_func` (it cannot be weighted as TRL does).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT's wrapper
    func = None
    for cls in type(base).__mro__:  # FSDP2 subclasses the model's class; the function lives in the model's file
        func = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if func is not None:
            break
    text = base.config.get_text_config()
    experts = getattr(base, "num_experts", None)
    if experts is None:
        experts = next((getattr(text, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                        if getattr(text, n, None)), None)
    top_k = getattr(base, "num_experts_per_tok", None) or getattr(text, "num_experts_per_tok", None)
    if func is None or not experts or not top_k:
        raise ValueError(f"{type(base).__name__} declares output_router_logits, but its code has no "
                         "load_balancing_loss_func (or no expert counts) to compute the auxiliary loss TRL adds; set "
                         "router_aux_loss_coef=0.0 to train without it.")

    def loss(router_logits, token_mask: torch.Tensor) -> torch.Tensor:
        """`router_logits`: one `[rows * width, experts]` tensor per MoE layer; `token_mask`: `[rows, width]`, 1 at
        the micro-batch's real tokens."""
        return func(tuple(router_logits), experts, top_k, token_mask)

    return loss
