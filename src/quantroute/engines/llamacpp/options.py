"""How a llama.cpp worker is started: :class:`WorkerOptions`, its command line and its
environment (gateway side).

The options a branch's manifest and the engine settings give become the worker's
``argv`` (``python -m quantroute.engines.llamacpp.worker --model ... --parallel N``;
an ONNX branch adds ``--backend onnx --tokenizer ...``),
less those only the gateway reads (its timeouts, the GPU, which is the worker's
environment instead). The environment is the gateway's allowlisted part
(:func:`~quantroute.engines.environment.worker_env`), with the one GPU the worker may
see.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from quantroute.engines.environment import worker_env

PIPE_LINE_LIMIT_BYTES = 1 << 24
"""The longest line the gateway reads from a worker (``engines/supervisor.py`` opens the
pipe with this ``limit``); a longer one kills the reader, and the worker is restarted."""

# Read by the gateway only; not passed to the worker.
_GATEWAY_ONLY = frozenset({"start_timeout_s", "gen_idle_timeout_s", "score_timeout_s", "gpu"})
_DEFAULTS = {"sampler": "chain", "backend": "llamacpp"}  # passed only when not these
_DRAFT = frozenset({"draft", "draft_gpu_layers", "spec_k_max", "spec_mode"})


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    n_ctx: int = 0
    parallel: int = 4
    n_threads: int = 0
    n_batch: int = 512
    n_gpu_layers: int = 0
    log_level: str = "info"
    start_timeout_s: float = 120.0
    # A generation's longest wait for its next event (a request queued behind long ones
    # waits for a free sequence, so this is generous).
    gen_idle_timeout_s: float = 300.0
    score_timeout_s: float = 300.0  # a whole scoring command (logits or score)
    # The worker's longest event line; a longer event is an error for its request only.
    max_event_bytes: int = 1 << 20
    cpus: tuple[int, ...] = ()  # pin the worker to these cores; () leaves it unpinned
    fault: str = ""  # fault injection for tests (see the worker's --fault)
    gpu: int | None = None  # CUDA device index (NVML order); None: the CPU
    oom_flag: str = ""  # a simulated device's out-of-memory flag file (see Offload)
    prompt_cache: bool = True  # reuse finished sequences' KV prefixes (prompt_cache.py)
    sampler: str = "chain"  # llama.cpp's sampler chain; "numpy" (sampling.py) is a reference
    # what computes the logits: llama.cpp over a GGUF, or ONNX Runtime over a model.onnx
    # (with the folder's tokenizer.gguf: argv's tokenizer_path); the rest of the worker is one
    backend: Literal["llamacpp", "onnx"] = "llamacpp"
    # speculative decoding (``draft.py``): a GGUF of the model's vocabulary held beside it
    # ("": none; a verified ``/proc/self/fd/N`` at a spawn), its GPU layers, the most
    # tokens it drafts a step and how the worker picks how many (auto, always, fixed)
    draft: str = ""
    draft_gpu_layers: int = 0
    spec_k_max: int = 8
    spec_mode: Literal["auto", "always", "fixed"] = "auto"

    def __post_init__(self) -> None:
        if not 1024 <= self.max_event_bytes <= PIPE_LINE_LIMIT_BYTES // 2:
            raise ValueError(
                f"max_event_bytes must lie in [1024, {PIPE_LINE_LIMIT_BYTES // 2}] (half the "
                f"pipe's line limit), not {self.max_event_bytes}"
            )
        if self.gen_idle_timeout_s <= 0 or self.score_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.backend not in ("llamacpp", "onnx"):
            raise ValueError(f"backend must be llamacpp or onnx, not {self.backend!r}")
        if self.spec_mode not in ("auto", "always", "fixed"):
            raise ValueError(f"spec_mode must be auto, always or fixed, not {self.spec_mode!r}")
        if not 1 <= self.spec_k_max <= 64:
            raise ValueError(f"spec_k_max must lie in [1, 64], not {self.spec_k_max}")
        if self.draft and self.backend != "llamacpp":
            raise ValueError("a draft needs backend llamacpp (an ONNX worker drafts nothing)")

    def argv(self, model_path: Path, tokenizer_path: Path | None = None) -> list[str]:
        """The worker's command line: ``model_path`` (a GGUF, or an ONNX folder's
        ``model.onnx``) and, for ``backend="onnx"``, ``tokenizer_path`` (its
        ``tokenizer.gguf``); either may be a ``/proc/self/fd/N`` the worker inherits."""
        if self.backend == "onnx" and tokenizer_path is None:
            raise ValueError("an onnx worker needs a tokenizer_path (the folder's tokenizer.gguf)")
        argv = [sys.executable, "-m", "quantroute.engines.llamacpp.worker"]
        argv += ["--model", str(model_path)]
        if tokenizer_path is not None:
            argv += ["--tokenizer", str(tokenizer_path)]
        for key, value in asdict(self).items():
            if key == "cpus":
                if value:
                    argv += ["--cpus", ",".join(map(str, value))]
            elif key in ("fault", "oom_flag"):
                if value:
                    argv += [f"--{key.replace('_', '-')}", value]
            elif key in _DRAFT:
                if self.draft:  # the draft's flags only with a draft
                    argv += [f"--{key.replace('_', '-')}", str(value)]
            elif key == "prompt_cache":
                if not value:
                    argv.append("--no-prompt-cache")
            elif key in ("sampler", "backend"):
                if value != _DEFAULTS[key]:
                    argv += [f"--{key}", value]
            elif key not in _GATEWAY_ONLY:
                argv += [f"--{key.replace('_', '-')}", str(value)]
        return argv

    def env(self) -> dict[str, str]:
        """The worker's environment: the gateway's allowlisted part (:func:`worker_env`),
        with the GPU it may see (NVML's order, so ``cuda:N`` is the same device for
        both), or none on the CPU."""
        env = worker_env(os.environ)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = "" if self.gpu is None else str(self.gpu)
        return env
