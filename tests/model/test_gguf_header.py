"""model/gguf_header.py reads what gguf's GGUFReader reads: every metadata value and every tensor's view."""

import struct

import numpy as np
import pytest

from nodeserve.model.gguf_header import read_header


def test_the_bundled_file_reads_as_gguf_reads_it(gguf_path):
    import gguf

    header = read_header(gguf_path)
    reader = gguf.GGUFReader(gguf_path)
    want = {}
    for key, field in reader.fields.items():
        try:
            want[key] = field.contents()
        except Exception:
            continue
    assert header.metadata.keys() == want.keys()
    for key, value in want.items():
        assert header.metadata[key] == value and type(header.metadata[key]) is type(value), key
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for got, ref in zip(header.tensors, reader.tensors):
        assert got.tensor_type == ref.tensor_type and got.shape == tuple(int(d) for d in ref.shape)
        assert (got.n_bytes, got.data_offset) == (ref.n_bytes, ref.data_offset)
        assert got.data.shape == ref.data.shape and got.data.dtype == ref.data.dtype
        assert np.array_equal(got.data, ref.data), got.name


def _gguf(kv: bytes, num_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, num_kv) + kv


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def test_values_arrays_and_a_string_that_is_not_utf8(tmp_path):
    kv = (_string(b"a.u32") + struct.pack("<II", 4, 7)
          + _string(b"a.strs") + struct.pack("<IIQ", 9, 8, 2) + _string(b"x") + _string("é".encode())
          + _string(b"a.bad") + struct.pack("<I", 8) + _string(b"\xff\xfe")
          + _string(b"a.f32s") + struct.pack("<IIQ", 9, 6, 2) + struct.pack("<ff", 0.5, -2.0)
          + _string(b"a.last") + struct.pack("<I?", 7, True))
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf(kv, 5))
    meta = read_header(str(path)).metadata
    assert meta["a.u32"] == 7 and meta["a.strs"] == ["x", "é"] and meta["a.f32s"] == [0.5, -2.0]
    assert "a.bad" not in meta and meta["a.last"] is True  # skipped, and what follows still reads


@pytest.mark.parametrize("data, why", [
    (b"GGML" + bytes(20), "magic"),
    (_gguf(b"", 0, version=1), "version"),
    (_gguf(_string(b"k") + struct.pack("<IQ", 8, 1000), 1), "past the end"),
    (_gguf(_string(b"k") + b"\x04\x00", 1), "unpack"),  # the value's type cut short
])
def test_a_broken_header_raises(tmp_path, data, why):
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    with pytest.raises((ValueError, struct.error), match=why):
        read_header(str(path))
