"""Which draft a reference's worker speculates with, and how its file reaches the worker
(gateway side; the worker's half is :mod:`.worker_speculative`).

A model's reference (a local GGUF served by llama.cpp) may hold a second GGUF of the
same model beside it: the *draft*, the model's cheapest other local GGUF branch by bits
per weight (:func:`pick_draft`). The worker gets it as ``--draft``, loaded from a
descriptor opened and checked against its verification before each spawn, exactly like
the model (:class:`DraftedFiles`; ``registry.verified``): never a path read from the
manifest. The worker itself refuses a draft whose vocabulary is not the model's, token
for token, and then serves plainly; its ``ready`` says which draft loaded.

What drafting gives is measured, not modelled: each drafted request's ``fin`` says how
many tokens the draft proposed and the model kept, the mean ``k``, and the worker's
measured decode rate drafting over its plain rate (``AdaptiveK.speedup``). The engine
folds them into :class:`SpeculationStats` (explain shows them) and routing reads the
speed-up, in steps (:func:`routed_speedup`), as the reference's decode speed beside its
profile's plain one (``EngineInfo.speedup``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from quantroute.engines.base import SamplingParams
from quantroute.engines.llamacpp.model_file import ModelFile, WorkerFiles
from quantroute.engines.llamacpp.options import WorkerOptions
from quantroute.engines.sampling import GREEDY_BELOW
from quantroute.engines.supervisor import Launch
from quantroute.registry.manifest import BranchArtifact
from quantroute.registry.verified import VerifiedFile

__all__ = ["Draft", "DraftedFiles", "SpeculationStats", "drafts", "pick_draft", "routed_speedup"]

_ENGINE = "llamacpp"  # the engine table's name of the only engine that drafts


@dataclass(frozen=True, slots=True)
class Draft:
    """The draft a reference's worker holds: the branch it is (``model:branch``), its file
    (``verified``: what the worker may load; ``None``: a test's own file, by its path),
    how the worker picks how many tokens to draft a step and at most how many."""

    branch_id: str
    path: Path
    verified: VerifiedFile | None
    mode: Literal["auto", "always"] = "auto"
    k_max: int = 8

    @property
    def branch(self) -> str:
        """The draft's branch name (``q4_k_m``)."""
        return self.branch_id.rpartition(":")[2]


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    """What a reference's drafting gave lately, from its drafted requests' ``fin``
    (:meth:`add`): how many, the tokens drafted and kept in all, and recent figures
    (exponentially weighted, ``WEIGHT`` the newest request's share): the share of drafted
    tokens kept, the mean drafts per step, and the worker's measured speed-up (its latest
    report; 0: not measured, as under ``speculation: always``)."""

    WEIGHT = 0.2

    requests: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance: float = 0.0
    mean_k: float = 0.0
    speedup: float = 0.0

    def add(self, drafted: int, accepted: int, mean_k: float, speedup: float) -> SpeculationStats:
        """These figures with one more drafted request's."""
        rate = accepted / drafted if drafted else 0.0
        w = self.WEIGHT if self.requests else 1.0
        return SpeculationStats(
            self.requests + 1,
            self.drafted + drafted,
            self.accepted + accepted,
            (1 - w) * self.acceptance + w * rate,
            (1 - w) * self.mean_k + w * mean_k,
            speedup if speedup > 0 else self.speedup,
        )

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "requests": self.requests,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.acceptance, 4),
            "mean_k": round(self.mean_k, 3),
            "speedup": round(self.speedup, 3) if self.speedup else None,
        }


_STEP = 2.0 ** (1 / 16)  # routing's speed-up moves in steps of about 4 %


def routed_speedup(speedup: float) -> float:
    """The measured speed-up routing reads: 1.0 until measured, at most 16, in steps of
    about 4 % (a record is rebuilt only when it moves a step: ``routing.states``)."""
    if speedup <= 0:
        return 1.0
    return float(_STEP ** round(math.log(min(speedup, 16.0), _STEP)))


def drafts(sampling: SamplingParams) -> bool:
    """Whether a request with ``sampling`` is drafted on a reference holding a draft. Not a
    seeded sampled one: speculated sampling follows the model's distribution, but a seed
    then repeats only for one draft schedule, which the worker picks from its timings."""
    return sampling.seed is None or not sampling.temperature >= GREEDY_BELOW  # greedy


def pick_draft(artifacts: Sequence[BranchArtifact]) -> BranchArtifact | None:
    """The draft for the reference among one route's ``artifacts``: the local llama.cpp
    branch with the fewest bits per weight (then by name), fewer than the reference's,
    whose file passed its checks; ``None`` when the reference is not such a branch
    itself or no other is."""
    reference = next((a for a in artifacts if a.is_reference), None)
    if reference is None or not _servable(reference):
        return None
    bits = reference.precision.spec.bits_per_weight
    candidates = [
        a
        for a in artifacts
        if not a.is_reference and _servable(a) and a.precision.spec.bits_per_weight < bits
    ]
    return min(candidates, key=lambda a: (a.precision.spec.bits_per_weight, a.name), default=None)


def _servable(a: BranchArtifact) -> bool:
    return a.engine == _ENGINE and a.url is None and a.verified() is not None


class DraftedFiles:
    """A reference's :class:`WorkerFiles` with its draft: the same interface, the draft
    opened, checked and passed as a descriptor at each spawn, and watched like the model
    (:meth:`moved`) while the worker lives."""

    def __init__(self, files: WorkerFiles, draft: Draft):
        self._files = files
        self._path = draft.path
        self._draft = ModelFile(draft.verified) if draft.verified is not None else None

    @property
    def verified(self) -> bool:
        return self._files.verified or self._draft is not None

    def argv(self, options: WorkerOptions) -> list[str]:
        """The worker's argv with the files by their paths (a spawn with nothing to check)."""
        return self._files.argv(replace(options, draft=str(self._path)))

    async def launch(self, options: WorkerOptions) -> Launch:
        """Before a spawn: open and check the draft, then the model's files; the worker
        loads the descriptors. Raises what a changed file raises (``ModelFile.open``)."""
        if self._draft is None:
            return await self._files.launch(replace(options, draft=str(self._path)))
        fd = await self._draft.open()
        try:
            launch = await self._files.launch(replace(options, draft=f"/proc/self/fd/{fd}"))
        except BaseException:
            self._draft.release()
            raise
        return Launch(launch.argv, (*launch.pass_fds, fd))

    def release(self) -> None:
        self._files.release()
        if self._draft is not None:
            self._draft.release()

    def moved(self) -> str | None:
        moved = self._files.moved()
        if moved is None and self._draft is not None:
            moved = self._draft.moved()
        return moved  # the draft's words name its file (VerifiedFile.label)
