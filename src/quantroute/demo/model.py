"""A tiny Llama, written functionally in torch so its weights carry GGUF names.

The parameters live in a ``dict`` keyed by the names llama.cpp reads
(``token_embd.weight``, ``blk.0.attn_q.weight``, ...), every matrix in torch's
``[out, in]`` layout, which is what ``GGUFWriter`` expects. The forward pass is
llama.cpp's ``llama`` graph: RMSNorm, attention with RoPE rotating *adjacent*
pairs (GGML rope mode 0), SwiGLU feed-forward, an untied output head. A model
trained here therefore needs no Q/K permutation on export.

torch is imported inside the functions, so ``import quantroute.demo`` works
without it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from quantroute.demo.vocab import BOS_ID, VOCAB

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Params = dict[str, "torch.Tensor"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the model. K-quants need ``n_embd`` and ``n_ff`` multiples of 256."""

    vocab_size: int = VOCAB.size
    n_embd: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_ff: int = 768
    # Key/value heads; ``None`` means one per query head. Fewer is grouped-query
    # attention: query head ``h`` reads kv head ``h // (n_head // kv_heads)``, as llama.cpp.
    n_head_kv: int | None = None
    context_length: int = 512
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_head`` unless grouped-query attention)."""
        return self.n_head if self.n_head_kv is None else self.n_head_kv

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head or self.head_dim % 2:
            raise ValueError("n_embd must split into n_head heads of even width")
        if self.kv_heads < 1 or self.n_head % self.kv_heads:
            raise ValueError("n_head must be a multiple of n_head_kv")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """How the model is trained. ``max_seconds`` is only a safety net; ``steps`` decides."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 2
    # "auto": bfloat16 autocast where the CPU has native bf16 (about 2x faster
    # there), float32 elsewhere; weights and optimizer state stay float32.
    autocast: Literal["auto", "bf16", "off"] = "auto"
    max_seconds: float = 280.0
    val_fraction: float = 0.02
    val_batches: int = 8


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What training did: steps run, the last losses (nats per token), seconds taken."""

    steps_run: int
    autocast: str
    train_loss: float
    val_loss: float
    seconds: float
    tokens_seen: int
    hit_time_cap: bool


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's GGUF name and torch shape, in the order they are written."""
    d, f, v, kv = config.n_embd, config.n_ff, config.vocab_size, config.kv_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, d)}
    for i in range(config.n_layer):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (d,)
        shapes[b + "attn_q.weight"] = (d, d)
        shapes[b + "attn_k.weight"] = (kv, d)
        shapes[b + "attn_v.weight"] = (kv, d)
        shapes[b + "attn_output.weight"] = (d, d)
        shapes[b + "ffn_norm.weight"] = (d,)
        shapes[b + "ffn_gate.weight"] = (f, d)
        shapes[b + "ffn_up.weight"] = (f, d)
        shapes[b + "ffn_down.weight"] = (d, f)
    shapes["output_norm.weight"] = (d,)
    shapes["output.weight"] = (v, d)
    return shapes


def count_params(config: ModelConfig) -> int:
    """Number of trainable weights."""
    return sum(math.prod(s) for s in param_shapes(config).values())


def init_params(config: ModelConfig, seed: int) -> Params:
    """Seeded initial weights: N(0, 0.02), residual projections scaled down, norms at 1."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    params: Params = {}
    resid_std = 0.02 / math.sqrt(2 * config.n_layer)
    for name, shape in param_shapes(config).items():
        if len(shape) == 1:
            tensor = torch.ones(shape)
        else:
            std = resid_std if name.endswith(("attn_output.weight", "ffn_down.weight")) else 0.02
            tensor = torch.randn(shape, generator=gen) * std
        params[name] = tensor.requires_grad_(True)
    return params


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def rope_tables(config: ModelConfig, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of GGML's "normal" RoPE, each ``[n_pos, head_dim // 2]``."""
    import torch

    half = config.head_dim // 2
    inv_freq = config.rope_base ** (-torch.arange(half, dtype=torch.float64) * 2 / config.head_dim)
    angles = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [P, half]
    return angles.cos().float(), angles.sin().float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    import torch

    # x: [B, H, T, hd]; rotate pairs (0,1), (2,3), ... like ggml_rope mode 0
    pairs = x.reshape(*x.shape[:-1], -1, 2)  # [B, H, T, hd/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = (x0 * cos - x1 * sin, x0 * sin + x1 * cos)
    return torch.stack(out, dim=-1).flatten(-2)


