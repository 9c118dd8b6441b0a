"""Every attribute of transformers that turboquant_hf replaces: what each replacement changes, and why no public
hook does it. No other module of the package assigns to transformers' classes, modules or registries, or replaces
a method of a model instance; `tests/test_patches.py` lists what a process that loads TurboQuant models has
replaced and fails on anything that is not named in `PROCESS_WIDE` or `ON_MODELS`.

What goes through public interfaces instead, and is no patch: the `turboquant` method in transformers' quantizer
registry (`register_quantization_config` / `register_quantizer`, `registration.py`, which replaces only an entry
of its own and leaves another package's in place) and every loader hook of `TurboQuantHfQuantizer` (`quantizer.py`).
Nor are the data the quantizer sets on the model it is loading, which transformers reads for exactly that purpose
(`_keys_to_ignore_on_load_*` for turboquant-mlx files, `_weight_conversions` for saving, the tp plan's entries for
experts under tensor parallelism), or the forwards that tensor parallelism gives this package's own modules.

Process-wide, installed once by `install()` (from `turboquant_hf.register()`, which importing the package runs):

1. `PreTrainedConfig.get_config_dict` (a classmethod): after transformers has read the config dict,
   `loading.complete_config_dict` gives it the TurboQuant `quantization_config` a published checkpoint describes
   in `tq_config.json` only (found in the folder, or for a Hub repo in the local Hub cache: it asks the Hub for
   nothing), rewrites a turboquant-mlx block into this package's config, and lets the inner config of a composite
   checkpoint inherit the outer one. Every config class reads through this one classmethod.
   No public hook: transformers builds a quantizer only from the `quantization_config` of the config it read;
   every HfQuantizer hook runs on a quantizer, so none runs for a checkpoint whose config.json names none (and
   transformers rejects a block without `quant_method` before any quantizer exists).
2. `PreTrainedModel._adjust_missing_and_unexpected_keys` (private): after it, `loading.check_loaded_keys` raises
   when TurboQuant tensors went unused or TurboQuant modules got no tensors, instead of returning a model with
   freshly initialised weights in their place.
   No public hook: the loader's record of missing and unexpected keys (after its renames and prefix changes) is
   handed to no quantizer hook (`_process_model_after_weight_loading` gets the model only), and when no quantizer
   was built (TurboQuant tensors that no config describes) no hook runs at all.

Process-wide, on first need (`wrap_parallel_styles`, from the quantizer, when a TurboQuant model loads with a
`distributed_config`, i.e. a tp or ep plan in use):

3. The entries of transformers' parallel style registry (`ALL_PARALLEL_STYLES`) that the model's plans name are
   wrapped (`tensor_parallel.TurboQuantStyle`, `ExpertDispatchStyle`), and `turboquant_experts` is added. The
   wrapper shards TurboQuant modules and hands every other module to transformers' own style, unchanged.
   No public hook: transformers looks styles up by name in this one registry, and tests the names themselves
   (`get_kv_heads_per_rank` looks for "colwise" on k_proj, expert parallelism for "ep_dispatch_experts", PEFT for
   "colwise"/"rowwise"), so TurboQuant modules must be sharded under the plan's own names.
   `HfQuantizer.update_parallel_plan` (5.25) / `update_tp_plan` (5.17) can change a plan, not what a name does.

On TurboQuant model instances (`patch_model`, from the quantizer's `_process_model_after_weight_loading`;
`unpatch_model` when `dequantize()` makes the model an ordinary one); the class keeps transformers' methods:

4. `save_pretrained` and `push_to_hub`: transformers' save, then `tq_config.json`, the model card and the
   tokenizer beside the weights (`saving.py`), uploaded after the card is written; or, for a model holding one
   tensor-parallel rank's slices, a refusal (the checkpoint would be partial).
   No public hook: the quantizer's save hooks (`is_serializable`, `get_state_dict_and_metadata`) are not given
   the folder, and nothing of the quantizer runs after transformers has written it.
5. `num_parameters`: transformers' count plus the weights the packed tensors encode.
   No public hook: it counts `named_parameters()` (bitsandbytes' 4-bit case is special-cased inside it), and the
   packed tensors are buffers.

On a model being quantized while it loads, until loading ends (`answer_placeholder_lookups`, from
`_process_model_before_weight_loading`; removed in `_process_model_after_weight_loading`):

6. `get_parameter_or_buffer` also answers for a weight that a TurboQuant module replaced (`q_proj.weight`) with
   a meta placeholder of the full-precision tensor.
   No public hook: the loader looks such names up itself (device-map sizing, allocator warm-up) after the
   quantizer has replaced the modules, and no hook is asked.
"""

