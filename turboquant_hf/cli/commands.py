"""`turboquant-hf`: quantize, push, card, plan, eval and convert from the command line (`python -m turboquant_hf` too)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile

from ..format import checkpoint as ckpt
from ..reporting import model_shape, sizing
from . import hub_errors
from .parser import build_parser

EXIT_OK = 0
EXIT_FAILURE = 1  # something unexpected went wrong (a bug, or a model transformers cannot load)
EXIT_USAGE = 2  # bad arguments or bad input (not a checkpoint, unknown recipe, missing files)
EXIT_HUB = 3  # the Hub refused or failed (authentication, server error, dropped connection)
EXIT_DOES_NOT_FIT = 4  # `plan --gpu-gb/--ram-gb`: the model does not fit the budget
EXIT_INTERRUPTED = 130

class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------------------------
# helpers
def _progress(**kw):
    from tqdm.auto import tqdm

    kw.setdefault("disable", None)  # shown on a terminal, silent in logs and pipes
    kw.setdefault("file", sys.stderr)
    return tqdm(**kw)


def _say(args, message: str) -> None:
    if not getattr(args, "json", False) and not getattr(args, "quiet", False):
        print(message, file=sys.stderr)


def _emit(args, result: dict, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2, default=str))
    else:
        print(text)


def _hub_api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=os.environ.get("HF_TOKEN") or None)


def _hub_error(exc: BaseException, doing: str, retry: str) -> CliError:
    """A clear message for a failed Hub call: what failed, why, and what to retry."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    network = hub_errors.network_failure(exc)
    cause = network if network is not None else exc
    status = hub_errors.status_code(exc)
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if network is None and status in (401, 403):
        why = (f"the Hub at {endpoint} refused the credentials ({status}); set HF_TOKEN to a token with write "
               "access (or run `hf auth login`)")
    elif network is None and status is not None and status >= 500:
        why = f"the Hub at {endpoint} answered {status} (a server error)"
    elif network is None and status is not None:
        server = str(exc).strip().splitlines()
        why = f"the Hub at {endpoint} answered {status}: {server[-1] if server else exc}"
    elif isinstance(cause, OfflineModeIsEnabled):
        why = f"offline mode is on (HF_HUB_OFFLINE), so {endpoint} was not contacted"
    else:
        why = f"the connection to {endpoint} failed ({type(cause).__name__}: {str(cause).strip() or 'no answer'})"
    return CliError(f"{doing} failed: {why}. {retry}", EXIT_HUB)


def _quant_config(args):
    """The TurboQuantConfig chosen by --recipe / --config / --bits / --group-size."""
    from ..quantization.config import TurboQuantConfig
    from ..quantization.recipes import get_recipe, recipe_names

    group_size = args.group_size or 128
    try:
        if getattr(args, "config", None):
            if not os.path.isfile(args.config):
                raise CliError(f"--config {args.config}: no such file")
            with open(args.config) as f:
                data = json.load(f)
            data = data.get("quantization_config", data)
            if args.group_size:
                data["group_size"] = args.group_size
            return TurboQuantConfig(**data), None
        if args.recipe:
            if args.recipe not in recipe_names():
                raise CliError(f"unknown recipe {args.recipe!r}; known recipes: {', '.join(recipe_names())}")
            overrides = {"bits": args.bits} if args.bits is not None else {}
            return get_recipe(args.recipe, group_size=group_size, **overrides), args.recipe
        return TurboQuantConfig(bits=args.bits if args.bits is not None else 3, group_size=group_size), None
    except ValueError as e:  # an out-of-range setting: TurboQuantConfig names it
        raise CliError(str(e)) from e
    except json.JSONDecodeError as e:  # pragma: no cover - subclass of ValueError
        raise CliError(f"--config {args.config}: not JSON: {e}") from e


def _command_line(argv) -> str:
    import shlex

    return "turboquant-hf " + " ".join(shlex.quote(a) for a in argv)


