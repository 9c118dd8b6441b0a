"""Quantized modules and the on-the-fly quantize operation.

`TurboQuantLinear` replaces `nn.Linear`. Its packed weight lives in a child
module named `weight`, so the state-dict names are exactly the tq3_native
checkpoint names (`<linear>.weight.tq_packed`, `<linear>.weight.tq_norms`) and
no renaming is needed in either direction.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels  # noqa: F401,I001  (after ops: registers the Triton kernels as their CUDA implementations)
from ..format import codec, hadamard
from ..format import constants as fmt
from ..format import runtime_layout as layout
from . import ops  # noqa: F401  (registers torch.ops.turboquant)
from .activations import CLAMPED_SWIGLU, check_activation
from .experts_layout import (  # noqa: F401
    DEFAULT_LAYOUT,
    EXPERT_BLOCKS,
    ExpertsLayout,
    fused_experts_geometry,
    stored_shape,
)

_CONSTANTS: dict = {}


def format_constants(n_levels: int, group_size: int, device,
                     runtime: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codebook, signs1, signs2) on `device`, shared by every module (never buffers: nothing to load or save).

    `runtime`: the codebook that packed indices in the runtime layout are read with (`layout.runtime_codebook`:
    for ternary weights the 4-entry `layout.pairs_codebook`, for 4-bit the sign-magnitude order; the format
    codebook itself otherwise)."""
    runtime = runtime and n_levels in (3, 16)
    key = (n_levels, group_size, device, runtime)
    hit = _CONSTANTS.get(key)
    if hit is None:
        device = torch.device(device)
        s1, s2 = fmt.signs(group_size, device)
        cb = fmt.codebook(n_levels, group_size, device)
        hit = _CONSTANTS[key] = (layout.runtime_codebook(cb) if runtime else cb, s1, s2)
    return hit


def group_linear(x: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, bias: torch.Tensor | None,
                 n_levels: int, group_size: int, in_features: int, runtime: bool) -> torch.Tensor:
    """`x` times a group-rotated packed weight (`torch.ops.turboquant.linear` with the format's constants), plus
    `bias`: the product of a `TurboQuantLinear` and of fused sibling projections (`integration.fusion`)."""
    codebook, s1, s2 = format_constants(n_levels, group_size, packed.device, runtime)
    y = ops.linear_op(x)(x, packed, norms, codebook, s1, s2, group_size, in_features)
    return y if bias is None else y + bias.to(y.dtype)


ROTATIONS = ("groups", "hadamard")


