"""Calibrated quantization of a loaded float model, one decoder layer at a time.

`calibrate_model(model, config, batches)` quantizes every module `planning.from_config(model, config)` plans into the
same TurboQuant modules the round-to-nearest path builds, choosing indices and norms with `gptq.gptq_rotated`
against the input Hessians of real activations:

1. the stack of blocks is found (the `nn.ModuleList` holding most of the planned modules: `model.layers`,
   `encoder.layer`, `transformer.h`, ...); one forward of the float model per batch, stopped at the last block,
   records each block's inputs (the hidden states of the first, and every block's keyword arguments: position
   embeddings, masks, which may differ from block to block); blocks the forward does not run (extra prediction
   layers) are left to step 3;
2. for each block in turn: hooks accumulate `sum X^T X` of every planned Linear's input over all batches (modules fed
   the same tensor, like q/k/v, share one), and per expert of fused MoE experts the Hessians of the tokens routed to
   it (`down_proj`: that expert's intermediate activations); each weight is quantized, the block's modules are
   replaced, and the block runs again with its quantized weights to give the next block its inputs. Only one block's
   Hessians exist at a time;
3. planned modules outside the stack are rounded to nearest.

An expert's projection uses its own Hessian when the expert saw at least as many routed tokens as the projection has
inputs (and at least `min_expert_tokens`); otherwise the Hessian pooled over all experts of its layer
(`expert_fallback="pooled"`, the default) or round-to-nearest (`"rtn"`): a Hessian of fewer tokens than inputs
overfits (benchmarks/QUALITY.md, Decisions).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..format import codec
from ..modeling.activations import gated
from ..modeling.experts_layout import EXPERT_BLOCKS, published
from ..modeling.modules import (
    TurboQuantExperts,
    is_conv1d,
    replace_experts_modules,
    replace_linear_modules,
)
from ..quantization import planning
from . import distillation
from .gptq import ROUNDING_OPTIONS, gptq_rotated

METHOD = "gptq-rotated"
DRIVER_OPTIONS = {"min_expert_tokens": 16, "expert_fallback": "pooled"}
OPTIONS = {**ROUNDING_OPTIONS, **DRIVER_OPTIONS}


def resolve_options(options: dict | None) -> dict:
    """`CalibrationConfig.options` over the defaults; an unknown name or a bad value is an error naming it."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"CalibrationConfig.options: unknown option(s) {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(OPTIONS))})")
    out = {**OPTIONS, **options}
    if out["expert_fallback"] not in ("pooled", "rtn"):
        raise ValueError(f"CalibrationConfig.options: expert_fallback must be 'pooled' or 'rtn', got "
                         f"{out['expert_fallback']!r}")
    for key in ("sweeps", "block_size", "min_expert_tokens"):
        if isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < (0 if key == "min_expert_tokens"
                                                                                     else 1):
            raise ValueError(f"CalibrationConfig.options: {key} must be a positive integer, got {out[key]!r}")
    return out


class _Stop(Exception):
    """Raised by the pre-hook of the last block: the rest of the forward is not needed."""


def find_block_stack(model: nn.Module, plan: planning.Plan) -> tuple[str, nn.ModuleList] | None:
    """(name, list) of the `nn.ModuleList` holding the most planned modules, or None when none holds any."""
    planned = list(plan.linears) + list(plan.experts)
    best, best_count = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            count = sum(p.startswith(name + ".") for p in planned)
            if count > best_count:
                best, best_count = (name, module), count
    return best


