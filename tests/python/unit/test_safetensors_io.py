"""hypershard.safetensors_io without processes: boxes of tensors read through mmap slices equal
the same slices of the saved tensors, for every dtype conversion, strided and permuted outputs,
0-dim and empty boxes, and slice sizes smaller than one row; bad folders raise named errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hypershard.safetensors_io import Reader, read_index


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
