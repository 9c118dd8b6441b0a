"""The on-disk side of the streaming quantizer: the source's safetensors headers and row reads, the output's shard
layout, shards written in place at fixed offsets (a shard is synced and renamed once complete), the host buffers
of a device pipeline, and the temporary output folder with the run's record for resuming."""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint as ckpt

INDEX_NAME = "model.safetensors.index.json"
STATE_NAME = "turboquant_convert.json"  # the layout record of a run, kept in the temporary folder for resume
# dtypes of safetensors, with torch's equivalent; floating-point ones are what can be quantized
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                 "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                 "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        TORCH_DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

# the order in which safetensors' own writer lays tensors out (largest alignment first), so that our shards are
# byte for byte what `safetensors.torch.save_file` writes for the same tensors
DTYPE_RANK = {d: i for i, d in enumerate(["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
                                           "I32", "U32", "F32", "F64", "I64", "U64"])}


class ConversionError(ckpt.CheckpointError):
    """The source cannot be converted (bad or unsupported input); nothing was written."""


# ---------------------------------------------------------------------------------------------------------------
# reading the source: headers, and rows of a tensor with plain reads
@dataclass
class SourceTensor:
    name: str
    file: str
    dtype: str
    shape: tuple
    start: int  # absolute offset of the data in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ckpt.DTYPE_BYTES[self.dtype]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if self.shape else 1

    @property
    def row_width(self) -> int:
        return self.shape[-1] if self.shape else 1


# E2M1 (the 4-bit float of MXFP4): codes 0-7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8-15 the same negated
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_VALUES = torch.tensor(_E2M1, dtype=torch.float32)
MXFP4_BLOCK = 32  # values sharing one scale


@dataclass
class Mxfp4Tensor:
    """A weight stored in MXFP4 (the OCP microscaling format gpt-oss ships its experts in): `<name>_blocks`, uint8
    `(..., in/32, 16)` (two E2M1 codes a byte, the low nibble first), and `<name>_scales`, uint8 `(..., in/32)`
    (the blocks' power-of-two exponents, biased by 127). Read as the bfloat16 rows it decodes to (exactly:
    every E2M1 value times a power of two is a bfloat16)."""

    name: str
    blocks: SourceTensor
    scales: SourceTensor
    dtype = "BF16"

    @property
    def file(self) -> str:
        return self.blocks.file

    @property
    def shape(self) -> tuple:
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * MXFP4_BLOCK)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.numel * 2

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def row_width(self) -> int:
        return self.shape[-1]


def mxfp4_pairs(tensors: dict) -> dict:
    """`tensors` with each `<name>_blocks` / `<name>_scales` pair replaced by one `Mxfp4Tensor` named `<name>`; a
    half without the other, or shapes that do not pair up, are errors naming the tensor."""
    out = dict(tensors)
    for name in sorted(tensors):
        if not name.endswith(("_blocks", "_scales")):
            continue
        base = name[: -len("_blocks")]
        blocks, scales = tensors.get(base + "_blocks"), tensors.get(base + "_scales")
        if blocks is None or scales is None:
            raise ConversionError(f"{tensors[name].file}: MXFP4 tensor {name} has no {'_scales' if scales is None else '_blocks'} "
                                  "partner; nothing was written")
        if (blocks.dtype, scales.dtype) != ("U8", "U8") or tuple(blocks.shape[:-1]) != tuple(scales.shape) or \
                blocks.shape[-1] != MXFP4_BLOCK // 2:
            raise ConversionError(f"{blocks.file}: {base}_blocks {blocks.dtype}{list(blocks.shape)} and _scales "
                                  f"{scales.dtype}{list(scales.shape)} are not MXFP4 blocks of {MXFP4_BLOCK}")
        out.pop(base + "_blocks", None)
        out.pop(base + "_scales", None)
        out[base] = Mxfp4Tensor(base, blocks, scales)
    return out