from __future__ import annotations

import types

# What tests/test_patches.py may find replaced: attributes of transformers' classes, and methods of a loaded
# TurboQuant model instance (the parallel styles of 3. are replaced only while a tp or ep plan is in use).
PROCESS_WIDE = (
    "transformers.configuration_utils.PreTrainedConfig.get_config_dict",
    "transformers.modeling_utils.PreTrainedModel._adjust_missing_and_unexpected_keys",
)
ON_MODELS = ("num_parameters", "push_to_hub", "save_pretrained")

_MARK = "_turboquant_patch"


def install() -> None:
    """Patches 1 and 2 (idempotent)."""
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.modeling_utils import PreTrainedModel

    from . import loading

    get_config_dict = PreTrainedConfig.__dict__["get_config_dict"].__func__
    if not getattr(get_config_dict, _MARK, False):
        def get_config_dict_with_turboquant(cls, pretrained_model_name_or_path, **kwargs):
            config_dict, rest = get_config_dict(cls, pretrained_model_name_or_path, **kwargs)
            return loading.complete_config_dict(cls, pretrained_model_name_or_path, config_dict, kwargs), rest

        setattr(get_config_dict_with_turboquant, _MARK, True)
        get_config_dict_with_turboquant.__doc__ = get_config_dict.__doc__
        PreTrainedConfig.get_config_dict = classmethod(get_config_dict_with_turboquant)

    adjust = PreTrainedModel._adjust_missing_and_unexpected_keys
    if not getattr(adjust, _MARK, False):
        def adjust_and_check(self, loading_info):
            adjust(self, loading_info)
            loading.check_loaded_keys(self, loading_info)

        setattr(adjust_and_check, _MARK, True)
        adjust_and_check.__doc__ = adjust.__doc__
        PreTrainedModel._adjust_missing_and_unexpected_keys = adjust_and_check


def wrap_parallel_styles(styles: dict) -> None:
    """Patch 3: `{style name: wrapper class}`; each registry entry is wrapped once for the process (a name the
    registry lacks is added, wrapping nothing)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    for style, kind in styles.items():
        original = ALL_PARALLEL_STYLES.get(style)
        if not isinstance(original, kind):
            type(ALL_PARALLEL_STYLES).register(style, kind(style, original))


def patch_model(model, refuse_saving=None) -> None:
    """Patches 4 and 5 on `model`; `refuse_saving` (a function that raises): what its save methods do instead
    (a model holding one tensor-parallel rank's slices)."""
    from . import saving

    if refuse_saving is not None:
        model.save_pretrained = refuse_saving
        model.push_to_hub = refuse_saving
    else:
        model.save_pretrained = types.MethodType(saving.save_pretrained, model)
        model.push_to_hub = types.MethodType(saving.push_to_hub, model)
    model.num_parameters = types.MethodType(_num_parameters, model)


def unpatch_model(model) -> None:
    """Back to transformers' own methods (a dequantized model is an ordinary one)."""
    for name in ON_MODELS:
        model.__dict__.pop(name, None)


def _num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """transformers' count, plus the weights each TurboQuant tensor encodes (frozen: not trainable), so that a
    quantized model reports the parameter count of the model it stands for."""
    from ..modeling.modules import TurboQuantWeight

    total = type(self).num_parameters(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    if only_trainable:
        return total
    return total + sum(m.rows * m.in_features for m in self.modules() if isinstance(m, TurboQuantWeight))


def answer_placeholder_lookups(model) -> None:
    """Patch 6 on `model`, until `end_placeholder_lookups`."""
    import torch

    from ..modeling.modules import TurboQuantWeight

    original = model.get_parameter_or_buffer

    def get_parameter_or_buffer(self, target: str):
        try:
            return original(target)
        except AttributeError:
            try:
                sub = self.get_submodule(target)
            except AttributeError:
                sub = None
            if isinstance(sub, TurboQuantWeight) and sub.awaiting_dtype is not None:
                return torch.empty(sub.checkpoint_shape, dtype=sub.awaiting_dtype, device="meta")
            raise

    model.get_parameter_or_buffer = types.MethodType(get_parameter_or_buffer, model)


def end_placeholder_lookups(model) -> None:
    model.__dict__.pop("get_parameter_or_buffer", None)
