"""The model card (README.md) of a TurboQuant checkpoint, rendered from what is in its directory.

Every number comes from the files: sizes and bits per tier from the safetensors headers, the recipe from
config.json / tq_config.json, quality from `turboquant_eval.json` (written by `turboquant-hf eval`), build
versions from `turboquant_build.json`. Base-model metadata (license, language) is copied from the base
model's card when it can be read: a README.md in the source folder, or the Hub.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from typing import Any

import yaml

from ..format import checkpoint as ckpt
from ..format import constants as fmt
from ..format import runtime_layout
from .model_shape import kv_cache_per_token, recurrent_state_bytes, text_config

EVAL_NAME = "turboquant_eval.json"
BUILD_NAME = "turboquant_build.json"
CARD_NAME = "README.md"
TEMPLATE_NAME = "README.md.jinja"

# the safetensors dtype of a config's `dtype` / `torch_dtype` name (its size: checkpoint.DTYPE_BYTES)
_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "bf16": "BF16", "fp16": "F16", "fp32": "F32",
                  "fp8": "F8_E4M3", "float8_e4m3fn": "F8_E4M3"}
_COPIED_FROM_BASE = ("license", "license_name", "license_link", "language")


class CardError(ValueError):
    """The directory is not a TurboQuant checkpoint this version can describe."""


# ---------------------------------------------------------------------------------------------------------------
# formatting
def human_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_count(n: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}" if n / div < 10 else f"{n / div:.1f}{unit}"
    return str(int(n))


def bits_label(bits) -> str:
    return "ternary (1.58-bit)" if bits == fmt.TERNARY else f"{bits}-bit"


def bits_tag(bits) -> str:
    return "ternary" if bits == fmt.TERNARY else f"{bits}-bit"


looks_like_repo_id = ckpt.looks_like_repo_id


# ---------------------------------------------------------------------------------------------------------------
# reading a directory
def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def safetensors_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def read_quantization_config(directory: str) -> dict:
    """The TurboQuant `quantization_config` of a saved directory (config.json, else tq_config.json)."""
    config = _read_json(os.path.join(directory, "config.json"))
    if config is None:
        raise CardError(f"{directory}: no config.json; not a saved transformers checkpoint")
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is not None and qc.get("quant_method") != "turboquant":
        raise CardError(f"{directory}: quantized with {qc.get('quant_method')!r}, not TurboQuant")
    if qc is None:
        tq = ckpt.read_tq_config(directory)
        if tq is None:
            raise CardError(f"{directory}: config.json has no turboquant quantization_config and there is no "
                            f"{fmt.TQ_CONFIG_NAME}; not a TurboQuant checkpoint")
        from ..quantization.config import TurboQuantConfig

        qc = TurboQuantConfig.from_tq_config(tq).to_dict()
    return qc


def check_checkpoint(directory: str) -> None:
    """Raise CardError unless `directory` holds a TurboQuant checkpoint (config, tq_config and packed tensors)."""
    if not os.path.isdir(directory):
        raise CardError(f"{directory}: no such directory")
    read_quantization_config(directory)
    files = safetensors_files(directory)
    if not files:
        raise CardError(f"{directory}: no .safetensors files")
    try:
        index = ckpt.read_checkpoint_index(files)
    except ckpt.CheckpointError as e:
        raise CardError(str(e)) from e
    if not ckpt.packed_weight_keys(index):
        raise CardError(f"{directory}: the safetensors files hold no *{fmt.PACKED_SUFFIX} tensors; "
                        "not a TurboQuant checkpoint")


def _module_pattern(name: str) -> str:
    """`model.layers.12.mlp.down_proj.weight` -> `model.layers.*.mlp.down_proj.weight`."""
    return re.sub(r"\.\d+\.", ".*.", name)


def checkpoint_summary(directory: str) -> dict[str, Any]:
    """Sizes of a TurboQuant checkpoint from its safetensors headers: per tier, full precision, files, base, and
    `gpu_bytes`: the weights as a CUDA device holds them by default (ternary tensors as the 2-bit codes of
    `turboquant_hf.format.runtime_layout`)."""
    files = safetensors_files(directory)
    if not files:
        raise CardError(f"{directory}: no .safetensors files")
    index = ckpt.read_checkpoint_index(files)
    qc = read_quantization_config(directory)
    tq = ckpt.read_tq_config(directory) or {}
    group_size = int(qc.get("group_size") or tq.get("group_size") or 128)
    orig_in = tq.get("orig_in_dims") or {}
    config = _read_json(os.path.join(directory, "config.json")) or {}
    base_dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    dtype_bytes = ckpt.DTYPE_BYTES[_CONFIG_DTYPES.get(base_dtype, "BF16")]

    def nbytes(name):
        info = index[name]
        n = ckpt.DTYPE_BYTES.get(info["dtype"], 0)
        for d in info["shape"]:
            n *= d
        return n

    tiers: dict[Any, dict] = {}
    quantized_names = set()
    base_bytes = gpu_extra = 0
    for key in ckpt.packed_weight_keys(index):
        packed, norms = index.get(key + fmt.PACKED_SUFFIX), index.get(key + fmt.NORMS_SUFFIX)
        if packed is None or norms is None:
            raise CardError(f"{directory}: {key} has {'no ' + fmt.NORMS_SUFFIX if norms is None else 'no packed data'}")
        rows = math.prod(norms["shape"][:-1])  # Linear layers: (rows, n_groups); fused experts: experts x rows
        n_groups = norms["shape"][-1]
        module = key[: -len(".weight")] if key.endswith(".weight") else key
        names = [key + fmt.PACKED_SUFFIX, key + fmt.NORMS_SUFFIX]
        codebook, signs = index.get(key + ".tq_codebook"), index.get(key + ".tq_signs")
        if codebook is not None and signs is not None:
            # whole-row Hadamard modules (tq_hadamard, from turboquant-mlx): their own codebook, signs, group size
            bits = fmt.bits_for_levels(codebook["shape"][0])
            in_features = signs["shape"][0]
            names += [key + ".tq_codebook", key + ".tq_signs"]
        else:
            try:
                bits = fmt.bits_for_levels(fmt.levels_from_geometry(packed["shape"][-1], group_size))
            except ValueError as e:
                raise CardError(f"{directory}: {key}{fmt.PACKED_SUFFIX}: {e}") from e
            in_features = orig_in.get(key) or orig_in.get(module) or n_groups * group_size
        g = in_features // n_groups if codebook is not None and signs is not None else group_size
        if bits == fmt.TERNARY:  # (a GPU holds 2-bit codes by default)
            gpu_extra += rows * n_groups * (runtime_layout.gpu_bytes_per_group(3, g, settings=False)
                                            - fmt.bytes_per_group(3, g))
        t = tiers.setdefault(bits, {"bits": bits, "layers": 0, "params": 0, "bytes": 0, "patterns": set()})
        t["layers"] += 1
        t["params"] += rows * in_features
        t["bytes"] += sum(nbytes(n) for n in names)
        t["patterns"].add(_module_pattern(module))
        quantized_names.update(names)
        base_bytes += rows * in_features * dtype_bytes
    fp_names = sorted(set(index) - quantized_names)
    fp_bytes = sum(nbytes(n) for n in fp_names)
    fp_params = sum(nbytes(n) // max(1, ckpt.DTYPE_BYTES.get(index[n]["dtype"], 1)) for n in fp_names)
    base_bytes += sum(nbytes(n) for n in fp_names)
    q_params = sum(t["params"] for t in tiers.values())
    q_bytes = sum(t["bytes"] for t in tiers.values())
    total = q_bytes + fp_bytes
    tier_list = []
    for bits in sorted(tiers, reverse=True):
        t = tiers[bits]
        tier_list.append({
            "bits": bits, "label": bits_label(bits), "layers": t["layers"], "params": t["params"],
            "params_h": human_count(t["params"]), "bytes": t["bytes"], "bytes_h": human_bytes(t["bytes"]),
            "bits_per_weight": round(8 * t["bytes"] / t["params"], 3), "modules": sorted(t["patterns"]),
        })
    # full-precision tensors, grouped by module pattern, largest first
    groups: dict[str, int] = {}
    for n in fp_names:
        groups[_module_pattern(n)] = groups.get(_module_pattern(n), 0) + nbytes(n)
    fp_groups = sorted(groups.items(), key=lambda kv: -kv[1])
    return {
        "group_size": group_size,
        "base_dtype": base_dtype,
        "base_dtype_bytes": dtype_bytes,
        "base_bytes": base_bytes,
        "total_bytes": total,
        "gpu_bytes": total + gpu_extra,
        "quantized_bytes": q_bytes,
        "quantized_params": q_params,
        "quantized_layers": sum(t["layers"] for t in tiers.values()),
        "full_precision_bytes": fp_bytes,
        "full_precision_params": fp_params,
        "full_precision_tensors": fp_groups,
        "bits_per_weight": round(8 * q_bytes / q_params, 3) if q_params else None,
        "bits_per_weight_all": round(8 * total / (q_params + fp_params), 3) if q_params + fp_params else None,
        "tiers": tier_list,
        "files": [{"name": os.path.basename(p), "size": os.path.getsize(p)} for p in files],
    }


# ---------------------------------------------------------------------------------------------------------------
# base model metadata
def _front_matter(text: str) -> dict:
    m = re.match(r"^---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", text, re.S)
    if not m:
        return {}
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def base_card_metadata(base_model: str | None, source_dir: str | None = None, timeout: float = 5.0) -> dict:
    """license / license_name / license_link / language of the base model's card, when it can be read:
    a README.md in `source_dir`, else the Hub's model_info of `base_model` (one request, no retries). {} otherwise."""
    data: dict = {}
    if source_dir and os.path.isfile(os.path.join(source_dir, CARD_NAME)):
        with open(os.path.join(source_dir, CARD_NAME), encoding="utf-8") as f:
            data = _front_matter(f.read())
    if not data and looks_like_repo_id(base_model) and not os.environ.get("HF_HUB_OFFLINE"):
        try:
            from huggingface_hub import HfApi

            info = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None).model_info(base_model, timeout=timeout)
            data = info.card_data.to_dict() if info.card_data is not None else {}
        except Exception:  # offline, private, missing: the card simply omits what it cannot know
            data = {}
    return {k: data[k] for k in _COPIED_FROM_BASE if data.get(k) is not None}


