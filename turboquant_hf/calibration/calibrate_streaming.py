"""Calibrated rounding in the streaming converter, with one decoder block's weights resident at a time.

`StreamingQuantizer.quantize(..., quantization_config=TurboQuantConfig(calibration=...))` writes the tensors that
`from_pretrained(src, quantization_config=cfg, dtype=...)` followed by `save_pretrained` writes (the same
`sequential.calibrate_blocks` pass on the same inputs), without holding the model:

1. the model is built from its config with every parameter on the meta device (buffers, such as rotary
   frequencies, are computed as usual on the CPU or the chosen device);
2. the calibration batches run through the layers before the block stack, whose weights are read from the
   safetensors when a module first runs (the input embeddings, mostly); each block passes its hidden states through
   unchanged, so that only its call (position embeddings, masks) is recorded; those weights are then dropped;
3. for each block: its weights are read (only its tensors, by positioned reads), `sequential.calibrate_block`
   quantizes its planned modules, the block runs on its quantized weights to give the next block its inputs, the
   packed tensors are handed to the converter's shard writer, and the block's tensors go back to the meta device;
4. the converter's slice pipeline writes every other tensor: those kept as they are, and the planned modules
   outside the stack (or of blocks the forward does not run), rounded to nearest as `calibrate_model` does.

Resident weights: the most of (the layers before the stack that the forward runs, one block); the calibration
activations (`samples * sequence_length * hidden size` per block input, float) come on top. Data-free calibration
needs the whole model to generate text and is refused; a bit budget (`target_bits_per_weight`) is refused too (its
Fisher measure needs the loss gradient through the whole model).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch import nn

from ..format.shards import TORCH_DTYPES, ConversionError, SliceWriter, SourceReader
from ..modeling.modules import to_norms_dtype
from ..quantization import planning
from . import sequential
from .data import _kind, calibration_batches, describe


@contextmanager
def parameters_on_meta():
    """While active, every parameter a module registers is created on the meta device; buffers are not."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers that are not on the meta device (shared tensors once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta" and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Put `tensor` (None: an empty one on the meta device) in the place of the parameter or buffer `name`."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if tensor is None:
        old = _get_tensor(model, name)
        tensor = torch.empty(old.shape, dtype=old.dtype, device="meta")
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor


