"""`TurboQuantConfig`: what to quantize, at which bit width, with which group size."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..format import constants as fmt
from ..format.checkpoint import public_source

QUANT_METHOD = "turboquant"

# Modules kept in full precision unless the user gives their own list: the output head, MoE routers and
# shared-expert gates (tiny, and every token depends on them), and vision towers.
DEFAULT_MODULES_TO_NOT_CONVERT = ["lm_head", "mlp.gate", "shared_expert_gate", "router", "visual", "vision_tower"]

_KNOWN_KEYS = {
    "bits",
    "group_size",
    "modules_to_not_convert",
    "module_bits",
    "expert_bits",
    "sensitive_bits",
    "sensitive_patterns",
    "format",
    "quantizer_seed",
    "quant_method",
    "calibrated_with",
    "target_bits_per_weight",
}

DATA_FREE = "data-free"


@dataclass
class CalibrationConfig:
    """How to choose indices and norms from activations instead of rounding each weight to its nearest codebook
    value. The checkpoint is the same tq3_native format either way.

    Args:
        data: the calibration text: `"data-free"` (the model writes its own text from neutral prompts), a path to
            a UTF-8 text file, a list of strings, a list of token-id tensors, or a `datasets.Dataset` with a
            `text` column.
        samples: sequences of `sequence_length` tokens to calibrate on (default 16).
        sequence_length: tokens per sequence (default 512).
        damping: added to the Hessian's diagonal, as a fraction of its mean diagonal.
        seed: seeds the choice of sequences and the data-free sampling.
        tokenizer: the tokenizer for text data (default: the model's own, from the same source).
        options: further settings of the rounding, by name.
        distill_steps: after the rounding, Adam steps that tune the group norms and the vector parameters kept in
            full precision (norm-layer weights, biases) to the float model's next-token distributions on the
            calibration sequences, two sequences a step (`calibration.distillation`; causal language models).
            A quarter of the sequences is kept out to check it; the tuning is undone unless their KL divergence
            fell. It holds the tuned layers' weights unpacked while it runs (about the float model's size).
            0 (default): none. The indices stay as rounded; the checkpoint format is unchanged.
        distill_lr: the learning rate of those steps (of the log-norms; the vectors take a tenth of it).
        block_steps: Adam steps, per decoder block and right after its rounding, that tune the block's group norms
            and vector parameters to the float block's outputs on the float model's hidden states, one sequence a
            step (`distillation.tune_block`); a quarter of the sequences checks each block, whose tuning is undone
            unless their error fell. The calibration then holds the float model's hidden states beside the
            quantized model's (one block's worth of activations more). 0 (default): none.
        block_lr: the learning rate of those steps (of the log-norms; the vectors take a tenth of it).

    The defaults, 16 x 512 = 8192 tokens, are practical on a CPU (quality and time by the number of sequences:
    benchmarks/QUALITY.md). The calibration's time is mostly the rounding sweep, which does not grow with the data;
    what grows is the data-free mode's generation and the sensitivity pass of a bit budget, which uses the same
    sequences.
    """

    data: Any = DATA_FREE
    samples: int = 16
    sequence_length: int = 512
    damping: float = 0.01
    seed: int = 0
    tokenizer: Any = None
    options: dict = field(default_factory=dict)
    distill_steps: int = 0
    distill_lr: float = 3e-3
    block_steps: int = 0
    block_lr: float = 1e-2

    def __post_init__(self):
        for name in ("distill_steps", "block_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CalibrationConfig: {name} must be an integer >= 0, got {value!r}")
        for name in ("distill_lr", "block_lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"CalibrationConfig: {name} must be a finite number > 0, got {value!r}")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"CalibrationConfig: samples must be a positive integer, got {self.samples!r}")
        if isinstance(self.sequence_length, bool) or not isinstance(self.sequence_length, int) \
                or self.sequence_length < 2:
            raise ValueError(f"CalibrationConfig: sequence_length must be an integer >= 2, got {self.sequence_length!r}")
        if not isinstance(self.damping, (int, float)) or not math.isfinite(self.damping) or self.damping < 0:
            raise ValueError(f"CalibrationConfig: damping must be a finite number >= 0, got {self.damping!r}")


def calibration_config(value) -> CalibrationConfig | None:
    """`TurboQuantConfig(calibration=...)` as a `CalibrationConfig`: None stays None, a `CalibrationConfig` is
    kept, a dict gives its fields, anything else is the data."""
    if value is None or isinstance(value, CalibrationConfig):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(CalibrationConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"TurboQuantConfig: unknown calibration setting(s) {', '.join(unknown)}")
        return CalibrationConfig(**value)
    return CalibrationConfig(data=value)


class TurboQuantConfig(QuantizationConfigMixin):
    """Configuration of TurboQuant weight quantization (tq3_native layout).

    Args:
        bits: default bit width of quantized Linear weights: 2, 3, 4, or 1.58 (ternary).
        group_size: weights per group along the input dimension: 64, 128 or 256.
        modules_to_not_convert: module names or patterns kept in full precision
            (default: `lm_head`; embeddings, norms and anything that is not a
            Linear weight are never converted). A list given here replaces the default.
        module_bits: `{pattern: bits}` overrides, matched with `re.search` against
            the module name in the order given; the first match wins.
        expert_bits: bit width of routed MoE experts (modules named `*.experts`);
            default: `bits`.
        sensitive_bits, sensitive_patterns: the published checkpoints' form of an
            override: modules whose name contains any of the patterns get
            `sensitive_bits`. `module_bits` is consulted first.
        calibration: choose indices and norms from activations (`CalibrationConfig`,
            its fields as a dict, or just the data: `"data-free"`, a text file, a list
            of strings or token tensors, a `datasets.Dataset`). Used while quantizing;
            the checkpoint records where the data came from in `calibrated_with`.
        target_bits_per_weight: a budget in stored bits per quantized weight (norms
            included: 3-bit at G = 128 is 3.25); the layers where more bits pay most
            get them, measured, until the budget is met. The outcome is written to
            `module_bits`, so the checkpoint reloads with no arguments.
    """

    def __init__(
        self,
        bits=3,
        group_size: int = 128,
        modules_to_not_convert: list[str] | None = None,
        module_bits: dict[str, Any] | None = None,
        expert_bits=None,
        sensitive_bits=None,
        sensitive_patterns: list[str] | None = None,
        format: str = fmt.FORMAT_NAME,
        quantizer_seed: int = fmt.QUANTIZER_SEED,
        quant_method: str = QUANT_METHOD,
        calibration=None,
        calibrated_with: dict | None = None,
        target_bits_per_weight: float | None = None,
        **kwargs,
    ):
        unknown = sorted(set(kwargs) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"TurboQuantConfig: unsupported setting(s) {', '.join(unknown)}; this version of turboquant_hf "
                f"understands {', '.join(sorted(_KNOWN_KEYS))}"
            )
        if quant_method != QUANT_METHOD:
            raise ValueError(f"TurboQuantConfig: quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        if format not in (fmt.FORMAT_NAME, fmt.HADAMARD_FORMAT):
            raise ValueError(
                f"TurboQuantConfig: format {format!r} is not supported by this version (supported: {fmt.FORMAT_NAME!r}, "
                f"{fmt.HADAMARD_FORMAT!r})"
            )
        if quantizer_seed != fmt.QUANTIZER_SEED:
            raise ValueError(
                f"TurboQuantConfig: quantizer_seed {quantizer_seed!r} is not supported; the format fixes it at "
                f"{fmt.QUANTIZER_SEED}"
            )
        self.quant_method = QUANT_METHOD
        self.bits = fmt.check_bits(bits)
        if format == fmt.HADAMARD_FORMAT:
            # loaded from turboquant-mlx checkpoints only: bits and group size are per tensor, from the files
            if isinstance(group_size, bool) or group_size not in fmt.HADAMARD_GROUP_SIZES:
                raise ValueError(f"group_size must be one of {', '.join(map(str, fmt.HADAMARD_GROUP_SIZES))} for format "
                                 f"{fmt.HADAMARD_FORMAT!r}, got {group_size!r}")
            self.group_size = int(group_size)
        else:
            self.group_size = fmt.check_group_size(group_size)
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert is not None else None
        self.module_bits = {}
        for pattern, value in (module_bits or {}).items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"TurboQuantConfig: module_bits pattern {pattern!r} is not a valid regex: {e}") from e
            self.module_bits[pattern] = fmt.check_bits(value)
        self.expert_bits = fmt.check_bits(expert_bits) if expert_bits is not None else None
        self.sensitive_bits = fmt.check_bits(sensitive_bits) if sensitive_bits is not None else None
        self.sensitive_patterns = list(sensitive_patterns) if sensitive_patterns else None
        if self.sensitive_patterns and self.sensitive_bits is None:
            raise ValueError("TurboQuantConfig: sensitive_patterns needs sensitive_bits")
        self.format = format
        self.quantizer_seed = fmt.QUANTIZER_SEED
        self.calibration = calibration_config(calibration)
        self.calibrated_with = dict(calibrated_with) if calibrated_with else None
        if target_bits_per_weight is not None:
            if isinstance(target_bits_per_weight, bool) or not isinstance(target_bits_per_weight, (int, float)) \
                    or not math.isfinite(target_bits_per_weight) or not 1 <= target_bits_per_weight <= 16:
                raise ValueError("TurboQuantConfig: target_bits_per_weight must be a number between 1 and 16, got "
                                 f"{target_bits_per_weight!r}")
            target_bits_per_weight = float(target_bits_per_weight)
        self.target_bits_per_weight = target_bits_per_weight

    def bits_for(self, module_name: str):
        """The bit width this config gives the Linear `module_name`."""
        for pattern, value in self.module_bits.items():
            if re.search(pattern, module_name):
                return value
        if self.sensitive_patterns and any(p in module_name for p in self.sensitive_patterns):
            return self.sensitive_bits
        if self.expert_bits is not None and re.search(r"(^|\.)experts(\.|$)", module_name):
            return self.expert_bits
        return self.bits

    def to_dict(self) -> dict[str, Any]:
        out = {
            "quant_method": self.quant_method,
            "format": self.format,
            "bits": self.bits,
            "group_size": self.group_size,
            "quantizer_seed": self.quantizer_seed,
            "modules_to_not_convert": self.modules_to_not_convert,
        }
        if self.module_bits:
            out["module_bits"] = dict(self.module_bits)
        if self.expert_bits is not None:
            out["expert_bits"] = self.expert_bits
        if self.sensitive_patterns:
            out["sensitive_bits"] = self.sensitive_bits
            out["sensitive_patterns"] = list(self.sensitive_patterns)
        if self.target_bits_per_weight is not None:
            out["target_bits_per_weight"] = self.target_bits_per_weight
        if self.calibrated_with:
            out["calibrated_with"] = dict(self.calibrated_with)
        return out

    def to_tq_config(self, compressed_layers: int, orig_in_dims: dict[str, int], original_model=None) -> dict:
        """The `tq_config.json` of a checkpoint quantized with this config (published keys first, then the recipe)."""
        out = {
            "format": self.format,
            "bits": self.bits,
            "group_size": self.group_size,
            "quantizer_seed": self.quantizer_seed,
            "compressed_layers": compressed_layers,
            "original_model": public_source(original_model),
        }
        if self.sensitive_patterns:
            out["sensitive_bits"] = self.sensitive_bits
            out["sensitive_patterns"] = list(self.sensitive_patterns)
        if self.module_bits:
            out["module_bits"] = dict(self.module_bits)
        if self.expert_bits is not None:
            out["expert_bits"] = self.expert_bits
        if self.modules_to_not_convert is not None:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        if self.target_bits_per_weight is not None:
            out["target_bits_per_weight"] = self.target_bits_per_weight
        if self.calibrated_with:
            out["calibrated_with"] = dict(self.calibrated_with)
        if orig_in_dims:
            out["orig_in_dims"] = dict(orig_in_dims)
        return out

    @classmethod
    def from_mlx(cls, block: dict[str, Any]) -> "TurboQuantConfig":
        """The config of a turboquant-mlx checkpoint, from its config.json `quantization` block
        (`{"mode": "turboquant", "bits", "group_size", "rotation", "use_qjl", ...}`). Raises a ValueError for
        other MLX quantization modes and for variants this version cannot load."""
        mode = block.get("mode", "affine")
        if mode != "turboquant":
            raise ValueError(
                f"config.json: MLX quantization mode {mode!r} (bits {block.get('bits')}, group_size "
                f"{block.get('group_size')}) is not TurboQuant; turboquant_hf loads MLX checkpoints written by "
                "turboquant-mlx (quantization mode 'turboquant') only"
            )
        if block.get("use_qjl"):
            raise ValueError("config.json: this turboquant-mlx checkpoint uses QJL residual correction "
                             "(use_qjl: true), which this version cannot load")
        rotation = block.get("rotation", "hadamard")
        if rotation not in ("hadamard", "blockwise_hadamard"):
            raise ValueError(f"config.json: turboquant-mlx rotation {rotation!r} is not supported (supported: "
                             "'hadamard', 'blockwise_hadamard')")
        bits = block.get("bits", 3)
        return cls(bits=bits if bits in fmt.BITS else 3, group_size=block.get("group_size", 64),
                   format=fmt.HADAMARD_FORMAT)

    @classmethod
    def from_tq_config(cls, tq_config: dict[str, Any]) -> "TurboQuantConfig":
        """Build the config a published `tq_config.json` describes."""
        return cls(
            bits=tq_config.get("bits", 3),
            group_size=tq_config.get("group_size", 128),
            sensitive_bits=tq_config.get("sensitive_bits"),
            sensitive_patterns=tq_config.get("sensitive_patterns"),
            format=tq_config.get("format", fmt.FORMAT_NAME),
            quantizer_seed=tq_config.get("quantizer_seed", fmt.QUANTIZER_SEED),
            modules_to_not_convert=tq_config.get("modules_to_not_convert"),
            module_bits=tq_config.get("module_bits"),
            expert_bits=tq_config.get("expert_bits"),
            calibrated_with=tq_config.get("calibrated_with"),
            target_bits_per_weight=tq_config.get("target_bits_per_weight"),
        )
