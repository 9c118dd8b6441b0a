"""Reading and describing tq3_native checkpoints on disk (headers only; weights move as safetensors)."""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
from typing import Any, Iterable

from . import constants as fmt

# bytes per element of each safetensors dtype
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_CACHE_SNAPSHOT = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/")


class CheckpointError(ValueError):
    """A checkpoint on disk is incomplete, truncated or inconsistent."""


def looks_like_repo_id(name: str | None) -> bool:
    return bool(name) and bool(_REPO_ID.match(str(name))) and not os.path.exists(name)


def public_source(source) -> str | None:
    """How a saved file names the model it came from: a Hub repo id as it is (a Hub cache snapshot path as its
    repo id), anything else by its folder's base name only; never a path of the machine that wrote it."""
    if source is None:
        return None
    source = os.fspath(source)
    if looks_like_repo_id(source):
        return source
    m = _HUB_CACHE_SNAPSHOT.search(source.replace(os.sep, "/"))
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    return os.path.basename(os.path.normpath(source)) or None


def public_command(command: str | None) -> str | None:
    """A command line with every argument that is a path of this machine reduced to its base name."""
    if not command:
        return command
    words = []
    for word in shlex.split(command):
        key, eq, value = word.partition("=") if word.startswith("--") else ("", "", word)
        if os.path.isabs(value) or (os.sep in value and os.path.exists(value)):
            value = public_source(value)
        words.append(key + eq + value)
    return shlex.join(words)