class StreamingCalibration:
    """The calibrated pass of one streaming conversion (see the module docstring). Built before the output layout
    is fixed: it chooses the calibration batches and sets `config.calibrated_with`."""

    def __init__(self, source_dir: str, config, dtype, device: torch.device):
        from transformers import AutoConfig, AutoModelForCausalLM

        cal = config.calibration
        if _kind(cal.data) == "data-free":
            raise ConversionError("calibration data 'data-free': the streaming converter holds one block at a time "
                                  "and cannot generate text with the model; give a text file (or strings, token ids, "
                                  "a dataset), or quantize with the model loaded whole")
        if config.target_bits_per_weight is not None:
            raise ConversionError(_BUDGET_REFUSAL)
        if cal.distill_steps:
            raise ConversionError("CalibrationConfig(distill_steps=...): distillation runs the whole model forward "
                                  "and backward, and the streaming converter holds one block at a time; quantize "
                                  "with the model loaded whole, or set distill_steps=0")
        if cal.block_steps:
            raise ConversionError("CalibrationConfig(block_steps=...): the block-wise tuning changes the blocks' "
                                  "vector parameters, which the streaming converter copies from the source; quantize "
                                  "with the model loaded whole, or set block_steps=0")
        self.damping, self.options = sequential.settings(cal)
        self.device = device
        model_config = AutoConfig.from_pretrained(source_dir)
        dtype = dtype if dtype is not None else _auto_dtype(model_config)
        with parameters_on_meta(), torch.device(device):
            self.model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        self.model.eval()
        self.batches = calibration_batches(cal, self.model)
        config.calibrated_with = {**describe(cal, self.batches), "method": sequential.METHOD}
        config.calibrated_with["damping"] = self.damping
        options = sequential.record_settings(cal)["options"]
        if options:
            config.calibrated_with["options"] = options
        self.plan = planning.from_config(self.model, config)
        found = sequential.find_block_stack(self.model, self.plan)
        if found is None:
            raise ConversionError(f"{source_dir}: no stack of blocks holds the quantized modules; calibrate with the "
                                  "model loaded whole")
        self.stack_name, self.blocks = found
        self.peak_resident = 0
        self.blocks_done = 0

    # -- the source tensors of the model's parameters ----------------------------------------------------------
    def _sources(self, units) -> None:
        """{model tensor name: unit}, for every unit (its sources concatenated give the tensor)."""
        names = [u.name for u in units]
        keys = planning.checkpoint_to_model_keys(self.model, names)
        self.unit_of = {keys[u.name]: u for u in units}

    def _load(self, names) -> None:
        for name in names:
            unit = self.unit_of.get(name)
            if unit is None:
                raise ConversionError(f"no source tensor for {name}: the streaming calibration reads every weight a "
                                      "block uses from the checkpoint")
            old = _get_tensor(self.model, name)
            parts = [self.reader.rows(t, 0, t.rows) if t.shape else self.reader.read(t, 0, t.nbytes).view(
                TORCH_DTYPES[t.dtype]) for t in unit.sources]
            data = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1)
            if data.numel() != old.numel():
                raise ConversionError(f"{unit.name}: {data.numel()} values in the checkpoint, the model's {name} "
                                      f"has shape {list(old.shape)}")
            _set_tensor(self.model, name, data.view(old.shape).to(device=self.device, dtype=old.dtype))
        self.peak_resident = max(self.peak_resident, resident_bytes(self.model))

    def _meta_names(self, module: nn.Module, prefix: str, recurse: bool) -> list[str]:
        tensors = list(module.named_parameters(prefix=prefix, recurse=recurse)) + \
            list(module.named_buffers(prefix=prefix, recurse=recurse))
        return [n for n, t in tensors if t.device.type == "meta"]

    def _release(self, prefix: str, module: nn.Module) -> None:
        for name, t in list(module.named_parameters(prefix=prefix)) + list(module.named_buffers(prefix=prefix)):
            if t.device.type != "meta":
                _set_tensor(self.model, name, None)

    # -- the pass ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> tuple[list, list]:
        """The first block's inputs and every block's calls, the layers before the stack loaded as they run."""
        stack = self.stack_name + "."

        def onload(name):
            def hook(module, args):
                self._load(self._meta_names(module, name, recurse=False))
            return hook

        outside = [(n, m) for n, m in self.model.named_modules() if n != self.stack_name and not n.startswith(stack)]
        handles = [m.register_forward_pre_hook(onload(n)) for n, m in outside]
        try:
            hidden, calls = sequential.capture_block_inputs(self.model, self.blocks, self.batches, run_blocks=False)
        except (RuntimeError, NotImplementedError) as e:
            if "meta" not in str(e):
                raise
            raise ConversionError(f"the streaming calibration could not run the layers before the block stack of "
                                  f"{type(self.model).__name__} with weights loaded as they run ({e}); calibrate with "
                                  "the model loaded whole") from e
        finally:
            for h in handles:
                h.remove()
        for name, module in outside:
            for pname, t in list(module.named_parameters(prefix=name, recurse=False)) + \
                    list(module.named_buffers(prefix=name, recurse=False)):
                if t.device.type != "meta" and pname in self.unit_of:  # read from the checkpoint: dropped
                    _set_tensor(self.model, pname, None)
        return hidden, calls

    def run(self, units, writer: SliceWriter, summary, progress) -> set[str]:
        """Calibrate every block the forward runs and hand its packed tensors to `writer`; returns the names of
        the units written."""
        from tqdm.auto import tqdm

        self._sources(units)
        self.reader = SourceReader()
        written: set[str] = set()
        bar = tqdm(total=len(self.blocks), unit="block", desc="calibrating", file=sys.stderr, dynamic_ncols=True,
                   disable=None if progress is None else not progress)

        def onload(i, block):
            self._load(self._meta_names(block, f"{self.stack_name}.{i}", recurse=True))

        def offload(i, block, results):
            for name, result in results.items():
                if name in self.plan_experts:
                    pairs = ((name + ".gate_up_proj", result[0]), (name + ".down_proj", result[1]))
                else:
                    pairs = ((name + ".weight", result),)
                for key, (packed, norms) in pairs:
                    written.add(self._write(writer, key, packed, norms, summary))
            self._release(f"{self.stack_name}.{i}", block)
            bar.update()

        try:
            hidden, calls = self.capture()
            self.peak_resident = max(self.peak_resident, resident_bytes(self.model))
            self.plan_experts = set(self.plan.experts)
            self.blocks_done = sequential.calibrate_blocks(self.model, self.plan, self.stack_name, hidden, calls,
                                                            self.damping, self.options, onload, offload)
        finally:
            self.reader.close()
            bar.close()
        return written

    def _write(self, writer: SliceWriter, key: str, packed: torch.Tensor, norms: torch.Tensor, summary) -> str:
        unit = self.unit_of.get(key)
        if unit is None or unit.target is None:
            raise ConversionError(f"{key}: calibrated, but the converter's plan does not quantize it")
        (pname, _, pshape), (nname, ndtype, nshape) = unit.outputs
        norms = to_norms_dtype(norms.float(), TORCH_DTYPES[ndtype], name=unit.name)
        if tuple(packed.shape) != tuple(pshape) or tuple(norms.shape) != tuple(nshape):
            raise ConversionError(f"{unit.name}: calibrated tensors of shapes {list(packed.shape)}, "
                                  f"{list(norms.shape)}; the layout expects {list(pshape)}, {list(nshape)}")
        writer.reserve()
        writer.put([(pname, 0, packed.contiguous().cpu()), (nname, 0, norms.contiguous().cpu())], (pname, nname))
        summary.params_processed += unit.numel
        return unit.name


_BUDGET_REFUSAL = ("target_bits_per_weight: the streaming converter holds one block at a time and cannot measure the "
                   "budget's sensitivities (the Fisher measure needs the loss gradient through the whole model); "
                   "allocate bits with the model loaded whole")


def _auto_dtype(model_config) -> torch.dtype:
    """The dtype `from_pretrained` loads the model in when none is given: the config's, else float32."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for c in (model_config, config):
        d = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None)
        if d is not None:
            return d if isinstance(d, torch.dtype) else getattr(torch, str(d).replace("torch.", ""))
    return torch.float32
