"""The folder reader keeps one weight file mapped at a time: what it read of the others is out
of the process's resident memory (a conversion never holds the whole folder there)."""

import torch
from safetensors.torch import save_file

from swift_mcore.models.hf_folder import HFFolder


def _folder(tmp_path):
    import json

    tensors = {f"t{i}": torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
               for i in range(4)}
    weight_map = {}
    for shard, names in enumerate((["t0", "t1"], ["t2", "t3"])):
        name = f"model-0000{shard + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in names}, str(tmp_path / name))
        weight_map.update({n: name for n in names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tensors


def test_one_file_is_open_at_a_time_and_reads_are_exact(tmp_path):
    tensors = _folder(tmp_path)
    with HFFolder(str(tmp_path)).reader() as reader:
        for name in ("t0", "t2", "t1", "t3"):
            assert torch.equal(reader.read(name), tensors[name])
            assert len(reader._handles) == 1
        assert torch.equal(reader.read("t3", rows=slice(1, 3)), tensors["t3"][1:3])
    assert not reader._handles


def test_a_file_is_mapped_afresh_after_remap_bytes_were_read_through_it(tmp_path):
    """What was read of a large shard leaves resident memory while the shard is still read."""
    tensors = _folder(tmp_path)
    reader = HFFolder(str(tmp_path)).reader()
    reader.remap_bytes = 2 * 4 * 3 * 4  # two of these float32 tensors
    with reader:
        assert torch.equal(reader.read("t0"), tensors["t0"]) and len(reader._handles) == 1
        assert torch.equal(reader.read("t1"), tensors["t1"]) and not reader._handles
        assert torch.equal(reader.read("t2", rows=slice(0, 2)), tensors["t2"][:2])
        assert len(reader._handles) == 1
