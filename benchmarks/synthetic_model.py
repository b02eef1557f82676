"""Write a bandwidth-bound synthetic model: a llama GGUF with random F16 weights, as a
one-branch quantroute repository, for the serving benchmark on a GPU.

Its shapes are TinyLlama-1.1B's by default (22 layers, width 2048, FFN 5632, 32 query and
4 key/value heads, a 32,000-token vocabulary): 1.1 B parameters, 2.2 GB in F16, so a decode
step reads far more bytes than any cache holds and decode speed is set by memory bandwidth.
The vocabulary is the demo's byte-level tokens followed by filler tokens, as the 150k-vocab
test model writes it (``tests/quality/test_drift_replay.py``); the weights are random, so
the text is nonsense, but greedy decoding is deterministic all the same.

Run::

    python benchmarks/synthetic_model.py --out /tmp/synthetic        # ~1 minute, 2.2 GB
    python benchmarks/synthetic_model.py --out /tmp/s --layers 1 --width 64 --ffn 128  # tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

NAME = "synthetic-1b"


def write_model(path: Path, *, layers: int, width: int, ffn: int, heads: int, kv_heads: int,
                vocab: int, seed: int = 0) -> int:  # fmt: skip
    """Write the GGUF; return its parameter count."""
    import gguf

    from quantroute.demo.vocab import BOS_ID, EOS_ID, UNK_ID, VOCAB

    rng = np.random.default_rng(seed)
    head_dim = width // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(NAME)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(2048)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(VOCAB.tokens) + [f"<x{i}>" for i in range(vocab - VOCAB.size)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(list(VOCAB.token_types) + [1] * (vocab - VOCAB.size))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    params = 0

    def tensor(name: str, shape: tuple[int, ...], std: float | None) -> None:
        nonlocal params
        params += int(np.prod(shape))
        if std is None:  # norms: ones, in F32 as llama.cpp's converter keeps them
            writer.add_tensor(name, np.ones(shape, np.float32))
        else:
            data = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            writer.add_tensor(name, data.astype(np.float16))

    tensor("token_embd.weight", (vocab, width), 1.0)
    tensor("output_norm.weight", (width,), None)
    tensor("output.weight", (vocab, width), 0.5 / np.sqrt(width / 64))
    kv = kv_heads * head_dim
    for i in range(layers):
        for name, shape in {
            "attn_norm.weight": (width,),
            "attn_q.weight": (width, width),
            "attn_k.weight": (kv, width),
            "attn_v.weight": (kv, width),
            "attn_output.weight": (width, width),
            "ffn_norm.weight": (width,),
            "ffn_gate.weight": (ffn, width),
            "ffn_up.weight": (ffn, width),
            "ffn_down.weight": (width, ffn),
        }.items():
            std = None if name.endswith("norm.weight") else 1.0 / np.sqrt(shape[1])
            tensor(f"blk.{i}.{name}", shape, std)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="repository folder to write")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args(argv)
    from quantroute.registry.manifest import sha256_file

    folder = args.out / NAME
    folder.mkdir(parents=True, exist_ok=True)
    gguf_path = folder / "f16.gguf"
    params = write_model(gguf_path, layers=args.layers, width=args.width, ffn=args.ffn,
                         heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab)  # fmt: skip
    (folder / "quantroute.yaml").write_text(
        f"model: {NAME}\nreference: f16\n"
        f"description: random F16 weights, {params / 1e9:.2f} B parameters (bandwidth-bound)\n"
        f"branches:\n  f16:\n    file: f16.gguf\n    precision: f16\n    engine: llamacpp\n"
        f"    sha256: {sha256_file(gguf_path)}\n"
    )
    print(f"{gguf_path}: {params / 1e9:.3f} B parameters, {gguf_path.stat().st_size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
