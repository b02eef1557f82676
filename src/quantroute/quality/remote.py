"""A remote branch's fidelity, measured through its top-k log-probabilities over HTTP.

The engine's :class:`~quantroute.engines.openai.topk.TopkClient` teacher-forces the
reference's tokens on the branch's server and reads its top-k rows (how each server is
asked: that module's text); :func:`measure_remote` scores them against the reference's
full logits with :meth:`~quantroute.quality.metrics.KldAccumulator.add_topk_logits`
(the KLD is a lower bound: :func:`quantroute.divergence.kl_divergence_topk`). A server
that gives no log-probabilities cannot be measured (``remote_no_logprobs``): its
manifest may declare a profile (``quality.profile.DeclaredQuality``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from quantroute.engines.openai.topk import (
    DEFAULT_TOP_K,
    FORCE_BIAS,
    NO_LOGPROBS,
    Dialect,
    Endpoint,
    TopkClient,
    dialect_for,
)
from quantroute.errors import ConfigError, EngineError
from quantroute.quality.metrics import KldAccumulator, QualityStats
from quantroute.quality.profile import Fidelity, Measure
from quantroute.registry.manifest import BranchArtifact

__all__ = [
    "DEFAULT_TOP_K",
    "FORCE_BIAS",
    "NO_LOGPROBS",
    "Dialect",
    "Endpoint",
    "RemoteMeasured",
    "TopkClient",
    "dialect_of",
    "endpoint_of",
    "measure_remote",
    "measure_remote_branches",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemoteMeasured:
    """A remote branch's quality against the reference, and how it was measured."""

    quality: QualityStats
    fidelity: Fidelity
    unforced: int  # positions whose next token's log-probability is a bound, not exact
    elapsed_s: float


async def measure_remote(
    client: TopkClient,
    chunks: Sequence[Sequence[int]],
    targets: Sequence[npt.ArrayLike],
    first: int,
    reference_logits: npt.NDArray[np.floating],
    tick: Callable[[], None] = lambda: None,
) -> RemoteMeasured:
    """Score ``client``'s branch on ``chunks`` (each evaluated from position 0; rows
    ``first .. n - 2`` predict ``targets``) against ``reference_logits``
    ``[n_chunks, n - 1 - first, V]``, the reference's logits of the same rows."""
    started = time.perf_counter()
    n_vocab = await client.n_vocab()
    if n_vocab is not None and n_vocab != reference_logits.shape[-1]:
        raise ConfigError(
            f"{client.endpoint.base_url} has {n_vocab} tokens; the reference has "
            f"{reference_logits.shape[-1]}: not the same model"
        )
    acc = KldAccumulator()
    for i, chunk in enumerate(chunks):
        rows = await client.score(chunk, first)  # [S, k+1]
        acc.add_topk_logits(reference_logits[i], rows, targets[i])
        tick()
    fidelity = Fidelity(
        measure=Measure.TOPK,
        top_k=client.k,
        tail_mass=acc.mean_tail_mass(),
        dialect=str(client.dialect),
    )
    return RemoteMeasured(acc.result(), fidelity, client.unforced, time.perf_counter() - started)


def endpoint_of(artifact: BranchArtifact, secret: Callable[[str], str | None]) -> Endpoint:
    """The endpoint of a remote branch, as its engine reaches it: its ``url``, the model
    it is asked for (``remote_model``, by default the branch's name) and the key in the
    variable its ``api_key_env`` names, read by ``secret`` (``Settings.secret``)."""
    spec = artifact.spec
    if artifact.url is None or spec is None:
        raise ValueError(f"{artifact.name} is not a remote branch")
    key = secret(spec.api_key_env) if spec.api_key_env else None
    if spec.api_key_env and key is None:
        logger.warning("%s:%s: %s is not set; asking without a key", *_who(artifact),
                       spec.api_key_env)  # fmt: skip
    return Endpoint(artifact.url, spec.remote_model or artifact.name, key)


def dialect_of(artifact: BranchArtifact) -> Dialect | None:
    """How to ask the branch's server, from its ``remote.server`` (``None``: find out)."""
    return dialect_for(artifact.spec.remote.server if artifact.spec is not None else "auto")


def _who(artifact: BranchArtifact) -> tuple[str, str]:
    return artifact.model, artifact.name


def measure_remote_branches(
    artifacts: Sequence[BranchArtifact],
    chunks: Sequence[Sequence[int]],
    targets: Sequence[npt.ArrayLike],
    first: int,
    cache_path: Path,
    *,
    k: int = DEFAULT_TOP_K,
    secret: Callable[[str], str | None] = lambda _name: None,
    tick: Callable[[], None] = lambda: None,
) -> list[tuple[BranchArtifact, RemoteMeasured]]:
    """Measure each remote branch in ``artifacts`` (the profiler's seam). The reference's
    logits are the ``.npy`` at ``cache_path``. A remote that gives no log-probabilities
    (or whose manifest says so: ``remote.logprobs: false``) is skipped with a warning:
    its manifest may declare a profile. Any other failure (unreachable, another
    vocabulary) raises, as a failing local branch does."""
    reference = np.load(cache_path, mmap_mode="r")  # [n_chunks, S, V]
    done = []
    for art in artifacts:
        if art.spec is not None and not art.spec.remote.logprobs:
            logger.warning("%s:%s: not measured: it returns no logprobs", *_who(art))
            continue
        client = TopkClient(endpoint_of(art, secret), k=k, dialect=dialect_of(art))
        try:
            measured = asyncio.run(_measure_one(client, chunks, targets, first, reference, tick))
        except ConfigError as exc:
            if exc.error_code != NO_LOGPROBS:
                raise ConfigError(f"{art.model}:{art.name}: {exc.message}") from exc
            logger.warning("%s:%s: not measured: %s", *_who(art), exc.message)
            continue
        except EngineError as exc:
            raise EngineError(f"profiling {art.model}:{art.name} failed: {exc.message}") from exc
        if measured.unforced:
            logger.warning(
                "%s:%s: at %d positions the server would not emit the next token; its "
                "log-probability there is an upper bound",
                *_who(art),
                measured.unforced,
            )
        done.append((art, measured))
    return done


async def _measure_one(
    client: TopkClient,
    chunks: Sequence[Sequence[int]],
    targets: Sequence[npt.ArrayLike],
    first: int,
    reference: npt.NDArray[np.floating],
    tick: Callable[[], None],
) -> RemoteMeasured:
    async with client:
        return await measure_remote(client, chunks, targets, first, reference, tick)
