"""A GGUF file's header: its metadata as Python values and its tensor table, with each tensor's bytes as a numpy
view of the memory-mapped file.

Hand-written rather than gguf's GGUFReader because that reader makes a numpy view per value of every array:
SmolLM2's 49,152-token vocabulary and its merges took ~2.7 s of every start on the 2-core Xeon; this reads the
same header in a single pass of struct unpacking (tests/model/test_gguf_header.py compares the two on the
bundled file). The gguf package still supplies the type tables and the dequantization.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUFValueType -> (struct format, numpy dtype) for the fixed-size types; 8 is STRING, 9 is ARRAY.
_SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
            5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
            12: ("<d", "<f8")}
_STRING, _ARRAY = 8, 9
# ggml types whose tensors are plain numbers (GGUFReader's view dtypes); every other type is viewed as bytes.
_ELEMENT_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                   28: np.float64}


@dataclass
class Tensor:
    """One tensor, as GGUFReader's ReaderTensor has it: shape in GGUF order (fastest-varying first); data as
    [rows..., row bytes] uint8 for block types, elements otherwise."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass
class Header:
    metadata: dict[str, Any]  # undecodable values (a string that is not UTF-8) are left out
    tensors: list[Tensor]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def raw_string(self) -> bytes:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def value(self, vtype: int) -> Any:
        """One value of type vtype; raises UnicodeDecodeError for a string (or array of them) that is not UTF-8,
        after moving past it."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.raw_string().decode("utf-8")
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1])
                if self.pos + count * dtype.itemsize > len(self.buf):
                    raise ValueError(f"an array of {count} values runs past the end of the file")
                out = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return out
            items, bad = [], None
            for _ in range(count):
                try:
                    items.append(self.value(item_type))
                except UnicodeDecodeError as e:
                    bad = e
            if bad is not None:
                raise bad
            return items
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_header(path: str) -> Header:
    """Raises ValueError (or struct.error) for a file that is not GGUF, or is truncated or corrupt in its header."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(cur.buf[:4]) != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} (big-endian, or not supported; supported: 2, 3)")
    num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": num_tensors, "GGUF.kv_count": num_kv}
    for _ in range(num_kv):
        key = cur.raw_string().decode("utf-8", errors="replace")
        try:
            meta[key] = cur.value(cur.unpack("<I"))
        except UnicodeDecodeError:
            continue
    infos = []
    for _ in range(num_tensors):
        name = cur.raw_string().decode("utf-8")
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"duplicated tensor {name}")
        names.add(name)
        ggml_type = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        num_elements = int(np.prod(dims)) if dims else 1
        n_bytes = num_elements * type_size // block_size
        start = data_start + offset
        np_dims = tuple(reversed(dims))
        if raw_type in _ELEMENT_DTYPES:
            dtype, count = np.dtype(_ELEMENT_DTYPES[raw_type]), num_elements
        else:  # block types: [rows..., bytes per row]
            dtype, count = np.dtype(np.uint8), n_bytes
            np_dims = (*np_dims[:-1], np_dims[-1] // block_size * type_size)
        end = min(start + count * dtype.itemsize, len(mm))  # a truncated file is the caller's to report
        view = mm[start:end].view(dtype) if (end - start) % dtype.itemsize == 0 else mm[start:start]
        data = view.reshape(np_dims) if view.size == count else view
        tensors.append(Tensor(name, ggml_type, dims, n_bytes, start, data))
    return Header(meta, tensors)
