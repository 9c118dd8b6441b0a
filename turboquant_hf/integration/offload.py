"""TurboQuant weights under accelerate's offload hooks (`device_map` with "cpu"/"disk", `offload_buffers=True`)."""

from __future__ import annotations

from ..modeling.modules import TurboQuantExperts, TurboQuantLinear, TurboQuantWeight


def disk_offloaded_modules(model) -> set[str]:
    """Names of the modules whose tensors accelerate offloads (`device_map` "disk", `offload_buffers=True`): their
    tensors stay on the meta device and its hooks bring them in for each forward."""
    return {name for name, module in model.named_modules() if offloads(module)}


def offloads(module) -> bool:
    """Whether an accelerate hook on `module` (alone or in a `SequentialHook`) offloads its tensors."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    return any(getattr(h, "offload", False) for h in hooks)


def onload_weights_with_owner(model) -> int:
    """accelerate hooks each module's own tensors into place around that module's forward; a TurboQuantWeight (the
    packed tensors) has no forward of its own, so its offload hook runs around its owner's (the TurboQuantLinear or
    TurboQuantExperts that computes with it). Returns how many weights it attached."""
    count = 0
    for owner in model.modules():
        if not isinstance(owner, (TurboQuantLinear, TurboQuantExperts)):
            continue
        children = [c for c in owner.children() if isinstance(c, TurboQuantWeight) and offloads(c)]
        if not children or getattr(owner, "_tq_onload_children", None) is not None:
            continue

        def pre(module, args, kwargs, children=tuple(children)):
            for c in children:
                c._hf_hook.pre_forward(c)

        def post(module, args, output, children=tuple(children)):
            for c in children:
                c._hf_hook.post_forward(c, None)

        owner._tq_onload_children = (owner.register_forward_pre_hook(pre, with_kwargs=True),
                                     owner.register_forward_hook(post))
        count += len(children)
    return count


def under(name: str, owners: set[str]) -> bool:
    """Whether module `name` is one of `owners` or inside one (the empty name owns every module)."""
    return any(name == o or name.startswith(o + ".") or o == "" for o in owners)