def mxfp4_header_shapes(tensors: dict) -> dict:
    """`{name: (dtype, shape)}` from safetensors headers with each MXFP4 pair `<name>_blocks` `(E, out, in/32, 16)`
    and `<name>_scales` as `<name>`: ("BF16", `(E, in, out)`), the shape and type transformers gives the decoded
    experts (gpt-oss stores them `[E, in, out]`)."""
    out = {}
    for name, (dtype, shape) in tensors.items():
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in tensors:
            continue
        if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in tensors and len(shape) == 4:
            e, rows, nb, _ = shape
            out[name[: -len("_blocks")]] = ("BF16", (e, nb * MXFP4_BLOCK, rows))
        else:
            out[name] = (dtype, shape)
    return out


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 MXFP4 `blocks` `(r, nb, 16)` and `scales` `(r, nb)` -> bfloat16 `(r, nb * 32)`."""
    r, nb = scales.shape
    codes = torch.stack((blocks & 15, blocks >> 4), -1).view(r, nb, MXFP4_BLOCK).long()
    values = _E2M1_VALUES[codes]
    return torch.ldexp(values, scales.to(torch.int32).sub_(127).unsqueeze(-1).float()).to(torch.bfloat16).view(r, -1)


def read_source_header(path: str) -> dict[str, SourceTensor]:
    """Every tensor of one .safetensors file (`checkpoint.read_safetensors_header`: the header whole and
    consistent, the file complete)."""
    try:
        header = ckpt.read_safetensors_header(path)
    except ckpt.CheckpointError as e:
        raise ConversionError(str(e)) from e
    return {name: SourceTensor(name, path, i["dtype"], i["shape"], i["start"], i["nbytes"]) for name, i in header.items()}


def source_index(directory: str) -> dict[str, SourceTensor]:
    """All tensors of a checkpoint folder: the files named by model.safetensors.index.json, else every
    .safetensors file. A file the index lists but that is missing is an error that names it."""
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConversionError(f"{index_path}: not a safetensors index ({e!r})") from e
        by_file: dict[str, list[str]] = {}
        for tensor, file in weight_map.items():
            by_file.setdefault(file, []).append(tensor)
        for file, tensors in sorted(by_file.items()):
            if not os.path.isfile(os.path.join(directory, file)):
                more = f" and {len(tensors) - 1} more tensors" if len(tensors) > 1 else ""
                raise ConversionError(f"{directory}: shard {file} is listed in {INDEX_NAME} (for {sorted(tensors)[0]}"
                                      f"{more}) but is missing")
        files = [os.path.join(directory, f) for f in sorted(by_file)]
    else:
        files = [str(f) for f in sorted(Path(directory).glob("*.safetensors"))]
        weight_map = None
    if not files:
        raise ConversionError(f"{directory}: no .safetensors files (weights are read as safetensors only)")
    index: dict[str, SourceTensor] = {}
    for path in files:
        for name, t in read_source_header(path).items():
            if name in index:
                raise ConversionError(f"{directory}: tensor {name} is in both {index[name].file} and {path}")
            index[name] = t
    if weight_map is not None:
        for tensor, file in weight_map.items():
            if tensor not in index:
                raise ConversionError(f"{os.path.join(directory, file)}: has no tensor {tensor}, which {INDEX_NAME} "
                                      "places there")
    return index


class SourceReader:
    """Reads byte ranges of source tensors with positioned reads (no memory map: nothing stays resident)."""

    def __init__(self):
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()  # positioned reads share a descriptor safely; opening it is guarded

    def read(self, t: SourceTensor, byte_offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`nbytes` bytes of `t` from `byte_offset`, as uint8: in a new tensor, or at the start of the uint8
        host tensor `out` (a reusable, possibly page-locked buffer), of which the filled part is returned."""
        fd = self.fds.get(t.file)
        if fd is None:
            with self.lock:
                fd = self.fds.get(t.file)
                if fd is None:
                    fd = self.fds[t.file] = os.open(t.file, os.O_RDONLY)
        buf = torch.empty(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
        view = memoryview(buf.numpy())
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], t.start + byte_offset + done)
            if got <= 0:
                raise ConversionError(f"{t.file}: unexpected end of file while reading tensor {t.name}")
            done += got
        return buf

    def rows(self, t: SourceTensor, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(t, Mxfp4Tensor):
            nb = t.row_width // MXFP4_BLOCK
            blocks = self.read(t.blocks, r0 * nb * 16, (r1 - r0) * nb * 16).view(r1 - r0, nb, 16)
            scales = self.read(t.scales, r0 * nb, (r1 - r0) * nb).view(r1 - r0, nb)
            rows = decode_mxfp4(blocks, scales)
            if out is None:
                return rows
            return out[: rows.numel() * 2].view(torch.bfloat16).view_as(rows).copy_(rows)
        width = t.row_width * t.itemsize
        data = self.read(t, r0 * width, (r1 - r0) * width, out)
        return data.view(TORCH_DTYPES[t.dtype]).view(r1 - r0, t.row_width)

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


# ---------------------------------------------------------------------------------------------------------------
# writing: safetensors shards whose layout is fixed before any work, filled in place
def shard_layout(outputs, max_shard_size: int) -> list[tuple[str, list]]:
    """[(file name, [(tensor, dtype, shape)])] of the output tensors [(tensor, dtype, shape)], in order: a new shard
    whenever the next tensor would overflow this one."""
    shards, current, size = [], [], 0
    for name, dtype, shape in outputs:
        nbytes = math.prod(shape) * ckpt.DTYPE_BYTES[dtype]
        if current and size + nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append((name, dtype, tuple(shape)))
        size += nbytes
    if current:
        shards.append(current)
    n = len(shards)
    return [("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors", entries)
            for i, entries in enumerate(shards)]


def shard_header(entries: list[tuple[str, str, tuple]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(header bytes, {name: (data offset, nbytes)}) of a shard, laid out as safetensors' own writer does."""
    order = sorted(entries, key=lambda e: (-DTYPE_RANK.get(e[1], 0), e[0]))
    meta: dict = {"__metadata__": {"format": "pt"}}
    spans, offset = {}, 0
    for name, dtype, shape in order:
        nbytes = math.prod(shape) * ckpt.DTYPE_BYTES[dtype]
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans[name] = (offset, nbytes)
        offset += nbytes
    text = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {k: (len(head) + s, n) for k, (s, n) in spans.items()}


class ShardWriter:
    def __init__(self, path: str, entries):
        self.path = path
        head, self.spans = shard_header(entries)
        self.size = len(head) + sum(n for _, n in self.spans.values())
        self.remaining = self.size - len(head)
        self.fd = os.open(path + ".tmp", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.size)
        self._pwrite(memoryview(head), 0)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def write(self, name: str, byte_offset: int, tensor: torch.Tensor) -> None:
        data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
        start, nbytes = self.spans[name]
        if byte_offset + data.nbytes > nbytes:  # pragma: no cover - a layout bug, never bad input
            raise RuntimeError(f"{name}: write past the end of the tensor in {self.path}")
        self._pwrite(memoryview(data).cast("B"), start + byte_offset)
        self.remaining -= data.nbytes

    def finish(self) -> None:
        if self.remaining:  # pragma: no cover - a layout bug
            raise RuntimeError(f"{self.path}: {self.remaining} bytes were never written")
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.path + ".tmp", self.path)

    def abandon(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def shard_is_complete(path: str, entries) -> bool:
    """A shard of an interrupted run can be kept: it has its final name, its exact size and its exact header."""
    if not os.path.isfile(path):
        return False
    head, spans = shard_header(entries)
    if os.path.getsize(path) != len(head) + sum(n for _, n in spans.values()):
        return False
    with open(path, "rb") as f:
        return f.read(len(head)) == head


class HostBuffers:
    """Reusable host buffers for the slices in flight to a device: one for a slice's source rows, one for its
    results (norms first, the packed bytes at the next multiple of 64). Page-locked when `pin` (CUDA), so that the
    copies to and from the device run asynchronously. A pair is allocated only when none is free, so there are
    never more pairs than slices in flight."""

    def __init__(self, in_bytes: int, out_bytes: int, pin: bool):
        self.in_bytes, self.out_bytes, self.pin = in_bytes, out_bytes, pin
        self.allocated = 0
        self._free: list = []
        self._lock = threading.Lock()

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return (torch.empty(self.in_bytes, dtype=torch.uint8, pin_memory=self.pin),
                torch.empty(self.out_bytes, dtype=torch.uint8, pin_memory=self.pin))

    def give(self, pair) -> None:
        with self._lock:
            self._free.append(pair)

    @staticmethod
    def results(out: torch.Tensor, packed_shape, norms_shape, norms_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of an output buffer for a slice's (packed, norms)."""
        n_norms = math.prod(norms_shape) * torch.empty((), dtype=norms_dtype).element_size()
        start = -(-n_norms // 64) * 64
        packed = out[start:start + math.prod(packed_shape)].view(packed_shape)
        return packed, out[:n_norms].view(norms_dtype).view(norms_shape)


class SliceWriter:
    """Writes finished slices at their places in the shards, in the order they are put, and finishes a shard
    (sync, rename) as soon as its last tensor is written: on its own thread, so that the writes overlap the
    reading and the quantizing. At most `in_flight` slices are between `reserve()` and their write.

    Only this thread touches the shard writers while it runs. Its first error (an OSError names the shard) stops
    the writing: the caller gets it from its next `reserve()`, `put()` or `close()`."""

    def __init__(self, out_dir: str, layout, done_files: set, in_flight: int):
        self.out_dir, self.done_files = out_dir, done_files
        self.entries_of = dict(layout)
        self.where = {name: f for f, entries in layout for name, _, _ in entries}  # output tensor -> shard
        self.pending = {f: len(entries) for f, entries in layout}  # tensors still to finish per shard
        self.writers: dict[str, ShardWriter] = {}
        self.error: BaseException | None = None
        self._stop = False
        self._room = threading.Semaphore(in_flight)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="turboquant-convert-writer", daemon=True)
        self._thread.start()

    def reserve(self) -> None:
        """Wait until fewer than `in_flight` slices are on their way (raises the writing's error, if any)."""
        while not self._room.acquire(timeout=0.05):
            self.check()
        self.check()

    def put(self, writes, finished=(), ready=None, release=None) -> None:
        """Write [(tensor name, byte offset, host tensor)] once the event `ready` (None: now) has completed, then
        mark the tensors `finished` complete; call `release()` after, whatever happens."""
        self.check()
        self._queue.put((writes, finished, ready, release))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Wait for every write (raises the writing's error, if any)."""
        self._queue.put(None)
        self._thread.join()
        self.check()
        if self.writers:  # pragma: no cover - a layout bug
            raise RuntimeError(f"shards left unfinished: {sorted(self.writers)}")

    def abort(self) -> None:
        """Stop without writing what is still queued; close the unfinished shards (never renamed)."""
        self._stop = True
        self._queue.put(None)
        self._thread.join()
        for w in self.writers.values():
            w.abandon()
        self.writers = {}

    def _shard(self, name: str) -> ShardWriter | None:
        f = self.where[name]
        if f in self.done_files:
            return None
        if f not in self.writers:
            self.writers[f] = ShardWriter(os.path.join(self.out_dir, f), self.entries_of[f])
        return self.writers[f]

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            writes, finished, ready, release = item
            shard = None
            try:
                if self.error is None and not self._stop:
                    if ready is not None:
                        ready.synchronize()
                    for name, byte_offset, tensor in writes:
                        shard = self.where[name]
                        w = self._shard(name)
                        if w is not None:
                            w.write(name, byte_offset, tensor)
                    for name in finished:
                        shard = self.where[name]
                        if shard not in self.done_files:
                            self.pending[shard] -= 1
                            if self.pending[shard] == 0:
                                self.writers[shard].finish()
                                del self.writers[shard]
            except OSError as e:
                self.error = e
                if e.filename is None and shard is not None:  # say which file could not be written
                    self.error = OSError(e.errno, e.strerror or str(e), os.path.join(self.out_dir, shard + ".tmp"))
                    self.error.__cause__ = e
            except BaseException as e:  # noqa: B036 - handed to the caller, KeyboardInterrupt included
                self.error = e
            finally:
                del writes, item
                if release is not None:
                    release()
                self._room.release()


# ---------------------------------------------------------------------------------------------------------------
# the run: its temporary output folder, the record that lets an interrupted run resume, the process's memory
def fingerprint(index: dict[str, SourceTensor]) -> list:
    """[file name, size, modification time] of every source file: a resumed run must read the same files."""
    out = []
    for path in sorted({t.file for t in index.values()}):
        st = os.stat(path)
        out.append([os.path.basename(path), st.st_size, st.st_mtime_ns])
    return out


def run_record(source_dir: str, index: dict[str, SourceTensor], quantization_config: dict, keep_dtype,
               max_shard_size: int, layout) -> dict:
    """What a run is: its source (and the source files' fingerprint), configuration, shard size and layout."""
    return {"version": 1, "source": source_dir, "files": fingerprint(index),
            "quantization_config": quantization_config, "keep_dtype": keep_dtype, "max_shard_size": max_shard_size,
            "layout": [[f, [[n, d, list(s)] for n, d, s in e]] for f, e in layout]}


def open_partial(tmp: str, state: dict, layout, resume: bool) -> set[str]:
    """Make the temporary output folder `tmp` ready; returns the shards already finished in it.

    With `resume` and an existing `tmp`, its run must have the record `state`: its complete shards are kept, the
    rest removed. Otherwise `tmp` starts empty but for the record `state`."""
    state_path = os.path.join(tmp, STATE_NAME)
    done_files: set[str] = set()
    if resume and os.path.isdir(tmp):
        try:
            with open(state_path) as f:
                previous = json.load(f)
        except (OSError, ValueError):
            previous = None
        if previous != json.loads(json.dumps(state)):
            raise ConversionError(
                f"{tmp}: cannot resume: that run was started with another source, configuration or shard size "
                "(or its record is unreadable); remove it, or run without --resume to start over")
        done_files = {f for f, entries in layout if shard_is_complete(os.path.join(tmp, f), entries)}
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with open(state_path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(state_path + ".tmp", state_path)
    for entry in os.listdir(tmp):  # leftovers of the interrupted run: unfinished shards
        if entry != STATE_NAME and entry not in done_files:
            os.remove(os.path.join(tmp, entry))
    return done_files


def move_into_place(tmp: str, save_dir: str) -> None:
    """Rename the complete folder `tmp` (its run record removed) to `save_dir`; an existing `save_dir` goes only once
    the new folder has its name."""
    os.remove(os.path.join(tmp, STATE_NAME))
    if os.path.exists(save_dir):
        old = os.path.join(os.path.dirname(save_dir), f".{os.path.basename(save_dir)}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(save_dir, old)
        os.replace(tmp, save_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, save_dir)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation without swapping (Linux: MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def peak_rss() -> int:
    """Peak resident memory of this process in bytes (Linux: VmHWM; elsewhere ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
