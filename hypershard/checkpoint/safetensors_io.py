"""Reading boxes of tensors out of safetensors files through mmap, a bounded slice at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}}) and the raw row-major bytes. ``read_index(directory)`` parses the headers of a
model folder (``model.safetensors`` or the files of ``model.safetensors.index.json``) without
reading any tensor; ``Reader.copy_box(entry, starts, sizes, out)`` copies the box
``tensor[starts : starts + sizes]`` (one range per dim) into ``out`` straight from the mapped file.

The box is copied in slices whose span in the file is at most ``staging_bytes``; after each slice
its pages are dropped from the mapping (``MADV_DONTNEED``: they stay in the page cache but leave
this process's resident set). So reading never makes a rank resident in more of a file than one
slice, whatever the tensor's size or the box's shape: a column block of a row-major weight touches
every row of it, a slice of rows at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import warnings
from pathlib import Path

import torch

__all__ = ["Entry", "Reader", "read_index", "DEFAULT_STAGING_BYTES"]

DEFAULT_STAGING_BYTES = 16 << 20  # 16 MiB of a file resident at a time, at most

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
INDEX_FILE = "model.safetensors.index.json"
_AROUND = 1 << 20  # bytes released on either side of a slice (more than the kernel's fault-around)


def _error(message: str) -> ValueError:
    return ValueError(f"hypershard: from_pretrained: {message}")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are, and what they hold."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple
    offset: int  # of its first byte in the file
    nbytes: int


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise _error(f"{path}: the {what} is not valid JSON ({error}); the file is damaged or incomplete") from None


def _files_of(directory: Path) -> tuple:
    """(the safetensors files of the folder, {tensor name: file name} of its index or None)."""
    index = directory / INDEX_FILE
    if index.is_file():
        parsed = _read_json(index, "index")
        weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
        if not isinstance(weight_map, dict):
            raise _error(f"{index}: no 'weight_map' object; the file is damaged or incomplete")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            tensors = sorted(k for k, v in weight_map.items() if v == missing[0])
            raise _error(
                f"{index} lists {len(missing)} file(s) that are not in {directory}: {missing[:3]} "
                f"(holding e.g. tensor {tensors[0]!r}); expected every listed shard file, found "
                f"{sorted(p.name for p in directory.glob('*.safetensors'))[:6]}; the download or copy is incomplete"
            )
        return [directory / n for n in names], weight_map
    return sorted(directory.glob("*.safetensors")), None


def _header(path: Path) -> tuple:
    """(the parsed JSON header, the offset of the first data byte, the file's size), checked."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _error(
                f"{path} is not a safetensors file: expected an 8-byte header length, found a file of {size} bytes"
            )
        length = int.from_bytes(head, "little")
        if length <= 0 or length > size - 8:
            raise _error(
                f"{path} is not a safetensors file or is truncated: its header length is {length} bytes, "
                f"expected at most the {size - 8} bytes that follow it"
            )
        raw = fh.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise _error(f"{path}: the header ({length} bytes) is not valid JSON ({error}); the file is damaged") from None
    if not isinstance(header, dict):
        raise _error(f"{path}: the header is a JSON {type(header).__name__}, expected an object; the file is damaged")
    return header, 8 + length, size


def _entry(path: Path, key: str, info, base: int, size: int) -> Entry:
    """One header entry checked against the file: a known dtype, a shape of non-negative ints,
    data_offsets [begin, end] with end - begin = bytes of dtype x shape, inside the file."""

    def bad(problem: str) -> ValueError:
        return _error(f"{path}: tensor {key!r}: {problem}; the file is damaged or truncated")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise bad(f"header entry {info!r}, expected an object with dtype, shape and data_offsets")
    if info["dtype"] not in _DTYPES:
        raise _error(
            f"{path}: tensor {key!r} has dtype {info['dtype']}, which this loader does not read; "
            f"allowed: {sorted(_DTYPES)}"
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r}, expected a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r}, expected [begin, end] with 0 <= begin <= end")
    dtype = _DTYPES[info["dtype"]]
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise bad(
            f"data_offsets [{begin}, {end}] hold {end - begin} bytes, expected {expected} "
            f"({info['dtype']} x shape {shape})"
        )
    if base + end > size:
        raise bad(
            f"its bytes end at byte {base + end} of the file, which has {size} bytes "
            f"(expected at least {base + end}, found {size})"
        )
    return Entry(key, path, dtype, tuple(shape), base + begin, end - begin)


