"""How transformers finds TurboQuant checkpoints, and the check that no load hands back random weights.

transformers builds a quantizer only from the `quantization_config` of the loaded config. Three ways a TurboQuant
checkpoint can reach the loader without a usable one are closed here (`complete_config_dict`):

- the published checkpoints describe themselves in `tq_config.json` only: when a folder has that file (or, for a
  Hub repo, the local Hub cache holds it for the commit being loaded) and its config.json has no
  `quantization_config`, the config read by any config class gets the one `tq_config.json` describes. Nothing is
  asked of the Hub for this: a config without `quantization_config` costs no request more than transformers' own;
- a turboquant-mlx config.json, whose `quantization_config` is MLX's block (`{"mode": "turboquant", "bits",
  "group_size", ...}`, no `quant_method`), gets this package's config in its place; other MLX modes (affine) are
  left as they are, for transformers to refuse as it does without this package;
- a composite checkpoint (a multimodal config with the language model's config inside) loaded by a class that
  reads only the inner config (`Qwen3_5MoeForCausalLM` on a `Qwen3_5MoeForConditionalGeneration` folder): the
  inner config inherits the outer `quantization_config`.

Whatever the entry point, every load of a model is then checked after its tensors are placed
(`check_loaded_keys`): a TurboQuant tensor that the model did not take, or a TurboQuant module whose tensors did
not arrive, raises `CheckpointError` naming the tensors and the class used, instead of leaving freshly initialised
weights. A Hub repo in the published form whose `tq_config.json` was not in the cache is found there: its
`tq_config.json` is fetched then (the one request this costs, made only for a checkpoint that holds TurboQuant
tensors) and the error says that loading it again works as it is.

`turboquant_hf.integration.patches` installs these two functions into transformers.
"""

from __future__ import annotations

import os

from ..format import checkpoint as ckpt
from ..format import constants as fmt
from ..format.checkpoint import CheckpointError
from ..quantization.config import QUANT_METHOD, TurboQuantConfig

_TQ_SUFFIXES = (fmt.PACKED_SUFFIX, fmt.NORMS_SUFFIX, ".tq_codebook", ".tq_signs")
_SHOWN = 5


def is_turboquant_tensor(name: str) -> bool:
    return name.endswith(_TQ_SUFFIXES)


def _is_turboquant_block(block) -> bool:
    if isinstance(block, TurboQuantConfig):
        return True
    return isinstance(block, dict) and block.get("quant_method") == QUANT_METHOD


def _find_tq_config(path, kwargs: dict, commit_hash) -> dict | None:
    """The `tq_config.json` beside the config of `path` (a folder), or the one the local Hub cache holds for `path`
    (a Hub repo id) at `commit_hash`; None otherwise. Never asks the Hub."""
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isdir(path):
        candidate = os.path.join(path, subfolder, fmt.TQ_CONFIG_NAME)
    elif os.path.isfile(path) or kwargs.get("gguf_file"):
        return None
    else:
        candidate = _cached_in_hub_cache(path, subfolder, kwargs.get("cache_dir"),
                                         commit_hash or kwargs.get("revision"))
    return ckpt.read_tq_config(candidate)


def _cached_in_hub_cache(repo_id: str, subfolder: str, cache_dir, revision) -> str | None:
    """The path of the repo's `tq_config.json` in the local Hub cache, or None (not cached, known to be missing,
    or `repo_id` is no repo id)."""
    from huggingface_hub import try_to_load_from_cache

    filename = f"{subfolder}/{fmt.TQ_CONFIG_NAME}" if subfolder else fmt.TQ_CONFIG_NAME
    try:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
    except ValueError:  # (huggingface_hub's HFValidationError: not a repo id)
        return None
    return found if isinstance(found, str) else None


def fetch_tq_config(repo_id: str, revision) -> dict | None:
    """The repo's `tq_config.json` from the Hub (into the local cache), or None when it has none or the Hub cannot
    be reached."""
    from transformers.utils.hub import cached_file

    candidate = cached_file(
        repo_id, fmt.TQ_CONFIG_NAME, revision=revision, _raise_exceptions_for_gated_repo=False,
        _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False,
    )
    return ckpt.read_tq_config(candidate)


