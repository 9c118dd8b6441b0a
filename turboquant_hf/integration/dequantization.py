"""`model.dequantize()`: TurboQuant modules back to the plain modules they replaced."""

from __future__ import annotations

import torch
from torch import nn

from ..modeling.experts_layout import stored
from ..modeling.modules import TurboQuantExperts, TurboQuantLinear
from .fusion import unfuse_projections


def restore_plain_modules(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every TurboQuant module of `model` by the plain module it stands for, holding the weights it
    computes with (`dequantize`) in `dtype`: a `TurboQuantLinear` by an `nn.Linear` (or the plain nn.Linear
    subclass it replaced), a `TurboQuantExperts` by the transformers experts module it replaced. Returns the number of modules restored."""
    unfuse_projections(model)
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, TurboQuantLinear):
            w = module.weight
            weight = w.dequantize(dtype).view(w.source_shape)
            if w.source_transposed:
                from transformers.pytorch_utils import Conv1D

                plain = Conv1D(module.out_features, module.in_features).to(device=w.device, dtype=dtype)
                weight = weight.t().contiguous()
            else:
                cls = module.__dict__.get("source_class", nn.Linear)
                plain = cls.__new__(cls)  # (nn.Linear's own initialisation: a plain subclass adds nothing to it)
                nn.Linear.__init__(plain, module.in_features, module.out_features, bias=module.bias is not None,
                                   device=w.device, dtype=dtype)
            plain.weight = nn.Parameter(weight, requires_grad=False)
            if module.bias is not None:
                plain.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
        elif isinstance(module, TurboQuantExperts):
            plain = module.__dict__.get("replaced_module")
            if plain is None:
                raise ValueError(f"{name}: built outside from_pretrained, this TurboQuantExperts does not know the "
                                 "experts module it stands for")
            if module.rotation == "hadamard":
                gate, up = (getattr(module, n).dequantize(dtype).view(getattr(module, n).source_shape)
                            for n in ("gate_proj", "up_proj"))
                gate_up = torch.cat([gate, up], dim=1)
            else:
                gate_up = module.gate_up_proj.dequantize(dtype).view(module.gate_up_proj.source_shape)
            down = module.down_proj.dequantize(dtype).view(module.down_proj.source_shape)
            layout = module.layout
            # back in the module's own storage: [E, in, out] where it is transposed, biases beside the weights
            for attr, w in (("gate_up_proj", gate_up), ("down_proj", down)):
                w = stored(w, layout).contiguous()
                setattr(plain, attr, nn.Parameter(w, requires_grad=False))
            if layout.bias:
                for attr in ("gate_up_proj_bias", "down_proj_bias"):
                    setattr(plain, attr, nn.Parameter(getattr(module, attr).detach().to(dtype), requires_grad=False))
        else:
            continue
        model.set_submodule(name, plain)
        count += 1
    return count
