"""The TurboQuant matrix product as one torch operator.

`torch.ops.turboquant.linear(x, packed, norms, codebook, signs1, signs2, group_size, in_features)`
computes `x @ W.T` for a weight stored as packed codebook indices and per-group
norms, without rebuilding W:

    <w_group, x_group> = norm * <codebook[idx], D2 . H . D1 . x_group>

so the activations are rotated once per group (`rotate_groups`) and then
multiplied by the codebook values (`codebook_matmul`). The plain-torch
implementation below is the CPU path and the oracle for the GPU kernels,
which register themselves for CUDA under the same op name. The codebook and
the signs are tensors, not constants, so other rotations and per-module
codebooks fit the same product.
"""

from __future__ import annotations

import torch

from ..format import codec, hadamard, runtime_layout
from ..format import constants as fmt
from . import cpu_kernel
from .activations import ACTIVATIONS, check_activation, gated
from .routing import expert_groups, routed_groups, sort_routing  # noqa: F401  (re-exported: ops.expert_groups)

# Bound on the float32 weight block the reference materialises per step.
_REFERENCE_BLOCK_ELEMENTS = 1 << 22

_LIB = torch.library.Library("turboquant", "DEF")


def _op(name: str):
    """Define `torch.ops.turboquant.<name>` with the decorated function's signature (schema inferred from its
    annotations), the function itself serving every device (the Triton kernels register CUDA over it).

    A plain library op rather than `torch.library.custom_op`: the dispatcher calls the implementation
    directly, where a custom op wraps every call in Python for autograd, several times the cost of a small
    decode step. `turboquant::linear` has an autograd formula for its input (`linear_input_grad`; the packed
    weight is frozen)."""

    def define(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return define


def rotate_activations(x: torch.Tensor, signs1: torch.Tensor, signs2: torch.Tensor, group_size: int) -> torch.Tensor:
    """`(M, in)` activations to `(M, n_groups*G)` float32, zero-padded and rotated per group."""
    m, in_features = x.shape
    padded = -(-in_features // group_size) * group_size
    xf = x.to(torch.float32)
    if padded != in_features:
        xf = torch.nn.functional.pad(xf, (0, padded - in_features))
    return codec.rotate_groups(xf.view(m, -1, group_size), signs1, signs2).view(m, padded)


def _weight_blocks(packed, norms, codebook, group_size: int, reuse_buffer: bool = False):
    """(first row, last row, the rows' float32 weight in the rotated basis) of a packed weight, a bounded block at
    a time (`reuse_buffer`: each block in the same per-thread buffer, overwritten by the next)."""
    rows, n_groups = norms.shape
    block = max(1, _REFERENCE_BLOCK_ELEMENTS // (n_groups * group_size))
    scratch = codec.decode_scratch(min(rows, block) * n_groups * group_size, codebook.dtype) if reuse_buffer else None
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        chunk = runtime_layout.codes(packed[start * n_groups : stop * n_groups], codebook.numel(), group_size, n_groups)
        yield start, stop, codec.rotated_weight(chunk, norms[start:stop], codebook, group_size, out=scratch)


def check_weight(packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int) -> None:
    """Raise ValueError unless `packed` holds exactly the groups that `norms` `(rows, n_groups)` names, in the
    published uint8 layout or the runtime int32 one (a product must never read past them or leave groups out)."""
    n_levels = codebook.numel()
    if norms.dim() != 2 or n_levels not in (3, 4, 8, 16):
        raise ValueError(f"TurboQuant weight: norms must be (rows, n_groups) and the codebook 3, 4, 8 or 16 entries, "
                         f"got norms {tuple(norms.shape)} and {n_levels} entries")
    rows, n_groups = norms.shape
    width = (runtime_layout.runtime_width(n_levels, group_size) if runtime_layout.is_runtime(packed)
             else fmt.bytes_per_group(n_levels, group_size))
    if packed.dim() != 2 or tuple(packed.shape) != (rows * n_groups, width):
        raise ValueError(f"TurboQuant weight: packed indices of shape {tuple(packed.shape)} do not hold {rows} rows "
                         f"x {n_groups} groups of {group_size} ({n_levels}-entry codebook): expected "
                         f"({rows * n_groups}, {width})")


def codebook_matmul(
    x_rot: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`(M, n_groups*G)` rotated activations times the packed weight: `(M, rows)` float32 (on CPU, for a few rows
    and no autograd graph to record, the compiled kernel where it serves: `cpu_kernel.linear`)."""
    check_weight(packed, norms, codebook, group_size)
    if x_rot.shape[-1] != norms.shape[1] * group_size:
        raise ValueError(f"TurboQuant weight: rotated activations of width {x_rot.shape[-1]} for "
                         f"{norms.shape[1]} groups of {group_size}")
    differentiable = x_rot.requires_grad and torch.is_grad_enabled()
    if not differentiable:
        y = cpu_kernel.linear(x_rot, packed, norms, codebook, group_size)
        if y is not None:
            return y
    # (on CPU each block is built in a reused per-thread buffer: see `codec.decode_scratch`; not where autograd
    # would keep the block for a backward pass)
    reuse = x_rot.device.type == "cpu" and not torch.compiler.is_compiling() and not differentiable
    parts = [(x_rot @ w.T).to(torch.float32)
             for _, _, w in _weight_blocks(packed, norms, codebook, group_size, reuse_buffer=reuse)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, 1) if parts else x_rot.new_empty(x_rot.shape[0], 0, dtype=torch.float32)


@_op("linear")
def turboquant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    norms: torch.Tensor,
    codebook: torch.Tensor,
    signs1: torch.Tensor,
    signs2: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """`x[..., in_features] @ W.T` -> `[..., rows]` in x's dtype (float32 accumulation)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    y = cpu_kernel.linear(x2, packed, norms, codebook, group_size, (signs1, signs2), in_features)
    if y is None:
        x_rot = rotate_activations(x2, signs1.float(), signs2.float(), group_size)
        y = codebook_matmul(x_rot, packed, norms.float(), codebook.float(), group_size)
    return y.to(x.dtype).reshape(*lead, norms.shape[0])


@torch.library.register_fake("turboquant::linear")
def _linear_fake(x, packed, norms, codebook, signs1, signs2, group_size, in_features):
    return x.new_empty(*x.shape[:-1], norms.shape[0])


@_op("linear_input_grad")
def turboquant_linear_input_grad(
    grad: torch.Tensor,
    packed: torch.Tensor,
    norms: torch.Tensor,
    codebook: torch.Tensor,
    signs1: torch.Tensor,
    signs2: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """The gradient of `turboquant::linear` with respect to x: `grad[..., rows] @ W` -> `[..., in_features]`
    (float32 accumulation). The weight is frozen: it has no gradient. Computed in the rotated basis, where the
    codebook lives (`grad @ W_rot`, one weight block at a time), then rotated back per group."""
    rows, n_groups = norms.shape
    lead = grad.shape[:-1]
    g2 = grad.reshape(-1, rows).to(torch.float32)
    g_rot = g2.new_zeros(g2.shape[0], n_groups * group_size)
    for start, stop, w in _weight_blocks(packed, norms.float(), codebook.float(), group_size):
        g_rot += g2[:, start:stop] @ w
    gx = codec.unrotate_groups(g_rot.view(-1, n_groups, group_size), signs1.float(), signs2.float())
    return gx.reshape(-1, n_groups * group_size)[:, :in_features].to(grad.dtype).reshape(*lead, in_features)


@torch.library.register_fake("turboquant::linear_input_grad")
def _(grad, packed, norms, codebook, signs1, signs2, group_size, in_features):
    return grad.new_empty(*grad.shape[:-1], in_features)


def _linear_setup_context(ctx, inputs, output):
    x, packed, norms, codebook, signs1, signs2, group_size, in_features = inputs
    ctx.save_for_backward(packed, norms, codebook, signs1, signs2)
    ctx.shape = (group_size, in_features)


def _linear_backward(ctx, grad):
    packed, norms, codebook, signs1, signs2 = ctx.saved_tensors
    gx = None
    if ctx.needs_input_grad[0]:
        gx = torch.ops.turboquant.linear_input_grad(grad, packed, norms, codebook, signs1, signs2, *ctx.shape)
    return gx, None, None, None, None, None, None, None


torch.library.register_autograd("turboquant::linear", _linear_backward, setup_context=_linear_setup_context)


def _nograd_twin(name: str, fn, fake) -> None:
    """Define `turboquant::<name>_nograd`: the op `name` (implementation `fn`, fake `fake`) without its autograd
    formula, for calls that need no gradient (`linear_op`, `moe_op` pick it): the same implementations on every
    device, without the Python layer that a formula registered from Python puts in front of every call. Called
    with inputs that require a gradient, autograd refuses it at backward."""
    _LIB.define(name + "_nograd" + torch.library.infer_schema(fn, mutates_args=()))
    _LIB.impl(name + "_nograd", fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"turboquant::{name}_nograd")(fake)


_nograd_twin("linear", turboquant_linear, _linear_fake)
_LINEAR = torch.ops.turboquant.linear.default
_LINEAR_NOGRAD = torch.ops.turboquant.linear_nograd.default


def linear_op(x: torch.Tensor):
    """The op for `x` times a packed weight: `turboquant::linear` where autograd may need the input's gradient
    (grad mode on and `x` requiring one), else `turboquant::linear_nograd`."""
    return _LINEAR if x.requires_grad and torch.is_grad_enabled() else _LINEAR_NOGRAD


@_op("moe_experts")
def turboquant_moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_packed: torch.Tensor,
    gate_up_norms: torch.Tensor,
    gate_up_codebook: torch.Tensor,
    down_packed: torch.Tensor,
    down_norms: torch.Tensor,
    down_codebook: torch.Tensor,
    signs1: torch.Tensor,
    signs2: torch.Tensor,
    group_size: int,
    num_experts: int,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """Routed experts: for each token, sum over its top-k experts of weight * (down(gated(gate_up(x) + b_gu)) + b_d).

    `gate_up` holds `num_experts * 2I` rows over the hidden size (each expert's gate rows, then its up rows; with
    `interleaved` alternating gate, up, gate, ...); `down` holds `num_experts * H` rows over I. `gate_up_bias`
    `(E, 2I)` (in the rows' order) and `down_bias` `(E, H)` are optional; `gated` is `activations.gated` with
    `activation` (`alpha`, `limit`: the clamped SwiGLU's). Only the experts some token was routed to are read.
    """
    check_activation(activation, limit)
    t, h = hidden.shape
    gu_rows = gate_up_norms.shape[0] // num_experts
    ng_h = gate_up_norms.shape[1]
    ng_i = down_norms.shape[1]
    s1, s2 = signs1.float(), signs2.float()
    x_rot = rotate_activations(hidden, s1, s2, group_size)  # once per token, shared by all its experts
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    for e, tok, slot in routed_groups(top_k_index, num_experts):
        gu = codebook_matmul(
            x_rot[tok],
            gate_up_packed[e * gu_rows * ng_h : (e + 1) * gu_rows * ng_h],
            gate_up_norms[e * gu_rows : (e + 1) * gu_rows],
            gate_up_codebook.float(),
            group_size,
        )
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].float()
        mid = gated(gu, activation, interleaved, alpha, limit)
        y = codebook_matmul(
            rotate_activations(mid, s1, s2, group_size),
            down_packed[e * h * ng_i : (e + 1) * h * ng_i],
            down_norms[e * h : (e + 1) * h],
            down_codebook.float(),
            group_size,
        )
        if down_bias is not None:
            y = y + down_bias[e].float()
        out.index_add_(0, tok, y * top_k_weights[tok, slot, None].float())
    return out.to(hidden.dtype)


@torch.library.register_fake("turboquant::moe_experts")
def _moe_fake(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook, down_packed, down_norms,
      down_codebook, signs1, signs2, group_size, num_experts, activation, gate_up_bias=None, down_bias=None,
      interleaved=False, alpha=1.0, limit=0.0):
    return torch.empty_like(hidden)


_TENSOR = object()  # (stands for a saved tensor input in `_moe_setup_context`)


def _moe_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*(t for t in inputs if isinstance(t, torch.Tensor)))
    ctx.inputs = [_TENSOR if isinstance(t, torch.Tensor) else t for t in inputs]  # settings and absent biases


def _moe_backward(ctx, grad):
    """Gradients for the hidden states and the routing weights (the packed experts and their biases are frozen): the
    reference forward again, with autograd, on the saved inputs."""
    saved = iter(ctx.saved_tensors)
    inputs = [next(saved) if v is _TENSOR else v for v in ctx.inputs]
    none = (None,) * len(inputs)
    with torch.enable_grad():
        h = inputs[0].detach().requires_grad_(ctx.needs_input_grad[0])
        w = inputs[2].detach().requires_grad_(ctx.needs_input_grad[2])
        wanted = [t for t in (h, w) if t.requires_grad]
        if not wanted:
            return none
        out = turboquant_moe_experts(h, inputs[1], w, *inputs[3:])
        grads = iter(torch.autograd.grad(out, wanted, grad))
    gh = next(grads) if h.requires_grad else None
    gw = next(grads) if w.requires_grad else None
    return (gh, None, gw) + none[3:]


torch.library.register_autograd("turboquant::moe_experts", _moe_backward, setup_context=_moe_setup_context)
_nograd_twin("moe_experts", turboquant_moe_experts, _moe_fake)
_MOE = torch.ops.turboquant.moe_experts.default
_MOE_NOGRAD = torch.ops.turboquant.moe_experts_nograd.default


def moe_op(hidden: torch.Tensor, top_k_weights: torch.Tensor):
    """`turboquant::moe_experts` where autograd may need a gradient (grad mode on and the hidden states or the
    routing weights requiring one), else `turboquant::moe_experts_nograd`."""
    if torch.is_grad_enabled() and (hidden.requires_grad or top_k_weights.requires_grad):
        return _MOE
    return _MOE_NOGRAD


# -- whole-row Hadamard rotation (turboquant-mlx checkpoints) --------------------------------------------------------
# Same codebook product; only the rotation of the activations differs: one per module over the whole input row
# (blocks of m * 2^k), with the module's stored +-1 signs, and a per-module codebook tensor.


@_op("hadamard_linear")
def turboquant_hadamard_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    norms: torch.Tensor,
    codebook: torch.Tensor,
    signs: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """`x[..., in_features] @ W.T` for `W = (codebook[idx] * norm) @ T.T / sqrt(b) * signs` (see `format.hadamard`)."""
    lead = x.shape[:-1]
    x_rot = hadamard.rotate_rows(x.reshape(-1, in_features).to(torch.float32), signs.float())
    y = codebook_matmul(x_rot, packed, norms.float(), codebook.float(), group_size)
    return y.to(x.dtype).reshape(*lead, norms.shape[0])


@torch.library.register_fake("turboquant::hadamard_linear")
def _(x, packed, norms, codebook, signs, group_size, in_features):
    return x.new_empty(*x.shape[:-1], norms.shape[0])


@_op("hadamard_moe_experts")
def turboquant_hadamard_moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_packed: torch.Tensor,
    gate_norms: torch.Tensor,
    gate_codebook: torch.Tensor,
    gate_signs: torch.Tensor,
    up_packed: torch.Tensor,
    up_norms: torch.Tensor,
    up_codebook: torch.Tensor,
    up_signs: torch.Tensor,
    down_packed: torch.Tensor,
    down_norms: torch.Tensor,
    down_codebook: torch.Tensor,
    down_signs: torch.Tensor,
    num_experts: int,
    activation: str,
) -> torch.Tensor:
    """Routed experts whose gate, up and down projections each carry their own rotation signs and codebook.

    `gate`/`up` hold `num_experts * I` rows over the hidden size, `down` `num_experts * H` rows over I (rows
    expert-major); group sizes follow from the norms' shapes. Only routed experts are read.
    """
    t, h = hidden.shape
    inter = gate_norms.shape[0] // num_experts
    g_h = h // gate_norms.shape[1]
    g_i = inter // down_norms.shape[1]
    ng_h, ng_i = gate_norms.shape[1], down_norms.shape[1]
    act = ACTIVATIONS[activation]
    x = hidden.to(torch.float32)
    x_gate = hadamard.rotate_rows(x, gate_signs.float())  # once per token, shared by all its experts
    x_up = x_gate if torch.equal(gate_signs, up_signs) else hadamard.rotate_rows(x, up_signs.float())
    d_signs = down_signs.float()
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    for e, tok, slot in routed_groups(top_k_index, num_experts):
        rows_i = slice(e * inter, (e + 1) * inter)
        gate = codebook_matmul(x_gate[tok], gate_packed[e * inter * ng_h : (e + 1) * inter * ng_h],
                               gate_norms[rows_i].float(), gate_codebook.float(), g_h)
        up = codebook_matmul(x_up[tok], up_packed[e * inter * ng_h : (e + 1) * inter * ng_h],
                             up_norms[rows_i].float(), up_codebook.float(), g_h)
        mid = hadamard.rotate_rows(act(gate) * up, d_signs)
        y = codebook_matmul(mid, down_packed[e * h * ng_i : (e + 1) * h * ng_i],
                            down_norms[e * h : (e + 1) * h].float(), down_codebook.float(), g_i)
        out.index_add_(0, tok, y * top_k_weights[tok, slot, None].float())
    return out.to(hidden.dtype)


@torch.library.register_fake("turboquant::hadamard_moe_experts")
def _(hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook, gate_signs, up_packed, up_norms,
      up_codebook, up_signs, down_packed, down_norms, down_codebook, down_signs, num_experts, activation):
    return torch.empty_like(hidden)
