"""Streaming offline conversion: quantize a safetensors checkpoint tensor by tensor, with bounded memory.

`TurboQuantizer.from_pretrained(src).quantize(save_dir, quantization_config=cfg)` writes the same tensors that
`from_pretrained(src, quantization_config=cfg)` followed by `save_pretrained(save_dir)` would, without ever
holding the model: the module replacement runs on the meta device to decide what is quantized, then each
source tensor is read lazily (`safe_open`), quantized on the best device available, and appended to the
current output shard. Output goes to a temporary folder beside `save_dir`, renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import checkpoint as ckpt
from . import codec
from . import format as fmt
from .config import TurboQuantConfig
from .modules import TurboQuantWeight, to_norms_dtype

try:  # optimum's quantizer interface, when the installed optimum has it
    from optimum.quantization_base import OptimumQuantizer as _QuantizerBase
except ImportError:  # pragma: no cover - same shape without optimum
    class _QuantizerBase:  # type: ignore[no-redef]
        pass

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}

_COPIED_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
_SKIPPED_FILES = {"model.safetensors.index.json", "config.json", "README.md", fmt.TQ_CONFIG_NAME}


@dataclass
class ConversionSummary:
    params_quantized: int = 0
    params_kept: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    shards: list = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        total = self.params_quantized + self.params_kept
        return 8 * self.bytes_out / total if total else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["bits_per_weight"] = self.bits_per_weight
        d["params_per_second"] = (self.params_quantized + self.params_kept) / self.seconds if self.seconds else 0.0
        return d


def _torch_dtype(name: str) -> torch.dtype:
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}.get(name)


class TurboQuantizer(_QuantizerBase):
    """Offline, streaming TurboQuant conversion of a local safetensors checkpoint folder."""

    def __init__(self, source_dir: str):
        self.source_dir = str(source_dir)
        files = sorted(Path(self.source_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.source_dir}: no .safetensors files (weights are read as safetensors only)")
        self.files = [str(f) for f in files]
        self.index = ckpt.read_checkpoint_index(self.files)

    @classmethod
    def from_pretrained(cls, model_or_path, file_name=None):
        if not os.path.isdir(str(model_or_path)):
            raise ValueError(f"{model_or_path}: the streaming converter reads a local checkpoint folder")
        return cls(str(model_or_path))

    # -- what gets quantized ---------------------------------------------------------------------------------
    def _targets(self, config: TurboQuantConfig) -> dict[str, TurboQuantWeight]:
        """{checkpoint tensor name: the TurboQuantWeight from_pretrained would fill from it}."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from .quantizer import checkpoint_to_model_keys
        from .sizing import apply_plan

        model_config = AutoConfig.from_pretrained(self.source_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
        apply_plan(model, config)
        modules = {n: m for n, m in model.named_modules() if isinstance(m, TurboQuantWeight)}
        targets = {}
        self.expert_groups = {}
        found = set()
        for key, model_key in checkpoint_to_model_keys(model, list(self.index)).items():
            if model_key in modules:
                targets[key] = modules[model_key]
                found.add(model_key)
        # per-expert sources: `<prefix>.experts.N.{gate,up,down}_proj.weight` (or Mixtral's w1/w3/w2), fused here
        # into `<prefix>.experts.gate_up_proj` / `.down_proj` exactly as transformers merges them while loading
        per_expert = {}
        for key in self.index:
            m = _PER_EXPERT.match(key)
            if m:
                per_expert.setdefault(m.group(1), {}).setdefault(_PART[m.group(3)], {})[int(m.group(2))] = key
        for prefix, parts in per_expert.items():
            for fused, sources in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
                fused_key = f"{prefix}.{fused}"
                model_key = checkpoint_to_model_keys(model, [fused_key])[fused_key]
                if model_key not in modules:
                    continue
                target = modules[model_key]
                n_experts = target.source_shape[0]
                if any(sorted(parts.get(p, {})) != list(range(n_experts)) for p in sources):
                    raise ckpt.CheckpointError(
                        f"{prefix}: the per-expert tensors do not cover experts 0..{n_experts - 1} for {fused}"
                    )
                self.expert_groups[fused_key] = [[parts[p][e] for p in sources] for e in range(n_experts)]
                targets[fused_key] = target
                found.add(model_key)
        missing = set(modules) - found
        if missing:
            raise ckpt.CheckpointError(
                f"{self.source_dir}: no source tensor for {sorted(missing)[0]} (and {len(missing) - 1} more); "
                "layouts that transformers transforms while loading, other than per-expert experts, are not streamed yet"
            )
        return targets

    # -- conversion ------------------------------------------------------------------------------------------
    def quantize(
        self,
        save_dir,
        file_prefix: str | None = None,
        quantization_config: TurboQuantConfig | None = None,
        max_shard_size: int = 5 * 10**9,
        max_memory: int | None = None,
        device: str | None = None,
        progress: bool = True,
    ) -> ConversionSummary:
        cfg = quantization_config or TurboQuantConfig()
        largest = max(
            (ckpt_numel(info) * 4 for info in self.index.values() if _torch_dtype(info["dtype"]) is not None),
            default=0,
        )
        if max_memory is not None and max_memory < largest:
            raise ValueError(
                f"--max-memory {max_memory} bytes is smaller than the float32 copy of the largest tensor "
                f"({largest} bytes); nothing was written"
            )
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        targets = self._targets(cfg)
        save_dir = os.path.abspath(str(save_dir))
        parent = os.path.dirname(save_dir)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(save_dir)}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        summary = ConversionSummary()
        start = time.perf_counter()
        try:
            self._write_shards(tmp, targets, cfg, max_shard_size, device, summary, progress)
            self._write_side_files(tmp, cfg, targets)
            summary.seconds = time.perf_counter() - start
            if os.path.exists(save_dir):
                raise FileExistsError(f"{save_dir} exists; remove it first (nothing was replaced)")
            os.replace(tmp, save_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return summary

    def _write_shards(self, out_dir, targets, cfg, max_shard_size, device, summary, progress) -> None:
        from tqdm.auto import tqdm

        grouped = {k for members in self.expert_groups.values() for per in members for k in per}
        # one unit per output tensor: a plain source tensor, or a fused expert tensor (in sorted name order)
        units = sorted([(n, None) for n in self.index if n not in grouped] + list(self.expert_groups.items()))
        total = sum(ckpt_numel(self.index[n]) * _element_size(self.index[n]["dtype"]) for n in self.index)
        shard: dict[str, torch.Tensor] = {}
        shard_bytes = 0
        written: list[tuple[str, list[str]]] = []

        def flush():
            nonlocal shard, shard_bytes
            if not shard:
                return
            path = os.path.join(out_dir, f"shard-{len(written):05d}.safetensors")
            save_file(shard, path, metadata={"format": "pt"})
            written.append((path, list(shard)))
            shard, shard_bytes = {}, 0

        bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="quantizing")
        handles = {}

        def read(key):
            info = self.index[key]
            f = handles.get(info["file"]) or handles.setdefault(info["file"], safe_open(info["file"], "pt"))
            return f.get_tensor(key)

        try:
            for name, members in units:
                bar.set_postfix_str(name[-60:], refresh=False)
                if members is None:
                    tensor = read(name)
                else:  # [E, out, in]: each expert's parts concatenated along out (gate rows, then up rows)
                    tensor = torch.stack([torch.cat([read(k) for k in per], dim=0) for per in members])
                summary.bytes_in += tensor.numel() * tensor.element_size()
                if name in targets:
                    w = targets[name]
                    packed, norms = codec.quantize_weight(tensor.to(device), w.bits, w.group_size, name=name)
                    out = {name + fmt.PACKED_SUFFIX: packed.cpu(), name + fmt.NORMS_SUFFIX: to_norms_dtype(
                        norms, w.norms_dtype, name=name).cpu()}
                    summary.params_quantized += tensor.numel()
                else:
                    out = {name: tensor}
                    summary.params_kept += tensor.numel()
                for k, v in out.items():
                    size = v.numel() * v.element_size()
                    if shard and shard_bytes + size > max_shard_size:
                        flush()
                    shard[k] = v.contiguous()
                    shard_bytes += size
                    summary.bytes_out += size
                bar.update(tensor.numel() * tensor.element_size())
                del tensor
            flush()
        finally:
            bar.close()
        n = len(written)
        weight_map = {}
        for i, (path, keys) in enumerate(written):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, os.path.join(out_dir, final))
            summary.shards.append(final)
            weight_map.update({k: final for k in keys})
        if n > 1:
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
                json.dump({"metadata": {"total_size": summary.bytes_out}, "weight_map": weight_map}, fh, indent=2)

    def _write_side_files(self, out_dir, cfg: TurboQuantConfig, targets) -> None:
        for entry in sorted(os.listdir(self.source_dir)):
            src = os.path.join(self.source_dir, entry)
            if os.path.isfile(src) and entry.endswith(_COPIED_SUFFIXES) and entry not in _SKIPPED_FILES:
                shutil.copy2(src, os.path.join(out_dir, entry))
        with open(os.path.join(self.source_dir, "config.json")) as fh:
            config = json.load(fh)
        config["quantization_config"] = cfg.to_dict()
        with open(os.path.join(out_dir, "config.json"), "w") as fh:
            json.dump(config, fh, indent=2)
        orig = {k: w.in_features for k, w in targets.items() if w.in_features % w.group_size}
        tq = cfg.to_tq_config(len(targets), orig, self.source_dir)
        with open(os.path.join(out_dir, fmt.TQ_CONFIG_NAME), "w") as fh:
            json.dump(tq, fh, indent=2)


def ckpt_numel(info: dict) -> int:
    n = 1
    for d in info["shape"]:
        n *= d
    return n


def _element_size(dtype: str) -> int:
    return ckpt._DTYPE_BYTES.get(dtype, 1)
