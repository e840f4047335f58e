"""A fix for vLLM's CPU multi-LoRA, applied inside vLLM's worker process.

vLLM's CPU LoRA path (``PunicaWrapperCPU``, ``vllm.lora.ops.torch_ops``) gathers each token's
adapter weights with ``weights[token_lora_indices]``. A token of a request *without* an
adapter has index -1, which Python indexing reads as the last adapter slot: in a batch that
mixes LoRA voices and base voices, the base voices ran with the adapter in the last slot
(measured with the tiny model: a base request batched with two adapters produced exactly the
tokens of the second adapter). The GPU kernels (Triton/punica) skip index -1; these
replacements do the same on CPU, by masking the rows of index -1.

The worker process imports this module through vLLM's ``worker_extension_cls`` (the only
hook that runs our code there before the model is built), set by
:func:`llm_worker.engine.args.engine_args` when LoRA is on and the device is the CPU.
"""

from __future__ import annotations

import torch

_PATCHED = False
ORIGINALS: dict[str, object] = {}
"""vLLM's own functions, as they were before :func:`apply` (for tests)."""


def _gather(weights: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    sel = weights[idx.clamp(min=0)].to(dtype=dtype)
    if sel.dim() == 4:
        sel = sel.squeeze(dim=1)
    return sel


def _mask(outputs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return outputs * (idx >= 0).to(outputs.dtype)[:, None]


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    sel = _gather(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    outputs = torch.einsum("bi, boi -> bo", inputs.to(dtype=output_tensor.dtype), sel)
    outputs = _mask(outputs, lora_indices_tensor)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    sel = _gather(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    outputs = torch.einsum("bi, boi -> bo", inputs.to(dtype=output_tensor.dtype), sel)
    outputs = _mask(outputs, lora_indices_tensor)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    sel = _gather(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    outputs = torch.einsum("bi, boi -> bo", inputs.to(dtype=output_tensor.dtype), sel)
    outputs = _mask(outputs, lora_indices_tensor)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


def apply() -> bool:
    """Replace the three gathers in vLLM's CPU LoRA ops (idempotent). False if this vLLM has
    no such module (not a CPU build, or a layout this fix does not know)."""
    global _PATCHED
    if _PATCHED:
        return True
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        ORIGINALS[name] = getattr(lora_ops, name)
    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink = bgmv_shrink  # type: ignore[attr-defined]
        module.bgmv_expand = bgmv_expand  # type: ignore[attr-defined]
        module.bgmv_expand_slice = bgmv_expand_slice  # type: ignore[attr-defined]
    _PATCHED = True
    return True


class LoraCpuFix:
    """vLLM ``worker_extension_cls``: importing it in the worker applies the fix."""


apply()