def resolve_base_model(directory: str, base_model: str | None = None) -> tuple[str | None, str | None]:
    """(Hub repo id of the base model or None, local source folder or None) from the argument, the build
    record, or tq_config.json's original_model (a repo id, or a Hub cache snapshot path)."""
    build = _read_json(os.path.join(directory, BUILD_NAME)) or {}
    tq = ckpt.read_tq_config(directory) or {}
    source = build.get("source") or tq.get("original_model")
    candidates = [base_model, build.get("base_model"), tq.get("original_model")]
    for c in candidates:
        if looks_like_repo_id(c):
            return c, source if source and os.path.isdir(source) else None
    if source and "/" in ckpt.public_source(source):  # a Hub cache snapshot path
        return ckpt.public_source(source), source if os.path.isdir(source) else None
    return None, source if source and os.path.isdir(source) else None


# ---------------------------------------------------------------------------------------------------------------
# rendering
# This package's name on the package index (the import name is turboquant_hf, the command turboquant-hf).
DISTRIBUTION = "turboquant-transformers"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in (DISTRIBUTION, "transformers", "torch", "safetensors", "huggingface_hub"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def write_build_record(directory: str, base_model: str | None = None, source: str | None = None,
                       command: str | None = None, recipe: str | None = None) -> None:
    """Write `directory/turboquant_build.json` (`build_record`; the one writer of it), whole or not at all."""
    path = os.path.join(directory, BUILD_NAME)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(build_record(base_model=base_model, source=source, command=command, recipe=recipe), f, indent=2)
    os.replace(path + ".tmp", path)


def build_record(base_model: str | None = None, source: str | None = None, command: str | None = None,
                 recipe: str | None = None) -> dict:
    import datetime

    return {"base_model": base_model, "source": ckpt.public_source(source), "command": ckpt.public_command(command),
            "recipe": recipe,
            "versions": _versions(),
            "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _config_code(qc: dict) -> tuple[str, str | None]:
    """(Python constructor of the config, the recipe name it equals or None)."""
    from ..quantization.config import TurboQuantConfig
    from ..quantization.recipes import get_recipe, recipe_names

    cfg = TurboQuantConfig.from_dict(dict(qc))
    for name in recipe_names():
        if get_recipe(name, group_size=cfg.group_size, modules_to_not_convert=cfg.modules_to_not_convert).to_dict() \
                == cfg.to_dict():
            code = f'recipes.get_recipe("{name}"' + (f", group_size={cfg.group_size}" if cfg.group_size != 128 else "")
            return code + ")", name
    args = [f"bits={cfg.bits!r}", f"group_size={cfg.group_size}"]
    if cfg.modules_to_not_convert is not None:
        args.append(f"modules_to_not_convert={cfg.modules_to_not_convert!r}")
    if cfg.module_bits:
        args.append(f"module_bits={cfg.module_bits!r}")
    if cfg.expert_bits is not None:
        args.append(f"expert_bits={cfg.expert_bits!r}")
    if cfg.sensitive_patterns:
        args += [f"sensitive_bits={cfg.sensitive_bits!r}", f"sensitive_patterns={cfg.sensitive_patterns!r}"]
    return f"TurboQuantConfig({', '.join(args)})", None


def _fp_summary(groups: list[tuple[str, int]], limit: int = 6) -> str:
    parts = [f"`{name}` ({human_bytes(size)})" for name, size in groups[:limit]]
    if len(groups) > limit:
        rest = sum(s for _, s in groups[limit:])
        parts.append(f"{len(groups) - limit} more tensor groups ({human_bytes(rest)}: norms, biases, …)")
    return ", ".join(parts) if parts else "nothing"


def _memory_context(config: dict, ternary_on_gpu_differs: bool) -> dict[str, Any]:
    """The card's memory section: KV cache per token and at a few contexts, recurrent state, notes."""
    kv = kv_cache_per_token(config, 2)
    rec = recurrent_state_bytes(config, 2)
    tc = text_config(config)
    max_ctx = int(tc.get("max_position_embeddings") or 0)
    contexts = [c for c in (4096, 32768, 131072) if not max_ctx or c <= max_ctx] or [max_ctx]
    if max_ctx and max_ctx not in contexts and max_ctx <= 1_048_576:
        contexts.append(max_ctx)
    memory = {
        "kv_per_token": kv["bytes"], "kv_per_token_h": f"{kv['bytes']:,} bytes", "kv_dtype": "bf16",
        "kv_explain": (f"{kv['layers']} attention layer{'s' if kv['layers'] != 1 else ''} × {kv['kv_heads']} KV "
                       f"head{'s' if kv['kv_heads'] != 1 else ''} × head_dim {kv['head_dim']} × "
                       f"2 (K and V) × 2 bytes"),
        "contexts": [{"tokens_h": f"{c:,}", "bytes_h": human_bytes(c * kv["bytes"])} for c in contexts if c],
        "recurrent_bytes": rec["bytes"], "recurrent_h": human_bytes(rec["bytes"]) if rec["bytes"] else "",
        "recurrent_explain": (f"The {rec['layers']} linear-attention layer{'s' if rec['layers'] != 1 else ''} keep a "
                              "fixed-size recurrent state instead of a KV cache." if rec["bytes"] else ""),
    }
    notes = []
    if kv["bytes"]:
        notes.append(f"The KV cache comes from {memory['kv_explain']}.")
    if rec["bytes"]:
        notes.append(memory["recurrent_explain"])
    if ternary_on_gpu_differs:
        notes.append("On a GPU the ternary weights are held as 2-bit codes, which the faster kernels read; "
                     "`TURBOQUANT_COMPACT_TERNARY=1` keeps them at their size on disk (slower kernels).")
    notes.append("The KV cache is not quantized; add activations and the framework's overhead on top.")
    memory["notes"] = " ".join(notes)
    return memory


def _reproduce_command(qc: dict, recipe: str | None, base_ref: str, out_name: str) -> str:
    """A command that reproduces the weights (rather than the build's own command line, whose paths are local)."""
    if recipe:
        opts = f"--recipe {recipe}" + (f" --group-size {qc['group_size']}" if qc.get("group_size", 128) != 128 else "")
    elif any(qc.get(k) is not None for k in ("module_bits", "expert_bits", "sensitive_patterns",
                                                "modules_to_not_convert")):
        opts = "--config quantization_config.json   # the JSON above"
    else:
        opts = f"--bits {qc.get('bits')} --group-size {qc.get('group_size', 128)}"
    return f"turboquant-hf quantize {base_ref} --out {out_name} {opts}"


def card_context(directory: str, repo_id: str | None = None, base_model: str | None = None,
                 base_metadata: dict | None = None, name: str | None = None,
                 source_dir: str | None = None) -> dict[str, Any]:
    """Everything the template needs, computed from the directory (`source_dir`: the local folder the model was
    quantized from, whose card gives the licence; the saved files name it by base name only)."""
    check_checkpoint(directory)
    config = _read_json(os.path.join(directory, "config.json")) or {}
    qc = read_quantization_config(directory)
    tq = ckpt.read_tq_config(directory) or {}
    build = _read_json(os.path.join(directory, BUILD_NAME)) or {}
    evaluation = _read_json(os.path.join(directory, EVAL_NAME))
    size = checkpoint_summary(directory)
    base_model, source = resolve_base_model(directory, base_model)
    source = source_dir if source_dir and os.path.isdir(source_dir) else source
    meta = base_card_metadata(base_model, source) if base_metadata is None else dict(base_metadata)

    archs = config.get("architectures") or []
    arch = archs[0] if archs else config.get("model_type", "model")
    pipeline_tag = "image-text-to-text" if arch.endswith("ForConditionalGeneration") and "vision_config" in config \
        else "text-generation"
    bit_tags = [bits_tag(t["bits"]) for t in size["tiers"]]
    layout = (qc or {}).get("format") or tq.get("format") or fmt.FORMAT_NAME  # tq_hadamard: loaded from MLX
    tags = ["turboquant", "quantized", layout] + bit_tags + ([config["model_type"]] if "model_type" in config
                                                                       else [])
    front: dict[str, Any] = {}
    if base_model:
        front["base_model"] = base_model
        front["base_model_relation"] = "quantized"
    for k in _COPIED_FROM_BASE:
        if k in meta:
            front[k] = meta[k]
    front.update({"library_name": "transformers", "pipeline_tag": pipeline_tag, "tags": tags})

    base_name = base_model.split("/")[-1] if base_model else os.path.basename(os.path.normpath(
        build.get("source") or tq.get("original_model") or directory))
    tiers = size["tiers"]
    if len(tiers) == 1:
        how = f"{tiers[0]['label']} TurboQuant"
    else:
        how = "TurboQuant at " + " / ".join(t["label"] for t in tiers)
    name = name or os.path.basename(os.path.normpath(directory))
    repo_ref = repo_id or f"<your-namespace>/{name}"
    summary = (f"**{base_name}** with its Linear weights quantized to {how} (`{layout}`, groups of "
               f"{size['group_size']}): {human_bytes(size['total_bytes'])} of weights instead of "
               f"{human_bytes(size['base_bytes'])}, loaded by plain 🤗 transformers once `turboquant_hf` is imported.")

    size_ctx = dict(size)
    size_ctx.update(
        base_bytes_h=human_bytes(size["base_bytes"]), total_bytes_h=human_bytes(size["total_bytes"]),
        gpu_bytes_h=human_bytes(size["gpu_bytes"]) if size["gpu_bytes"] != size["total_bytes"] else "",
        ratio=f"{size['base_bytes'] / size['total_bytes']:.1f}", quantized_params_h=human_count(size["quantized_params"]),
        full_precision_bytes_h=human_bytes(size["full_precision_bytes"]),
        full_precision_summary=_fp_summary(size["full_precision_tensors"]),
        files=[dict(f, size_h=human_bytes(f["size"])) for f in size["files"]],
    )
    memory = _memory_context(config, bool(size_ctx["gpu_bytes_h"]))
    config_code, recipe = _config_code(qc)  # the recipe the stored config equals, if any
    base_ref = base_model or "path/to/base-model"
    out_name = repo_ref.split("/")[-1]
    command = _reproduce_command(qc, recipe, base_ref, out_name)
    versions = build.get("versions") or _versions()
    if config.get("transformers_version"):
        versions = dict(versions)
        versions.setdefault("transformers", config["transformers_version"])
    versions_text = ", ".join(f"{k} {v}" for k, v in versions.items())
    quality = None
    if evaluation:
        quality = {
            "tokens": f"{evaluation['tokens']:,}",
            "text_name": f"`{evaluation.get('text', 'text')}`",
            "dtype": evaluation.get("dtype", "float32"),
            "window": evaluation.get("window", 512),
            "base_perplexity": f"{evaluation['base_perplexity']:.3f}",
            "quantized_perplexity": f"{evaluation['quantized_perplexity']:.3f}",
            "mean_kl": f"{evaluation['mean_kl']:.4f}",
            "top1_agreement": (f"{100 * evaluation['top1_agreement']:.1f}%" if "top1_agreement" in evaluation
                               else None),
            "warning": evaluation.get("warning"),
        }
    calibration = calibration_text((qc or {}).get("calibrated_with") or tq.get("calibrated_with"))
    hub_url = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    return {
        "front_matter": yaml.safe_dump(front, sort_keys=False, allow_unicode=True).strip(),
        "front": front, "title": f"{base_name} — TurboQuant {' / '.join(bits_tag(t['bits']) for t in tiers)}",
        "summary": summary, "base_model": base_model, "base_name": base_name, "hub_url": hub_url,
        "format": layout, "size": size_ctx, "group_size": size["group_size"],
        "base_dtype": size["base_dtype"], "base_bits": 8 * size["base_dtype_bytes"],
        "repo_id": repo_ref, "pipeline_tag": pipeline_tag, "base_ref": base_ref, "quality": quality,
        "calibration": calibration,
        "memory": memory, "quantization_config_json": json.dumps(qc, indent=2), "command": command,
        "config_code": config_code,
        "config_import": "TurboQuantConfig" if config_code.startswith("TurboQuantConfig") else "recipes",
        "out_name": out_name, "seed": qc.get("quantizer_seed", fmt.QUANTIZER_SEED), "versions_text": versions_text,
        "distribution": DISTRIBUTION,
        "license": front.get("license"), "evaluation": evaluation,
    }


def calibration_text(record: dict | None) -> str | None:
    """One sentence on the data the checkpoint was calibrated on (its `calibrated_with` record), or None."""
    if not record:
        return None
    kind = record.get("kind")
    if kind == "data-free":
        prompts = ", ".join(f"`{p}`" if p else "BOS alone" for p in record.get("prompts", []))
        sampling = ", ".join(f"{k} {v}" for k, v in (record.get("sampling") or {}).items())
        source = (f"text the base model wrote itself (data-free mode: sampled from {prompts or 'neutral prompts'}"
                  f"{'; ' + sampling if sampling else ''})")
    else:
        source = f"`{record.get('source', 'unnamed data')}`"
        if record.get("source_sha256"):
            source += f" (sha256 {record['source_sha256'][:12]}…)"
    size = ""
    if record.get("samples") and record.get("sequence_length"):
        size = f": {record['samples']} sequences of {record['sequence_length']} tokens"
        if record.get("tokens"):
            size += f" ({record['tokens']:,} tokens)"
        if "seed" in record:
            size += f", seed {record['seed']}"
    method = f" ({record['method']})" if isinstance(record.get("method"), str) else ""
    text = f"Calibrated{method} on {source}{size}."
    allocation = record.get("bit_allocation")
    if isinstance(allocation, dict) and allocation.get("measure"):
        kls = ", ".join(f"{k[3:]} {v:.4f}" for k, v in allocation.items()
                        if k.startswith("kl_") and isinstance(v, (int, float)) and not math.isnan(v))
        text += (f" Bits per tensor allocated under the budget by the {allocation['measure']} measure"
                 f"{f' (mean KL of each candidate on the calibration data: {kls})' if kls else ''}.")
    tuned = record.get("block_tuned")
    if isinstance(tuned, dict) and tuned.get("steps") and tuned.get("kept"):
        text += (f" After each decoder block's rounding, {tuned['steps']} steps tuned its group norms and vector "
                 f"parameters to the base model's block outputs ({tuned['kept']} of {tuned.get('blocks')} blocks "
                 f"kept the tuning; mean relative squared error of the block outputs on "
                 f"{tuned.get('held_out_sequences') or 'the'} checking sequences: {tuned.get('error_before')} "
                 f"before, {tuned.get('error_after')} after).")
    distilled = record.get("distilled")
    if isinstance(distilled, dict) and distilled.get("steps") and distilled.get("kept"):
        text += (f" Then {distilled['steps']} distillation steps tuned the group norms and the vector parameters "
                 f"kept in full precision to the base model's next-token distributions on "
                 f"{distilled.get('train_sequences')} of the sequences (mean KL on the other "
                 f"{distilled.get('held_out_sequences')}, over each position's {distilled.get('top_tokens')} "
                 f"likeliest tokens: {distilled.get('held_out_kl_before')} before, "
                 f"{distilled.get('held_out_kl_after')} after).")
    return text


def _template():
    import jinja2

    try:
        from importlib.resources import files

        text = files("turboquant_hf.model_cards").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError):  # a source checkout that was not installed
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.path.join(root, "model_cards", TEMPLATE_NAME)
        with open(path, encoding="utf-8") as f:
            text = f.read()
    env = jinja2.Environment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined, autoescape=False)
    return env.from_string(text)