def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, batches,
                         run_blocks: bool = True) -> tuple[list, list[list]]:
    """(hidden, calls): the first block's hidden states per batch, and per block per batch its (args without the
    hidden states, kwargs, whether the hidden states were passed by keyword). `run_blocks=False`: every block
    passes its hidden states through unchanged instead of running (its weights need not be loaded: the streaming
    driver), which records the same calls wherever a block's arguments do not depend on the blocks before it."""
    device = _model_device(model)
    calls: list[list] = [[] for _ in blocks]
    hidden: list = []

    def hook(index):
        def record(module, args, kwargs):
            by_keyword = not args
            hs = kwargs.get("hidden_states") if by_keyword else args[0]
            kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            calls[index].append((tuple(args[1:]), kwargs, by_keyword))
            if index == 0:
                hidden.append(hs)
            if index == len(blocks) - 1:
                raise _Stop
        return record

    handles = [b.register_forward_pre_hook(hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    if not run_blocks:
        for b in blocks:
            b.forward = _pass_through
    try:
        for batch in batches:
            try:
                model(input_ids=batch.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
        if not run_blocks:
            for b in blocks:
                del b.forward
    if len(hidden) != len(batches) or any(len(c) > len(batches) for c in calls):
        raise RuntimeError("calibration: the forward did not pass through the blocks once per batch")
    return hidden, calls


def _pass_through(*args, **kwargs):
    return kwargs["hidden_states"] if not args else args[0]


def _run_block(block, hs, call):
    args, kwargs, by_keyword = call
    out = block(**kwargs, hidden_states=hs) if by_keyword else block(hs, *args, **kwargs)
    return out if isinstance(out, torch.Tensor) else out[0]


def _model_device(model) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# Hessians
class InputHessians:
    """Hooks that accumulate `sum X^T X` of each Linear's input (float32) while they are active (`with`), one
    Hessian shared by modules fed the same tensor in a forward (call `new_batch()` before each forward), and per
    expert of fused experts modules. Both `collect_input_hessians` (one block) and the bit budget's statistics
    (`budget.collect_statistics`, the whole model) use it."""

    def __init__(self, linears: dict[str, nn.Module], experts: dict[str, tuple[nn.Module, planning.ExpertsPlan]]):
        self.linears, self.experts = linears, experts
        self.hessians: dict[str, torch.Tensor] = {}
        self.owner: dict[str, str] = {}  # module -> the module whose Hessian it shares
        self.expert_hessians: dict[str, list] = {}
        self.seen: dict = {}

    def __enter__(self):
        self.handles = []
        for name, module in self.linears.items():
            self.handles.append(module.register_forward_pre_hook(self._linear_hook(name)))
        for name, (module, plan) in self.experts.items():
            self.handles.append(module.register_forward_pre_hook(self._experts_hook(name, module, plan),
                                                                 with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.seen = {}

    def new_batch(self):
        self.seen = {}  # (tensors stay referenced for the batch: no address is reused by another tensor)

    def _linear_hook(self, name):
        def hook(module, args):
            x = args[0]
            key = (x.data_ptr(), tuple(x.shape), x.stride())
            if name not in self.owner:
                self.owner[name] = self.seen[key][0] if key in self.seen else name
            if key not in self.seen:
                self.seen[key] = (name, x)
            if self.owner[name] == name:
                x2 = x.detach().reshape(-1, x.shape[-1]).float()
                h = x2.t() @ x2
                if name in self.hessians:
                    self.hessians[name] += h
                else:
                    self.hessians[name] = h
        return hook

    def _experts_hook(self, name, module, plan: planning.ExpertsPlan):
        lay = plan.layout
        gate_up = published(module.gate_up_proj, lay)  # [E, 2I, H] whatever the storage
        bias = module.gate_up_proj_bias if lay.bias else None

        def hook(mod, args, kwargs):
            values = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "router_indices") if k in kwargs]
            e, two_i, h = gate_up.shape
            if name not in self.expert_hessians:
                dev = values[0].device
                self.expert_hessians[name] = [torch.zeros(e, h, h, device=dev), torch.zeros(e, two_i // 2, two_i // 2,
                                                                                             device=dev),
                                              torch.zeros(e, dtype=torch.int64)]
            hgu, hdn, counts = self.expert_hessians[name]
            for expert, x in _expert_inputs(values, lay, e):
                hgu[expert] += x.t() @ x
                gu = x @ gate_up[expert].float().t()
                if bias is not None:
                    gu = gu + bias[expert].float()
                inner = gated(gu, plan.activation, lay.interleaved, lay.alpha, lay.limit)
                hdn[expert] += inner.t() @ inner
                counts[expert] += x.shape[0]
        return hook

    def hessian(self, name: str) -> torch.Tensor:
        return self.hessians[self.owner.get(name, name)]


def collect_input_hessians(block: nn.Module, hidden: list, calls: list, linears: dict[str, nn.Module],
                           experts: dict[str, tuple[nn.Module, str]] | None = None) -> InputHessians:
    """Run `block` over every batch and accumulate its input Hessians: `acc.hessian(name)` for each Linear of
    `linears` (`{name: module}`), `acc.expert_hessians[name] = [gate_up (E, H, H), down (E, I, I), tokens (E,)]`
    for each experts module of `experts` (`{name: (module, activation)}`)."""
    acc = InputHessians(linears, experts or {})
    with acc, torch.no_grad():
        for hs, call in zip(hidden, calls):
            acc.new_batch()
            _run_block(block, hs, call)
    return acc


def _expert_inputs(values: list, layout, e: int):
    """(expert, its input rows (n, H) float32) for each expert with inputs in an experts forward's arguments `values`:
    the tokens routed to it (hidden states, top-k indices), or with `EXPERT_BLOCKS` inputs the nonzero rows of its
    block."""
    hs = values[0].detach().reshape(-1, values[0].shape[-1]).float()
    if layout.inputs == EXPERT_BLOCKS:
        blocks = hs.view(e, -1, hs.shape[-1])
        for expert in range(e):
            rows = blocks[expert][blocks[expert].ne(0).any(-1)]
            if rows.shape[0]:
                yield expert, rows
        return
    routed = values[1].reshape(hs.shape[0], -1)
    for expert in range(e):
        tokens = (routed == expert).any(-1).nonzero().squeeze(1)
        if tokens.numel():
            yield expert, hs[tokens]


# ---------------------------------------------------------------------------------------------------------------
# quantizing and replacing
def _linear_weight(module: nn.Module) -> torch.Tensor:
    w = module.weight.detach()
    return w.t() if is_conv1d(module) else w


def _install_linear(model, name: str, plan: planning.LinearPlan, packed, norms) -> None:
    old = model.get_submodule(name)
    bias = old.bias.detach() if old.bias is not None else None
    replace_linear_modules(model, {name: plan}, awaiting_weights=False)
    new = model.get_submodule(name)
    new.weight.load_packed_(packed, norms)
    if bias is not None:
        new.bias.data.copy_(bias)


def _install_experts(model, name: str, plan: planning.ExpertsPlan, gate_up, down) -> None:
    old = model.get_submodule(name)
    replace_experts_modules(model, {name: plan}, awaiting_weights=False)
    new: TurboQuantExperts = model.get_submodule(name)
    new.gate_up_proj.load_packed_(*gate_up)
    new.down_proj.load_packed_(*down)
    biases = ("gate_up_proj_bias", "down_proj_bias") if plan.layout.bias else ()
    for attr in biases:
        setattr(new, attr, nn.Parameter(getattr(old, attr).detach().clone(), requires_grad=False))
    for attr in ("gate_up_proj", "down_proj", *biases):  # the replaced module keeps its shapes only (for dequantize())
        p = getattr(old, attr)
        setattr(old, attr, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))


def _experts_weights(module, plan: planning.ExpertsPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The (gate_up [E, 2I, H], down [E, H, I]) matrices of a float experts module, one row per output channel
    whatever its storage (`experts_layout.published`)."""
    return (published(module.gate_up_proj.detach(), plan.layout),
            published(module.down_proj.detach(), plan.layout))


def _quantize_experts(module, hessians, plan: planning.ExpertsPlan, damping: float, options: dict):
    """Packed (gate_up, down) of a fused experts module, expert by expert (expert-major rows)."""
    hgu, hdn, counts = hessians
    pooled = (hgu.sum(0), hdn.sum(0))
    out = []
    gate_up, down = _experts_weights(module, plan)
    for weight, per_expert, pool, bits in ((gate_up, hgu, pooled[0], plan.gate_up_bits),
                                           (down, hdn, pooled[1], plan.down_bits)):
        packed, norms = [], []
        for e in range(weight.shape[0]):
            w = weight[e].detach()
            if counts[e] >= max(options["min_expert_tokens"], weight.shape[-1], 1):
                p, n = _gptq(w, per_expert[e], bits, plan.group_size, damping, options)
            elif options["expert_fallback"] == "pooled" and int(counts.sum()) > 0:
                p, n = _gptq(w, pool, bits, plan.group_size, damping, options)
            else:
                p, n = codec.quantize_weight(w, bits, plan.group_size)
            packed.append(p)
            norms.append(n)
        out.append((torch.cat(packed), torch.cat(norms)))
    return out


def _gptq(weight, hessian, bits, group_size, damping, options, name="weight"):
    return gptq_rotated(weight, hessian, bits, group_size, damping, sweeps=options["sweeps"],
                        block_size=options["block_size"], name=name)


def rtn_quantize(model: nn.Module, plan: planning.Plan) -> None:
    """Round-to-nearest for the planned modules of a loaded float model (the bytes quantizing on load gives)."""
    for name, p in plan.linears.items():
        w = _linear_weight(model.get_submodule(name))
        _install_linear(model, name, p, *codec.quantize_weight(w, p.bits, p.group_size, name=name))
    for name, p in plan.experts.items():
        gate_up, down = _experts_weights(model.get_submodule(name), p)
        _install_experts(model, name, p, codec.quantize_weight(gate_up, p.gate_up_bits, p.group_size),
                         codec.quantize_weight(down, p.down_bits, p.group_size))


@torch.no_grad()
def calibrate_model(model: nn.Module, config, batches, progress=None) -> dict:
    """Quantize the float `model` in place as `config` plans, calibrated on `batches` (token-id tensors, (1, T) each);
    see the module docstring. `progress(i, n)`: called after the i-th of n blocks (from 1). Returns a summary
    (method, blocks, seconds)."""
    if not batches:
        raise ValueError("calibration needs at least one batch of token ids")
    damping, options = settings(config.calibration)
    cal = config.calibration
    block_steps, block_lr = (cal.block_steps, cal.block_lr) if cal is not None else (0, 0.0)
    tuning: list = []
    start = time.perf_counter()
    plan = planning.from_config(model, config)
    found = find_block_stack(model, plan)
    was_training = model.training
    model.eval()
    blocks_done = 0
    if found is not None:
        stack_name, blocks = found
        hidden, calls = capture_block_inputs(model, blocks, batches)
        blocks_done = calibrate_blocks(model, plan, stack_name, hidden, calls, damping, options, progress=progress,
                                       block_steps=block_steps, block_lr=block_lr, tuning=tuning)
        del hidden, calls
    rtn_quantize(model, plan)  # planned modules outside the stack
    model.train(was_training)
    summary = {"method": METHOD, "blocks": blocks_done, "seconds": time.perf_counter() - start,
               **record_settings(config.calibration)}
    if block_steps > 0:
        summary["block_tuned"] = tuning_record(tuning, block_steps, block_lr, len(batches))
    return summary


def tuning_record(tuning: list, steps: int, lr: float, n_batches: int) -> dict:
    """What `calibrated_with["block_tuned"]` records of the block-wise tuning: its settings, the blocks tuned and
    kept, the mean relative squared error of the blocks' outputs on the checking sequences before and after (a
    block whose tuning was undone counts with its error before)."""
    kept = [t for t in tuning if t["kept"]]
    n = max(len(tuning), 1)
    return {"parameters": "group norms and vector parameters", "steps": steps, "lr": lr, "blocks": len(tuning),
            "kept": len(kept), "held_out_sequences": distillation.held_out(n_batches) if n_batches > 1 else 0,
            "error_before": round(sum(t["error_before"] for t in tuning) / n, 6),
            "error_after": round(sum(t["error_after"] if t["kept"] else t["error_before"] for t in tuning) / n, 6)}


def settings(cal) -> tuple[float, dict]:
    """(damping, every rounding option) of a `CalibrationConfig` (None: the defaults)."""
    return (cal.damping if cal is not None else 0.01), resolve_options(cal.options if cal is not None else None)


def record_settings(cal) -> dict:
    """The settings a `calibrated_with` record names: damping, and the options that differ from the defaults."""
    damping, options = settings(cal)
    return {"damping": damping, "options": {k: v for k, v in options.items() if v != OPTIONS[k]}}


def calibrate_blocks(model: nn.Module, plan: planning.Plan, stack_name: str, hidden: list, calls: list,
                     damping: float, options: dict, onload=None, offload=None, progress=None,
                     block_steps: int = 0, block_lr: float = 1e-2, tuning: list | None = None) -> int:
    """The pass over the block stack that both drivers share (`calibrate_model`, and the streaming converter's,
    which holds one block's weights at a time). For each block the forward ran once per batch, in order:
    `onload(i, block)` (the streaming driver loads the block's weights), `calibrate_block`, the block run again on
    its quantized weights to give the next block its inputs, `offload(i, block, results)` (the streaming driver
    writes the results and frees the block), `progress(i + 1, n)`. `hidden`: the first block's inputs per batch,
    `calls`: each block's recorded calls (`capture_block_inputs`). The modules done are removed from `plan`;
    returns the number of blocks done.

    `block_steps` > 0: each block's group norms and vector parameters are tuned after its rounding
    (`distillation.tune_block`, learning rate `block_lr`) to the float block's outputs on the float model's hidden
    states, which this pass then carries beside the quantized model's (the float block runs once per batch before
    the rounding); each block's record is appended to `tuning`, and the results handed to `offload` hold the tuned
    norms."""
    blocks = model.get_submodule(stack_name)
    n_batches = len(hidden)
    done = 0
    hidden_float = list(hidden) if block_steps > 0 else None
    for i, block in enumerate(blocks):
        if len(calls[i]) != n_batches:  # a block the forward does not run (its modules: round-to-nearest)
            break
        if onload is not None:
            onload(i, block)
        prefix = f"{stack_name}.{i}."
        linears = {n: p for n, p in plan.linears.items() if n.startswith(prefix)}
        experts = {n: p for n, p in plan.experts.items() if n.startswith(prefix)}
        if hidden_float is not None:
            with torch.no_grad():
                targets = [_run_block(block, hs, call) for hs, call in zip(hidden_float, calls[i])]
        results = calibrate_block(model, block, hidden, calls[i], linears, experts, damping, options)
        for n in list(linears) + list(experts):
            plan.linears.pop(n, None)
            plan.experts.pop(n, None)
        if hidden_float is not None:
            record = distillation.tune_block(block, hidden, calls[i], targets, _run_block, block_steps, block_lr)
            for name in linears:
                results[name] = (results[name][0], model.get_submodule(name).weight.tq_norms.float().clone())
            if tuning is not None:
                tuning.append(record)
            hidden_float = targets
        if i + 1 < len(blocks) and len(calls[i + 1]) == n_batches:
            with torch.no_grad():
                hidden = [_run_block(block, hs, call) for hs, call in zip(hidden, calls[i])]
        if offload is not None:
            offload(i, block, results)
        done += 1
        if progress is not None:
            progress(i + 1, len(blocks))
    return done


def calibrate_block(model, block, hidden, calls, linears: dict, experts: dict, damping, options) -> dict:
    """Calibrate the planned modules of one block (`linears`: {name: LinearPlan}, `experts`: {name: ExpertsPlan})
    on its inputs, quantize them and install the TurboQuant modules in `model`. Returns {Linear name: (packed,
    norms)} and {experts name: ((gate_up packed, norms), (down packed, norms))}, norms float32."""
    modules = {n: model.get_submodule(n) for n in linears}
    experts_modules = {n: (model.get_submodule(n), p) for n, p in experts.items()}
    acc = collect_input_hessians(block, hidden, calls, modules, experts_modules)
    results = {}
    shared: dict = {}  # modules with one Hessian, bit width and group size: quantized as one stacked weight
    for name, p in linears.items():
        w = _linear_weight(modules[name])
        if name in acc.owner:
            shared.setdefault((acc.owner[name], p.bits, p.group_size), []).append((name, w))
        else:  # not reached by the forward
            results[name] = codec.quantize_weight(w, p.bits, p.group_size, name=name)
    for (owner, bits, group_size), members in shared.items():
        stacked = torch.cat([w for _, w in members]) if len(members) > 1 else members[0][1]
        packed, norms = _gptq(stacked, acc.hessian(owner), bits, group_size, damping, options,
                              name=", ".join(n for n, _ in members))
        row = 0
        n_groups = norms.shape[1]
        for name, w in members:
            rows = w.shape[0]
            results[name] = (packed[row * n_groups:(row + rows) * n_groups].clone(), norms[row:row + rows].clone())
            row += rows
    for n, p in experts.items():
        module = experts_modules[n][0]
        if n in acc.expert_hessians:
            results[n] = _quantize_experts(module, acc.expert_hessians[n], p, damping, options)
        else:  # never reached by a token
            gate_up, down = _experts_weights(module, p)
            results[n] = (codec.quantize_weight(gate_up, p.gate_up_bits, p.group_size),
                          codec.quantize_weight(down, p.down_bits, p.group_size))
    del acc
    for name, p in linears.items():
        _install_linear(model, name, p, *results[name])
    for name, p in experts.items():
        _install_experts(model, name, p, *results[name])
    return results