class TurboQuantWeight(nn.Module):
    """Packed indices `tq_packed` (uint8, `(rows*n_groups, bytes_per_group)`) and norms `tq_norms` (float32, `(rows, n_groups)`).

    `source_shape` is the shape of the full-precision tensor it replaces (`(out, in)` for a Linear,
    `(E, out, in)` for fused experts); `rows = prod(source_shape[:-1])`.

    `rotation` says how the activations are rotated before the codebook product:
    - `"groups"` (tq3_native): per group, the seed-42 Walsh-Hadamard transform; the codebook is a format constant.
    - `"hadamard"` (turboquant-mlx checkpoints): over the whole input row (see `format.hadamard`), with this module's
      signs `tq_signs` `(in,)`; its codebook `tq_codebook` `(n_levels,)` is stored too, and `tq_norms` holds
      the per-group scales. The input width must then be a multiple of G.
    """

    def __init__(self, source_shape: tuple, bits, group_size: int, device=None, norms_dtype=None,
                 rotation: str = "groups"):
        super().__init__()
        if rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
        self.rotation = rotation
        self.source_shape = tuple(source_shape)
        rows = 1
        for d in self.source_shape[:-1]:
            rows *= d
        in_features = self.source_shape[-1]
        self.rows = rows
        self.in_features = in_features
        if rotation == "hadamard":
            if group_size not in fmt.HADAMARD_GROUP_SIZES or in_features % group_size:
                raise ValueError(f"group_size {group_size!r} does not divide the input width {in_features} into one of "
                                 f"the supported group sizes {fmt.HADAMARD_GROUP_SIZES}")
            self.group_size = int(group_size)
        else:
            self.group_size = fmt.check_group_size(group_size)
        self.n_levels = fmt.levels_for_bits(bits)
        self.n_groups = -(-in_features // group_size)
        bpg = fmt.bytes_per_group(self.n_levels, group_size)
        self.register_buffer("tq_packed", torch.empty(rows * self.n_groups, bpg, dtype=torch.uint8, device=device))
        self.norms_dtype = norms_dtype or fmt.default_norms_dtype(self.n_levels)
        self.register_buffer("tq_norms", torch.empty(rows, self.n_groups, dtype=self.norms_dtype, device=device))
        if rotation == "hadamard":
            self.register_buffer("tq_codebook", torch.empty(self.n_levels, dtype=torch.float16, device=device))
            self.register_buffer("tq_signs", torch.empty(in_features, dtype=torch.float16, device=device))
        # While a full-precision checkpoint loads, the state dict advertises the source tensor (its parent's
        # name for it, e.g. `q_proj.weight`) in this dtype, so the loader hands it to the quantize op.
        self.awaiting_dtype: torch.dtype | None = None
        # The source is stored `(in, out)` (GPT-2's `Conv1D`) or `(E, in, out)` (transposed experts): its last two
        # dimensions are swapped before it is quantized.
        self.source_transposed = False

    # `tensor_parallel.ShardSpec` when this holds one tensor-parallel rank's slice of the weight
    tp_shard = None

    @property
    def checkpoint_shape(self) -> tuple:
        """The shape of the full-precision tensor in a checkpoint (the whole weight's, for a tensor-parallel slice)."""
        shape = tuple(self.tp_shard.full_shape if self.tp_shard is not None else self.source_shape)
        return shape[:-2] + (shape[-1], shape[-2]) if self.source_transposed else shape

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if layout.is_runtime(self.tq_packed):  # checkpoints always get the published bytes (a new tensor)
            destination[prefix + "tq_packed"] = self.published_packed()
        for name in ("tq_packed", "tq_norms"):  # rows of a fused weight (`fusion`): their own copy
            if prefix + name in destination:
                destination[prefix + name] = own_storage(destination[prefix + name])
        if self.awaiting_dtype is not None:
            # under tensor parallelism a DTensor placeholder, so that the loader reads only this rank's slice
            make = self.__dict__.get("tp_source_placeholder")
            destination[prefix[:-1]] = (make(self.awaiting_dtype) if make is not None else
                                        torch.empty(self.checkpoint_shape, dtype=self.awaiting_dtype, device="meta"))
        elif self.tp_shard is not None and self.tq_packed.is_meta:
            # one rank's slice of a pre-quantized checkpoint: `tensor_parallel.load_shards` reads it, not the loader
            destination.pop(prefix + "tq_packed", None)
            destination.pop(prefix + "tq_norms", None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        runtime = layout.is_runtime(self.tq_packed)
        if runtime:  # state dicts hold the published bytes: take them in that layout, then rearrange again
            self.tq_packed = torch.empty(self.expected_shapes()["tq_packed"], dtype=torch.uint8,
                                         device=self.tq_packed.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if runtime:
            self.use_runtime_layout_()

    def load_packed_(self, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor | None = None,
                     signs: torch.Tensor | None = None) -> None:
        self.tq_packed = packed
        self.tq_norms = to_norms_dtype(norms, self.norms_dtype)
        if self.rotation == "hadamard":
            # stored exactly as given (their dtype included): they are part of the checkpoint's weights
            self.tq_codebook = codebook
            self.tq_signs = signs
        self.awaiting_dtype = None
        self.use_runtime_layout_()

    # -- layout of the packed indices (see `format.runtime_layout`) ---------------------------------------------
    @property
    def runtime_layout(self) -> bool:
        """Whether `tq_packed` holds the GPU kernels' runtime layout (int32) rather than the published bytes."""
        return layout.is_runtime(self.tq_packed)

    def packed_shape(self) -> tuple[int, ...]:
        """The shape of `tq_packed` in the published layout (uint8 bytes), whichever layout it is in."""
        t = self.tq_packed
        if not self.runtime_layout:
            return tuple(t.shape)
        return (t.shape[0], fmt.bytes_per_group(self.n_levels, self.group_size))

    def kernel_codebook(self) -> torch.Tensor:
        """The codebook the ops receive with `tq_packed`: the stored one (`rotation="hadamard"`) or the format's,
        and for a ternary or 4-bit weight in the runtime layout that codebook as `layout.runtime_codebook` orders
        it (stored codebooks: ternary only, see `use_runtime_layout_`)."""
        if self.rotation == "hadamard":
            return self._pairs_codebook if self.runtime_layout and self.n_levels == 3 else self.tq_codebook
        return format_constants(self.n_levels, self.group_size, self.tq_packed.device, self.runtime_layout)[0]

    def published_packed(self) -> torch.Tensor:
        """`tq_packed` in the published layout (the tensor itself when it already is)."""
        return layout.published(self.tq_packed, self.n_levels, self.group_size, self.n_groups)

    def wants_runtime_layout(self) -> bool:
        """Whether this weight takes the runtime layout on a CUDA device: `layout.wanted`, except 4-bit weights
        with a stored codebook (`rotation="hadamard"`), since the 4-bit runtime codes need the format's
        symmetric codebook."""
        return layout.wanted(self.n_levels, self.group_size) and not (
            self.n_levels == 16 and self.rotation == "hadamard")

    def use_runtime_layout_(self) -> bool:
        """Rearrange `tq_packed` into the runtime layout when it lives on a CUDA device and the weight has one
        (ternary, 2-, 3- and 4-bit; see `layout.wanted`); returns whether it is in that layout now. Lossless:
        `published_packed()` inverts it. See `wants_runtime_layout`."""
        t = self.tq_packed
        if (t.dtype == torch.uint8 and t.device.type == "cuda" and self.wants_runtime_layout()
                and tuple(t.shape) == self.expected_shapes()["tq_packed"]):
            self.tq_packed = layout.to_runtime(t, self.n_levels, self.group_size, self.n_groups)
        if self.runtime_layout and self.n_levels == 3 and self.rotation == "hadamard":
            self._pairs_codebook = layout.pairs_codebook(self.tq_codebook)
        return self.runtime_layout

    def use_published_layout_(self) -> None:
        """Put `tq_packed` back into the published byte layout (in place)."""
        if self.runtime_layout:
            self.tq_packed = self.published_packed()
        self.__dict__.pop("_pairs_codebook", None)

    @property
    def bits(self):
        return fmt.bits_for_levels(self.n_levels)

    @property
    def device(self) -> torch.device:
        return self.tq_packed.device

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {
            "tq_packed": (self.rows * self.n_groups, fmt.bytes_per_group(self.n_levels, self.group_size)),
            "tq_norms": (self.rows, self.n_groups),
        }
        if self.rotation == "hadamard":
            shapes.update(tq_codebook=(self.n_levels,), tq_signs=(self.in_features,))
        return shapes

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) / .half() must move the norms (and a stored codebook and signs), never round them.
        kept = {n: getattr(self, n) for n in ("tq_norms", "tq_codebook", "tq_signs") if hasattr(self, n)}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if after.dtype != before.dtype:
                setattr(self, name, before.to(device=after.device))
        # the runtime layout belongs to CUDA devices: elsewhere the published bytes
        if self.tq_packed.device.type == "cuda":
            self.use_runtime_layout_()
        elif self.tq_packed.device.type != "meta":
            self.use_published_layout_()
        return self

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The effective weight `(rows, in_features)` (the product the forward computes, as one matrix)."""
        if self.rotation == "hadamard":
            w = codec.rotated_weight(self.published_packed(), self.tq_norms.float(), self.tq_codebook.float(),
                                     self.group_size)
            return hadamard.unrotate_rows(w, self.tq_signs.float()).to(dtype)
        return codec.dequantize_weight(self.published_packed(), self.tq_norms, self.in_features, self.group_size, dtype=dtype)

    def extra_repr(self) -> str:
        return (f"rows={self.rows}, in_features={self.in_features}, bits={self.bits}, group_size={self.group_size}"
                + (", rotation=hadamard" if self.rotation == "hadamard" else ""))


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it where it is part of a larger storage (a view into a fused weight), so that state
    dicts never hand safetensors tensors that share memory."""
    if t.device.type != "meta" and t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def to_norms_dtype(norms: torch.Tensor, dtype: torch.dtype, name: str = "norms") -> torch.Tensor:
    """Cast float32 norms for storage; a norm that float16 cannot hold is an error, never an Inf."""
    out = norms.to(dtype)
    if dtype != norms.dtype and not torch.isfinite(out).all():
        raise ValueError(f"{name}: group norms exceed the {dtype} range; store this tensor with float32 norms")
    return out


class TurboQuantLinear(nn.Module):
    """A Linear layer whose weight is stored TurboQuant-packed; forward runs `torch.ops.turboquant.linear`."""

    _tq_group = None  # (`turboquant_hf.integration.fusion` sets the group and this layer's index in it per instance)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits=3,
        group_size: int = 128,
        dtype: torch.dtype = torch.float32,
        device=None,
        norms_dtype=None,
        rotation: str = "groups",
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = TurboQuantWeight((out_features, in_features), bits, group_size, device=device,
                                       norms_dtype=norms_dtype, rotation=rotation)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @property
    def bits(self):
        return self.weight.bits

    @property
    def group_size(self) -> int:
        return self.weight.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._tq_group  # fused with its siblings (`turboquant_hf.integration.fusion`)
        if group is not None:
            if torch.compiler.is_compiling() or group.intact():
                y = group.output(self._tq_index, x)
                if y is not None:
                    return y
            else:
                group.dissolve()  # a member's tensors were replaced (moved, reloaded): each computes its own again
        w = self.weight
        if w.rotation == "hadamard":
            y = torch.ops.turboquant.hadamard_linear(
                x, w.tq_packed, w.tq_norms, w.kernel_codebook(), w.tq_signs, w.group_size, self.in_features
            )
            return y if self.bias is None else y + self.bias.to(y.dtype)
        packed = w.tq_packed
        return group_linear(x, packed, w.tq_norms, self.bias, w.n_levels, w.group_size, self.in_features,
                            layout.is_runtime(packed))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if prefix + "bias" in destination and not keep_vars:
            destination[prefix + "bias"] = own_storage(destination[prefix + "bias"])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"bits={self.bits}, group_size={self.group_size}"
        )

    def __str__(self) -> str:
        """The representation, and how to put LoRA adapters on this layer. PEFT's refusal of a target type it
        does not know (what `peft.get_peft_model` raises, unless the LoRA config has this type registered) shows
        the layer as `str(layer)`; PEFT has no registry or hook a package could fill for every config, and
        `print(model)` shows each layer's `repr`, which stays as it is."""
        return (f"{self!r} [LoRA on TurboQuant layers: `import turboquant_hf.lora` and pass "
                "`turboquant_hf.lora.register(lora_config)` in place of the LoraConfig]")


class TurboQuantExperts(nn.Module):
    """Routed MoE experts with TurboQuant-packed fused weights.

    Replaces a transformers experts module; its children `gate_up_proj` and `down_proj` give the published names
    (`...experts.gate_up_proj.tq_packed`). Whatever the module's `layout` (`experts_layout.ExpertsLayout`), each
    packed matrix holds one row per output channel over the input dimension: `gate_up_proj` `[E, 2I, H]` (each
    expert's gate rows before its up rows, or with `layout.interleaved` alternating as transformers stores them),
    `down_proj` `[E, H, I]`; a transposed (`[E, in, out]`) source is transposed before it is quantized. With
    `layout.bias` it holds `gate_up_proj_bias` `[E, 2I]` and `down_proj_bias` `[E, H]` in full precision (the names
    transformers gives them). `forward(hidden_states, top_k_index, top_k_weights)` computes only the routed experts;
    with `layout.inputs == EXPERT_BLOCKS` (Llama 4), `forward(hidden_states)` over the `(E*T, H)` expert blocks.

    With `rotation="hadamard"` (turboquant-mlx checkpoints, whose gate and up projections each carry their own
    rotation signs and codebook) the children are `gate_proj` `[E, I, H]`, `up_proj` `[E, I, H]` and `down_proj`
    `[E, H, I]` instead; `gate_up_bits` may then be a pair (gate bits, up bits).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        gate_up_bits=3,
        down_bits=3,
        group_size: int = 128,
        activation: str = "silu",
        device=None,
        norms_dtypes: tuple = (None, None),
        rotation: str = "groups",
        layout: ExpertsLayout = DEFAULT_LAYOUT,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        check_activation(activation, layout.limit)
        if rotation == "hadamard" and layout != DEFAULT_LAYOUT:
            raise ValueError("experts with a whole-row Hadamard rotation (turboquant-mlx) have the default layout only")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.rotation = rotation
        self.layout = layout
        if rotation == "hadamard":
            gate_bits, up_bits = gate_up_bits if isinstance(gate_up_bits, (tuple, list)) else (gate_up_bits,) * 2
            dtypes = tuple(norms_dtypes) + (None,) * (3 - len(norms_dtypes))
            shapes = {"gate_proj": (num_experts, intermediate_size, hidden_size),
                      "up_proj": (num_experts, intermediate_size, hidden_size),
                      "down_proj": (num_experts, hidden_size, intermediate_size)}
            for (name, shape), bits, dtype in zip(shapes.items(), (gate_bits, up_bits, down_bits), dtypes):
                gs = group_size[name] if isinstance(group_size, dict) else group_size
                setattr(self, name, TurboQuantWeight(shape, bits, gs, device=device, norms_dtype=dtype,
                                                     rotation="hadamard"))
            return
        self.gate_up_proj = TurboQuantWeight((num_experts, 2 * intermediate_size, hidden_size), gate_up_bits,
                                             group_size, device=device, norms_dtype=norms_dtypes[0])
        self.down_proj = TurboQuantWeight((num_experts, hidden_size, intermediate_size), down_bits, group_size,
                                          device=device, norms_dtype=norms_dtypes[1])
        self.gate_up_proj.source_transposed = self.down_proj.source_transposed = layout.transposed
        if layout.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, dtype=dtype,
                                                              device=device), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device),
                                               requires_grad=False)

    @property
    def group_size(self) -> int:
        return (self.gate_proj if self.rotation == "hadamard" else self.gate_up_proj).group_size

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None):
        if self.rotation == "hadamard":
            g, u, d = self.gate_proj, self.up_proj, self.down_proj
            return torch.ops.turboquant.hadamard_moe_experts(
                hidden_states, top_k_index, top_k_weights,
                g.tq_packed, g.tq_norms, g.kernel_codebook(), g.tq_signs,
                u.tq_packed, u.tq_norms, u.kernel_codebook(), u.tq_signs,
                d.tq_packed, d.tq_norms, d.kernel_codebook(), d.tq_signs,
                self.num_experts, self.activation,
            )
        if self.layout.inputs == EXPERT_BLOCKS:
            return self._expert_blocks(hidden_states)
        if top_k_index is None or top_k_weights is None:
            raise TypeError("TurboQuantExperts.forward needs hidden_states, top_k_index and top_k_weights")
        return self._routed(hidden_states, top_k_index, top_k_weights)

    def _routed(self, hidden_states, top_k_index, top_k_weights):
        gu, dn, lay = self.gate_up_proj, self.down_proj, self.layout
        device = gu.tq_packed.device
        cb_gu, s1, s2 = format_constants(gu.n_levels, gu.group_size, device, gu.runtime_layout)
        biases = (self.gate_up_proj_bias, self.down_proj_bias) if lay.bias else (None, None)
        return ops.moe_op(hidden_states, top_k_weights)(
            hidden_states, top_k_index, top_k_weights,
            gu.tq_packed, gu.tq_norms, cb_gu, dn.tq_packed, dn.tq_norms, dn.kernel_codebook(),
            s1, s2, gu.group_size, self.num_experts, self.activation,
            *biases, lay.interleaved, lay.alpha, lay.limit,
        )

    def _expert_blocks(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama 4's convention (`EXPERT_BLOCKS`): `(E*T, H)` rows, expert e's block of T rows holding the tokens it
        receives (zero rows where the router did not pick it) -> each row's expert output. Each token's nonzero rows
        (at most `layout.top_k`: Llama 4's router gives a token `num_experts_per_tok` nonzero scores) are gathered
        into routed pairs, one row each, for the routed op; rows not computed are zero, as the expert's output for a
        zero row is (no biases). No host synchronisation."""
        e = self.num_experts
        rows, h = hidden_states.shape
        if rows % e:
            raise ValueError(f"expert-block inputs need a multiple of {e} rows (one block per expert), got {rows}")
        t = rows // e
        k = min(self.layout.top_k or e, e)
        live = hidden_states.view(e, t, h).ne(0).any(-1).t().to(torch.int8)  # (T, E): the experts each token reaches
        reached, experts = live.topk(k, dim=1, sorted=False)
        experts = torch.where(reached > 0, experts, e)  # (e: "no expert", computed as zeros)
        src = experts.clamp(max=e - 1) * t + torch.arange(t, device=experts.device)[:, None]  # each pair's row
        src = src.reshape(-1)
        ones = torch.ones(src.numel(), 1, dtype=torch.float32, device=hidden_states.device)
        y = self._routed(hidden_states[src], experts.reshape(-1, 1), ones)
        return torch.zeros_like(hidden_states).index_add_(0, src, y)

    def extra_repr(self) -> str:
        text = (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation}")
        if self.layout != DEFAULT_LAYOUT:
            text += f", layout={self.layout.describe()}"
        if self.activation == CLAMPED_SWIGLU:
            text += f", alpha={self.layout.alpha}, limit={self.layout.limit}"
        return text


def replace_experts_modules(model: nn.Module, plan: dict, awaiting_weights: bool) -> int:
    """Swap each experts module named in `plan` (`{name: planning.ExpertsPlan}`) for a TurboQuantExperts."""
    for name, p in plan.items():
        old = model.get_submodule(name)
        e, two_i, h = stored_shape(old.gate_up_proj.shape, p.layout)
        bias = getattr(old, "gate_up_proj_bias", None) if p.layout.bias else None
        new = TurboQuantExperts(e, h, two_i // 2, p.gate_up_bits, p.down_bits, p.group_size, p.activation,
                                device=old.gate_up_proj.device, norms_dtypes=p.norms_dtypes, rotation=p.rotation,
                                layout=p.layout, dtype=bias.dtype if bias is not None else torch.float32)
        if awaiting_weights:
            new.gate_up_proj.awaiting_dtype = old.gate_up_proj.dtype
            new.down_proj.awaiting_dtype = old.down_proj.dtype
        # the module it replaces (its weights on the meta device: no memory), for `restore_plain_modules`
        new.__dict__["replaced_module"] = old
        model.set_submodule(name, new)
    return len(plan)


def replace_linear_modules(model: nn.Module, plan: dict, awaiting_weights: bool) -> int:
    """Swap every `nn.Linear` (a plain subclass too, `linear_kind`; or GPT-2 `Conv1D`, whose weight is stored
    `(in, out)`) named in `plan` (`{name: planning.LinearPlan}`) for a TurboQuantLinear."""
    for name, p in plan.items():
        linear = model.get_submodule(name)
        transposed = is_conv1d(linear)
        in_features, out_features = linear.weight.shape if transposed else linear.weight.shape[::-1]
        new = TurboQuantLinear(
            in_features,
            out_features,
            bias=linear.bias is not None,
            bits=p.bits,
            group_size=p.group_size,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            norms_dtype=p.norms_dtype,
            rotation=p.rotation,
        )
        new.weight.source_transposed = transposed
        if awaiting_weights:
            new.weight.awaiting_dtype = linear.weight.dtype
        if type(linear) is not nn.Linear and not transposed:  # (a plain subclass: `dequantize` restores its class)
            new.__dict__["source_class"] = type(linear)
        model.set_submodule(name, new)
    return len(plan)


# nn.Linear subclasses of transformers whose forward overrides nn.Linear's with the same map, `x @ W.T + b`
# (FalconLinear writes it out by hand); they are quantized like nn.Linear and dequantized back to their class.
PLAIN_LINEAR_SUBCLASSES = ("FalconLinear",)


def linear_kind(module: nn.Module) -> str:
    """How the quantizer treats a module: "linear" (an `nn.Linear`, a subclass that keeps nn.Linear's forward and
    holds only its weight and bias, or one of PLAIN_LINEAR_SUBCLASSES), "conv1d" (GPT-2's `Conv1D`), "other" (an
    nn.Linear subclass with a forward or parameters of its own: a router, a grouped or decoupled projection, ...,
    kept in full precision) or "" (not a linear layer)."""
    if type(module) is nn.Linear:
        return "linear"
    if is_conv1d(module):
        return "conv1d"
    if not isinstance(module, nn.Linear):
        return ""
    cls = type(module)
    own = {n for n, _ in module.named_parameters(recurse=True)} | {n for n, _ in module.named_buffers(recurse=True)}
    if own - {"weight", "bias"}:
        return "other"
    if cls.__name__ in PLAIN_LINEAR_SUBCLASSES or cls.forward is nn.Linear.forward:
        return "linear"
    return "other"


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2 family): a Linear whose weight is stored transposed, `(in, out)`."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def quantize_linear_(module: TurboQuantLinear, weight: torch.Tensor, name: str = "weight") -> None:
    """Fill `module` from a full-precision weight (used outside from_pretrained, e.g. by tests and tools)."""
    module.weight.load_packed_(*codec.quantize_weight(weight, module.bits, module.group_size, name=name))