# ---------------------------------------------------------------------------------------------------------------
# quantize
def _source_bytes(src: str) -> int | None:
    """Bytes of the safetensors weights of a local folder or a Hub repo (None when the Hub cannot tell)."""
    from ..reporting import card as tq_card

    if os.path.isdir(src):
        return sum(os.path.getsize(f) for f in tq_card.safetensors_files(src))
    try:  # the safetensors headers (a few KB per file)
        meta = _hub_api().get_safetensors_metadata(src)
        return sum(t.data_offsets[1] - t.data_offsets[0] for f in meta.files_metadata.values()
                   for t in f.tensors.values())
    except Exception:  # offline, or not a safetensors repo: the in-memory path decides for itself
        return None


def _use_streaming(args) -> tuple[bool, str]:
    """(use the streaming converter?, why) from --streaming/--resume, or the model's size against the budget."""
    from ..format.shards import available_memory

    if args.streaming or args.resume:
        return True, "--resume" if args.resume and not args.streaming else "--streaming"
    budget = args.max_memory if args.max_memory is not None else available_memory()
    size = _source_bytes(args.src)
    if budget is not None and size is not None and size > budget:
        from ..reporting.card import human_bytes

        which = "--max-memory" if args.max_memory is not None else "the available memory"
        return True, f"the weights ({human_bytes(size)}) exceed {which} ({human_bytes(budget)})"
    return False, ""


def _quantize_streaming(args, argv, cfg, recipe, out: str, why: str) -> int:
    """`quantize` through the streaming converter: tensor by tensor, shards written as they are complete."""
    from ..conversion.streaming import ConversionError, StreamingQuantizer
    from ..reporting import card as tq_card

    _say(args, f"streaming conversion ({why})")
    progress = False if args.json else None
    try:
        converter = StreamingQuantizer.from_pretrained(args.src)
        summary = converter.quantize(
            out, quantization_config=cfg, max_shard_size=args.max_shard_size, max_memory=args.max_memory,
            device=None if args.device in (None, "auto") else args.device, progress=progress, resume=args.resume,
            overwrite=args.force, dtype=args.dtype, base_model=args.base_model,
            build_info={"command": _command_line(argv), "recipe": recipe, "repo_id": args.push_to_hub})
    except (ConversionError, FileExistsError, ValueError) as e:
        raise CliError(str(e)) from e
    if args.eval:
        _evaluate(out, args.src, args.eval, args.max_tokens, args.window, write=True)
        tq_card.write_card(out, base_model=args.base_model, repo_id=args.push_to_hub, name=os.path.basename(out))
    return _report_quantized(args, out, cfg, {"converter": "streaming", "summary": summary.as_dict()})


