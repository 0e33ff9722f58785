"""A tiny, random-weight llama GGUF model that a real ``llama-server`` loads in a blink.

Why: the integration tests need a *real* llama-server (its HTTP defects live in
cpp-httplib and the server, not in any model), but no model can be downloaded
on a test machine, and a real model is gigabytes and slow on a CPU. A llama-
architecture model with a few layers of width 64 and random weights loads in a
fraction of a second and generates thousands of (meaningless) tokens per second,
which is all the HTTP layer needs.

The file is written with the ``gguf`` package (llama.cpp's own ``gguf-py``),
imported lazily so that ``llama_guard.testing`` stays importable without it; it
comes with the ``llama-guard[real]`` extra.

What llama.cpp requires of a llama-arch GGUF, and what this writes:

* KV: ``general.architecture = llama``, ``llama.context_length``,
  ``llama.embedding_length``, ``llama.block_count``,
  ``llama.feed_forward_length``, ``llama.attention.head_count``,
  ``llama.attention.head_count_kv``, ``llama.attention.layer_norm_rms_epsilon``
  (required for llama), ``llama.rope.dimension_count``, ``llama.vocab_size``.
* Tokenizer: ``tokenizer.ggml.model = llama`` (SentencePiece, SPM), tokens,
  scores and token types with ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2, the 256
  byte-fallback tokens ``<0x00>`` .. ``<0xFF>`` (so any text tokenizes, and
  ``\\n`` has a token) and a few hundred plain pieces; a ChatML chat template so
  ``/v1/chat/completions`` works without warnings.
* Tensors (numpy shapes, which GGUF stores reversed): ``token_embd``
  ``(n_vocab, n_embd)``, per block ``attn_norm``/``ffn_norm`` ``(n_embd,)``,
  ``attn_q``/``attn_output`` ``(n_embd, n_embd)``, ``attn_k``/``attn_v``
  ``(n_kv, n_embd)``, ``ffn_gate``/``ffn_up`` ``(n_ff, n_embd)``, ``ffn_down``
  ``(n_embd, n_ff)``, then ``output_norm`` ``(n_embd,)`` and ``output``
  ``(n_vocab, n_embd)``. All F32: the model is small enough that size does not
  matter, and F32 needs no conversion anywhere.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

__all__ = ["CHATML_TEMPLATE", "tiny_model_vocab", "write_tiny_model"]

#: ChatML, written into the model so the server's chat endpoint needs no ``--chat-template``.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# SentencePiece token types, as gguf.TokenType numbers (kept here so the vocabulary
# can be built without importing gguf).
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6

# Common English words, as "▁word" pieces, so ordinary prompts tokenize into words, not bytes.
_WORDS_TEXT = (
    "the of and to in is that it for was on are as with be at by this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know get through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well such here "
    "take why things help put years different away again off went old number great tell men say small every "
    "found still between name should home big give air line set own under read last never us left end along "
    "while might next sound below saw something thought both few those always looked show large often "
    "together asked house world going want school important until form food keep children feet land side "
    "without boy once animals life enough took sometimes four head above kind began almost live page got "
    "earth need far hand high year mother light parts country father let night following picture being study "
    "second eyes soon times story boys since white days ever paper hard near sentence better best across "
    "during today others however sure means knew try told young miles sun ways thing whole hear example "
    "heard several change answer room sea against top turned learn point city play toward five using "
    "himself usually hello llama server token stream model"
)
_WORDS = _WORDS_TEXT.split()


def tiny_model_vocab() -> tuple[list[str], list[float], list[int]]:
    """The tokens, scores and token types of the tiny SPM vocabulary.

    Layout: ``<unk>``, ``<s>``, ``</s>`` (ids 0, 1, 2, llama.cpp's SPM defaults),
    the 256 byte tokens, then ``▁`` and single characters, then ``▁word`` pieces.
    Scores fall with the id so SentencePiece prefers longer, earlier pieces.
    """
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [_UNKNOWN, _CONTROL, _CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    pieces: list[str] = ["\u2581"]
    pieces += list(string.ascii_letters + string.digits + string.punctuation)
    pieces += ["\u2581" + w for w in _WORDS]
    seen = set(tokens)
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(_NORMAL)
    scores: list[float] = [0.0] * len(tokens)
    first_piece = 3 + 256
    for i in range(first_piece, len(tokens)):
        # Word pieces (longer) score higher than single characters, so merges are found.
        bonus = 0.0 if len(tokens[i]) <= 1 else float(len(tokens[i]))
        scores[i] = bonus - (i - first_piece) * 1e-3
    return tokens, scores, types


def _import_gguf() -> tuple[Any, Any]:
    """Import gguf and numpy, or explain which extra provides them."""
    try:
        import gguf
        import numpy
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "writing the tiny test model needs the 'gguf' and 'numpy' packages: pip install 'llama-guard[real]'"
        ) from exc
    return gguf, numpy


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int | None = None,
    n_ff: int | None = None,
    context_length: int = 4096,
    weight_std: float = 0.02,
) -> Path:
    """Write a tiny llama-architecture GGUF model with random weights to ``path``.

    Deterministic: the same arguments give the same bytes (the weights come from
    ``numpy.random.default_rng(seed)``; gguf writes no timestamps), so a test
    can cache or hash it. The file is written to a temporary name next to
    ``path`` and renamed into place, so a concurrent reader never sees half a
    model.

    ``n_embd`` must be a multiple of ``n_head`` (head size = ``n_embd // n_head``),
    and ``n_head`` a multiple of ``n_head_kv`` (default: ``n_head``, no GQA).
    ``n_ff`` defaults to ``2 * n_embd``. Returns the path written.
    """
    gguf, np = _import_gguf()
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    kv_heads = n_head if n_head_kv is None else n_head_kv
    if n_head % kv_heads:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_head_kv ({kv_heads})")
    ff = 2 * n_embd if n_ff is None else n_ff
    head_dim = n_embd // n_head
    n_kv = head_dim * kv_heads

    tokens, scores, types = tiny_model_vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(weight_std)).astype(np.float32)

    def ones(n: int) -> Any:
        return np.ones((n,), dtype=np.float32)

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")

    writer = gguf.GGUFWriter(str(tmp), "llama")
    try:
        writer.add_name(f"llama_guard tiny test model (seed {seed})")
        writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        writer.add_vocab_size(n_vocab)
        writer.add_context_length(context_length)
        writer.add_embedding_length(n_embd)
        writer.add_block_count(n_layer)
        writer.add_feed_forward_length(ff)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(kv_heads)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(10000.0)

        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_chat_template(CHATML_TEMPLATE)

        tensors: list[tuple[str, Any]] = [("token_embd.weight", weight(n_vocab, n_embd))]
        for i in range(n_layer):
            blk = f"blk.{i}"
            tensors += [
                (f"{blk}.attn_norm.weight", ones(n_embd)),
                (f"{blk}.attn_q.weight", weight(n_embd, n_embd)),
                (f"{blk}.attn_k.weight", weight(n_kv, n_embd)),
                (f"{blk}.attn_v.weight", weight(n_kv, n_embd)),
                (f"{blk}.attn_output.weight", weight(n_embd, n_embd)),
                (f"{blk}.ffn_norm.weight", ones(n_embd)),
                (f"{blk}.ffn_gate.weight", weight(ff, n_embd)),
                (f"{blk}.ffn_up.weight", weight(ff, n_embd)),
                (f"{blk}.ffn_down.weight", weight(n_embd, ff)),
            ]
        tensors += [("output_norm.weight", ones(n_embd)), ("output.weight", weight(n_vocab, n_embd))]
        for name, array in tensors:
            writer.add_tensor(name, array)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    try:
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target