def complete_config_dict(cls, path, config_dict: dict, kwargs: dict) -> dict:
    """Give a config dict read from `path` by config class `cls` the TurboQuant `quantization_config` its
    checkpoint needs (see the module docstring). Returns the dict, changed in place."""
    if not isinstance(config_dict, dict) or not config_dict:
        return config_dict
    if _is_mlx_turboquant_block(config_dict.get("quantization_config")):
        config_dict["quantization_config"] = TurboQuantConfig.from_mlx(config_dict["quantization_config"]).to_dict()
    if "quantization_config" not in config_dict and not isinstance(path, dict):
        tq = _find_tq_config(os.fspath(path), kwargs, config_dict.get("_commit_hash"))
        if tq is not None:
            try:
                config_dict["quantization_config"] = TurboQuantConfig.from_tq_config(tq).to_dict()
            except ValueError as e:
                raise CheckpointError(f"{path}: {fmt.TQ_CONFIG_NAME} describes no checkpoint this version can "
                                      f"load: {e}") from e
    block = config_dict.get("quantization_config")
    if _is_turboquant_block(block):
        inner = []
        key = getattr(cls, "base_config_key", "")
        if key and isinstance(config_dict.get(key), dict):
            inner.append(config_dict[key])
        model_type = getattr(cls, "model_type", "")
        if model_type and config_dict.get("model_type") != model_type:
            inner += [v for v in config_dict.values() if isinstance(v, dict) and v.get("model_type") == model_type]
        for sub in inner:
            sub.setdefault("quantization_config", dict(block) if isinstance(block, dict) else block.to_dict())
    return config_dict


def _is_mlx_turboquant_block(block) -> bool:
    """MLX's block (`{"group_size", "bits", "mode"}`, never a `quant_method`) of a turboquant-mlx checkpoint."""
    return (isinstance(block, dict) and "quant_method" not in block and "group_size" in block and "bits" in block
            and block.get("mode") == "turboquant")


def check_loaded_keys(model, loading_info) -> None:
    """Raise if a load left TurboQuant tensors unused or TurboQuant modules without their tensors."""
    quantizer = model.__dict__.get("_turboquant_quantizer")
    unexpected = sorted(k for k in loading_info.unexpected_keys if is_turboquant_tensor(k))
    source = getattr(model.config, "_name_or_path", None) or getattr(model.config, "name_or_path", None)
    where = f"{type(model).__name__}.from_pretrained({source!r})" if source else type(model).__name__
    if unexpected and quantizer is None:
        raise CheckpointError(_undescribed(model, where, source, unexpected))
    if quantizer is None:
        return
    quantizer.raise_conversion_failures()
    from .tensor_parallel import deferred_keys

    deferred = deferred_keys(model, quantizer.checkpoint_index)  # tensor-parallel slices read after loading
    if deferred:
        loading_info.unexpected_keys.difference_update(deferred)
        unexpected = [k for k in unexpected if k not in deferred]
    if unexpected:
        raise CheckpointError(
            f"{where}: {len(unexpected)} TurboQuant tensor(s) match no quantized layer of this class "
            f"({_first(unexpected)}); the checkpoint does not belong to {type(model).__name__} or was renamed"
        )
    owners = quantized_module_names(model)
    missing = sorted(k for k in loading_info.missing_keys if _owned_by(k, owners))
    if missing and not quantizer.pre_quantized:  # quantizing on the fly: name the source tensors
        missing = sorted({k[: -len(s)] if k.endswith(s) else k for k in missing for s in _TQ_SUFFIXES
                          if k.endswith(s)} | {k for k in missing if not is_turboquant_tensor(k)})
    if missing:
        raise CheckpointError(
            f"{where}: the checkpoint is missing {len(missing)} tensor(s) of quantized layers ({_first(missing)})"
        )


def _undescribed(model, where: str, source, unexpected) -> str:
    """The error for TurboQuant tensors loaded without the quantizer. For a Hub repo, its `tq_config.json` is
    fetched now (into the cache, so that loading it again finds it) and named in the fix."""
    said = (f"{where}: the checkpoint holds TurboQuant tensors ({_first(unexpected)}) but was loaded without the "
            "turboquant quantizer, which would leave random weights in their place. ")
    tq = None
    if isinstance(source, str) and source and not os.path.exists(source):
        try:
            tq = fetch_tq_config(source, getattr(model.config, "_commit_hash", None))
        except Exception:  # noqa: BLE001  (what goes wrong while this error is written must not replace it)
            tq = None
    if tq is None:
        return said + (f"Its config.json has no turboquant quantization_config and no {fmt.TQ_CONFIG_NAME} describes "
                       "it: load it with quantization_config=TurboQuantConfig(bits=..., group_size=...) as it was "
                       "written")
    try:
        config = TurboQuantConfig.from_tq_config(tq)
        explicit = f"TurboQuantConfig(bits={config.bits}, group_size={config.group_size})"
    except ValueError:
        explicit = "TurboQuantConfig(bits=..., group_size=...)"
    return said + (f"The repo describes them in {fmt.TQ_CONFIG_NAME} only, which is read before loading when the "
                   "local Hub cache holds it (turboquant_hf asks the Hub for nothing while configs load); it is in "
                   f"the cache now, so loading {source!r} again works as it is. Or pass "
                   f"quantization_config={explicit}")


def quantized_module_names(model) -> set[str]:
    from ..modeling.modules import TurboQuantExperts, TurboQuantLinear

    return {n for n, m in model.named_modules() if isinstance(m, (TurboQuantLinear, TurboQuantExperts))}


def _owned_by(key: str, owners: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:i]) in owners for i in range(1, len(parts)))


def _first(names) -> str:
    names = list(names)
    more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
