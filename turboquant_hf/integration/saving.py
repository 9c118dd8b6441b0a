"""Saving a TurboQuant model: tq_config.json, the model card, the tokenizer beside the weights, and push_to_hub.

transformers writes the weights and config.json (`HfQuantizer.is_serializable`); `save_pretrained` and
`push_to_hub` here add what the published format and the Hub need, in the folder transformers wrote. They become
the methods of each TurboQuant model instance (`patches.patch_model`: transformers has no hook that runs after it
has written the folder).
"""

from __future__ import annotations

import os
import warnings

from transformers.utils import logging

from ..format import checkpoint as ckpt
from ..modeling.modules import TurboQuantExperts, TurboQuantWeight
from ..quantization.config import TurboQuantConfig
from ..quantization.planning import checkpoint_to_model_keys

logger = logging.get_logger(__name__)


def describe_quantized_model(model, save_directory: str) -> dict:
    """The `tq_config.json` that describes `model` as saved in `save_directory` (names as written there)."""
    cfg = model.config.quantization_config
    if isinstance(cfg, dict):
        cfg = TurboQuantConfig.from_dict(cfg)
    files = [os.path.join(save_directory, f) for f in os.listdir(save_directory) if f.endswith(".safetensors")]
    saved = ckpt.packed_weight_keys(ckpt.read_checkpoint_index(files))
    modules = dict(model.named_modules())
    layers, orig_in_dims = 0, {}
    for key, model_key in checkpoint_to_model_keys(model, saved).items():
        module = modules.get(model_key)
        if not isinstance(module, TurboQuantWeight):
            continue
        layers += 1
        if module.in_features % module.group_size:
            orig_in_dims[key] = module.in_features
    return cfg.to_tq_config(layers, orig_in_dims, getattr(model, "_turboquant_original_model", None))


def save_pretrained(self, save_directory, *args, model_card: bool = True, base_model=None, **kwargs):
    """transformers' save_pretrained, then tq_config.json and (unless `model_card=False`) the model card README.md.

    `base_model`: the Hub id of the model this was quantized from, for the card (default: tq_config's
    original_model when it is a Hub id). With `push_to_hub=True` the folder is uploaded after the card is
    written, so the Hub gets this card and not transformers' generic one.
    """
    push = kwargs.pop("push_to_hub", False)
    tags = kwargs.pop("tags", None)
    hub_kwargs = {k: kwargs.pop(k) for k in ("repo_id", "commit_message", "create_pr", "private") if k in kwargs}
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    if not kwargs.get("is_main_process", True) or os.path.isfile(save_directory):
        return result
    ckpt.write_tq_config(save_directory, describe_quantized_model(self, save_directory))
    _save_source_tokenizer(self, save_directory)
    repo_id = None
    if push:
        from huggingface_hub import HfApi

        api = HfApi()
        repo_id = hub_kwargs.get("repo_id") or os.path.basename(os.path.normpath(str(save_directory)))
        repo_id = api.create_repo(repo_id, private=hub_kwargs.get("private"), token=kwargs.get("token"),
                                  exist_ok=True).repo_id
    if model_card:
        _write_card(self, save_directory, repo_id=repo_id, base_model=base_model, tags=tags)
    if push:
        push_folder(save_directory, repo_id, token=kwargs.get("token"), commit_message=hub_kwargs.get("commit_message"),
                    create_pr=hub_kwargs.get("create_pr", False), api=api)
    return result


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _save_source_tokenizer(model, save_directory) -> None:
    """The tokenizer of the model this one was loaded from, saved beside it when the folder has none, so that
    `pipeline(model=save_directory)` and a pushed repo work on their own."""
    source = getattr(model, "_turboquant_original_model", None)
    if not source or any(os.path.isfile(os.path.join(save_directory, f)) for f in _TOKENIZER_FILES):
        return
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, f)) for f in _TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # no tokenizer where the weights came from: the folder is complete without one
        logger.info("TurboQuant: no tokenizer saved beside the model (%s: %s)", source, e)
        return
    tokenizer.save_pretrained(save_directory)