def forward(
    params: Params,
    config: ModelConfig,
    tokens: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits ``[B, T, V]`` for token ids ``[B, T]`` (positions start at 0)."""
    import torch.nn.functional as F

    b, t = tokens.shape
    cos, sin = rope if rope is not None else rope_tables(config, t)
    cos, sin = cos[:t], sin[:t]
    h, hkv, hd, eps = config.n_head, config.kv_heads, config.head_dim, config.norm_eps
    x = F.embedding(tokens, params["token_embd.weight"])  # [B, T, D]
    for i in range(config.n_layer):
        p = f"blk.{i}."
        a = _rms_norm(x, params[p + "attn_norm.weight"], eps)
        q = (a @ params[p + "attn_q.weight"].T).view(b, t, h, hd).transpose(1, 2)  # [B, H, T, hd]
        # k, v: [B, Hkv, T, hd]
        k = (a @ params[p + "attn_k.weight"].T).view(b, t, hkv, hd).transpose(1, 2)
        v = (a @ params[p + "attn_v.weight"].T).view(b, t, hkv, hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if hkv != h:  # kv head j serves query heads j*g .. j*g+g-1, as ggml broadcasts
            k = k.repeat_interleave(h // hkv, dim=1)  # [B, H, T, hd]
            v = v.repeat_interleave(h // hkv, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, hd]
        x = x + att.transpose(1, 2).reshape(b, t, -1) @ params[p + "attn_output.weight"].T
        m = _rms_norm(x, params[p + "ffn_norm.weight"], eps)
        gate = F.silu(m @ params[p + "ffn_gate.weight"].T)  # [B, T, F]
        x = x + (gate * (m @ params[p + "ffn_up.weight"].T)) @ params[p + "ffn_down.weight"].T
    x = _rms_norm(x, params["output_norm.weight"], eps)
    logits: torch.Tensor = x @ params["output.weight"].T  # [B, T, V]
    return logits


def use_bf16(mode: Literal["auto", "bf16", "off"]) -> bool:
    """Whether training autocasts to bfloat16 under ``mode``."""
    if mode != "auto":
        return mode == "bf16"
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _batch(
    stream: npt.NDArray[np.int32],
    rng: np.random.Generator,
    batch_size: int,
    seq_len: int,
    bos_id: int = BOS_ID,
) -> npt.NDArray[np.int64]:
    """``batch_size`` windows of ``seq_len + 1`` tokens, each starting with BOS."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    windows = np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    windows[:, 0] = bos_id  # inference prompts always start with BOS at position 0
    return windows


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(
    params: Params,
    config: ModelConfig,
    stream: npt.NDArray[np.int32],
    cfg: TrainConfig,
    *,
    progress: bool = True,
    bos_id: int = BOS_ID,
) -> TrainResult:
    """Train ``params`` in place on random BOS-led windows of ``stream``.

    AdamW with linear warm-up and a cosine decay to ``min_lr_ratio``; the data
    order comes from ``cfg.seed`` alone. Stops after ``cfg.steps`` steps, or
    earlier at ``cfg.max_seconds`` (logged as a warning, since the result then
    depends on the machine's speed). The last ``val_fraction`` of the stream is
    held out for the validation loss. torch's thread count is set to
    ``cfg.threads`` while training and restored afterwards. ``bos_id`` is the
    vocabulary's BOS token, put at position 0 of every window.
    """
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    n_val = max(int(len(stream) * cfg.val_fraction), cfg.seq_len + 2)
    train_stream, val_stream = stream[:-n_val], stream[-n_val:]
    if len(train_stream) < cfg.seq_len + 2:
        raise ValueError(f"corpus of {len(stream)} tokens is too short for seq_len {cfg.seq_len}")
    rng = np.random.default_rng(cfg.seed)
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for p in params.values() if p.ndim == 2],
                "weight_decay": cfg.weight_decay,
            },
            {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    rope = rope_tables(config, cfg.seq_len)
    bf16 = use_bf16(cfg.autocast)
    loss_ema = float("nan")
    steps_run = 0
    hit_cap = False
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)  # the thread count is part of what decides the bits
    bar = tqdm(range(cfg.steps), desc="training", unit="step", disable=not progress)
    started = time.monotonic()
    try:
        for step in bar:
            if time.monotonic() - started > cfg.max_seconds:
                hit_cap = True
                break
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg)
            batch = torch.from_numpy(_batch(train_stream, rng, cfg.batch_size, cfg.seq_len, bos_id))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = forward(params, config, batch[:, :-1], rope)  # [B, T, V]
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.grad_clip)
            opt.step()
            value = float(loss.item())
            loss_ema = value if step == 0 else 0.95 * loss_ema + 0.05 * value
            steps_run = step + 1
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss_ema:.3f}")
        seconds = time.monotonic() - started
        val = evaluate(params, config, val_stream, cfg, bos_id=bos_id)
    finally:
        bar.close()
        torch.set_num_threads(threads_before)
    if hit_cap:
        logger.warning(
            "training stopped at the %.0f s cap after %d of %d steps; the result is not "
            "reproducible on other machines",
            cfg.max_seconds,
            steps_run,
            cfg.steps,
        )
    logger.info(
        "trained %d steps in %.1f s (%s): train loss %.3f, val loss %.3f nats/token",
        steps_run,
        seconds,
        "bf16 autocast" if bf16 else "float32",
        loss_ema,
        val,
    )
    return TrainResult(
        steps_run=steps_run,
        autocast="bf16" if bf16 else "off",
        train_loss=loss_ema,
        val_loss=val,
        seconds=seconds,
        tokens_seen=steps_run * cfg.batch_size * cfg.seq_len,
        hit_time_cap=hit_cap,
    )


def evaluate(
    params: Params,
    config: ModelConfig,
    stream: npt.NDArray[np.int32],
    cfg: TrainConfig,
    *,
    bos_id: int = BOS_ID,
) -> float:
    """Mean cross-entropy (nats/token) on fixed-seed windows of ``stream``."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(cfg.seed + 1)
    seq_len = min(cfg.seq_len, len(stream) - 2)
    rope = rope_tables(config, seq_len)
    losses = []
    with torch.no_grad():
        for _ in range(cfg.val_batches):
            batch = torch.from_numpy(_batch(stream, rng, cfg.batch_size, seq_len, bos_id))
            logits = forward(params, config, batch[:, :-1], rope)
            losses.append(float(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())))
    return float(np.mean(losses))


def to_numpy(params: Params) -> dict[str, npt.NDArray[np.float32]]:
    """Detached float32 copies of the weights, same names, same order."""
    return {name: t.detach().float().numpy().copy() for name, t in params.items()}
