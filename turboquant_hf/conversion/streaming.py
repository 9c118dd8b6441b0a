"""Streaming offline conversion: quantize a safetensors checkpoint tensor by tensor, with bounded memory.

`StreamingQuantizer.from_pretrained(src).quantize(save_dir, quantization_config=cfg)` writes the same tensors that
`from_pretrained(src, quantization_config=cfg)` followed by `save_pretrained(save_dir)` would, without ever
holding the model: the module replacement runs on the meta device to decide what is quantized, then each
source tensor is read in slices of rows with plain file reads (no memory map, so nothing of the source stays
resident), quantized on the best device available, and written straight to its place in the output shard.

With `quantization_config.calibration`, the planned modules of the decoder blocks are calibrated first, one block's
weights resident at a time (`calibrate_streaming`), and written through the same shard writer; the bytes equal the
in-memory calibrated path's. A bit budget (`target_bits_per_weight`) is refused.

Memory: the working set is a few slices of rows in flight: one per worker plus two on CPU (about 32 bytes per
weight of a slice; slices of 256K weights), eight for a GPU (their source rows and results in reusable page-locked
host buffers; slices of 16M weights), whatever the size of the tensors or of the model; `max_memory` caps it.

Safety: the layout of every output shard is computed from the source headers before any work, and the
shards are written into `.NAME.partial` beside `save_dir`, each renamed from `*.tmp` once complete and synced.
The folder is renamed to `save_dir` at the very end, so an interrupted run never leaves an output that looks
complete; `resume=True` keeps the finished shards of an interrupted run and writes only the rest (the bytes are
the same as an uninterrupted run's). Errors remove the temporary folder; an interruption (Ctrl-C, SIGTERM,
SIGKILL) keeps it for `resume`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..format import checkpoint as ckpt
from ..format import codec
from ..format import constants as fmt
from ..format.shards import (
    DTYPE_NAMES,
    INDEX_NAME,
    STATE_NAME,  # noqa: F401  (the run record's file name, in the partial folder: for callers)
    TORCH_DTYPES,
    ConversionError,
    HostBuffers,
    Mxfp4Tensor,
    SliceWriter,
    SourceReader,
    move_into_place,
    mxfp4_pairs,
    open_partial,
    peak_rss,
    run_record,
    shard_layout,
    source_index,
)
from ..quantization.config import TurboQuantConfig

try:  # optimum's quantizer interface, when the installed optimum has it
    from optimum.quantization_base import OptimumQuantizer as _QuantizerBase
except ImportError:  # pragma: no cover - same shape without optimum
    class _QuantizerBase:  # type: ignore[no-redef]
        pass

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}

_COPIED_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
_SKIPPED_FILES = {"model.safetensors.index.json", "config.json", "README.md", fmt.TQ_CONFIG_NAME}

# names of the scale tensors that quantized (FP8, block-scaled) checkpoints carry beside their weights
_SCALE_TENSOR = re.compile(r"^(.*)\.(weight_scale_inv|weight_scale|weight_scale_2|input_scale)$")

# Working memory per weight of a slice being quantized: the source slice, the quantizer's buffers (three float32
# ones, the int32 and uint8 indices, a 16-bit staging copy: codec.GroupQuantizer), the packed output.
_BYTES_PER_ELEMENT = 32
CPU_SLICE = 1 << 18  # weights per slice on CPU: the quantizer's buffers for it (5 MB) stay in the caches
CUDA_SLICE = 1 << 24  # 32 MB of bf16 a slice: large enough for the kernels, small enough for the host buffers
# devices whose slices are quantized by the worker pool; on the others (CUDA) the main thread quantizes
_POOLED_DEVICES = ("cpu",)
# threads that read ahead for a device, and slices on their way from the disk to the output (being read, waiting
# for the device, on it, being written)
_DEVICE_READERS = 4
_DEVICE_IN_FLIGHT = 8
# bytes per slice of a tensor copied as it is: no larger than a quantized slice's buffers, so that the allocator
# keeps returning them to the system (a larger freed block raises glibc's mmap threshold, and each worker's arena
# then holds on to its largest slices: benchmarks/CONVERT_SPEED.md, "Memory")
_COPY_SLICE = 1 << 20


@dataclass
class ConversionSummary:
    params_quantized: int = 0
    params_kept: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bytes_out_quantized: int = 0  # packed indices and norms
    seconds: float = 0.0
    shards: list = field(default_factory=list)
    shards_resumed: int = 0  # finished shards of an interrupted run that were kept
    params_processed: int = 0  # weights read and written by this run (less than the total after a resume)
    device: str = "cpu"
    peak_rss_before: int = 0  # the process's peak resident memory before the tensor work (libraries loaded), bytes
    peak_rss: int = 0  # ... and after it: the difference is the most the tensor work needed
    calibrated_blocks: int = 0  # blocks calibrated (`calibrate_streaming`), 0 when rounding to nearest
    peak_resident_weights: int = 0  # with calibration: the most bytes of the model's weights held at once

    @property
    def bits_per_weight(self) -> float:
        total = self.params_quantized + self.params_kept
        return 8 * self.bytes_out / total if total else 0.0

    @property
    def bits_per_quantized_weight(self) -> float:
        return 8 * self.bytes_out_quantized / self.params_quantized if self.params_quantized else 0.0

    @property
    def params_per_second(self) -> float:
        return self.params_processed / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["bits_per_weight"] = self.bits_per_weight
        d["bits_per_quantized_weight"] = self.bits_per_quantized_weight
        d["params_per_second"] = self.params_per_second
        return d

    def text(self) -> str:
        from ..reporting.card import human_bytes, human_count

        resumed = f", {self.shards_resumed} of them kept from the interrupted run" if self.shards_resumed else ""
        calibrated = (f"; calibrated {self.calibrated_blocks} blocks, at most {human_bytes(self.peak_resident_weights)}"
                      " of weights resident" if self.calibrated_blocks else "")
        return (f"quantized {human_count(self.params_quantized)} params, kept {human_count(self.params_kept)} in "
                f"full precision; {human_bytes(self.bytes_in)} in, {human_bytes(self.bytes_out)} out in "
                f"{len(self.shards)} shard{'s' if len(self.shards) != 1 else ''}{resumed}; "
                f"{self.bits_per_weight:.3f} bits per weight ({self.bits_per_quantized_weight:.3f} in the quantized "
                f"ones){calibrated}; {self.seconds:.1f} s, "
                f"{human_count(self.params_per_second)} params/s on {self.device}")


_QUANTIZABLE = ("BF16", "F16", "F32", "F64")


# ---------------------------------------------------------------------------------------------------------------
# the plan: one unit per output tensor (or pair of packed/norms tensors), sources concatenated along rows
@dataclass
class _Unit:
    name: str
    sources: list  # [SourceTensor], concatenated along rows in this order
    target: object = None  # the TurboQuantWeight from_pretrained would fill, or None: copied as it is
    outputs: list = field(default_factory=list)  # [(name, dtype, shape)]

    @property
    def nbytes_in(self) -> int:
        return sum(t.nbytes for t in self.sources)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.sources)


class StreamingQuantizer(_QuantizerBase):
    """Offline, streaming TurboQuant conversion of a local safetensors checkpoint folder."""

    def __init__(self, source_dir: str):
        self.source_dir = os.path.abspath(str(source_dir))
        if not os.path.isdir(self.source_dir):
            raise ConversionError(f"{source_dir}: no such directory")
        self.tensors = source_index(self.source_dir)
        config_path = os.path.join(self.source_dir, "config.json")
        if not os.path.isfile(config_path):
            raise ConversionError(f"{self.source_dir}: no config.json")
        with open(config_path) as f:
            self.config = json.load(f)
        self._check_supported()
        if self.mxfp4:
            self.tensors = mxfp4_pairs(self.tensors)
        self.index = {k: {"dtype": t.dtype, "shape": t.shape, "file": t.file} for k, t in self.tensors.items()}

    @classmethod
    def from_pretrained(cls, model_or_path, file_name=None):
        path = str(model_or_path)
        if not os.path.isdir(path):
            from ..reporting.card import looks_like_repo_id

            if not looks_like_repo_id(path):
                raise ConversionError(f"{model_or_path}: neither a local checkpoint folder nor a Hub repo id")
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, allow_patterns=["*.safetensors", "*.json", "*.jinja", "*.model",
                                                           "*.txt", "*.tiktoken", "README.md"])
        return cls(path)

    @property
    def largest_tensor_bytes(self) -> int:
        return max((t.nbytes for t in self.tensors.values()), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def _check_supported(self) -> None:
        """Refuse sources that are already quantized (FP8 with scale tensors, ...): never quantize their stored
        values as if they were the weights. MXFP4 (`quant_method` "mxfp4", gpt-oss's experts) is read as the
        bfloat16 values it decodes to (`shards.Mxfp4Tensor`); sets `self.mxfp4`."""
        self.mxfp4 = False
        for cfg in (self.config, self.config.get("text_config") or {}):
            qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
            if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4" and cfg is self.config:
                self.mxfp4 = True
                continue
            if qc:
                method = qc.get("quant_method", "?") if isinstance(qc, dict) else qc
                raise ConversionError(
                    f"{os.path.join(self.source_dir, 'config.json')}: the checkpoint is already quantized "
                    f"(quant_method {method!r}); the converter reads bf16, fp16 or fp32 weights only. Convert it to "
                    "bf16 first; nothing was written")
        for name, t in sorted(self.tensors.items()):
            scale = _SCALE_TENSOR.match(name)
            if t.dtype.startswith("F8") or (scale and scale.group(1) + ".weight" in self.tensors):
                raise ConversionError(
                    f"{t.file}: tensor {name} ({t.dtype}) belongs to a quantized checkpoint (FP8 weights with "
                    "scale tensors are not supported); the converter reads bf16, fp16 or fp32 weights only. "
                    "Nothing was written")

    # -- what gets quantized ---------------------------------------------------------------------------------
    def _targets(self, config: TurboQuantConfig) -> dict:
        """{output tensor name: the TurboQuantWeight from_pretrained would fill}; fills `self.expert_groups`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from ..modeling.modules import TurboQuantWeight
        from ..quantization.planning import checkpoint_to_model_keys
        from ..reporting.sizing import apply_plan

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
                    raise ConversionError(
                        f"{prefix}: the per-expert tensors do not cover experts 0..{n_experts - 1} for {fused}"
                    )
                self.expert_groups[fused_key] = [[parts[p][e] for p in sources] for e in range(n_experts)]
                targets[fused_key] = target
                found.add(model_key)
        missing = set(modules) - found
        if missing:
            raise ConversionError(
                f"{self.source_dir}: no source tensor for {min(missing)} (and {len(missing) - 1} more); "
                "layouts that transformers transforms while loading, other than per-expert experts, are not streamed yet"
            )
        for name, w in targets.items():
            if getattr(w, "rotation", "groups") != "groups":
                raise ConversionError(f"{name}: the streaming converter writes the {fmt.FORMAT_NAME} layout only")
            if w.source_transposed and len(w.source_shape) == 3 and not isinstance(self.tensors.get(name), Mxfp4Tensor):
                raise ConversionError(
                    f"{name}: experts stored [E, in, out] (gpt-oss, Llama 4) are not streamed in this version; "
                    "quantize them with from_pretrained and save_pretrained. Nothing was written")
        return targets

    def _plan(self, cfg: TurboQuantConfig, keep_dtype: str | None) -> list[_Unit]:
        targets = self._targets(cfg)
        self._n_targets = len(targets)
        self._orig_in_dims = {k: w.in_features for k, w in targets.items() if w.in_features % w.group_size}
        grouped = {k for members in self.expert_groups.values() for per in members for k in per}
        units = []
        for name in sorted([n for n in self.tensors if n not in grouped] + list(self.expert_groups)):
            if name in self.expert_groups:
                sources = [self.tensors[k] for per in self.expert_groups[name] for k in per]
            else:
                sources = [self.tensors[name]]
            target = targets.get(name)
            unit = _Unit(name, sources, target)
            if target is not None:
                for t in sources:
                    if t.dtype not in _QUANTIZABLE:
                        raise ConversionError(f"{t.file}: tensor {t.name} is stored as {t.dtype}; only bf16, fp16 and "
                                              "fp32 weights can be quantized. Nothing was written")
                    if t.row_width != target.in_features:
                        raise ConversionError(f"{t.file}: tensor {t.name} has shape {list(t.shape)}, the model expects "
                                              f"an input width of {target.in_features}")
                rows = sum(t.rows for t in sources)
                if rows != target.rows:
                    raise ConversionError(f"{name}: the source holds {rows} rows, the model expects {target.rows}")
                bpg = fmt.bytes_per_group(target.n_levels, target.group_size)
                norms_dtype = DTYPE_NAMES[target.norms_dtype]
                unit.outputs = [(name + fmt.PACKED_SUFFIX, "U8", (rows * target.n_groups, bpg)),
                                (name + fmt.NORMS_SUFFIX, norms_dtype, (rows, target.n_groups))]
            else:
                t = sources[0]
                if isinstance(t, Mxfp4Tensor):
                    raise ConversionError(f"{t.file}: {name} is stored in MXFP4 and this configuration does not "
                                          "quantize it; MXFP4 tensors are converted only into TurboQuant weights. "
                                          "Nothing was written")
                dtype = keep_dtype if keep_dtype and t.dtype in _QUANTIZABLE else t.dtype
                unit.outputs = [(name, dtype, t.shape)]
            units.append(unit)
        return units

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
        resume: bool = False,
        overwrite: bool = False,
        dtype: str | torch.dtype | None = None,
        base_model: str | None = None,
        model_card: bool = True,
        build_info: dict | None = None,
    ) -> ConversionSummary:
        """Convert into `save_dir`; return the summary (also printed when `progress`).

        max_memory: bytes of working memory the conversion may use on top of the Python process; refused when
        smaller than the largest source tensor. resume: keep the finished shards of an interrupted run into the
        same `save_dir` (same source, config and shard size), write the rest. overwrite: replace an existing
        `save_dir` once the new one is complete. dtype: cast the tensors kept in full precision (default: as
        stored); with calibration, also the dtype the blocks run in (as `from_pretrained(dtype=...)`). build_info:
        `{"command", "recipe"}` for the model card's build record.
        """
        cfg = quantization_config or TurboQuantConfig()
        self._check_budget(max_memory)
        keep_dtype = _keep_dtype(dtype)
        save_dir = self._check_output(save_dir, overwrite)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        calibrated = None
        if cfg.target_bits_per_weight is not None and cfg.calibration is None:
            from ..calibration.calibrate_streaming import _BUDGET_REFUSAL

            raise ConversionError(_BUDGET_REFUSAL)
        if cfg.calibration is not None:  # before the layout: it records the calibration data in the config
            from ..calibration.calibrate_streaming import StreamingCalibration

            calibrated = StreamingCalibration(self.source_dir, cfg, _torch_dtype(dtype), device)
        units = self._plan(cfg, keep_dtype)
        layout = shard_layout([o for unit in units for o in unit.outputs], max_shard_size)
        state = run_record(self.source_dir, self.tensors, cfg.to_dict(), keep_dtype, max_shard_size, layout)
        parent = os.path.dirname(save_dir)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(save_dir)}.partial")
        done_files = open_partial(tmp, state, layout, resume)
        summary = _summary(units, layout, done_files, device)
        start = time.perf_counter()
        try:
            self._convert(tmp, units, layout, done_files, device, max_memory, progress, summary, calibrated)
            self._write_side_files(tmp, cfg, layout, summary, keep_dtype)
            summary.seconds = time.perf_counter() - start
            summary.peak_rss = peak_rss()
            if model_card:
                self._write_card(tmp, save_dir, base_model, build_info)
            move_into_place(tmp, save_dir)
        except Exception:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except BaseException:  # interrupted: the finished shards stay for resume=True
            if progress is not False:
                print(f"interrupted; {tmp} keeps the finished shards: run again with resume=True (--resume) to "
                      "continue", file=sys.stderr)
            raise
        if progress is not False:
            print(summary.text(), file=sys.stderr)
        return summary

    def _check_budget(self, max_memory: int | None) -> None:
        """Refuse a working-memory budget smaller than the largest source tensor."""
        largest = self.largest_tensor_bytes
        if max_memory is not None and max_memory < largest:
            name = max(self.tensors.values(), key=lambda t: t.nbytes).name
            raise ValueError(
                f"--max-memory {max_memory:,} bytes is smaller than the largest tensor ({name}, {largest:,} bytes); "
                "nothing was written"
            )

    def _check_output(self, save_dir, overwrite: bool) -> str:
        """The absolute output folder, refused if it exists (unless `overwrite`) or overlaps the source."""
        save_dir = os.path.abspath(str(save_dir))
        if os.path.exists(save_dir) and not overwrite:
            raise FileExistsError(f"{save_dir} exists; remove it first or pass overwrite=True (--force); "
                                  "nothing was written")
        if os.path.commonpath([save_dir, self.source_dir]) in (save_dir, self.source_dir):
            raise ValueError(f"{save_dir}: the output must be outside the source folder {self.source_dir} "
                             "(the source is never modified)")
        return save_dir

    def _convert(self, out_dir, units, layout, done_files, device, max_memory, progress, summary,
                 calibrated=None) -> None:
        """Read, quantize and write every unit not already in a finished shard (see `_SlicePipeline`); with
        `calibrated` (`calibrate_streaming.StreamingCalibration`), its pass over the blocks writes their
        calibrated units first, through the same shard writer."""
        if calibrated is None:
            _SlicePipeline(out_dir, units, layout, done_files, device, max_memory).run(progress, summary)
            return
        writer = SliceWriter(out_dir, layout, done_files, _SlicePipeline.in_flight_for(device))
        try:
            written = calibrated.run(units, writer, summary, progress)
        except BaseException:
            writer.abort()
            raise
        summary.calibrated_blocks = calibrated.blocks_done
        summary.peak_resident_weights = calibrated.peak_resident
        rest = [u for u in units if u.name not in written]
        _SlicePipeline(out_dir, rest, layout, done_files, device, max_memory).run(progress, summary, writer)

    def _write_side_files(self, out_dir, cfg: TurboQuantConfig, layout, summary, keep_dtype) -> None:
        if len(layout) > 1:
            weight_map = {name: f for f, entries in layout for name, _, _ in entries}
            with open(os.path.join(out_dir, INDEX_NAME), "w") as fh:
                json.dump({"metadata": {"total_size": summary.bytes_out}, "weight_map": weight_map}, fh, indent=2)
        for entry in sorted(os.listdir(self.source_dir)):
            src = os.path.join(self.source_dir, entry)
            if os.path.isfile(src) and entry.endswith(_COPIED_SUFFIXES) and entry not in _SKIPPED_FILES:
                shutil.copy2(src, os.path.join(out_dir, entry))
        config = dict(self.config)
        config["quantization_config"] = cfg.to_dict()
        if keep_dtype:
            config.pop("torch_dtype", None)
            config["dtype"] = str(TORCH_DTYPES[keep_dtype]).replace("torch.", "")
        with open(os.path.join(out_dir, "config.json"), "w") as fh:
            json.dump(config, fh, indent=2)
        ckpt.write_tq_config(out_dir, cfg.to_tq_config(self._n_targets, self._orig_in_dims, self.source_dir))

    def _write_card(self, out_dir, save_dir, base_model, build_info) -> None:
        """The model card README.md, rendered from the files by the same generator save_pretrained uses."""
        info = build_info or {}
        try:
            from ..reporting import card as tq_card

            tq_card.write_build_record(out_dir, base_model=base_model, source=self.source_dir,
                                       command=info.get("command"), recipe=info.get("recipe"))
            tq_card.write_card(out_dir, base_model=base_model, repo_id=info.get("repo_id"),
                               name=os.path.basename(save_dir), source_dir=self.source_dir)
        except Exception as e:  # noqa: BLE001  (the weights are complete; a card that cannot be rendered must not lose them)
            import warnings

            warnings.warn(f"TurboQuant: converted the model but could not write its model card: {e}")


