"""Mixed precision under a bit budget: `TurboQuantConfig(target_bits_per_weight=...)`.

The budget is counted in stored bits per quantized weight: for each tensor the plan quantizes
(`planning.from_config`), the bytes the checkpoint holds for it (`rows * groups * (packed bytes per group + norm
bytes)`, from `format.constants`, padding of the last group included) times 8, summed over those tensors and
divided by the number of weights they encode. At G = 128 a 3-bit tensor costs 3 + 32/128 = 3.25 bits per weight,
a 4-bit one 4.25, a 2-bit one 2.25, a ternary one 26 * 8 / 128 + 16 / 128 = 1.75.

`allocate_bits` measures how much each free Linear (one not matched by a user `module_bits` pattern) loses at each
candidate width, starts every free tensor at the cheapest width and takes upgrades greedily by loss saved per
extra stored bit until no further upgrade fits the budget. Fused experts modules keep the bits of the config and
count at their stored size.

Sensitivity measures (`MEASURES`):
  * "auto" (the default): the allocations of "fisher" and of "energy" (one statistics pass gives both), each
    rounded to nearest and judged by its measured mean KL(base || quantized) on the same batches; the lower wins.
    Neither proxy wins on every model (benchmarks/BUDGET.md: Fisher on SmolLM2-135M, energy on Gemma-3-270M at
    3.5 bits), and one extra forward per batch and candidate tells them apart;
  * "fisher": for each Linear, `sum_j g_j^2 (dW H dW^T)_jj`, the output error of the round-to-nearest weight
    error dW under the input Hessian H = sum X^T X, weighted per output channel by the mean squared gradient g_j^2
    of the language-model loss with respect to that output (a diagonal Fisher estimate of the loss increase);
  * "energy": `tr(dW H dW^T) / tr(W H W^T)`, the output error relative to the output's own energy;
  * "weight": `||dW||_F^2`, weight-only (no data);
  * "kl": the measured mean KL(base || quantized) of the final logits with that tensor alone rounded at each
    width (one forward per tensor and width: the ground truth the others are judged against; expensive).

The widths are the config's bits and 4, and 2 when the target is below what the config's
bits alone cost (a downgrade is then needed).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..format import constants as fmt
from ..format.codec import dequantize_weight, quantize_weight
from ..format.shards import available_memory
from ..modeling.experts_layout import stored_shape
from ..modeling.modules import is_conv1d
from ..quantization import planning

MEASURES = ("auto", "fisher", "energy", "weight", "kl")
DEFAULT_MEASURE = "auto"
AUTO_CANDIDATES = ("fisher", "energy")


# ---------------------------------------------------------------------------------------------------------------
# accounting
def stored_bits(bits, rows: int, in_features: int, group_size: int) -> int:
    """Bits the checkpoint stores for a (rows, in_features) tensor at `bits`: packed indices plus group norms."""
    n_levels = fmt.levels_for_bits(bits)
    groups = -(-in_features // group_size)
    norm_bytes = torch.empty(0, dtype=fmt.default_norms_dtype(n_levels)).element_size()
    return rows * groups * (fmt.bytes_per_group(n_levels, group_size) + norm_bytes) * 8


def quantized_tensors(model: nn.Module, config) -> tuple[dict[str, tuple[int, int]], dict[str, tuple]]:
    """({Linear name: (rows, in_features)}, {fixed tensor name: (bits, rows, in_features)}) of the plan; fused
    experts modules appear among the fixed ones as `name.gate_up_proj` and `name.down_proj`."""
    plan = planning.from_config(model, config)
    linears = {}
    for name in plan.linears:
        w = _weight(model.get_submodule(name))
        linears[name] = (w.shape[0], w.shape[1])
    fixed = {}
    for name, p in plan.experts.items():
        module = model.get_submodule(name)
        e, two_i, h = stored_shape(module.gate_up_proj.shape, p.layout)  # (packed [E, out, in], whatever the storage)
        fixed[name + ".gate_up_proj"] = (p.gate_up_bits, e * two_i, h)
        e, h_out, i = stored_shape(module.down_proj.shape, p.layout)
        fixed[name + ".down_proj"] = (p.down_bits, e * h_out, i)
    return linears, fixed


def user_fixed(name: str, config) -> bool:
    return any(re.search(pattern, name) for pattern in config.module_bits)


def bits_per_weight(model: nn.Module, config, assignment: dict[str, object] | None = None) -> float:
    """Stored bits per quantized weight of `config` on `model`, with `assignment` ({Linear name: bits}) overriding
    the config's width for those Linears."""
    linears, fixed = quantized_tensors(model, config)
    assignment = assignment or {}
    total = weights = 0
    for name, (rows, cols) in linears.items():
        total += stored_bits(assignment.get(name, config.bits_for(name)), rows, cols, config.group_size)
        weights += rows * cols
    for bits, rows, cols in fixed.values():
        total += stored_bits(bits, rows, cols, config.group_size)
        weights += rows * cols
    if weights == 0:
        raise ValueError("target_bits_per_weight: the config quantizes no tensor of this model")
    return total / weights


