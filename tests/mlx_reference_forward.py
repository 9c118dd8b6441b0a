"""MLX's own forward of a turboquant-mlx checkpoint, on CPU: run with the MLX environment's python.

    python mlx_reference_forward.py CHECKPOINT_DIR IDS_JSON OUT_NPY

turboquant-mlx's matrix products are Metal kernels, which do not run on Linux. This replaces only those: each
quantized layer keeps turboquant-mlx's own input rotation (`rotate_input`, MLX's `hadamard_transform`) and index
unpacking (`unpack_indices` / `unpack_trits`), and multiplies by `codebook[idx] * scale` in float32 with plain MLX
ops. The model, its loader and everything else are MLX's / mlx-lm's, in float32.
"""

import json
import sys

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from turboquant_mlx.core.packing import unpack_indices, unpack_trits
from turboquant_mlx.core.rotation import rotate_input
from turboquant_mlx.generate import load_turboquant
from turboquant_mlx.layers.polar_linear import PolarQuantizedLinear
from turboquant_mlx.layers.polar_switch_linear import PolarQuantizedSwitchLinear


def rotated_weight(layer, trit: bool) -> mx.array:
    """`codebook[idx] * scale` in float32, shape `(..., out, in)` (the weight in the rotated basis)."""
    *lead, words = layer.weight.shape
    n_groups = layer.scales.shape[-1]
    in_dims = n_groups * layer.group_size
    rows = layer.weight.reshape(-1, words)
    idx = unpack_trits(rows, in_dims) if trit else unpack_indices(rows, layer.bits, in_dims)
    values = mx.take(layer.codebook.astype(mx.float32), idx.astype(mx.uint32))
    values = values.reshape(-1, n_groups, layer.group_size) * layer.scales.reshape(-1, n_groups, 1).astype(mx.float32)
    return values.reshape(*lead, in_dims)


def linear_call(self, x):
    if self._needs_rotation:
        x = rotate_input(x, self.signs)
    y = x.astype(mx.float32) @ rotated_weight(self, False).T
    return y + self.bias if "bias" in self else y


def switch_call(self, x, indices, sorted_indices=False):
    if self._needs_rotation:
        x = rotate_input(x, self.signs)
    w = rotated_weight(self, self.trit)
    y = mx.gather_mm(x.astype(mx.float32), w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
    return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y


def main(checkpoint: str, ids_json: str, out: str) -> None:
    PolarQuantizedLinear.__call__ = linear_call
    PolarQuantizedSwitchLinear.__call__ = switch_call
    model, _ = load_turboquant(checkpoint)
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    with open(ids_json) as f:
        ids = mx.array(json.load(f), dtype=mx.int32)
    logits = model(ids)
    np.save(out, np.array(logits.astype(mx.float32)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
