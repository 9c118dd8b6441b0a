"""Reading turboquant-mlx checkpoints (the MLX family of TurboQuant) into TurboQuantLinear / TurboQuantExperts.

An MLX TurboQuant module `P` is stored as `P.weight` (uint32 indices, LSB first, `32 // b` per word, or 20 base-3
digits per word for ternary, running across the whole row), `P.scales` (per-group RMS, f16), `P.codebook` (f16,
its length gives the tier: 3 ternary, 4/8/16 for 2/3/4 bits) and `P.signs` (f16 `(in,)`, the row rotation's
signs). Loading repacks the indices losslessly into the per-group byte layout of `codec` (the scales become the
norms, the codebook and signs are kept as they are), so the modules compute exactly what the file describes:
`W = (codebook[idx] * scale) @ T.T / sqrt(b) * signs` per block of b inputs (see `format.hadamard`). Nothing is
dequantized or requantized.

MLX names differ from transformers': experts are stacked under `mlp.switch_mlp.{gate,up,down}_proj`,
Qwen3.5/3.6 use `language_model.model.*` / `language_model.lm_head`, `conv1d.weight` is `(C, K, 1)`, and the
Qwen3.5 family's RMSNorm weights are stored with the `1 +` folded in. Every tensor is read here (the loader of
transformers is told to leave them alone) and checked against the model.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from ..format import constants as fmt
from ..format.checkpoint import CheckpointError
from ..quantization.planning import (
    HADAMARD,
    ExpertsPlan,
    LinearPlan,
    Plan,
    activation_of,
    checkpoint_to_model_keys,
    fused_experts_geometry,
)

PARTS = ("weight", "scales", "codebook", "signs")
TRITS_PER_WORD = 20
LEVELS_FOR_CODEBOOK = {3: 3, 4: 4, 8: 8, 16: 16}  # codebook entries -> codebook size (ternary, 2, 3, 4 bits)
_FLOAT_DTYPES = ("F16", "BF16", "F32")

# Model types whose MLX conversion stores RMSNorm weights as `1 + w` (mlx-lm's Qwen3.5 `sanitize`), for 1-D
# tensors with these name endings; the transformers classes add the 1 themselves.
_NORM_PLUS_ONE_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_NORM_PLUS_ONE_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                           ".q_norm.weight", ".k_norm.weight")
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_mlx_checkpoint(index: dict) -> bool:
    """True when the headers hold MLX-quantized modules (a uint32 `P.weight` beside `P.scales`)."""
    return any(k.endswith(".scales") and index.get(k[: -len("scales")] + "weight", {}).get("dtype") == "U32"
               for k in index)


def indices_per_word(n_levels: int) -> int:
    return TRITS_PER_WORD if n_levels == 3 else 32 // int(math.log2(n_levels))


_HALF_WORD_TABLES: dict = {}


def _half_word_table(n_levels: int, device) -> tuple[int, torch.Tensor]:
    """(radix, table): a word is `hi * radix + lo`, each half holding half the word's indices; `table[half]` lists
    them (uint8), least significant first. Two lookups decode a word."""
    key = (n_levels, str(device))
    if key not in _HALF_WORD_TABLES:
        per = indices_per_word(n_levels) // 2
        base = 3 if n_levels == 3 else n_levels
        codes = torch.arange(base**per, dtype=torch.int64)
        table = torch.stack([(codes // base**i) % base for i in range(per)], -1).to(torch.uint8)
        _HALF_WORD_TABLES[key] = (base**per, table.to(device))
    return _HALF_WORD_TABLES[key]


def unpack_words(words: torch.Tensor, n_levels: int, count: int) -> torch.Tensor:
    """MLX-packed uint32 rows `(rows, n_words)` to indices `(rows, count)` uint8."""
    w = words.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    radix, table = _half_word_table(n_levels, w.device)
    # (3-bit words hold 10 indices in 30 bits, 2-bit 16, 4-bit 8, ternary 20 base-3 digits: all split in halves)
    hi = w // radix
    halves = torch.stack([w - hi * radix, hi], -1)
    return torch.nn.functional.embedding(halves, table).reshape(w.shape[0], -1)[:, :count]


def pack_groups(indices: torch.Tensor, n_levels: int) -> torch.Tensor:
    """uint8 indices `(n, G)` to the per-group layout `(n, bytes_per_group)` of `codec.pack_indices` (the same bytes;
    computed in uint8, which is what makes repacking a large checkpoint fast)."""
    n, g = indices.shape
    if n_levels == 3:  # 5 base-3 digits a byte: at most 242
        width = -(-g // 5) * 5
        d = indices if width == g else torch.nn.functional.pad(indices, (0, width - g))
        d = d.reshape(n, -1, 5)
        return d[..., 0] + 3 * d[..., 1] + 9 * d[..., 2] + 27 * d[..., 3] + 81 * d[..., 4]
    if n_levels == 8:  # 8 indices in 3 bytes, LSB first
        i = indices.reshape(n, -1, 8)
        b0 = i[..., 0] | (i[..., 1] << 3) | (i[..., 2] << 6)
        b1 = (i[..., 2] >> 2) | (i[..., 3] << 1) | (i[..., 4] << 4) | (i[..., 5] << 7)
        b2 = (i[..., 5] >> 1) | (i[..., 6] << 2) | (i[..., 7] << 5)
        return torch.stack([b0, b1, b2], -1).reshape(n, -1)
    per = 8 // int(math.log2(n_levels))
    b = 8 // per
    i = indices.reshape(n, -1, per)
    out = i[..., 0]
    for k in range(1, per):
        out = out | (i[..., k] << (b * k))
    return out


def repack(words: torch.Tensor, n_levels: int, in_features: int, group_size: int) -> torch.Tensor:
    """MLX rows of packed indices `(..., rows, n_words)` to the per-group layout `(rows * n_groups, bytes_per_group)`.

    Lossless: the same indices, regrouped. For 2 and 4 bits an MLX row is already an LSB-first bit stream whose
    groups start on byte boundaries, so its bytes are taken as they are; 3-bit words hold 10 indices and 2 spare
    bits, and ternary words 20 base-3 digits across group boundaries, so those are unpacked and packed again.
    """
    words = words.reshape(-1, words.shape[-1]).contiguous()
    rows = words.shape[0]
    n_groups = in_features // group_size
    bpg = fmt.bytes_per_group(n_levels, group_size)
    if n_levels in (4, 16):
        as_bytes = words.view(torch.uint8)  # little-endian words: byte j holds indices [j*8/b, (j+1)*8/b)
        return as_bytes[:, : n_groups * bpg].reshape(rows * n_groups, bpg).clone()
    out = torch.empty(rows * n_groups, bpg, dtype=torch.uint8)
    chunk = max(1, (1 << 22) // in_features)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        idx = unpack_words(words[start:stop], n_levels, in_features)
        out[start * n_groups : stop * n_groups] = pack_groups(idx.reshape(-1, group_size), n_levels)
    return out


class MLXLayout:
    """The plan for reading one turboquant-mlx checkpoint (its header index) into a transformers model."""

    def __init__(self, index: dict, model_type: str | None = None):
        self.index = index
        self.model_type = model_type
        self.quantized: dict[str, dict] = {}  # MLX module path -> {"levels", "group_size", "in", "shape"}
        self._check_tensors()
        self.linear_targets: dict[str, str] = {}    # model Linear name -> MLX path
        self.expert_targets: dict[str, dict] = {}   # model experts name -> {projection: MLX path}
        self.plain_targets: dict[str, tuple] = {}   # MLX key -> (model key, transform)

    # -- headers -------------------------------------------------------------------------------------------------
    def _check_tensors(self) -> None:
        idx = self.index
        for key in sorted(idx):
            if key.endswith(".qjl_packed"):
                raise CheckpointError(f"{key}: QJL residual correction (turboquant-mlx --use-qjl) is not supported")
            if not key.endswith(".scales"):
                continue
            path = key[: -len(".scales")]
            if idx.get(path + ".weight", {}).get("dtype") != "U32":
                continue
            if path + ".biases" in idx and path + ".codebook" not in idx:
                raise CheckpointError(
                    f"{path}.biases: {path} is MLX affine-quantized (weight, scales, biases), not TurboQuant; "
                    "turboquant_hf loads turboquant-mlx modules (weight, scales, codebook, signs) only"
                )
        for key in sorted(k for k in idx if k.endswith(".codebook")):
            path = key[: -len(".codebook")]
            for part in PARTS:
                if path + "." + part not in idx:
                    raise CheckpointError(f"checkpoint is missing {path}.{part} (needed for the turboquant-mlx "
                                          f"layer {path})")
            self.quantized[path] = self._check_module(path)

    def _check_module(self, path: str) -> dict:
        idx = self.index
        cb, sc, sg, wt = (idx[f"{path}.{p}"] for p in ("codebook", "scales", "signs", "weight"))
        if len(cb["shape"]) != 1 or cb["shape"][0] not in LEVELS_FOR_CODEBOOK or cb["dtype"] not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{path}.codebook: {cb['dtype']} {list(cb['shape'])}; supported codebooks have 3 (ternary), 4, 8 or "
                "16 (2, 3, 4 bits) float entries"
            )
        n_levels = LEVELS_FOR_CODEBOOK[cb["shape"][0]]
        if len(sg["shape"]) != 1 or sg["dtype"] not in _FLOAT_DTYPES:
            raise CheckpointError(f"{path}.signs: expected a float vector (in_features,), found {sg['dtype']} "
                                  f"{list(sg['shape'])}")
        in_features = sg["shape"][0]
        if wt["dtype"] != "U32" or len(wt["shape"]) not in (2, 3):
            raise CheckpointError(f"{path}.weight: expected uint32 of 2 or 3 dimensions, found {wt['dtype']} "
                                  f"{list(wt['shape'])}")
        lead = tuple(wt["shape"][:-1])
        words = -(-in_features // indices_per_word(n_levels))
        if wt["shape"][-1] != words:
            raise CheckpointError(
                f"{path}.weight: {wt['shape'][-1]} words per row, but {in_features} inputs at "
                f"{fmt.bits_for_levels(n_levels)} bits take {words}"
            )
        if sc["dtype"] not in _FLOAT_DTYPES or tuple(sc["shape"][:-1]) != lead or not sc["shape"][-1] \
                or in_features % sc["shape"][-1]:
            raise CheckpointError(f"{path}.scales: expected float {list(lead) + ['n_groups']} with n_groups dividing "
                                  f"{in_features}, found {sc['dtype']} {list(sc['shape'])}")
        group_size = in_features // sc["shape"][-1]
        if group_size not in fmt.HADAMARD_GROUP_SIZES or (n_levels == 8 and group_size % 8):
            raise CheckpointError(f"{path}.scales: group size {group_size} is not supported (supported: "
                                  f"{fmt.HADAMARD_GROUP_SIZES})")
        return {"levels": n_levels, "group_size": group_size, "in": in_features, "shape": lead + (in_features,)}

    # -- names ---------------------------------------------------------------------------------------------------
    @staticmethod
    def transformers_name(mlx_key: str) -> str:
        """The published transformers name of an MLX key (before the model class's own renamings)."""
        if mlx_key.startswith("language_model.model."):
            mlx_key = "model.language_model." + mlx_key[len("language_model.model."):]
        elif mlx_key.startswith("language_model."):
            mlx_key = mlx_key[len("language_model."):]
        return mlx_key.replace(".switch_mlp.", ".experts.")

    def plan(self, model: nn.Module) -> Plan:
        """The modules to replace, after checking that every checkpoint tensor has a place in `model` of the
        right shape."""

        meta = model.state_dict()
        names = {}
        for path in self.quantized:
            hf = self.transformers_name(path)
            parent, _, leaf = hf.rpartition(".")
            if parent.endswith(".experts") and leaf in EXPERT_PROJECTIONS:
                names[path] = parent + ".down_proj"  # a name the model has, renamed like its siblings
            else:
                names[path] = hf + ".weight"
        quantized_keys = {f"{p}.{part}" for p in self.quantized for part in PARTS}
        plain = [k for k in self.index if k not in quantized_keys]
        names.update({k: self.transformers_name(k) for k in plain})
        renamed = checkpoint_to_model_keys(model, list(names.values()), meta)
        ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]

        plan, experts_parts = Plan(), {}
        for path, info in self.quantized.items():
            model_key = renamed[names[path]]
            owner_name = model_key.rpartition(".")[0]
            if names[path].endswith(".experts.down_proj"):
                owner = _submodule(model, owner_name)
                geometry = fused_experts_geometry(owner) if owner is not None else None
                if geometry is None:
                    raise CheckpointError(f"{path}.weight: no fused experts module {owner_name} in "
                                          f"{type(model).__name__} to load it into")
                e, h, i = geometry
                leaf = path.rpartition(".")[2]
                expected = (e, i, h) if leaf != "down_proj" else (e, h, i)
                if info["shape"] != expected:
                    raise CheckpointError(f"{path}.weight: holds {info['shape']} weights, {owner_name}.{leaf} "
                                          f"needs {expected}")
                experts_parts.setdefault(owner_name, {})[leaf] = path
                continue
            owner = _submodule(model, owner_name)
            if type(owner) is not nn.Linear:
                raise CheckpointError(f"{path}.weight: no Linear layer {owner_name} in {type(model).__name__} to load "
                                      "it into")
            if info["shape"] != (owner.out_features, owner.in_features):
                raise CheckpointError(f"{path}.weight: holds {info['shape']} weights, {owner_name} is "
                                      f"{(owner.out_features, owner.in_features)}")
            self.linear_targets[owner_name] = path
            plan.linears[owner_name] = LinearPlan(fmt.bits_for_levels(info["levels"]), info["group_size"],
                                                  _dtype(self.index[path + ".scales"]), HADAMARD)
        activation = activation_of(model)
        for owner_name, parts in experts_parts.items():
            missing = [p for p in EXPERT_PROJECTIONS if p not in parts]
            if missing:
                some = next(iter(parts.values())).rpartition(".")[0]
                raise CheckpointError(f"checkpoint is missing {some}.{missing[0]}.weight (needed for the quantized "
                                      f"experts {owner_name})")
            info = {p: self.quantized[parts[p]] for p in EXPERT_PROJECTIONS}
            self.expert_targets[owner_name] = parts
            plan.experts[owner_name] = ExpertsPlan(
                (fmt.bits_for_levels(info["gate_proj"]["levels"]), fmt.bits_for_levels(info["up_proj"]["levels"])),
                fmt.bits_for_levels(info["down_proj"]["levels"]),
                {p: info[p]["group_size"] for p in EXPERT_PROJECTIONS},
                activation,
                tuple(_dtype(self.index[parts[p] + ".scales"]) for p in EXPERT_PROJECTIONS),
                HADAMARD,
            )

        for key in plain:
            model_key = renamed[names[key]]
            if model_key not in meta:
                if any(p.search(key) or p.search(model_key) for p in ignore):
                    continue  # a part this class does not load (e.g. MTP weights)
                raise CheckpointError(f"{key}: no matching parameter in {type(model).__name__} (looked for "
                                      f"{model_key}); the checkpoint does not belong to this architecture")
            shape = tuple(self.index[key]["shape"])
            target = tuple(meta[model_key].shape)
            transform = None
            if key.endswith("conv1d.weight") and len(shape) == 3 and shape[-1] == 1 and shape != target \
                    and (shape[0], shape[2], shape[1]) == target:
                transform = "conv1d"  # MLX stores depthwise convolutions (C, K, 1)
                shape = target
            elif self.model_type in _NORM_PLUS_ONE_TYPES and len(shape) == 1 and key.endswith(_NORM_PLUS_ONE_SUFFIXES):
                transform = "minus_one"
            if shape != target:
                raise CheckpointError(f"{key}: shape {list(self.index[key]['shape'])}, {model_key} in "
                                      f"{type(model).__name__} is {list(target)}")
            self.plain_targets[key] = (model_key, transform)
        return plan

    def ignore_patterns(self) -> tuple[set, set]:
        """(unexpected, missing) key patterns for transformers' loader: this class loads these tensors itself."""
        unexpected = {"^" + re.escape(k) + "$" for k in self.index}
        missing = {"^" + re.escape(k) + "$" for k, _ in self.plain_targets.values()}
        missing |= {"^" + re.escape(n) + r"\.weight\.tq_\w+$" for n in self.linear_targets}
        missing |= {"^" + re.escape(n) + r"\.\w+_proj\.tq_\w+$" for n in self.expert_targets}
        return unexpected, missing

    # -- after transformers' loader ------------------------------------------------------------------------------
    def load_into(self, model: nn.Module) -> None:
        """Read every tensor of the checkpoint into `model` (whose modules `plan` replaced)."""
        from safetensors import safe_open

        files: dict[str, object] = {}

        def read(key: str) -> torch.Tensor:
            path = self.index[key]["file"]
            if path not in files:
                files[path] = safe_open(path, "pt")
            return files[path].get_tensor(key)

        with torch.no_grad():
            for key, (model_key, transform) in self.plain_targets.items():
                t = read(key)
                if transform == "conv1d":
                    t = t.transpose(1, 2)
                elif transform == "minus_one":
                    t = t.float() - 1.0
                _set_tensor(model, model_key, t)
            for name, path in self.linear_targets.items():
                self._fill(model.get_submodule(name).weight, path, read)
            for name, parts in self.expert_targets.items():
                experts = model.get_submodule(name)
                for leaf, path in parts.items():
                    self._fill(getattr(experts, leaf), path, read)
        files.clear()

    def _fill(self, target, path: str, read) -> None:
        info = self.quantized[path]
        device = target.tq_packed.device
        if device.type == "meta":
            device = torch.device("cpu")
        packed = repack(read(path + ".weight"), info["levels"], info["in"], info["group_size"])
        scales = read(path + ".scales")
        target.load_packed_(packed.to(device), scales.reshape(-1, scales.shape[-1]).to(device),
                            read(path + ".codebook").to(device), read(path + ".signs").to(device))


def _dtype(info: dict) -> torch.dtype:
    return {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[info["dtype"]]


def _submodule(model: nn.Module, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    owner_name, _, attr = key.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    current = getattr(owner, attr)
    if current.is_meta:
        new = value.to(current.dtype)
    else:
        new = value.to(device=current.device, dtype=current.dtype)
    if isinstance(current, nn.Parameter):
        if current.is_meta:
            setattr(owner, attr, nn.Parameter(new, requires_grad=False))
        else:
            current.data = new
    else:
        owner._buffers[attr] = new
