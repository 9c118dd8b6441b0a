"""Named quantization recipes: each is one TurboQuantConfig.

| name        | what it does |
|-------------|--------------|
| `tq2`/`tq3`/`tq4` | every quantized layer at 2 / 3 / 4 bits |
| `tq3a-tqTe` | 3-bit attention, GatedDeltaNet and shared experts; ternary (1.58-bit) routed experts |
| `tq3-down4` | 3 bits everywhere except the routed experts' `down_proj`, at 4 bits |
| `tq3-sensitive4` | 3 bits, `o_proj` and `down_proj` at 4 (the published `sensitive_bits` recipe) |
"""

from __future__ import annotations

from .config import TurboQuantConfig

_RECIPES = {
    "tq2": dict(bits=2),
    "tq3": dict(bits=3),
    "tq4": dict(bits=4),
    "tq3a-tqTe": dict(bits=3, expert_bits=1.58),
    "tq3-down4": dict(bits=3, module_bits={r"experts\.down_proj": 4}),
    "tq3-sensitive4": dict(bits=3, sensitive_bits=4, sensitive_patterns=["o_proj", "down_proj"]),
}


def recipe_names() -> list[str]:
    return list(_RECIPES)


def get_recipe(name: str, group_size: int = 128, **overrides) -> TurboQuantConfig:
    """The TurboQuantConfig of recipe `name` (ValueError naming the known recipes otherwise)."""
    if name not in _RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(_RECIPES)}")
    return TurboQuantConfig(**{**_RECIPES[name], "group_size": group_size, **overrides})
