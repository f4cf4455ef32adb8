"""The folder reader keeps one weight file mapped at a time: what it read of the others is out
of the process's resident memory (a conversion never holds the whole folder there)."""

import pytest
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


def _vocab_layout(vocab, padded, hidden=3):
    from swift_mcore.models.convert import Layout

    layout = Layout.__new__(Layout)  # only the fields vocab_source reads
    for key, value in dict(vocab=vocab, padded_vocab=padded, hidden=hidden, score=0,
                           tied=False).items():
        object.__setattr__(layout, key, value)
    return layout


def test_the_vocabulary_is_read_a_few_rows_at_a_time_and_padding_is_zero(monkeypatch):
    """The embedding and the LM head (a model's largest tensors) never sit in memory whole
    beside their parameter: each rank's rows come in pieces of VOCAB_CHUNK_BYTES, equal to
    the whole read; a rank's rows past the vocabulary are zero, and a rank of padding alone
    reads nothing."""
    from swift_mcore.models import hf_load

    source = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    layout = _vocab_layout(vocab=10, padded=16)
    monkeypatch.setattr(hf_load, "VOCAB_CHUNK_BYTES", 2 * 3 * 4)  # two float32 rows
    for name, hf_name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                          ("output_layer.weight", "lm_head.weight")):
        for tp_rank, rows in ((0, source[:8]), (1, torch.cat([source[8:], torch.zeros(6, 3)]))):
            reads = []

            def read(tensor, rows=None, cols=None):
                reads.append((tensor, rows.start, rows.stop))
                return source[rows]

            param = torch.nn.Parameter(torch.full((8, 3), float("nan")))
            hf_load.copy_vocab_rows(param, layout.vocab_source(name, tp_rank, 2), read)
            assert torch.equal(param.data, rows)
            assert all(n == hf_name and stop - start <= 2 for n, start, stop in reads)
            assert torch.equal(param.data, layout.to_mcore(name, read, tp_rank, 2))
    layout = _vocab_layout(vocab=4, padded=16)
    param = torch.nn.Parameter(torch.ones(8, 3))
    hf_load.copy_vocab_rows(param, layout.vocab_source("output_layer.weight", 1, 2),
                            lambda *a, **k: pytest.fail("a rank of padding read " + str(a)))
    assert not param.data.any()


def test_the_free_heap_is_handed_back_while_a_folder_is_read_on_cpu_only(monkeypatch):
    import types

    from swift_mcore.runtime import cpu
    from swift_mcore.runtime.cpu import host_memory

    calls = []
    monkeypatch.setattr(host_memory, "release_free_heap", lambda: calls.append(1) or True)
    assert cpu.after_weights_read(types.SimpleNamespace(cuda=True)) is False and not calls
    assert cpu.after_weights_read(types.SimpleNamespace(cuda=False)) is True and calls == [1]
