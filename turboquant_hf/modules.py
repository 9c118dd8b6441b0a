"""Quantized modules and the on-the-fly quantize operation.

`TurboQuantLinear` replaces `nn.Linear`. Its packed weight lives in a child
module named `weight`, so the state-dict names are exactly the tq3_native
checkpoint names (`<linear>.weight.tq_packed`, `<linear>.weight.tq_norms`) and
no renaming is needed in either direction.
"""

from __future__ import annotations

import torch
from torch import nn

from . import codec
from . import format as fmt
from . import ops  # noqa: F401  (registers torch.ops.turboquant)

_CONSTANTS: dict = {}


def format_constants(n_levels: int, group_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codebook, signs1, signs2) on `device`, shared by every module (never buffers: nothing to load or save)."""
    device = torch.device(device)
    key = (n_levels, group_size, device)
    if key not in _CONSTANTS:
        s1, s2 = fmt.signs(group_size, device)
        _CONSTANTS[key] = (fmt.codebook(n_levels, group_size, device), s1, s2)
    return _CONSTANTS[key]


class TurboQuantWeight(nn.Module):
    """Packed indices `tq_packed` (uint8, `(rows*n_groups, bytes_per_group)`) and norms `tq_norms` (float32, `(rows, n_groups)`)."""

    def __init__(self, rows: int, in_features: int, bits, group_size: int, device=None):
        super().__init__()
        self.rows = rows
        self.in_features = in_features
        self.group_size = fmt.check_group_size(group_size)
        self.n_levels = fmt.levels_for_bits(bits)
        self.n_groups = -(-in_features // group_size)
        bpg = fmt.bytes_per_group(self.n_levels, group_size)
        self.register_buffer("tq_packed", torch.empty(rows * self.n_groups, bpg, dtype=torch.uint8, device=device))
        self.register_buffer("tq_norms", torch.empty(rows, self.n_groups, dtype=torch.float32, device=device))

    @property
    def bits(self):
        return fmt.bits_for_levels(self.n_levels)

    @property
    def device(self) -> torch.device:
        return self.tq_packed.device

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "tq_packed": (self.rows * self.n_groups, fmt.bytes_per_group(self.n_levels, self.group_size)),
            "tq_norms": (self.rows, self.n_groups),
        }

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) / .half() must move the norms, never round them.
        norms = self.tq_norms
        super()._apply(fn, recurse)
        if self.tq_norms.dtype != torch.float32:
            self.tq_norms = norms.to(device=self.tq_norms.device, dtype=torch.float32)
        return self

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return codec.dequantize_weight(self.tq_packed, self.tq_norms, self.in_features, self.group_size, dtype=dtype)

    def extra_repr(self) -> str:
        return f"rows={self.rows}, in_features={self.in_features}, bits={self.bits}, group_size={self.group_size}"


class TurboQuantLinear(nn.Module):
    """A Linear layer whose weight is stored TurboQuant-packed; forward runs `torch.ops.turboquant.linear`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits=3,
        group_size: int = 128,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = TurboQuantWeight(out_features, in_features, bits, group_size, device=device)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        # While loading a full-precision checkpoint, the state dict advertises a float `weight` of the original
        # shape and dtype so the loader hands the tensor to the quantize op instead of dropping it.
        self.awaiting_weight_dtype: torch.dtype | None = None

    @property
    def bits(self):
        return self.weight.bits

    @property
    def group_size(self) -> int:
        return self.weight.group_size

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.awaiting_weight_dtype is not None:
            destination[prefix + "weight"] = torch.empty(
                self.out_features, self.in_features, dtype=self.awaiting_weight_dtype, device="meta"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        codebook, s1, s2 = format_constants(w.n_levels, w.group_size, w.tq_packed.device)
        y = torch.ops.turboquant.linear(
            x, w.tq_packed, w.tq_norms, codebook, s1, s2, w.group_size, self.in_features
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"bits={self.bits}, group_size={self.group_size}"
        )


def replace_linear_modules(model: nn.Module, plan: dict[str, tuple], awaiting_weights: bool) -> int:
    """Swap every `nn.Linear` named in `plan` ({name: (bits, group_size)}) for a TurboQuantLinear on its device."""
    count = 0
    for name, (bits, group_size) in plan.items():
        linear = model.get_submodule(name)
        new = TurboQuantLinear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            bits=bits,
            group_size=group_size,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        if awaiting_weights:
            new.awaiting_weight_dtype = linear.weight.dtype
        model.set_submodule(name, new)
        count += 1
    return count


def quantize_linear_(module: TurboQuantLinear, weight: torch.Tensor, name: str = "weight") -> None:
    """Fill `module` from a full-precision weight (used outside from_pretrained, e.g. by tests and tools)."""
    packed, norms = codec.quantize_weight(weight, module.bits, module.group_size, name=name)
    module.weight.tq_packed = packed
    module.weight.tq_norms = norms
    module.awaiting_weight_dtype = None