def read_safetensors_header(path: str) -> dict[str, dict[str, Any]]:
    """`{name: {"dtype", "shape", "file", "start", "nbytes"}}` of a .safetensors file (`start`: the absolute offset
    of the tensor's data), after checking that the header is whole and consistent and the file complete."""
    size = os.path.getsize(path)

    def bad(why):
        return CheckpointError(f"{path}: {why}")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise bad(f"corrupted safetensors header (it claims {n} bytes, the file has {size}): truncated or damaged")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"corrupted safetensors header (not readable JSON: {e})") from e
    header.pop("__metadata__", None)
    out, spans = {}, []
    for name, info in header.items():
        try:
            dtype, shape, (start, stop) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            start, stop = int(start), int(stop)
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"corrupted safetensors header: entry {name!r} is malformed ({e!r})") from e
        if dtype not in DTYPE_BYTES:
            raise bad(f"tensor {name} has the unknown dtype {dtype!r}")
        nbytes = DTYPE_BYTES[dtype]
        for d in shape:
            nbytes *= d
        if stop - start != nbytes or start < 0:
            raise bad(f"corrupted safetensors header: tensor {name} has {stop - start} bytes for {dtype} {list(shape)}")
        if 8 + n + stop > size:
            raise bad(f"truncated safetensors file ({size} bytes; tensor {name} ends at {8 + n + stop})")
        out[name] = {"dtype": dtype, "shape": shape, "file": path, "start": 8 + n + start, "nbytes": nbytes}
        spans.append((start, stop, name))
    spans.sort()
    for (_, e0, a), (s1, _, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise bad(f"corrupted safetensors header: tensors {a} and {b} overlap")
    return out


def read_checkpoint_index(files: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Merged header index of every safetensors file in `files` (other files are ignored)."""
    index: dict[str, dict[str, Any]] = {}
    for path in files or ():
        if str(path).endswith(".safetensors"):
            index.update(read_safetensors_header(str(path)))
    return index


def read_tq_config(path) -> dict[str, Any] | None:
    """The `tq_config.json` of a checkpoint folder (or that file itself): the one reader of it. None where there is
    none; CheckpointError naming the file where it is not JSON."""
    path = os.fspath(path) if path else path
    if path and os.path.isdir(path):
        path = os.path.join(path, fmt.TQ_CONFIG_NAME)
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{path}: unreadable {fmt.TQ_CONFIG_NAME}: {e}") from e


def write_tq_config(directory, tq: dict) -> None:
    """Write a checkpoint folder's `tq_config.json` (the one writer of it): whole or not at all (a temporary file
    renamed into place)."""
    path = os.path.join(os.fspath(directory), fmt.TQ_CONFIG_NAME)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(tq, f, indent=2)
    os.replace(path + ".tmp", path)


def packed_weight_keys(index: dict[str, Any]) -> list[str]:
    """Checkpoint names `X.weight` whose `X.weight.tq_packed` is stored."""
    return sorted(k[: -len(fmt.PACKED_SUFFIX)] for k in index if k.endswith(fmt.PACKED_SUFFIX))


def check_packed_tensor(index: dict[str, Any], key: str, rows: int, in_features: int, group_size: int):
    """Validate `key.tq_packed` / `key.tq_norms` against a layer of `rows` x `in_features`.

    Returns (codebook size, norms dtype)."""
    packed_name, norms_name = key + fmt.PACKED_SUFFIX, key + fmt.NORMS_SUFFIX
    n_groups = -(-in_features // group_size)
    for name in (packed_name, norms_name):
        if name not in index:
            raise CheckpointError(f"checkpoint is missing {name} (needed for the quantized layer {key})")
    packed, norms = index[packed_name], index[norms_name]
    if norms["dtype"] not in fmt.NORMS_DTYPES or norms["shape"] != (rows, n_groups):
        raise CheckpointError(
            f"{norms_name}: expected float32 (or float16) of shape {(rows, n_groups)} for a {rows}x{in_features} layer at "
            f"group_size {group_size}, found {norms['dtype']} {norms['shape']}"
        )
    if packed["dtype"] != "U8" or len(packed["shape"]) != 2 or packed["shape"][0] != rows * n_groups:
        raise CheckpointError(
            f"{packed_name}: expected uint8 of shape ({rows * n_groups}, bytes_per_group), found "
            f"{packed['dtype']} {packed['shape']}"
        )
    try:
        return fmt.levels_from_geometry(packed["shape"][1], group_size), fmt.NORMS_DTYPES[norms["dtype"]]
    except ValueError as e:
        raise CheckpointError(f"{packed_name}: {e}") from e


def checkpoint_dirs(files: Iterable[str]) -> list[str]:
    return sorted({os.path.dirname(str(p)) for p in files or ()})


def check_hadamard_tensor(index: dict[str, Any], key: str, rows: int, in_features: int):
    """Validate a whole-row-Hadamard module saved in this package's layout (`key.tq_packed`, `.tq_norms`,
    `.tq_codebook`, `.tq_signs`; see `turboquant_hf.integration.mlx`) against a layer of `rows` x `in_features`.

    Returns (codebook size, group size, norms dtype)."""
    names = {part: f"{key}.tq_{part}" for part in ("packed", "norms", "codebook", "signs")}
    for name in names.values():
        if name not in index:
            raise CheckpointError(f"checkpoint is missing {name} (needed for the quantized layer {key})")
    packed, norms, codebook, signs = (index[names[p]] for p in ("packed", "norms", "codebook", "signs"))
    if len(codebook["shape"]) != 1 or codebook["shape"][0] not in (3, 4, 8, 16) or codebook["dtype"] not in fmt.NORMS_DTYPES:
        raise CheckpointError(f"{names['codebook']}: expected 3, 4, 8 or 16 float entries, found {codebook['dtype']} "
                              f"{list(codebook['shape'])}")
    if signs["shape"] != (in_features,) or signs["dtype"] not in fmt.NORMS_DTYPES:
        raise CheckpointError(f"{names['signs']}: expected float ({in_features},), found {signs['dtype']} "
                              f"{list(signs['shape'])}")
    n_groups = norms["shape"][1] if len(norms["shape"]) == 2 else 0
    if norms["dtype"] not in fmt.NORMS_DTYPES or norms["shape"][0] != rows or not n_groups or in_features % n_groups:
        raise CheckpointError(f"{names['norms']}: expected float ({rows}, n_groups) with n_groups dividing "
                              f"{in_features}, found {norms['dtype']} {list(norms['shape'])}")
    n_levels, group_size = codebook["shape"][0], in_features // n_groups
    expected = (rows * n_groups, fmt.bytes_per_group(n_levels, group_size))
    if packed["dtype"] != "U8" or packed["shape"] != expected:
        raise CheckpointError(f"{names['packed']}: expected uint8 {list(expected)} for a {n_levels}-entry codebook, "
                              f"found {packed['dtype']} {list(packed['shape'])}")
    return n_levels, group_size, fmt.NORMS_DTYPES[norms["dtype"]]