def read_index(directory) -> dict:
    """{tensor name: Entry} of every tensor in the folder's safetensors files (headers only).

    Every header entry is checked against its file before anything is read (a damaged or
    truncated file, a lying shape, overlapping tensors, an index that names a missing file or a
    tensor its file lacks): the ValueError names the file, the tensor, and what was expected and
    found. The checks read only the files, so every rank raises the same error."""
    directory = Path(directory)
    if not directory.is_dir():
        raise _error(f"{str(directory)!r} is not a directory; allowed: a save_pretrained folder")
    files, weight_map = _files_of(directory)
    if not files:
        raise _error(
            f"{directory} holds no *.safetensors file; allowed: a folder written by save_pretrained "
            "(safetensors) or hypershard.checkpoint.export_hf"
        )
    entries: dict = {}
    for path in files:
        header, base, size = _header(path)
        mine = []
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in entries:
                raise _error(f"tensor {key!r} is in both {entries[key].file.name} and {path.name}")
            entries[key] = _entry(path, key, info, base, size)
            mine.append(entries[key])
        mine.sort(key=lambda e: (e.offset, e.offset + e.nbytes))
        for before, after in zip(mine, mine[1:]):
            if after.offset < before.offset + before.nbytes and after.nbytes and before.nbytes:
                raise _error(
                    f"{path}: tensor {after.key!r}: its bytes [{after.offset - base}, "
                    f"{after.offset - base + after.nbytes}) overlap tensor {before.key!r}'s "
                    f"[{before.offset - base}, {before.offset - base + before.nbytes}); expected disjoint "
                    "data_offsets; the file is damaged"
                )
    if weight_map is not None:
        for key, name in sorted(weight_map.items()):
            if key not in entries or entries[key].file.name != name:
                found = f"in {entries[key].file.name}" if key in entries else "in no file"
                raise _error(
                    f"{directory / INDEX_FILE} maps tensor {key!r} to {name}, found {found}; "
                    "the index and the files disagree (a damaged or mixed download)"
                )
    return entries


class Reader:
    """Read-only mappings of a checkpoint's files, open for one load (``with Reader() as r``)."""

    def __init__(self, staging_bytes: int = DEFAULT_STAGING_BYTES):
        self.staging_bytes = max(int(staging_bytes), mmap.PAGESIZE)
        self._maps: dict = {}
        self.bytes_read = 0
        self.largest_slice = 0  # bytes of the largest file span one slice touched

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for handle, fd in self._maps.values():
            handle.close()
            fd.close()
        self._maps.clear()

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            fd = open(path, "rb")
            handle = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_RANDOM"):
                handle.madvise(mmap.MADV_RANDOM)  # no read-ahead of bytes other ranks own
            self._maps[path] = (handle, fd)
        return self._maps[path][0]

    def _prefetch(self, handle: mmap.mmap, start: int, length: int) -> None:
        """Asks the kernel to read [start, start + length) ahead in large requests: the mapping is
        MADV_RANDOM (no read-ahead past what this rank owns), so a slice not in the page cache
        would otherwise fault in one 4 KiB page at a time (measured on 0.8B dp4 fully_shard, file
        not cached: 13.5 s per rank to load without this)."""
        if length <= 0 or not hasattr(mmap, "MADV_WILLNEED"):
            return
        first = start - start % mmap.PAGESIZE
        handle.madvise(mmap.MADV_WILLNEED, first, min(len(handle), start + length) - first)

    def _release(self, handle: mmap.mmap, start: int, length: int) -> None:
        """Drops the pages of [start, start + length) from this process's mapping -- and those
        around it: a page fault also maps the neighbouring pages already in the page cache (the
        kernel's fault-around, 64 KiB), which would otherwise stay resident after the slice."""
        if length <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = max(0, start - _AROUND)
        first -= first % mmap.PAGESIZE
        last = min(len(handle), start + length + _AROUND)
        handle.madvise(mmap.MADV_DONTNEED, first, last - first)

    def copy_box(self, entry: Entry, starts, sizes, out: torch.Tensor) -> None:
        """out.copy_(tensor[starts[d] : starts[d] + sizes[d] for every dim d]) from the mapped file;
        `out` has shape `sizes` (any strides, any dtype: the copy converts)."""
        shape = list(entry.shape)
        if list(out.shape) != list(sizes):
            raise AssertionError(f"copy_box: out {list(out.shape)} != box {list(sizes)}")
        if any(s == 0 for s in sizes):
            return
        handle = self._map(entry.file)
        item = torch.empty((), dtype=entry.dtype).element_size()
        if not shape:  # a 0-dim tensor
            self._copy_span(handle, entry, 0, 1, (), (), out)
            return
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        self._copy_dim(handle, entry, item, shape, strides, 0, 0, list(starts), list(sizes), out)

    def _copy_dim(self, handle, entry, item, shape, strides, d, base, starts, sizes, out) -> None:
        row_bytes = strides[d] * item
        if row_bytes > self.staging_bytes and d + 1 < len(shape):
            # One index of this dim spans more than a slice: one index at a time, deeper.
            for i in range(sizes[d]):
                self._copy_dim(
                    handle,
                    entry,
                    item,
                    shape,
                    strides,
                    d + 1,
                    base + (starts[d] + i) * strides[d],
                    starts,
                    sizes,
                    out[i],
                )
            return
        rows = max(1, self.staging_bytes // row_bytes)
        inner = tuple(slice(starts[j], starts[j] + sizes[j]) for j in range(d + 1, len(shape)))
        for r0 in range(0, sizes[d], rows):
            r = min(rows, sizes[d] - r0)
            first = base + (starts[d] + r0) * strides[d]
            self._copy_span(
                handle, entry, first * item, r * strides[d], (r, *shape[d + 1 :]), inner, out.narrow(0, r0, r)
            )

    def _copy_span(self, handle, entry, byte_start, count, view_shape, inner, out) -> None:
        start = entry.offset + byte_start
        length = count * entry.dtype.itemsize
        self._prefetch(handle, start, length)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the given buffer is not writable": it is only read
            flat = torch.frombuffer(handle, dtype=entry.dtype, count=count, offset=start)
        view = flat.view(view_shape)
        out.copy_(view[(slice(None), *inner)] if view_shape else view)
        del flat, view  # the buffer export must end before the mapping can close
        self.bytes_read += length
        self.largest_slice = max(self.largest_slice, length)
        self._release(handle, start, length)