def _write_card(model, save_directory, repo_id=None, base_model=None, tags=None) -> None:
    from ..reporting import card as tq_card

    source = getattr(model, "_turboquant_original_model", None)
    try:
        tq_card.write_build_record(save_directory, base_model=base_model, source=source)
        text = tq_card.render_card(str(save_directory), repo_id=repo_id, base_model=base_model,
                                   source_dir=source if source and os.path.isdir(source) else None, tags=tags)
    except Exception as e:  # the weights are saved; a card that cannot be rendered must not lose them
        warnings.warn(f"TurboQuant: saved the model but could not write its model card: {e}")
        return
    tq_card.save_card(save_directory, text)


class PushError(RuntimeError):
    """The Hub does not list every file of a push after its commit."""


DEFAULT_COMMIT_MESSAGE = "Upload TurboQuant model"


def push_folder(directory, repo_id: str, *, private: bool | None = None, token=None, revision: str | None = None,
                create_pr: bool = False, commit_message: str | None = None, card=None, api=None,
                on_step=None) -> dict:
    """Upload a saved TurboQuant folder to the Hub in one commit, then check that the Hub lists every file: the one
    way the command line (`turboquant-hf push`, `quantize --push-to-hub`), `save_pretrained(push_to_hub=True)` and
    `push_to_hub` publish. The repository is created when missing. Files and folders whose name starts with a dot,
    and `*.tmp` files, are left out; `card`: the README.md text to upload in place of the folder's, or a function of
    the repository's full id (as the Hub names it once created) that returns it. A failed
    commit leaves the repository as it was. `on_step(name)`: called before each of "create repo", "upload",
    "check". Returns {"repo_id", "url", "commit", "files"}; `card.CardError` when the folder is not a TurboQuant
    checkpoint, `PushError` when the Hub lists a file missing after the commit."""
    from huggingface_hub import CommitOperationAdd, HfApi

    from ..reporting import card as tq_card

    tq_card.check_checkpoint(str(directory))
    api = api or HfApi()
    step = on_step or (lambda name: None)
    step("create repo")
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    step("upload")
    if callable(card):
        card = card(repo_id)
    ops = [] if card is None else [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8"))]
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if (card is not None and rel == "README.md") or name.startswith(".") or name.endswith(".tmp"):
                continue
            ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=os.path.join(root, name)))
    info = api.create_commit(repo_id, operations=ops, commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
                             token=token, revision=revision, create_pr=create_pr)
    step("check")
    if not create_pr:  # (a pull request's files are not on the revision yet)
        listed = {f.rfilename for f in (api.model_info(repo_id, revision=revision, token=token).siblings or [])}
        missing = sorted(op.path_in_repo for op in ops if op.path_in_repo not in listed)
        if missing:
            raise PushError(f"the Hub lists no {', '.join(missing)} in {repo_id} after the commit")
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    return {"repo_id": repo_id, "url": f"{endpoint}/{repo_id}", "commit": getattr(info, "oid", None),
            "files": len(ops)}


def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                 token=None, create_pr: bool = False, revision: str | None = None, tags=None,
                 base_model=None, **save_kwargs):
    """Push weights, config, tq_config.json and the TurboQuant model card in one commit.

    transformers' own push_to_hub would replace the README with its generic card; this one uploads the
    folder that `save_pretrained` wrote, card included.
    """
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as tmp:
        self.save_pretrained(tmp, model_card=False, **save_kwargs)
        _write_card(self, tmp, repo_id=repo_id, base_model=base_model, tags=tags)
        return push_folder(tmp, repo_id, token=token, revision=revision, create_pr=create_pr,
                           commit_message=commit_message, api=api)


def drop_expert_converters(model) -> None:
    """Packed experts are saved pre-fused, whatever the source layout: transformers must not split them back
    into per-expert tensors on save (its reverse converters would also match `...gate_up_proj.tq_packed`)."""
    from transformers.core_model_loading import WeightConverter

    conversions = getattr(model, "_weight_conversions", None)
    if not conversions:
        return
    packed_owners = [n for n, m in model.named_modules() if isinstance(m, TurboQuantExperts)]
    if not packed_owners:
        return
    model._weight_conversions = [
        c for c in conversions
        if not (isinstance(c, WeightConverter) and any("experts" in str(t) for t in c.target_patterns))
    ]
