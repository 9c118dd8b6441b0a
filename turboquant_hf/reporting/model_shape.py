"""What a transformers config.json says about a model's shape beyond its weights: the language-model part of it,
which layers are full or linear attention, the KV cache one token costs and the recurrent state a sequence keeps
(the model card and `turboquant-hf plan` state both)."""

from __future__ import annotations

from typing import Any


def text_config(config: dict) -> dict:
    """The language-model part of a config.json (`text_config` of multimodal models)."""
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def attention_layers(config: dict) -> tuple[list[int], list[int]]:
    """(full-attention layer indices, linear-attention layer indices) from `layer_types` or
    `full_attention_interval`; every layer is full attention when neither is given."""
    tc = text_config(config)
    n = int(tc.get("num_hidden_layers") or 0)
    types = tc.get("layer_types")
    if types:
        full = [i for i, t in enumerate(types) if "attention" in t and "linear" not in t]
        linear = [i for i, t in enumerate(types) if "linear" in t]
        return full, linear
    interval = tc.get("full_attention_interval")
    if interval:
        full = [i for i in range(n) if (i + 1) % int(interval) == 0]
        return full, [i for i in range(n) if (i + 1) % int(interval)]
    return list(range(n)), []


def kv_cache_per_token(config: dict, dtype_bytes: int = 2) -> dict[str, Any]:
    """Bytes of KV cache one token costs: attention layers × KV heads × head_dim × 2 (K and V) × dtype bytes."""
    tc = text_config(config)
    full, _ = attention_layers(config)
    heads = int(tc.get("num_attention_heads") or 1)
    kv_heads = int(tc.get("num_key_value_heads") or heads)
    head_dim = int(tc.get("head_dim") or (int(tc.get("hidden_size") or 0) // heads))
    per_token = len(full) * kv_heads * head_dim * 2 * dtype_bytes
    return {"layers": len(full), "kv_heads": kv_heads, "head_dim": head_dim, "dtype_bytes": dtype_bytes,
            "bytes": per_token}


def recurrent_state_bytes(config: dict, dtype_bytes: int = 2) -> dict[str, Any]:
    """Constant per-sequence state of linear-attention (GatedDeltaNet) layers: the recurrent matrix state
    (value heads × key dim × value dim) plus the causal-conv state ((2·key + value dims) × (kernel − 1))."""
    tc = text_config(config)
    _, linear = attention_layers(config)
    if not linear:
        return {"layers": 0, "bytes": 0}
    k_heads = int(tc.get("linear_num_key_heads") or 0)
    v_heads = int(tc.get("linear_num_value_heads") or k_heads)
    k_dim = int(tc.get("linear_key_head_dim") or 0)
    v_dim = int(tc.get("linear_value_head_dim") or 0)
    kernel = int(tc.get("linear_conv_kernel_dim") or 4)
    state = v_heads * k_dim * v_dim
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * (kernel - 1)
    return {"layers": len(linear), "state_elems": state, "conv_elems": conv, "dtype_bytes": dtype_bytes,
            "bytes": len(linear) * (state + conv) * dtype_bytes}
