"""What this machine's torch build offers the ops' platform forms (probes, no model knowledge)."""

from __future__ import annotations

import torch

__all__ = ["activation_qmax", "cpu_int8_dot", "onednn_available", "plain_f32"]


def onednn_available() -> bool:
    """Whether torch ships oneDNN's fused linear + pointwise CPU op (``mkldnn::_linear_pointwise``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return torch.ops.mkldnn._linear_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


def cpu_int8_dot() -> dict[str, bool]:
    """Which int8 dot-product instructions this CPU has (torch's probes): VNNI, AMX tiles."""
    return {"vnni": bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)()),
            "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())}


def activation_qmax(device: torch.device | str = "cpu") -> int:
    """The int8 activation range this machine's int8 GEMMs accumulate exactly (`flashrt.quant.linear`):
    127 on CUDA and on CPUs with VNNI / AMX int8 dot products, 63 (7 bits) with AVX2's."""
    if torch.device(device).type == "cuda":
        return 127
    return 127 if any(cpu_int8_dot().values()) else 63


def plain_f32(weight: torch.Tensor) -> bool:
    """A plain float32 row-major weight, what oneDNN's fused CPU forms take. A quantized weight (a tensor
    subclass) is not: it runs its own GEMM (a GeGLU's gate and up halves share one quantization of the
    input, where oneDNN's fused pair would quantize it twice)."""
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dtype == torch.float32
            and weight.is_contiguous())
