"""Which part of each Hugging Face weight vLLM's own loader reads on a generator rank.

A tensor-parallel vLLM rank keeps only a slice of most weights: rows of `q/k/v_proj` (whole KV
heads, *replicated* when there are fewer KV heads than ranks), columns of `o_proj`, a padded
vocabulary range of the embeddings, a range of every expert's intermediate dimension, the whole of
a norm. Rather than restate those rules per layer type (and get one wrong), the regions are read
off vLLM's loaders themselves: the model's parameters are put back in checkpoint format (vLLM's
layerwise-reload machinery, the same it uses for every `reload_weights`), every weight loader is
wrapped to load into a scratch tensor instead of the model, and each Hugging Face weight is fed
through `model.load_weights` as a *probe* whose values are the indices of one dimension. The
indices that land in the scratch tensors are the rows (columns, experts, ...) the rank reads.

Each weight is probed twice per dimension, with values `i + 1` and `2 (i + 1)`: a loader that
only moves values (narrow, chunk, transpose, concatenate) lands exactly twice the first probe's
values with the second (a constant it fills in, such as zero padding rows, lands the same both
times and is ignored); one that transforms them (an offset, a scale) does not, and its weight is
then sent whole. Whatever is not understood is sent whole; vLLM's loader narrows it as it does a
checkpoint. A weight that no loader call reads is reported as `None`: the caller decides whether
that is expected (a tied `lm_head`) or a layout vLLM does not know.

Regions are boxes: one `(start, end)` per dimension, the bounding range of what the loader read
(a superset is always safe: the loader reads within it).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable

import torch

Box = tuple[tuple[int, int], ...]
_EXACT_FP32 = 1 << 23  # probe values stay exactly representable in float32


def layer_pattern(name: str) -> str:
    """Weights of different decoder layers are loaded alike: probe one per pattern and shape."""
    return re.sub(r"\.layers\.\d+\.", ".layers.*.", name)


class _Recorder:
    """Wraps every weight loader of a model in checkpoint format so that it loads into scratch tensors."""

    def __init__(self):
        # id(param) -> (plain float32 tensor of the param's shape, the same storage dressed as the param)
        self.scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def wrap(self, tensor: torch.Tensor, original):
        signature = inspect.signature(original)

        def probing_loader(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            param = bound.arguments["param"]
            if id(param) not in self.scratch:
                plain = torch.full(tuple(param.shape), float("nan"), dtype=torch.float32)
                dressed = plain.view(plain.shape)
                dressed.__class__ = param.__class__
                dressed.__dict__ = {k: v for k, v in param.__dict__.items() if k != "weight_loader"}
                self.scratch[id(param)] = (plain, dressed)
            bound.arguments["param"] = self.scratch[id(param)][1]
            return original(*bound.args, **bound.kwargs)

        probing_loader.__signature__ = signature
        return probing_loader

    def landed(self) -> list[torch.Tensor]:
        """The values the last load put into the scratch tensors (one flat tensor per parameter touched)."""
        out = []
        for plain, _ in self.scratch.values():
            data = plain.reshape(-1)
            out.append(data[~torch.isnan(data)])
        self.scratch.clear()
        return out


def _probe(shape: tuple[int, ...], dim: int, scale: float) -> torch.Tensor:
    """`scale * (index along dim + 1)`, broadcast to `shape` without allocating it."""
    view = [1] * len(shape)
    view[dim] = shape[dim]
    values = (torch.arange(shape[dim], dtype=torch.float32) + 1) * scale
    return values.view(view).expand(shape)


def _read_box(model, recorder: _Recorder, name: str, shape: tuple[int, ...]) -> Box | None | str:
    """The box of `name` this rank's loader reads; None if it reads nothing; "whole" if not understood."""
    box = []
    for dim in range(len(shape)):
        if shape[dim] + 1 > _EXACT_FP32 // 2:
            return "whole"
        model.load_weights([(name, _probe(shape, dim, 1.0))])
        first = recorder.landed()
        model.load_weights([(name, _probe(shape, dim, 2.0))])
        second = recorder.landed()
        if [t.shape for t in first] != [t.shape for t in second]:
            return "whole"
        first, second = torch.cat(first), torch.cat(second)
        fill = second == first  # a constant the loader writes itself (zero padding rows), not read from the probe
        read = (second == 2 * first) & ~fill
        if not bool((read | fill).all()):
            return "whole"  # the loader transforms values: do not rely on where they land
        values = first[read]
        if not values.numel():
            return None
        if not torch.equal(values, values.round()) or values.min() < 1 or values.max() > shape[dim]:
            return "whole"
        box.append((int(values.min()) - 1, int(values.max())))
    return tuple(box)


def _loader_of(tensor: torch.Tensor) -> tuple[torch.Tensor, bool, object]:
    return tensor, hasattr(tensor, "weight_loader"), getattr(tensor, "weight_loader", None)


def read_regions(model: torch.nn.Module, weights: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, Box | None]:
    """For each Hugging Face weight `(name, shape)`, the box this rank's vLLM loader reads (the whole
    shape when it cannot tell), or None when no loader reads it. Leaves the model as it was."""
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    recorder = _Recorder()
    # The kernel-format tensors' own weight_loader attributes, to put back afterwards.
    saved = [_loader_of(t) for layer in model.modules() for t in get_layer_tensors(layer).values()]
    layerwise.initialize_layerwise_reload(model)  # parameters back in checkpoint format, on the meta device
    try:
        for layer in model.modules():
            for tensor in get_layer_tensors(layer).values():
                # vLLM keeps these checkpoint-format tensors for the next reload: their loaders are put back too
                saved.insert(0, _loader_of(tensor))
                tensor.weight_loader = recorder.wrap(tensor, layerwise._get_original_loader(tensor))
        cache: dict[tuple[str, tuple[int, ...]], Box | None | str] = {}
        out: dict[str, Box | None] = {}
        for name, shape in weights:
            shape = tuple(int(s) for s in shape)
            key = (layer_pattern(name), shape)
            if key not in cache:
                try:
                    cache[key] = _read_box(model, recorder, name, shape)
                except Exception:  # a loader that cannot take a probe: let it narrow the whole tensor itself
                    recorder.landed()
                    cache[key] = "whole"
            found = cache[key]
            out[name] = tuple((0, s) for s in shape) if found == "whole" else found
        return out
    finally:
        for layer in model.modules():  # the kernel-format tensors, untouched, back in place
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                layerwise._place_kernel_tensors(layer, info)
                info.reset()
        for tensor, had, loader in saved:
            if had:
                tensor.weight_loader = loader  # vLLM's parameter classes keep it behind a property
            elif hasattr(tensor, "weight_loader"):
                del tensor.weight_loader
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
