"""The tiny GGUF model: deterministic, well-formed, and loadable by llama.cpp's own reader.

Not marked ``real_server``: it needs only the ``gguf`` package, not a binary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="needs the 'gguf' package: pip install 'llama-guard[real]'")

from llama_guard.testing._tiny_model import tiny_model_vocab, write_tiny_model


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes(tmp_path):
    a = write_tiny_model(tmp_path / "a.gguf", seed=7)
    b = write_tiny_model(tmp_path / "b.gguf", seed=7)
    assert sha256(a) == sha256(b)


def test_other_seed_other_weights(tmp_path):
    a = write_tiny_model(tmp_path / "a.gguf", seed=0)
    b = write_tiny_model(tmp_path / "b.gguf", seed=1)
    assert sha256(a) != sha256(b)


def test_no_temporary_file_left(tmp_path):
    write_tiny_model(tmp_path / "m.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_vocab_has_what_llama_cpp_needs():
    tokens, scores, types = tiny_model_vocab()
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3 : 3 + 256] == [f"<0x{b:02X}>" for b in range(256)]
    assert len(set(tokens)) == len(tokens) == len(scores) == len(types)
    assert "\u2581" in tokens


def test_reader_sees_a_llama_model(tmp_path):
    import gguf

    path = write_tiny_model(tmp_path / "m.gguf", n_layer=3, n_embd=32, n_head=2, n_head_kv=1)
    reader = gguf.GGUFReader(path)
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert int(fields["llama.block_count"].parts[-1][0]) == 3
    names = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    n_vocab = len(tiny_model_vocab()[0])
    assert names["token_embd.weight"] == (32, n_vocab)  # GGUF order: ne0 first
    assert names["blk.2.attn_k.weight"] == (32, 16)
    assert names["blk.2.ffn_down.weight"] == (64, 32)
    assert "output.weight" in names


def test_rejects_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match="multiple of n_head"):
        write_tiny_model(tmp_path / "m.gguf", n_embd=30, n_head=4)
