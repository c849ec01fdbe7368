"""The streaming safetensors writer: files that the safetensors library reads back exactly,
split by size, with an index, appearing atomically."""

import json

import pytest
import torch
from safetensors import safe_open

from megatron_rl.bridge.hf_files import INDEX_FILE, HFCheckpoint, TensorSpec, write_checkpoint


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(2, 4, 6, generator=g).to(torch.float16),
    }


def specs(ts):
    return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in ts.items()]


def read_all(path):
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_round_trip_through_safetensors(tmp_path):
    ts = tensors()
    out = write_checkpoint(tmp_path / "hf", specs(ts), iter(ts.items()), {"model_type": "llama"}, 1 << 30)
    back = read_all(out)
    assert set(back) == set(ts)
    for name, t in ts.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(ts)
    assert index["metadata"]["total_size"] == 3 * 5 * 4 + 7 * 2 + 48 * 2


def test_size_limit_splits_files_and_the_index_finds_them(tmp_path):
    ts = tensors()
    out = write_checkpoint(tmp_path / "hf", specs(ts), iter(ts.items()), None, max_file_bytes=64)
    assert len(list(out.glob("*.safetensors"))) == 3
    ckpt = HFCheckpoint(out)
    assert sorted(ckpt.names()) == sorted(ts)
    with ckpt.reader() as reader:
        assert torch.equal(reader.slice("c.weight")[1, 2:4, :], ts["c.weight"][1, 2:4, :])


def test_refuses_a_non_empty_output_dir(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("keep me")
    ts = tensors()
    with pytest.raises(FileExistsError, match="not empty"):
        write_checkpoint(tmp_path / "hf", specs(ts), iter(ts.items()), None, 1 << 30)


def test_a_failed_stream_leaves_nothing_behind(tmp_path):
    ts = tensors()

    def broken():
        yield "a.weight", ts["a.weight"]
        raise RuntimeError("rank died")

    with pytest.raises(RuntimeError, match="rank died"):
        write_checkpoint(tmp_path / "hf", specs(ts), broken(), None, 1 << 30)
    assert list(tmp_path.iterdir()) == []


def test_wrong_tensor_order_is_an_error(tmp_path):
    ts = tensors()
    with pytest.raises(RuntimeError, match="expected"):
        write_checkpoint(tmp_path / "hf", specs(ts), reversed(list(ts.items())), None, 1 << 30)