def render_card(directory: str, repo_id: str | None = None, base_model: str | None = None,
                base_metadata: dict | None = None, name: str | None = None, source_dir: str | None = None,
                tags: list[str] | None = None) -> str:
    """README.md text for the TurboQuant checkpoint in `directory`.

    repo_id: the Hub repo the usage examples load from; base_model: the base model's Hub id (default: from
    tq_config.json / turboquant_build.json); base_metadata: license/language to use instead of reading the base
    card; name: the checkpoint's folder name when `directory` is a temporary folder; source_dir: the local
    folder it was quantized from; tags: Hub tags added to the card's own (`save_pretrained(tags=...)`)."""
    ctx = card_context(directory, repo_id=repo_id, base_model=base_model, base_metadata=base_metadata, name=name,
                       source_dir=source_dir)
    text = _template().render(**ctx)
    text = re.sub(r"\n{3,}", "\n\n", text)
    text = text.rstrip() + "\n"
    if tags:
        from huggingface_hub import ModelCard

        card = ModelCard(text)
        card.data.tags = list(card.data.tags or []) + [t for t in tags if t not in (card.data.tags or [])]
        text = str(card)
    return text


def write_card(directory: str, repo_id: str | None = None, base_model: str | None = None,
               base_metadata: dict | None = None, name: str | None = None, source_dir: str | None = None) -> str:
    """Render and write `directory/README.md`; return its path."""
    text = render_card(directory, repo_id=repo_id, base_model=base_model, base_metadata=base_metadata, name=name,
                       source_dir=source_dir)
    return save_card(directory, text)


def save_card(directory: str, text: str) -> str:
    """Write `text` as `directory/README.md` (the one writer of it), whole or not at all; return its path."""
    path = os.path.join(directory, CARD_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