def _torch_dtype(dtype) -> torch.dtype | None:
    """`dtype` as a torch dtype (None: as stored, "auto")."""
    if dtype is None or str(dtype) == "auto":
        return None
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""))


def _keep_dtype(dtype) -> str | None:
    """The safetensors dtype to cast the tensors kept in full precision to (None: as stored)."""
    tdtype = _torch_dtype(dtype)
    return None if tdtype is None else DTYPE_NAMES[tdtype]


def _summary(units: list[_Unit], layout, done_files: set, device) -> ConversionSummary:
    """The summary of a run before its tensor work: what is quantized and kept, the bytes in and out."""
    summary = ConversionSummary(device=str(device), shards=[f for f, _ in layout],
                                shards_resumed=len(done_files), peak_rss_before=peak_rss())
    for unit in units:
        if unit.target is not None:
            summary.params_quantized += unit.numel
            summary.bytes_out_quantized += sum(math.prod(s) * ckpt.DTYPE_BYTES[d] for _, d, s in unit.outputs)
        else:
            summary.params_kept += unit.numel
        summary.bytes_in += unit.nbytes_in
    summary.bytes_out = sum(math.prod(s) * ckpt.DTYPE_BYTES[d] for _, e in layout for _, d, s in e)
    return summary


class _SlicePipeline:
    """Reads, quantizes and writes every unit not already in a finished shard, slice by slice.

    On CPU, slices are read and quantized by a pool of single-threaded workers (one per torch thread): whole
    slices in parallel, rather than every operation split across cores, which stalls at each of the ~80
    operations of a slice as soon as another process takes a core. On a device (CUDA), a pipeline: several
    threads read slices ahead into reusable host buffers (page-locked), the main thread copies each to the
    device on a copy stream, quantizes it there once the copy is done, and copies the results back into
    host buffers, all asynchronously; the writer thread waits for those copies. On both, a writer thread
    writes the slices in order at their fixed places in the shards, and syncs and renames a shard as soon as
    its last tensor is complete, while the next slices are read and quantized."""

    def __init__(self, out_dir, units, layout, done_files, device, max_memory):
        self.out_dir, self.layout, self.done_files, self.device = out_dir, layout, done_files, device
        where = {name: f for f, entries in layout for name, _, _ in entries}
        self.todo = [u for u in units if any(where[n] not in done_files for n, _, _ in u.outputs)]
        self.on_cpu = device.type in _POOLED_DEVICES
        self.cuda = device.type == "cuda" and not self.on_cpu
        self.workers = max(1, torch.get_num_threads()) if self.on_cpu else _DEVICE_READERS
        self.in_flight = self.in_flight_for(device)
        self.slice_elems = CPU_SLICE if self.on_cpu else CUDA_SLICE
        self.copy_bytes = _COPY_SLICE
        if max_memory is not None:  # every slice in flight at once, with its temporaries, within the budget
            self.slice_elems = max(1, min(self.slice_elems, max_memory // (self.in_flight * _BYTES_PER_ELEMENT)))
            self.copy_bytes = max(1, min(self.copy_bytes, max_memory // (self.in_flight * 4)))
        self.kernels = {}
        for unit in self.todo:
            target = unit.target
            if target is not None and (target.n_levels, target.group_size) not in self.kernels:
                self.kernels[target.n_levels, target.group_size] = codec.GroupQuantizer(
                    fmt.bits_for_levels(target.n_levels), target.group_size, device)
        self.buffers = self._host_buffers() if not self.on_cpu else None
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(device)
            self.copy_stream = torch.cuda.Stream(device)
        self.reader = SourceReader()

    @staticmethod
    def in_flight_for(device) -> int:
        """Slices on their way at once: on CPU the workers' (one per torch thread), one being written and one
        ready for the writer."""
        if device.type in _POOLED_DEVICES:
            return max(1, torch.get_num_threads()) + 2
        return _DEVICE_IN_FLIGHT

    def slice_rows(self, unit, t) -> int:
        return max(1, self.slice_elems // max(1, fmt.padded_width(t.row_width, unit.target.group_size)))

    def tasks(self):
        """Every slice, in order: (unit, source tensor, row offset of the source in the unit, first, last), where
        first/last are rows of a quantized source, or bytes of a tensor copied as it is."""
        for unit in self.todo:
            if unit.target is not None:
                offset = 0
                for t in unit.sources:
                    rows = self.slice_rows(unit, t)
                    for r0 in range(0, t.rows, rows):
                        yield unit, t, offset, r0, min(t.rows, r0 + rows)
                    offset += t.rows
            else:
                t = unit.sources[0]
                step = max(t.itemsize, self.copy_bytes // t.itemsize * t.itemsize)
                for b0 in range(0, max(t.nbytes, 1), step):
                    yield unit, t, 0, b0, min(t.nbytes, b0 + step)

    @staticmethod
    def result_shapes(unit, rows):
        (_, _, pshape), (_, ndtype, _) = unit.outputs
        n_groups = pshape[0] // unit.target.rows
        return (rows * n_groups, pshape[1]), (rows, n_groups), TORCH_DTYPES[ndtype]

    def _host_buffers(self) -> HostBuffers:
        """Host buffers as large as the largest slice of a quantized tensor."""
        in_bytes = out_bytes = 0
        for unit in self.todo:
            for t in unit.sources if unit.target is not None else ():
                rows = min(t.rows, self.slice_rows(unit, t))
                pshape, nshape, ndtype = self.result_shapes(unit, rows)
                in_bytes = max(in_bytes, rows * t.row_width * t.itemsize)
                n_norms = math.prod(nshape) * torch.empty((), dtype=ndtype).element_size()
                out_bytes = max(out_bytes, -(-n_norms // 64) * 64 + math.prod(pshape))
        return HostBuffers(in_bytes, out_bytes, pin=self.cuda)

    def quantize(self, unit, t, data, r0):
        from ..modeling.modules import to_norms_dtype

        name = t.name if len(unit.sources) == 1 else f"{unit.name} ({t.name})"
        packed, norms = self.kernels[unit.target.n_levels, unit.target.group_size](data, name, r0)
        return packed, to_norms_dtype(norms, TORCH_DTYPES[unit.outputs[1][1]], name=unit.name)

    def work(self, task):
        """In a worker thread: a slice read (and, on CPU, quantized)."""
        unit, t, _, a, b = task
        if unit.target is None:
            data = self.reader.read(t, a, b - a)
            out_dtype = unit.outputs[0][1]
            return data if out_dtype == t.dtype else data.view(TORCH_DTYPES[t.dtype]).to(TORCH_DTYPES[out_dtype])
        if self.on_cpu:
            return self.quantize(unit, t, self.reader.rows(t, a, b), a)
        pair = self.buffers.take()
        try:
            return pair, self.reader.rows(t, a, b, out=pair[0])
        except BaseException:
            self.buffers.give(pair)
            raise

    def on_device(self, unit, t, a, b, pair, rows):
        """Quantize a slice read into host buffers: (packed, norms) in the pair's output buffer, and the event
        after which they are there (None: already there)."""
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                x = rows.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
            self.compute_stream.wait_event(copied)  # the kernels below wait for the copy, the host does not
            x.record_stream(self.compute_stream)  # x's memory is reused only once they are done with it
        else:
            x = rows.to(self.device)  # on CPU the host buffer itself, which the quantizer may change: it is ours
        packed, norms = self.quantize(unit, t, x, a)
        packed_host, norms_host = HostBuffers.results(pair[1], *self.result_shapes(unit, b - a))
        packed_host.copy_(packed, non_blocking=self.cuda)
        norms_host.copy_(norms, non_blocking=self.cuda)
        if not self.cuda:
            return packed_host, norms_host, None
        done = torch.cuda.Event(blocking=True)
        done.record(self.compute_stream)
        return packed_host, norms_host, done

    def write(self, writer, task, result, summary) -> int:
        """Hand a finished slice to the writer; returns the source bytes it covered."""
        unit, t, offset, a, b = task
        if unit.target is None:
            name, out_dtype, _ = unit.outputs[0]
            writer.put([(name, a // t.itemsize * ckpt.DTYPE_BYTES[out_dtype], result)],
                       [name] if b >= t.nbytes else ())
            summary.params_processed += (b - a) // t.itemsize
            return b - a
        ready = release = None
        if self.on_cpu:
            packed, norms = result
        else:
            pair, rows = result
            packed, norms, ready = self.on_device(unit, t, a, b, pair, rows)
            release = lambda pair=pair: self.buffers.give(pair)
        (pname, _, pshape), (nname, _, _) = unit.outputs
        row = offset + a
        n_groups = pshape[0] // unit.target.rows
        last = t is unit.sources[-1] and b == t.rows
        writer.put([(pname, row * n_groups * pshape[1], packed),
                    (nname, row * n_groups * norms.element_size(), norms)],
                   (pname, nname) if last else (), ready, release)
        summary.params_processed += (b - a) * t.row_width
        return (b - a) * t.row_width * t.itemsize

    def run(self, progress, summary, writer: SliceWriter | None = None) -> None:
        """Write every unit to do; `writer`: a shard writer already holding other tensors (made for
        `in_flight_for(device)` slices), closed here like the pipeline's own."""
        from tqdm.auto import tqdm

        total = sum(u.nbytes_in for u in self.todo)
        bar = tqdm(total=total, unit="B", unit_scale=True, disable=None if progress is None else not progress,
                   desc="quantizing", file=sys.stderr, dynamic_ncols=True)
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="turboquant-convert",
                                  initializer=torch.set_num_threads if self.on_cpu else None,
                                  initargs=(1,) if self.on_cpu else ())
        if writer is None:
            writer = SliceWriter(self.out_dir, self.layout, self.done_files, self.in_flight)
        ahead: deque = deque()
        it = self.tasks()
        shown = None
        closed = False

        def submit() -> None:  # read the next slice, once fewer than in_flight are on their way
            task = next(it, None)
            if task is not None:
                writer.reserve()
                ahead.append((task, pool.submit(self.work, task)))

        try:
            for _ in range(self.in_flight):
                submit()
            while ahead:
                task, fut = ahead.popleft()
                result = fut.result()
                if task[0] is not shown:
                    bar.set_postfix_str(task[0].name, refresh=False)
                    shown = task[0]
                bar.update(self.write(writer, task, result, summary))
                del result
                submit()
            writer.close()
            closed = True
        finally:
            for _, fut in ahead:
                fut.cancel()
            pool.shutdown(wait=True)
            if not closed:
                writer.abort()
            self.reader.close()
            bar.close()
