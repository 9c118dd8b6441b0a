"""The forms transformers gives fused MoE experts, read off an experts module.

transformers stores routed experts as 3-D parameters in several layouts, which its `@use_experts_implementation`
decorator describes with flags on the module (`is_transposed`, `is_concatenated`, `has_bias`, `has_gate`,
`has_post_expert_norm`):

- `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`, gate rows then up rows (Qwen3-MoE, Qwen3.5-MoE, Mixtral, ...);
- transposed, `[E, in, out]`: `gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]`, applied as `x @ W`
  (Llama 4; gpt-oss);
- interleaved gate/up columns (gate 0, up 0, gate 1, ...) and biases `gate_up_proj_bias` `[E, 2I]`,
  `down_proj_bias` `[E, H]`, with the clamped SwiGLU of `activations.CLAMPED_SWIGLU` (gpt-oss);
- Llama 4's experts are not decorated: their forward takes every expert's block of tokens at once
  (`EXPERT_BLOCKS`).

Whatever the layout, TurboQuant packs each matrix in the published row layout, one row per output channel with the
groups along the input dimension (`published`), so the quantized experts run the same op in every layout; the layout
is kept to apply the biases, the gate/up order and the activation, and to give back the very module transformers
built (`model.dequantize()`).

`read_experts` reads a module's form, or raises `UnsupportedExperts` with the reason; it checks the module's own gate
activation (`_apply_gate` or `act_fn`) by evaluating it on a probe, so a model whose gate computes something else is
refused rather than computed wrongly.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .activations import ACTIVATIONS, CLAMPED_SWIGLU, gated

ROUTED = "routed"  # forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)
EXPERT_BLOCKS = "expert_blocks"  # forward(hidden_states (E*T, H)) -> (E*T, H): Llama 4 (see ExpertsLayout)


@dataclass(frozen=True)
class ExpertsLayout:
    """How a transformers experts module stores and applies its experts (everything but the weights' values).

    - `transposed`: stored `[E, in, out]` (`gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]`), else `[E, out, in]`;
    - `interleaved`: the gate/up outputs alternate (gate 0, up 0, gate 1, ...), else gate outputs, then up outputs;
    - `bias`: `gate_up_proj_bias` `[E, 2I]` (in the gate/up outputs' order) and `down_proj_bias` `[E, H]`;
    - `inputs`: `ROUTED`, or `EXPERT_BLOCKS`: the forward takes `(E*T, H)` rows, expert e's block of T rows being
      the tokens as that expert receives them (already scaled by their routing score; all zero where the router did
      not pick it), and returns each row's expert output, unweighted, in the same order;
    - `top_k`: with `EXPERT_BLOCKS`, the most experts a token is routed to (the config's `num_experts_per_tok`; 0:
      any number): each token's first `top_k` nonzero rows are computed;
    - `alpha`, `limit`: the parameters of `activations.CLAMPED_SWIGLU`.
    """

    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    inputs: str = ROUTED
    top_k: int = 0
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self):
        if self.inputs not in (ROUTED, EXPERT_BLOCKS):
            raise ValueError(f"inputs must be {ROUTED!r} or {EXPERT_BLOCKS!r}, got {self.inputs!r}")
        if self.inputs == EXPERT_BLOCKS and self.bias:
            raise ValueError("experts that take expert blocks (Llama 4) have no biases: an expert's output for an "
                             "unrouted (zero) row must be zero")

    def describe(self) -> str:
        parts = ["[E, in, out]" if self.transposed else "[E, out, in]",
                 "interleaved gate/up" if self.interleaved else "gate then up"]
        if self.bias:
            parts.append("biased")
        if self.inputs == EXPERT_BLOCKS:
            parts.append("expert-block inputs")
        return ", ".join(parts)


DEFAULT_LAYOUT = ExpertsLayout()


class ExpertsForm(NamedTuple):
    """What `read_experts` finds: the geometry, the layout and the activation (a name of
    `activations.EXPERT_ACTIVATIONS`)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    layout: ExpertsLayout
    activation: str


class UnsupportedExperts(ValueError):
    """An experts module in a form TurboQuant does not compute; the message says why."""


def published(weight: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """A stored expert matrix (`[E, out, in]`, or `[E, in, out]` when transposed) as `[E, out, in]` (a view): the
    rows TurboQuant packs, one per output channel."""
    return weight.transpose(-1, -2) if layout.transposed else weight


def stored(weight: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """A published `[E, out, in]` expert matrix in the module's storage (a view): the inverse of `published`."""
    return weight.transpose(-1, -2) if layout.transposed else weight


def stored_shape(shape: tuple, layout: ExpertsLayout) -> tuple:
    """The shape a module stores for an expert tensor of published shape `[E, out, in]` (and the reverse)."""
    shape = tuple(shape)
    return shape[:-2] + (shape[-1], shape[-2]) if layout.transposed else shape


def fused_experts_geometry(module) -> tuple[int, int, int] | None:
    """(E, H, I) of a fused-experts module in the default layout (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
    no biases, not transposed), else None."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
        return None
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2) or getattr(module, "is_transposed", False):
        return None
    if any(isinstance(getattr(module, n, None), torch.Tensor) for n in ("gate_up_proj_bias", "down_proj_bias")):
        return None
    return e, h, two_i // 2


def read_experts(module, activation: str, top_k: int = 0) -> ExpertsForm:
    """The form of a transformers experts module (`activation`: the model's `hidden_act`, tried first where the module
    applies an activation function of its own; `top_k`: its `num_experts_per_tok`). Raises `UnsupportedExperts` with
    the reason for a form TurboQuant does not compute."""
    if getattr(module, "has_gate", True) is False or (
            not isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(module, "up_proj", None), torch.Tensor)):
        raise UnsupportedExperts("its experts have no gate projection (up_proj and down_proj only)")
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedExperts("it normalizes each expert's output (has_post_expert_norm)")
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == dn.dim() == 3):
        raise UnsupportedExperts("it holds no 3-D gate_up_proj and down_proj parameters")
    decorated = hasattr(module, "is_transposed")  # (set by transformers' @use_experts_implementation)
    e, h, i, transposed = _geometry(tuple(gu.shape), tuple(dn.shape), getattr(module, "is_transposed", None))
    bias = _has_bias(module, e, h, i)
    if decorated:
        inputs = ROUTED
    else:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
        n_args = len(params)
        if n_args not in (1, 3) or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            names = ", ".join({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name for p in params)
            raise UnsupportedExperts(f"its forward takes ({names}): neither routed tokens "
                                     "(hidden states, top-k indices, top-k weights) nor expert blocks (hidden states)")
        inputs = ROUTED if n_args == 3 else EXPERT_BLOCKS
        if inputs == EXPERT_BLOCKS and bias:
            raise UnsupportedExperts("it takes expert blocks and has biases")
    interleaved = getattr(module, "is_concatenated", True) is False
    act, alpha, limit = _gate_activation(module, activation, interleaved)
    layout = ExpertsLayout(transposed, interleaved, bias, inputs, top_k if inputs == EXPERT_BLOCKS else 0,
                           alpha, limit)
    return ExpertsForm(e, h, i, layout, act)


def _geometry(gu: tuple, dn: tuple, transposed: bool | None) -> tuple[int, int, int, bool]:
    """(E, H, I, transposed) from the stored shapes; `transposed` None: whichever orientation the shapes fit (never
    both: `[E, 2I, H]` with `[E, H, I]` and `[E, H', 2I']` with `[E, I', H']` would need I = 0)."""
    e = gu[0]
    fits = {False: gu[1] % 2 == 0 and dn == (e, gu[2], gu[1] // 2),
            True: gu[2] % 2 == 0 and dn == (e, gu[2] // 2, gu[1])}
    for t in ((False, True) if transposed is None else (bool(transposed),)):
        if fits[t]:
            return (e, gu[2], gu[1] // 2, t) if not t else (e, gu[1], gu[2] // 2, t)
    expected = ("[E, H, 2I] and [E, I, H] (is_transposed)" if transposed else
                "[E, 2I, H] and [E, H, I]" if transposed is not None else "[E, 2I, H] and [E, H, I] or transposed")
    raise UnsupportedExperts(f"gate_up_proj {list(gu)} and down_proj {list(dn)} are not {expected}")


def _has_bias(module, e: int, h: int, i: int) -> bool:
    """Whether the module holds expert biases of the expected shapes (`has_bias`, where the decorator set it, must
    agree with the tensors present)."""
    biases = {n: getattr(module, n, None) for n in ("gate_up_proj_bias", "down_proj_bias")}
    present = [n for n, b in biases.items() if isinstance(b, torch.Tensor)]
    flag = getattr(module, "has_bias", None)
    if len(present) == 1 or (flag is not None and bool(flag) != bool(present)):
        raise UnsupportedExperts(f"its biases ({', '.join(present) or 'none'}) do not match has_bias={flag}")
    if not present:
        return False
    shapes = (tuple(biases["gate_up_proj_bias"].shape), tuple(biases["down_proj_bias"].shape))
    if shapes != ((e, 2 * i), (e, h)):
        raise UnsupportedExperts(f"its biases have shapes {[list(s) for s in shapes]}, not [E, 2I] and [E, H] = "
                                 f"{[[e, 2 * i], [e, h]]}")
    return True


def _probe(columns: int, scale: float) -> torch.Tensor:
    """Fixed probe values for a gate activation: `(6, columns)`, float32 on the CPU (also while a model is built on the
    meta device, under another default dtype), spread well past `scale` on both sides."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, columns, generator=gen, device="cpu", dtype=torch.float32) * scale


def _same(got, want: torch.Tensor) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape and got.device == want.device
            and torch.allclose(got.float(), want, rtol=1e-5, atol=1e-6))


def _gate_activation(module, activation: str, interleaved: bool) -> tuple[str, float, float]:
    """(activation name, alpha, limit) of what the module computes from its gate/up product, checked on a probe: its
    `_apply_gate(gate_up)` where it has one (transformers' decorated experts), else its `act_fn` (applied to the
    gate, gate outputs first), else the model's `activation`."""
    names = sorted(ACTIVATIONS, key=lambda n: n != activation)  # (the model's own first)
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    clamped = isinstance(alpha, (int, float)) and isinstance(limit, (int, float)) and limit > 0
    apply_gate = getattr(module, "_apply_gate", None)
    if callable(apply_gate):
        x = _probe(16, 3 * max(float(limit), 1.0) if clamped else 3.0)
        try:
            with torch.no_grad():
                got = apply_gate(x)
        except Exception as e:  # noqa: BLE001  (a gate that cannot run on a CPU probe is not one we know)
            raise UnsupportedExperts(f"its _apply_gate could not be evaluated on a probe ({e})") from e
        candidates = [(n, 1.0, 0.0) for n in names]
        if clamped:
            candidates.insert(0, (CLAMPED_SWIGLU, float(alpha), float(limit)))
        for name, a, lim in candidates:
            if _same(got, gated(x, name, interleaved, a, lim)):
                return name, a, lim
        order = "interleaved" if interleaved else "gate then up"
        raise UnsupportedExperts(f"its _apply_gate computes none of act(gate) * up ({', '.join(names)}) or the clamped "
                                 f"SwiGLU, with its gate/up outputs {order}")
    act_fn = getattr(module, "act_fn", None)
    if callable(act_fn):
        x = _probe(16, 3.0)
        with torch.no_grad():
            got = act_fn(x)
        for name in names:
            if _same(got, ACTIVATIONS[name](x)):
                return name, 1.0, 0.0
        raise UnsupportedExperts(f"its act_fn ({type(act_fn).__name__}) is none of {', '.join(names)}")
    if activation not in ACTIVATIONS:
        raise UnsupportedExperts(f"activation {activation!r} is none of {', '.join(ACTIVATIONS)}")
    return activation, 1.0, 0.0
