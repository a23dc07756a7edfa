"""hypershard.checkpoint.safetensors_io without processes: boxes of tensors read through mmap slices equal
the same slices of the saved tensors, for every dtype conversion, strided and permuted outputs,
0-dim and empty boxes, and slice sizes smaller than one row; bad folders raise named errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hypershard.checkpoint.safetensors_io import Reader, read_index


@pytest.fixture
def folder(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 53, generator=g), "b": torch.randn(5, 6, 7, generator=g).bfloat16(),
               "c": torch.tensor(3.5), "d": torch.randint(0, 100, (300, 70), generator=g)}
    save_file(dict(list(tensors.items())[:2]), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[2:]), str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 + (i >= 2)}-of-00002.safetensors" for i, k in enumerate(tensors)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path, tensors


@pytest.mark.parametrize("staging", [4096, 256, 1 << 20])
def test_boxes_equal_the_slices(folder, staging):
    path, tensors = folder
    index = read_index(path)
    assert {k: (e.dtype, e.shape) for k, e in index.items()} == {k: (t.dtype, tuple(t.shape))
                                                                 for k, t in tensors.items()}
    with Reader(staging) as reader:
        out = torch.empty(10, 20)
        reader.copy_box(index["a"], (3, 7), (10, 20), out)
        assert torch.equal(out, tensors["a"][3:13, 7:27])
        out = torch.empty(2, 3, 4)  # bf16 file, float32 model: converted while copied
        reader.copy_box(index["b"], (1, 2, 3), (2, 3, 4), out)
        assert torch.equal(out, tensors["b"][1:3, 2:5, 3:7].float())
        out = torch.empty(4, 3)
        reader.copy_box(index["b"], (4, 1, 2), (1, 3, 4), out.t().unsqueeze(0))  # a permuted, strided target
        assert torch.equal(out.t(), tensors["b"][4, 1:4, 2:6].float())
        out = torch.empty(())
        reader.copy_box(index["c"], (), (), out)
        assert out.item() == 3.5
        out = torch.empty(300, 35, dtype=torch.int64)  # a column block: every row, a slice at a time
        reader.copy_box(index["d"], (0, 35), (300, 35), out)
        assert torch.equal(out, tensors["d"][:, 35:])
        reader.copy_box(index["d"], (5, 0), (0, 70), torch.empty(0, 70))  # an empty box reads nothing
        assert reader.largest_slice <= max(reader.staging_bytes, 70 * 8)  # at least a page


def test_bad_folders(tmp_path):
    with pytest.raises(ValueError, match="holds no \\*.safetensors file"):
        read_index(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="is not a safetensors file"):
        read_index(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        read_index(tmp_path / "nothing")


# ------------------------------------------------------------------ damaged files are named


def _rewrite(path, edit=None, data=None):
    """Rewrites a safetensors file with its header passed through `edit` (and its data replaced)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header = edit(header) if edit else header
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(len(text).to_bytes(8, "little") + text + (raw[8 + length :] if data is None else data))


def _damaged(folder, match):
    path, _ = folder
    with pytest.raises(ValueError, match=match) as info:
        read_index(path)
    return str(info.value)


def test_truncated_file_names_file_and_tensor(folder):
    path, _ = folder
    f = path / "model-00002-of-00002.safetensors"  # d (300 x 70 int64), then c (4 bytes) at the end
    full = f.stat().st_size
    f.write_bytes(f.read_bytes()[:-2])  # a partial download: the last 2 bytes, inside c, missing
    text = _damaged(folder, "truncated")
    assert str(f) in text and "tensor 'c'" in text, text
    assert f"its bytes end at byte {full} of the file, which has {full - 2} bytes" in text, text
    assert f"expected at least {full}, found {full - 2}" in text, text


def test_header_length_past_the_end(folder):
    path, _ = folder
    f = path / "model-00001-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:50])  # cut inside the header
    text = _damaged(folder, "header length")
    assert str(f) in text and "expected at most the 42 bytes" in text


def test_corrupt_header_names_the_file(folder):
    path, _ = folder
    f = path / "model-00001-of-00002.safetensors"
    _rewrite(f, lambda h: b"{" + b"\x00" * (len(json.dumps(h)) - 1))
    text = _damaged(folder, "is not valid JSON")
    assert str(f) in text and "header" in text


def test_lying_shape_names_expected_and_found(folder):
    path, _ = folder
    f = path / "model-00001-of-00002.safetensors"

    def lie(h):
        h["a"]["shape"] = [37, 54]  # one column more than the bytes hold
        return h

    _rewrite(f, lie)
    text = _damaged(folder, "tensor 'a'")
    assert str(f) in text and f"hold {37 * 53 * 4} bytes, expected {37 * 54 * 4} (F32 x shape [37, 54])" in text


def test_overlapping_tensors(folder):
    path, _ = folder
    f = path / "model-00001-of-00002.safetensors"

    def overlap(h):
        begin, end = h["b"]["data_offsets"]
        h["b"]["data_offsets"] = [begin - 8, end - 8]  # starts inside a's bytes, same length
        return h

    _rewrite(f, overlap)
    text = _damaged(folder, "overlap")
    assert str(f) in text and "'a'" in text and "'b'" in text


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("dtype", "F4", "dtype F4, which this loader does not read"),
        ("shape", [37, -53], "expected a list of non-negative integers"),
        ("data_offsets", [10, 5], "expected \\[begin, end\\] with 0 <= begin <= end"),
    ],
)
def test_bad_entry_fields(folder, field, value, match):
    path, _ = folder
    f = path / "model-00001-of-00002.safetensors"

    def edit(h):
        h["a"][field] = value
        return h

    _rewrite(f, edit)
    text = _damaged(folder, match)
    assert str(f) in text and "'a'" in text


def test_shard_listed_in_index_but_missing(folder):
    path, _ = folder
    (path / "model-00002-of-00002.safetensors").unlink()
    text = _damaged(folder, "lists 1 file\\(s\\) that are not in")
    assert "model-00002-of-00002.safetensors" in text and "tensor 'c'" in text


def test_index_disagrees_with_the_files(folder):
    path, _ = folder
    index = path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map["e"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    text = _damaged(folder, "maps tensor 'e' to model-00001-of-00002.safetensors, found in no file")
    index.write_text('{"weight_map": {"a": ')  # a truncated index
    text = _damaged(folder, "is not valid JSON")
    assert str(index) in text