def _refuse_quantized_source(src: str) -> bool:
    """`quantize` reads full-precision weights: a checkpoint whose config declares a quantization (TurboQuant,
    turboquant-mlx, FP8, ...) is refused before any work, instead of being loaded with its own settings while
    the requested bits are silently ignored. MXFP4 (gpt-oss as it ships) is the exception: the streaming
    converter reads it as the bfloat16 values it decodes to; returns True for it."""
    path = os.path.join(src, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False  # a missing or unreadable config is reported by the loader, naming the file
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
        return True
    for cfg in (config, config.get("text_config") or {}):
        if not isinstance(cfg, dict):
            continue
        qc = cfg.get("quantization_config") or cfg.get("quantization")
        if not qc:
            continue
        method = (qc.get("quant_method") or qc.get("mode") or "unknown") if isinstance(qc, dict) else qc
        hint = ("re-encode it with `turboquant-hf convert SRC --to tq3_native`" if method == "turboquant"
                else "load it with from_pretrained (it needs no quantization_config)")
        raise CliError(f"{path}: the checkpoint is already quantized (quant_method {method!r}); `quantize` reads "
                       f"full-precision weights (bf16, fp16 or fp32) and MXFP4. Quantize its full-precision source "
                       f"instead, or {hint}")
    return False


def _calibration_from_args(args, cfg) -> None:
    """--calibration / --calibration-samples / --calibration-length / --distill-steps / --block-steps as
    `cfg.calibration`."""
    from ..quantization.config import DATA_FREE, CalibrationConfig

    data = getattr(args, "calibration", None)
    if data is None:
        return
    if data != DATA_FREE and not os.path.isfile(data):
        raise CliError(f"--calibration {data}: no such file (give a UTF-8 text file, or 'data-free')")
    try:
        cfg.calibration = CalibrationConfig(data=data, samples=args.calibration_samples,
                                            sequence_length=args.calibration_length,
                                            distill_steps=getattr(args, "distill_steps", 0),
                                            block_steps=getattr(args, "block_steps", 0))
    except ValueError as e:
        raise CliError(str(e).replace("CalibrationConfig: samples", "--calibration-samples")
                       .replace("CalibrationConfig: sequence_length", "--calibration-length")
                       .replace("CalibrationConfig: distill_steps", "--distill-steps")
                       .replace("CalibrationConfig: block_steps", "--block-steps")) from e


def cmd_quantize(args, argv) -> int:
    from ..reporting import card as tq_card

    cfg, recipe = _quant_config(args)
    _calibration_from_args(args, cfg)
    if getattr(args, "target_bits", None) is not None:
        from ..quantization.config import TurboQuantConfig

        try:
            cfg.target_bits_per_weight = TurboQuantConfig(target_bits_per_weight=args.target_bits).target_bits_per_weight
        except ValueError as e:
            raise CliError(str(e).replace("TurboQuantConfig: target_bits_per_weight", "--target-bits")) from e
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not args.force:
        raise CliError(f"--out {args.out} already exists; choose another directory or pass --force to replace it")
    if not os.path.isdir(args.src) and not tq_card.looks_like_repo_id(args.src):
        raise CliError(f"{args.src}: neither a local directory nor a Hub repo id (namespace/name)")
    mxfp4 = os.path.isdir(args.src) and _refuse_quantized_source(args.src)
    if args.eval and not os.path.isfile(args.eval):
        raise CliError(f"--eval {args.eval}: no such file")
    streaming, why = (True, "MXFP4 source weights") if mxfp4 else _use_streaming(args)
    if streaming and cfg.target_bits_per_weight is not None:
        raise CliError(f"--target-bits: the streaming converter ({why}) holds one block at a time and cannot measure "
                       "the budget's sensitivities (they need the loss gradient through the whole model); allocate "
                       "bits with the model loaded whole (leave out --streaming, or raise --max-memory)")
    if streaming and cfg.calibration is not None and args.calibration == "data-free":
        raise CliError(f"--calibration data-free: the streaming converter ({why}) holds one block at a time and "
                       "cannot generate text with the model; give a text file, or calibrate with the model loaded "
                       "whole (leave out --streaming, or raise --max-memory)")
    if streaming:
        return _quantize_streaming(args, argv, cfg, recipe, out, why)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    steps = ["load and quantize", "save", "tokenizer"] + (["eval"] if args.eval else []) + ["card", "finish"]
    bar = _progress(total=len(steps), desc="quantize", unit="step")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import turboquant_hf  # noqa: F401  (registers the quantizer)

        bar.set_postfix_str(steps[0])
        dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
        kw = {"device_map": args.device} if args.device not in (None, "cpu") else {}
        model = AutoModelForCausalLM.from_pretrained(args.src, quantization_config=cfg, dtype=dtype, **kw)
        if args.base_model:
            model._turboquant_original_model = args.base_model
        bar.update()
        bar.set_postfix_str("save")
        model.save_pretrained(tmp, model_card=False)
        bar.update()
        bar.set_postfix_str("tokenizer")
        try:
            AutoTokenizer.from_pretrained(args.src).save_pretrained(tmp)
        except (OSError, ValueError) as e:
            _say(args, f"note: no tokenizer saved ({e})")
        bar.update()
        tq_card.write_build_record(tmp, base_model=args.base_model, source=args.src, command=_command_line(argv),
                                   recipe=recipe)
        if args.eval:
            bar.set_postfix_str("eval")
            del model
            _evaluate(tmp, args.src, args.eval, args.max_tokens, args.window, write=True)
            bar.update()
        bar.set_postfix_str("card")
        tq_card.write_card(tmp, base_model=args.base_model, repo_id=args.push_to_hub, name=os.path.basename(out),
                           source_dir=args.src if os.path.isdir(args.src) else None)
        bar.update()
        if os.path.exists(out):  # --force
            shutil.rmtree(out)
        os.replace(tmp, out)
        bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return _report_quantized(args, out, cfg, {"converter": "from_pretrained"})


def _report_quantized(args, out: str, cfg, extra: dict) -> int:
    """Both quantize paths: sizes, the evaluation if one ran, the optional push, then the result (JSON or text)."""
    from ..reporting import card as tq_card

    size = tq_card.checkpoint_summary(out)
    result = {"out": out, "bytes": size["total_bytes"], "base_bytes": size["base_bytes"],
              "bits_per_weight": size["bits_per_weight"], "quantization_config": cfg.to_dict(), **extra}
    evaluation = os.path.join(out, tq_card.EVAL_NAME)
    if os.path.isfile(evaluation):
        with open(evaluation) as f:
            result["eval"] = json.load(f)
    if args.push_to_hub:
        result["push"] = _push(out, args.push_to_hub, args.private, None, args)
    text = (f"wrote {out}: {tq_card.human_bytes(size['total_bytes'])} (base {tq_card.human_bytes(size['base_bytes'])}),"
            f" {size['bits_per_weight']} bits per quantized weight")
    if "eval" in result:
        e = result["eval"]
        text += (f"\nperplexity {e['base_perplexity']:.3f} -> {e['quantized_perplexity']:.3f}, mean KL "
                 f"{e['mean_kl']:.4f}, top-1 agreement {100 * e['top1_agreement']:.1f}% on {e['tokens']} tokens")
    if "push" in result:
        text += f"\npushed to {result['push']['url']}"
    _emit(args, result, text)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------------
# push
def _push(directory: str, repo_id: str, private: bool, message: str | None, args) -> dict:
    """`saving.push_folder` with the card rendered for `repo_id`, a progress bar, and the failures as CliError."""
    from ..integration.saving import PushError, push_folder
    from ..reporting import card as tq_card

    retry = (f"Nothing in {directory} was changed; run `turboquant-hf push {directory} {repo_id}` again "
             "(the upload is a single commit: a failed push leaves the repository as it was).")
    steps = {"create repo": f"creating the repository {repo_id}", "upload": f"uploading {directory} to {repo_id}",
             "check": f"checking the upload of {repo_id}"}
    where = ["checking the checkpoint"]
    bar = _progress(total=3, desc="push", unit="step")

    def on_step(name: str) -> None:
        if where[0] in steps.values():
            bar.update()
        where[0] = steps[name]
        bar.set_postfix_str(name)

    try:
        result = push_folder(directory, repo_id, private=private, api=_hub_api(), on_step=on_step,
                             commit_message=message or "Upload TurboQuant checkpoint with turboquant-hf",
                             card=lambda full_id: tq_card.render_card(directory, repo_id=full_id))
        bar.update()
    except tq_card.CardError as e:
        raise CliError(f"push: {e}") from e
    except PushError as e:
        raise CliError(f"push: {e}. {retry}", EXIT_HUB) from e
    except Exception as e:
        if hub_errors.is_hub_exception(e):
            raise _hub_error(e, where[0], retry) from e
        raise
    finally:
        bar.close()
    return result


def cmd_push(args, argv) -> int:
    if not os.path.isdir(args.dir):
        raise CliError(f"push: {args.dir}: no such directory")
    result = _push(args.dir, args.repo, args.private, args.message, args)
    _emit(args, result, f"pushed {result['files']} files to {result['url']}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------------
# card
def cmd_card(args, argv) -> int:
    from ..reporting import card as tq_card

    try:
        if args.stdout:
            text = tq_card.render_card(args.dir, repo_id=args.repo_id, base_model=args.base_model)
            sys.stdout.write(text)
            return EXIT_OK
        path = tq_card.write_card(args.dir, repo_id=args.repo_id, base_model=args.base_model)
    except tq_card.CardError as e:
        raise CliError(f"card: {e}") from e
    _emit(args, {"path": path}, f"wrote {path}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------------
# plan
def _plan_sources(src: str):
    """(config dict, {tensor name: (dtype, shape)}, where) from a local folder or a Hub repo, headers only."""
    from ..reporting import card as tq_card

    if os.path.isdir(src):
        cfg_path = os.path.join(src, "config.json")
        if not os.path.isfile(cfg_path):
            raise CliError(f"plan: {src} has no config.json")
        files = tq_card.safetensors_files(src)
        if not files:
            raise CliError(f"plan: {src} holds no .safetensors files (plan reads the tensor shapes from their headers)")
        with open(cfg_path) as f:
            config = json.load(f)
        tensors = {}
        for path in _progress(iterable=files, desc="read headers", unit="file"):
            try:
                for name, info in ckpt.read_safetensors_header(path).items():
                    tensors[name] = (info["dtype"], tuple(info["shape"]))
            except ckpt.CheckpointError as e:
                raise CliError(f"plan: {e}") from e
        return config, tensors, src
    if not tq_card.looks_like_repo_id(src):
        raise CliError(f"plan: {src} is neither a local directory nor a Hub repo id (namespace/name)")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        NotASafetensorsRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    api = _hub_api()
    step = f"reading config.json of {src}"
    try:
        path = hf_hub_download(src, "config.json", endpoint=os.environ.get("HF_ENDPOINT") or None)
        with open(path) as f:
            config = json.load(f)
        step = f"reading the safetensors headers of {src}"
        meta = api.get_safetensors_metadata(src)
    except NotASafetensorsRepoError as e:
        raise CliError(f"plan: {src} has no safetensors weights ({e})") from e
    except Exception as e:
        # (a refused connection reaches here as LocalEntryNotFoundError, an EntryNotFoundError: not a missing file)
        if hub_errors.network_failure(e) is None and isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError,
                                                          EntryNotFoundError)):
            raise CliError(f"plan: {step} failed: {type(e).__name__} ({str(e).strip().splitlines()[0]})") from e
        if hub_errors.is_hub_exception(e):
            raise _hub_error(e, step, f"Retry `turboquant-hf plan {src}`.") from e
        raise
    tensors = {}
    for fm in meta.files_metadata.values():
        for name, info in fm.tensors.items():
            tensors[name] = (info.dtype, tuple(info.shape))
    return config, tensors, f"{api.endpoint}/{src}"


def _plan_tq_config(src: str) -> dict | None:
    """tq_config.json of a local folder or a Hub repo, None where there is none."""

    from ..format import constants as fmt

    if os.path.isdir(src):
        try:
            return ckpt.read_tq_config(src)
        except ckpt.CheckpointError as e:
            raise CliError(f"plan: {e}") from e
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    step = f"reading {fmt.TQ_CONFIG_NAME} of {src}"
    try:
        path = hf_hub_download(src, fmt.TQ_CONFIG_NAME, endpoint=os.environ.get("HF_ENDPOINT") or None)
    except Exception as e:
        if isinstance(e, EntryNotFoundError) and hub_errors.network_failure(e) is None:
            return None  # optional: config.json's quantization_config is enough
        if hub_errors.is_hub_exception(e):
            raise _hub_error(e, step, f"Retry `turboquant-hf plan {src}`.") from e
        raise
    with open(path) as f:
        return json.load(f)


def cmd_plan(args, argv) -> int:
    from ..format import constants as fmt
    from ..reporting import card as tq_card

    cfg, recipe = _quant_config(args)
    config, tensors, where = _plan_sources(args.src)
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        from ..format.shards import mxfp4_header_shapes

        tensors = mxfp4_header_shapes(tensors)  # (planned as the bf16 weights they decode to, as quantize reads them)
    # packed tensors in the headers: the checkpoint is quantized already, and is planned as it is stored
    stored = any(name.endswith(fmt.PACKED_SUFFIX) for name in tensors)
    try:
        if stored:
            plan = sizing.plan_stored_memory(config, tensors, _plan_tq_config(args.src), args.kv_dtype, args.context,
                                             args.batch, gpus=args.gpus)
            recipe = None
        else:
            plan = sizing.plan_memory(config, tensors, cfg, args.kv_dtype, args.context, args.batch, gpus=args.gpus)
    except sizing.PlanError as e:
        raise CliError(f"plan: {e}") from e
    plan["source"] = where
    plan["recipe"] = recipe
    h = tq_card.human_bytes
    budget_ok = True
    for key, gb in (("gpu", args.gpu_gb), ("ram", args.ram_gb)):
        if gb is not None:
            suffix = "gpu_bytes" if key == "gpu" else "bytes"  # (a GPU holds ternary weights as 2-bit codes)
            tp = plan.get("tensor_parallel") if key == "gpu" else None  # --gpus N: the budget of each GPU
            total = tp[f"total_{suffix}_per_gpu"] if tp else plan[f"total_{suffix}"]
            fits = total <= gb * 1e9
            plan[f"fits_{key}"] = fits
            plan[f"{key}_budget_bytes"] = int(gb * 1e9)
            # the longest context that fits beside the weights
            per_token = (tp["kv_cache_bytes_per_token_per_gpu"] if tp else plan["kv_cache_bytes_per_token"]) * args.batch
            weights = tp[f"weights_{suffix}_per_gpu"] if tp else plan[f"weights_{suffix}"]
            room = gb * 1e9 - weights - plan["recurrent_state_bytes"] * args.batch
            longest = int(room // per_token) if per_token and room > 0 else 0
            limit = int(model_shape.text_config(config).get("max_position_embeddings") or 0)
            plan[f"max_context_{key}"] = min(longest, limit) if limit else longest
            budget_ok = budget_ok and fits
    if stored:
        held = " and ".join(t["label"] for t in plan["tiers"])
        lines = [f"{where}: already quantized with TurboQuant ({held}, group size {plan['group_size']}); planned as "
                 "stored, from its safetensors headers"]
        ignored = [flag for flag, value in (("--recipe", args.recipe), ("--config", args.config), ("--bits", args.bits),
                                            ("--group-size", args.group_size)) if value is not None]
        if ignored:
            lines.append(f"({', '.join(ignored)} not applied: the weights are quantized already)")
    else:
        lines = [f"{where}: {recipe or f'{cfg.bits}-bit'}, group size {cfg.group_size}"]
    lines += ["", f"{'tier':<22}{'tensors':>9}{'weights':>10}{'size':>12}{'bits/weight':>13}"]
    for t in plan["tiers"]:
        lines.append(f"{t['label']:<22}{t['tensors']:>9}{tq_card.human_count(t['params']):>10}{h(t['bytes']):>12}"
                     f"{t['bits_per_weight']:>13}")
    lines.append(f"{'full precision':<22}{plan['full_precision_tensors']:>9}{'':>10}{h(plan['full_precision_bytes']):>12}")
    lines.append(f"{'weights':<22}{'':>19}{h(plan['weights_bytes']):>12}   "
                 + (f"({plan['weights_bytes']:,} bytes as stored; base about {h(plan['base_weights_bytes'])})" if stored
                    else f"(base {h(plan['base_weights_bytes'])})"))
    if plan["weights_gpu_bytes"] != plan["weights_bytes"]:
        lines.append(f"{'weights on a GPU':<22}{'':>19}{h(plan['weights_gpu_bytes']):>12}   (ternary as 2-bit codes, "
                     "the faster kernels; TURBOQUANT_COMPACT_TERNARY=1 keeps the size above)")
    lines += [
        "",
        f"KV cache per token ({args.kv_dtype}): {plan['kv_cache_bytes_per_token']:,} bytes "
        f"({plan['kv_cache']['layers']} full-attention layers x {plan['kv_cache']['kv_heads']} KV heads x "
        f"{plan['kv_cache']['head_dim']} x 2 x {plan['kv_cache']['dtype_bytes']} bytes)",
    ]
    if plan["recurrent_state_bytes"]:
        lines.append(f"recurrent state ({plan['recurrent_state']['layers']} linear-attention layers): "
                     f"{h(plan['recurrent_state_bytes'])} per sequence, constant")
    lines.append(f"at {plan['context']:,} tokens x batch {args.batch}: KV {h(plan['kv_cache_bytes'])}, "
                 f"total {h(plan['total_bytes'])}"
                 + (f" ({h(plan['total_gpu_bytes'])} on a GPU)" if plan["total_gpu_bytes"] != plan["total_bytes"] else ""))
    if "tensor_parallel" in plan:
        lines += _tensor_parallel_lines(plan["tensor_parallel"])
    for key, gb in (("gpu", args.gpu_gb), ("ram", args.ram_gb)):
        if gb is not None:
            verdict = "fits" if plan[f"fits_{key}"] else "does NOT fit"
            lines.append(f"{key.upper()} {gb:g} GB: {verdict}; longest context that fits: "
                         f"{plan[f'max_context_{key}']:,} tokens")
    _emit(args, plan, "\n".join(lines))
    return EXIT_OK if budget_ok else EXIT_DOES_NOT_FIT


def _tensor_parallel_lines(tp: dict) -> list[str]:
    """The `plan --gpus N` section: what each GPU holds under tensor parallelism."""
    from ..reporting import card as tq_card

    h = tq_card.human_bytes
    n = tp["gpus"]
    lines = ["", f"tensor parallel over {n} GPUs (tp_plan='auto'), per GPU: weights {h(tp['weights_bytes_per_gpu'])}"
                 + (f" ({h(tp['weights_gpu_bytes_per_gpu'])} on a GPU)"
                    if tp["weights_gpu_bytes_per_gpu"] != tp["weights_bytes_per_gpu"] else "")
                 + f", KV {h(tp['kv_cache_bytes_per_gpu'])}, total {h(tp['total_gpu_bytes_per_gpu'])}",
             f"  split over the GPUs: {h(tp['split_bytes'])} of weights; on every GPU: {h(tp['replicated_bytes'])}"]
    for reason in tp["refused"][:5]:
        lines.append(f"  REFUSED by tensor parallelism (a split would cut a group): {reason}")
    if len(tp["refused"]) > 5:
        lines.append(f"  ... and {len(tp['refused']) - 5} more")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# eval
def _evaluate(directory: str, base: str, text_path: str, max_tokens: int, window: int, write: bool) -> dict:
    from ..reporting.evaluation import evaluate_folder

    try:
        return evaluate_folder(directory, base, text_path, max_tokens, window, write,
                               progress=lambda total: _progress(total=total, desc="eval", unit="window"))
    except ValueError as e:
        raise CliError(f"eval: {e}") from e


def cmd_eval(args, argv) -> int:
    from ..reporting import card as tq_card

    try:
        tq_card.check_checkpoint(args.dir)
    except tq_card.CardError as e:
        raise CliError(f"eval: {e}") from e
    if not os.path.isfile(args.text):
        raise CliError(f"eval: --text {args.text}: no such file")
    if not os.path.isdir(args.base) and not tq_card.looks_like_repo_id(args.base):
        raise CliError(f"eval: --base {args.base}: neither a local directory nor a Hub repo id")
    result = _evaluate(args.dir, args.base, args.text, args.max_tokens, args.window, write=args.write_card)
    if args.write_card:
        result["card"] = tq_card.write_card(args.dir)
    _emit(args, result, f"{result['tokens']} tokens of {result['text']}: perplexity base {result['base_perplexity']:.3f},"
                        f" quantized {result['quantized_perplexity']:.3f}; mean KL(base || quantized) "
                        f"{result['mean_kl']:.4f} nats/token; top-1 agreement {100 * result['top1_agreement']:.1f}%"
                        + (f"\nwarning: {result['warning']}" if result.get("warning") else ""))
    return EXIT_OK


def cmd_convert(args, argv) -> int:
    """A turboquant-mlx checkpoint (or one saved from it) requantized into the vLLM-servable tq3_native layout."""
    if not os.path.isdir(args.src):
        raise CliError(f"convert: {args.src}: not a local folder")
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not args.force:
        raise CliError(f"convert: --out {args.out} exists (use --force to replace it)")
    import torch
    from transformers import AutoModelForCausalLM

    from .. import TurboQuantConfig
    from ..conversion.mlx_conversion import to_tq3_native

    _say(args, f"loading {args.src}")
    try:
        with open(os.path.join(args.src, "config.json")) as f:
            declared = "quantization_config" in json.load(f)
    except (OSError, ValueError) as e:
        raise CliError(f"convert: {args.src}: no readable config.json ({e})") from e
    # (an explicit quantization_config=None would erase the one config.json declares)
    extra = {} if declared else {"quantization_config": TurboQuantConfig()}
    model = AutoModelForCausalLM.from_pretrained(
        args.src, dtype=getattr(torch, args.dtype) if args.dtype != "auto" else "auto", **extra)
    try:
        report = to_tq3_native(model, group_size=args.group_size)
    except ValueError as e:
        raise CliError(f"convert: {args.src}: {e}") from e
    def record(tmp):
        with open(os.path.join(tmp, "turboquant_convert.json"), "w") as f:
            json.dump({"source": ckpt.public_source(args.src), "to": args.to, **report}, f, indent=2)

    _save_model_folder(args, model, out, record)
    worst = max(report["layers"], key=lambda x: x["relative_error"])
    result = {"out": out, "to": args.to, "layers": len(report["layers"]), "relative_error": report["relative_error"],
              "max_relative_error": report["max_relative_error"], "worst_layer": worst["name"],
              "per_layer": report["layers"]}
    _emit(args, result, f"converted {len(report['layers'])} layers to {args.to} in {out}; error added to the MLX "
                        f"weights (relative, all layers): {report['relative_error']:.4f}, worst "
                        f"{worst['relative_error']:.4f} ({worst['name']})")
    return EXIT_OK


def _save_model_folder(args, model, out: str, extra=None) -> None:
    """`model` and the tokenizer of `args.src` (plus `extra(folder)`) into a hidden folder beside `out`, renamed
    to `out` once complete: an interrupted command leaves no `out` behind."""
    from transformers import AutoTokenizer

    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".", dir=os.path.dirname(out))
    try:
        model.save_pretrained(tmp)
        try:
            AutoTokenizer.from_pretrained(args.src).save_pretrained(tmp)
        except Exception as e:  # a checkpoint without a loadable tokenizer is still complete
            _say(args, f"note: no tokenizer saved ({e})")
        if extra is not None:
            extra(tmp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def cmd_dequantize(args, argv) -> int:
    """A TurboQuant checkpoint back to an ordinary one: every quantized weight as the values the model computes with."""
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not args.force:
        raise CliError(f"dequantize: --out {args.out} exists (use --force to replace it)")
    import torch
    from transformers import AutoModelForCausalLM

    _say(args, f"loading {args.src}")
    model = AutoModelForCausalLM.from_pretrained(args.src)
    if getattr(model, "hf_quantizer", None) is None or model.config.quantization_config.quant_method != "turboquant":
        raise CliError(f"dequantize: {args.src} is not a TurboQuant checkpoint")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else model.get_input_embeddings().weight.dtype
    model.dequantize(dtype=dtype)
    _save_model_folder(args, model, out)
    params = sum(p.numel() for p in model.parameters())
    _emit(args, {"out": out, "dtype": str(dtype).replace("torch.", ""), "params": params},
          f"wrote {out}: {params:,} parameters in {str(dtype).replace('torch.', '')}, no quantization_config")
    return EXIT_OK


COMMANDS = {"quantize": cmd_quantize, "push": cmd_push, "card": cmd_card, "plan": cmd_plan, "eval": cmd_eval,
            "convert": cmd_convert, "dequantize": cmd_dequantize}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _sigterm)
    except ValueError:  # not the main thread
        pass
    try:
        return COMMANDS[args.command](args, argv)
    except CliError as e:
        print(f"turboquant-hf {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"turboquant-hf {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        from ..format.checkpoint import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"turboquant-hf {args.command}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        if hub_errors.is_hub_exception(e):
            print(f"turboquant-hf {args.command}: error: {_hub_error(e, args.command, 'Retry the command.')}",
                  file=sys.stderr)
            return EXIT_HUB
        print(f"turboquant-hf {args.command}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
