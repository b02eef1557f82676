"""The engine table: every engine a manifest's ``engine:`` may name, what each takes,
and how each is built. One entry per engine, nothing imported by name.

=========== ============= ============================== ======== ==========================
engine      source        precisions                     prompt   fidelity measured by
=========== ============= ============================== ======== ==========================
llamacpp    file          the GGUF ones (f32 ... q2_k)   rendered full logits
onnxruntime file + tokens f32, f16, int8, int4           rendered full logits
openai      url           every one                      messages top logprobs (or declared)
=========== ============= ============================== ======== ==========================

- **source**: a local ``file`` (checked by sha256 and header before anything runs it)
  or a server's ``url``. ``file + tokens``: the file is an ONNX graph and the branch
  names its ``tokenizer`` too (a GGUF holding the vocabulary, checked the same way;
  ``EngineKind.tokenizer``, ``registry.onnx_pair``).
- **prompt**: ``rendered``: the gateway renders a chat request with the model's
  template (``shaping/``) and hands the engine text; ``messages``: the engine gets the
  client's messages (``GenerationRequest.chat``) and its server applies its own.
- **scores**: ``logits``: the engine writes and compares full logit rows
  (``Engine.write_logits`` / ``score``: profiles and the drift monitor);
  ``top_logprobs``: measured through an OpenAI API's top logprobs
  (``quality.remote``); a manifest may declare a remote's profile instead.

``onnxruntime`` runs in the same supervised worker as ``llamacpp``
(``WorkerOptions(backend="onnx")``): ONNX Runtime's CPU execution provider decodes,
llama.cpp tokenizes from the tokenizer file, and the worker is handed both files as
verified descriptors. It is placed on the CPU only (``telemetry.occupancy``).

A manifest that names an engine not here, or gives it a source, precision or tokenizer
it does not take, is refused at the scan, naming the file and branch
(``registry.manifest``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from quantroute.config import Settings
from quantroute.engines.base import Engine
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.openai.engine import OpenAIEngine, RemoteConfig
from quantroute.engines.supervisor import RestartPolicy
from quantroute.registry.manifest import BranchArtifact
from quantroute.types import Precision

__all__ = ["ENGINES", "BuildContext", "EngineKind", "default_threads"]


def default_threads(n_workers: int, cores: int | None = None) -> int:
    """Threads per worker when not configured: the cores split among the workers,
    one core left to the gateway. llama.cpp's threads spin while they wait, so
    workers that together ask for more threads than there are cores slow each
    other down by an order of magnitude on a small host."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, (cores - 1) // max(n_workers, 1))


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What building one branch's engine may use: the settings, the restart policy of
    supervised workers, how many local workers share the host and the CPUs this one is
    pinned to, and ``secret``, which reads a variable a manifest names (a remote's key)
    from the environment the settings were read from."""

    settings: Settings
    policy: RestartPolicy
    route: str  # ``model`` or ``model@version``
    n_workers: int = 1
    cpus: tuple[int, ...] = ()
    secret: Callable[[str], str | None] = field(default=lambda _name: None)


@dataclass(frozen=True, slots=True)
class EngineKind:
    """One engine: what it takes (see the module's table) and its constructor.
    ``tokenizer``: its file is an ONNX graph, and a branch names its tokenizer file too."""

    name: str
    source: Literal["file", "url"]
    precisions: frozenset[Precision]
    prompt: Literal["rendered", "messages"]
    scores: Literal["logits", "top_logprobs"]
    build: Callable[[BuildContext, BranchArtifact], Engine]
    tokenizer: bool = False


def _worker_options(
    ctx: BuildContext, a: BranchArtifact, backend: Literal["llamacpp", "onnx"] = "llamacpp"
) -> WorkerOptions:
    """A local worker's options: the settings, then the branch's own."""
    e = ctx.settings.engine
    o = a.spec.options if a.spec is not None else None
    threads = e.n_threads or (len(ctx.cpus) if ctx.cpus else default_threads(ctx.n_workers))
    return WorkerOptions(
        n_ctx=(o.n_ctx if o else None) or e.n_ctx,
        parallel=(o.parallel if o else None) or e.parallel,
        n_threads=(o.n_threads if o else None) or threads,
        n_batch=(o.n_batch if o else None) or e.n_batch,
        log_level=ctx.settings.server.log_level,
        start_timeout_s=e.start_timeout_s,
        gen_idle_timeout_s=e.gen_idle_timeout_s,
        score_timeout_s=e.score_timeout_s,
        max_event_bytes=e.max_event_bytes,
        prompt_cache=e.prompt_cache,
        cpus=ctx.cpus,
        fault=e.fault_for(ctx.route, a.name) or e.fault_for(a.model, a.name),
        backend=backend,
    )


def _llamacpp(ctx: BuildContext, a: BranchArtifact) -> Engine:
    """A supervised llama.cpp worker: the settings, then the branch's options."""
    return LlamaCppEngine(
        f"{ctx.route}:{a.name}", a.path, _worker_options(ctx, a), ctx.policy, verified=a.verified()
    )


def _onnxruntime(ctx: BuildContext, a: BranchArtifact) -> Engine:
    """The same supervised worker running the branch's ONNX graph under ONNX Runtime,
    handed the graph and its tokenizer as verified descriptors."""
    return LlamaCppEngine(
        f"{ctx.route}:{a.name}",
        a.path,
        _worker_options(ctx, a, "onnx"),
        ctx.policy,
        verified=a.verified(),
        # a branch whose files failed their checks is never started: its paths will do
        tokenizer=a.verified_tokenizer() or a.tokenizer_path,
        data=a.verified_data() or a.data_path,
    )


def _openai(ctx: BuildContext, a: BranchArtifact) -> Engine:
    """A relay to the branch's server; its key read from the variable the manifest names."""
    spec = a.spec
    assert spec is not None and a.url is not None  # a url branch's artifact has both
    r = spec.remote
    config = RemoteConfig(
        url=a.url,
        model=spec.remote_model or a.name,
        server=r.server,
        api_key=ctx.secret(spec.api_key_env) if spec.api_key_env else None,
        max_connections=r.max_connections,
        connect_timeout_s=r.connect_timeout_s,
        first_token_timeout_s=r.first_token_timeout_s,
        idle_timeout_s=r.idle_timeout_s,
        probe_interval_s=r.probe_interval_s,
        logprobs=r.logprobs,
        max_event_bytes=r.max_event_bytes,
        parallel=spec.options.parallel,
    )
    return OpenAIEngine(f"{ctx.route}:{a.name}", config)


_GGUF = frozenset(p for p in Precision if p.spec.gguf)
_ONNX = frozenset({Precision.F32, Precision.F16, Precision.INT8, Precision.INT4})

ENGINES: Mapping[str, EngineKind] = {
    kind.name: kind
    for kind in (
        EngineKind("llamacpp", "file", _GGUF, "rendered", "logits", _llamacpp),
        EngineKind(
            "onnxruntime", "file", _ONNX, "rendered", "logits", _onnxruntime, tokenizer=True
        ),
        EngineKind("openai", "url", frozenset(Precision), "messages", "top_logprobs", _openai),
    )
}