def default_widths(config, allow_lower: bool = False) -> tuple:
    """The candidate widths: the config's bits and 4, and 2 with `allow_lower`."""
    widths = {config.bits, 4}
    if allow_lower:
        widths.add(2)
    return tuple(sorted(widths))


def _weight(module: nn.Module) -> torch.Tensor:
    w = module.weight.detach()
    return w.t() if is_conv1d(module) else w


def _rounded(weight: torch.Tensor, bits, group_size: int) -> torch.Tensor:
    """The round-to-nearest TurboQuant reconstruction of a (rows, in) weight, float32."""
    packed, norms = quantize_weight(weight.float(), bits, group_size)
    return dequantize_weight(packed, norms, weight.shape[1], group_size)


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# statistics
def collect_statistics(model: nn.Module, names, batches, gradients: bool = True) -> tuple[dict, dict, int]:
    """({name: sum X^T X of its input}, {name: sum over tokens of the squared loss gradient per output channel},
    tokens) over `batches`, for the Linears `names`. The Hessians are those calibrated rounding uses
    (`sequential.InputHessians`: modules fed the same tensor share one); the gradients are of the next-token
    cross-entropy of the model on the batches (omitted with `gradients=False`)."""
    from .sequential import InputHessians

    grads: dict[str, torch.Tensor] = {}
    handles = []

    def out_hook(name):
        def hook(module, args, out):
            if out.requires_grad:
                def grad_hook(g):
                    s = g.detach().reshape(-1, g.shape[-1]).float().pow(2).sum(0)
                    grads[name] = grads[name] + s if name in grads else s
                out.register_hook(grad_hook)
        return hook

    modules = {n: model.get_submodule(n) for n in names}
    if gradients:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(out_hook(name)))
    inputs = InputHessians(modules, {})
    device = _device(model)
    # gradients flow from the embeddings' output, none into the parameters (no parameter gradient is stored)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if gradients:
        for p in trainable:
            p.requires_grad_(False)
        handles.append(model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
    tokens = 0
    try:
        with inputs:
            for batch in batches:
                inputs.new_batch()
                ids = batch.to(device)
                tokens += ids.numel()
                if gradients:
                    with torch.enable_grad():
                        logits = model(input_ids=ids, use_cache=False).logits
                        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
                        loss.backward()
                else:
                    with torch.no_grad():
                        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        if gradients:
            for p in trainable:
                p.requires_grad_(True)
    hessians = {n: inputs.hessian(n) for n in names if n in inputs.owner}
    missing = [n for n in names if n not in hessians or (gradients and n not in grads)]
    if missing:
        raise RuntimeError(f"budget: the forward over the batches did not reach {', '.join(missing[:3])}"
                           f"{' ...' if len(missing) > 3 else ''} (no input or output gradient recorded)")
    return hessians, grads, tokens


def _base_log_probs(model, batches, device) -> list[torch.Tensor]:
    with torch.no_grad():
        return [F.log_softmax(model(input_ids=b.to(device), use_cache=False).logits[0].float(), -1) for b in batches]


def _mean_kl(model, batches, base_lp, device) -> float:
    total = n = 0.0
    with torch.no_grad():
        for batch, lp in zip(batches, base_lp):
            q = F.log_softmax(model(input_ids=batch.to(device), use_cache=False).logits[0].float(), -1)
            total += (lp.exp() * (lp - q)).sum().item()
            n += lp.shape[0]
    return total / n


def sensitivities(model: nn.Module, config, batches, measure: str = "fisher", widths=None,
                  names=None) -> dict[str, dict]:
    """{Linear name: {bits: loss}} for each width of `widths` (default `default_widths(config)`) and each free
    Linear of the plan (or `names`), under `measure` (one of `MEASURES` but "auto", which chooses between whole
    allocations in `allocate_bits`). Lower is better; only differences between widths of one tensor, and across
    tensors, matter."""
    if measure not in MEASURES:
        raise ValueError(f"sensitivity measure must be one of {', '.join(MEASURES)}, got {measure!r}")
    if measure == "auto":
        raise ValueError('sensitivities: "auto" chooses between whole allocations (allocate_bits) and has no '
                         'per-tensor losses; ask for "fisher", "energy", "weight" or "kl"')
    widths = tuple(widths) if widths is not None else default_widths(config)
    if names is None:
        linears, _ = quantized_tensors(model, config)
        names = [n for n in linears if not user_fixed(n, config)]
    g = config.group_size
    if measure == "weight":
        out = {}
        for name in names:
            w = _weight(model.get_submodule(name)).float()
            out[name] = {b: (_rounded(w, b, g) - w).pow(2).sum().item() for b in widths}
        return out
    if measure == "kl":
        return _kl_sensitivities(model, names, batches, widths, g)
    hessians, grads, _ = collect_statistics(model, names, batches, gradients=measure == "fisher")
    return hessian_losses(model, names, hessians, grads, widths, g)[measure]


def hessian_losses(model: nn.Module, names, hessians: dict, grads: dict | None, widths, group_size: int) -> dict:
    """{"energy": {name: {bits: loss}}, "fisher": ... (only with `grads`)}: both Hessian measures from one rounding
    of each tensor at each width (`collect_statistics` gives `hessians` and `grads`)."""
    out = {"energy": {}}
    if grads:
        out["fisher"] = {}
    for name in names:
        w = _weight(model.get_submodule(name)).float()
        h = hessians[name]
        energy = ((w @ h) * w).sum().item()
        for measure in out:
            out[measure][name] = {}
        for b in widths:
            dw = _rounded(w, b, group_size) - w
            per_row = ((dw @ h) * dw).sum(1)
            out["energy"][name][b] = per_row.sum().item() / max(energy, 1e-30)
            if grads:
                out["fisher"][name][b] = (grads[name] * per_row).sum().item()
    return out


def measured_kl(model: nn.Module, config, assignments: dict[str, dict], batches,
                resident: bool | None = None) -> dict[str, float]:
    """{label: mean KL(base || quantized) over the tokens of `batches`} for each `assignments[label]` ({Linear
    name: bits}; the other Linears of the plan at the config's bits), every Linear of the plan rounded to nearest
    (fused experts stay as they are: they are at the config's bits under every assignment). Each tensor is rounded
    once per width in use and shared between the assignments that use it; the float weights are back in place on
    return.

    `resident=True` keeps every rounded weight in memory at the weight's dtype (about the model's size again, once
    per extra width); `False` keeps only its packed codes and norms and rebuilds each weight just before its module
    runs (one dequantization per module, batch and assignment; a fraction of the model's size, one module's weight
    at a time). The two give the same numbers. `None`: resident when the rounded weights fit in half of the free
    memory of the model's device."""
    linears, _ = quantized_tensors(model, config)
    device = _device(model)
    modules = {name: model.get_submodule(name) for name in linears}
    originals = {name: module.weight.data for name, module in modules.items()}
    widths = dict.fromkeys((name, a.get(name, config.bits_for(name))) for a in assignments.values() for name in modules)
    if resident is None:
        needed = sum(originals[name].numel() * originals[name].element_size() for name, _ in widths)
        free = _free_bytes(device)
        resident = free is None or needed <= free // 2

    def rebuild(name, packed, norms):
        q = dequantize_weight(packed, norms, _weight(modules[name]).shape[1], config.group_size)
        return (q.t() if is_conv1d(modules[name]) else q).contiguous().to(originals[name].dtype)

    stored = {}
    for name, b in widths:
        codes = quantize_weight(_weight(modules[name]).float(), b, config.group_size)
        stored[name, b] = rebuild(name, *codes) if resident else codes
    active: dict[str, object] = {}  # {name: bits} of the assignment being run (rebuilt weights only)
    hooks = []
    if not resident:
        for name, module in modules.items():
            def before(module, args, name=name):
                if active:
                    module.weight.data = rebuild(name, *stored[name, active[name]])

            def after(module, args, output, name=name):
                module.weight.data = originals[name]

            hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    totals = dict.fromkeys(assignments, 0.0)
    positions = 0
    try:
        with torch.no_grad():
            for batch in batches:
                ids = batch.to(device)
                base = F.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
                positions += base.shape[0] * base.shape[1]
                for label, assignment in assignments.items():
                    chosen = {name: assignment.get(name, config.bits_for(name)) for name in modules}
                    if resident:
                        for name, module in modules.items():
                            module.weight.data = stored[name, chosen[name]]
                    else:
                        active.update(chosen)
                    try:
                        q = F.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
                    finally:
                        active.clear()
                        for name, module in modules.items():
                            module.weight.data = originals[name]
                    totals[label] += (base.exp() * (base - q)).sum().item()
                del base
    finally:
        for hook in hooks:
            hook.remove()
        for name, module in modules.items():
            module.weight.data = originals[name]
    return {label: total / max(positions, 1) for label, total in totals.items()}


def _free_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` (CUDA: the driver's free memory; else the host's), None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return available_memory()
    return None


def _kl_sensitivities(model, names, batches, widths, group_size) -> dict[str, dict]:
    device = _device(model)
    base_lp = _base_log_probs(model, batches, device)
    out = {}
    for name in names:
        module = model.get_submodule(name)
        original = module.weight.data.clone()
        w = _weight(module).float()
        out[name] = {}
        try:
            for b in widths:
                q = _rounded(w, b, group_size)
                module.weight.data.copy_((q.t() if is_conv1d(module) else q).to(original.dtype))
                out[name][b] = _mean_kl(model, batches, base_lp, device)
        finally:
            module.weight.data.copy_(original)
    return out


# ---------------------------------------------------------------------------------------------------------------
# allocation
def greedy(costs: dict[str, dict], losses: dict[str, dict], available: float) -> dict[str, object]:
    """Start every tensor at its cheapest width and take the upgrade (to any wider width) with the largest loss
    saved per extra stored bit that still fits in `available` extra bits, until none fits. `costs[name][bits]` are
    stored bits, `losses[name][bits]` the sensitivity."""
    choice = {name: min(c, key=c.get) for name, c in costs.items()}
    spent = 0.0
    while True:
        best = None
        for name, current in choice.items():
            for b, cost in costs[name].items():
                extra = cost - costs[name][current]
                if extra <= 0 or spent + extra > available:
                    continue
                gain = (losses[name][current] - losses[name][b]) / extra
                if best is None or gain > best[0]:
                    best = (gain, name, b, extra)
        if best is None:
            return choice
        _, name, b, extra = best
        choice[name] = b
        spent += extra


def allocate_bits(model: nn.Module, config, batches, measure: str = DEFAULT_MEASURE, widths=None,
                  allow_lower: bool | None = None, report: dict | None = None) -> dict[str, object]:
    """{Linear name: bits} for the free Linears of the plan of `config` on the float `model`, meeting
    `config.target_bits_per_weight` (stored bits per quantized weight, norms included, over every tensor the plan
    quantizes; module docstring) exactly or below it by less than one upgrade. Linears matched by a `module_bits`
    pattern of the user keep their bits and count at them. `batches`: (1, T) token tensors for the measure;
    `measure`: one of `MEASURES`; `widths`: the candidate widths (default `default_widths(config, allow_lower)`;
    `allow_lower=None`: 2 bits is a candidate only when the target is below the config's own widths' cost).
    `report`, if given, receives what was chosen: "measure" (for "auto", the candidate that won) and, for "auto",
    "kl" ({candidate: measured mean KL on the batches})."""
    if measure not in MEASURES:
        raise ValueError(f"sensitivity measure must be one of {', '.join(MEASURES)}, got {measure!r}")
    if widths is None:
        if allow_lower is None:
            target = config.target_bits_per_weight
            allow_lower = target is not None and config.bits > 2 and target < bits_per_weight(model, config) - 1e-9
        widths = default_widths(config, allow_lower)
    widths = tuple(widths)
    accounting = _accounting(model, config, widths)
    if not accounting[0]:
        return {}
    names = list(accounting[0])
    batches = list(batches)
    report = report if report is not None else {}
    if measure != "auto":
        report["measure"] = measure
        losses = sensitivities(model, config, batches, measure, widths, names=names)
        return allocate_from(model, config, losses, widths, accounting)
    hessians, grads, _ = collect_statistics(model, names, batches, gradients=True)
    losses = hessian_losses(model, names, hessians, grads, widths, config.group_size)
    del hessians, grads
    candidates = {m: allocate_from(model, config, losses[m], widths, accounting) for m in AUTO_CANDIDATES}
    distinct = {}
    for m, chosen in candidates.items():
        if chosen not in distinct.values():
            distinct[m] = chosen
    kl = measured_kl(model, config, distinct, batches) if len(distinct) > 1 else dict.fromkeys(distinct, float("nan"))
    best = min(distinct, key=lambda m: (kl[m], AUTO_CANDIDATES.index(m)))
    report.update(measure=best, kl={m: kl.get(m, kl[best]) for m in candidates})
    return candidates[best]


def _accounting(model, config, widths):
    """(costs {free name: {bits: stored bits}}, stored bits of the fixed tensors, weights quantized), after
    refusing a target outside [cheapest, dearest]."""
    target = config.target_bits_per_weight
    if target is None:
        raise ValueError("allocate_bits: the config has no target_bits_per_weight")
    for b in widths:
        fmt.check_bits(b)
    linears, fixed = quantized_tensors(model, config)
    g = config.group_size
    free = [n for n in linears if not user_fixed(n, config)]
    total_weights = sum(r * c for r, c in linears.values()) + sum(r * c for _, r, c in fixed.values())
    if total_weights == 0:
        raise ValueError("target_bits_per_weight: the config quantizes no tensor of this model")
    fixed_bits = sum(stored_bits(config.bits_for(n), r, c, g) for n, (r, c) in linears.items() if n not in free)
    fixed_bits += sum(stored_bits(b, r, c, g) for b, r, c in fixed.values())
    costs = {n: {b: stored_bits(b, *linears[n], g) for b in widths} for n in free}
    cheapest = (fixed_bits + sum(min(c.values()) for c in costs.values())) / total_weights
    dearest = (fixed_bits + sum(max(c.values()) for c in costs.values())) / total_weights
    if not cheapest - 1e-9 <= target <= dearest + 1e-9:
        raise ValueError(
            f"target_bits_per_weight {target} cannot be met with widths {', '.join(map(str, widths))} on this "
            f"model: the cheapest assignment stores {cheapest:.4f} bits per weight and the dearest {dearest:.4f} "
            f"(stored bits per quantized weight, group norms included)")
    return costs, fixed_bits, total_weights


def allocate_from(model: nn.Module, config, losses: dict[str, dict], widths, accounting=None) -> dict[str, object]:
    """`allocate_bits` from sensitivities already measured (`losses[name][bits]`, e.g. from `sensitivities`)."""
    costs, fixed_bits, total_weights = accounting or _accounting(model, config, tuple(widths))
    start = sum(min(c.values()) for c in costs.values())
    available = config.target_bits_per_weight * total_weights - fixed_bits - start
    return greedy(costs, {n: losses[n] for n in costs}, available)


def fixed_rule(model: nn.Module, config, patterns, high=4) -> dict[str, object]:
    """A rule for comparison: Linears whose name matches any regex of `patterns` at `high` bits, taken in order
    (largest loss saved first is unknown, so in model order) while they fit the budget; the rest at the config's
    bits."""
    linears, _ = quantized_tensors(model, config)
    choice = {}
    g = config.group_size
    total = sum(r * c for r, c in linears.values())
    base = sum(stored_bits(config.bits_for(n), r, c, g) for n, (r, c) in linears.items())
    available = config.target_bits_per_weight * total - base
    for name, (r, c) in linears.items():
        if user_fixed(name, config) or not any(re.search(p, name) for p in patterns):
            continue
        extra = stored_bits(high, r, c, g) - stored_bits(config.bits_for(name), r, c, g)
        if extra <= available:
            choice[name] = high
            available -= extra
    return choice
