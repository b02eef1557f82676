"""From a repository scan to routes: one engine per branch of every version, built by
its entry of the engine table (``engines.table``).

:class:`Catalog` is what the gateway builds its first route table with and
what a reload builds the next one with. A route's ``fingerprint`` is what
decides its engines (files, sha256s, engine options, reference): a reload
keeps the engines of a route whose fingerprint did not change and builds new
ones for the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from quantroute.config import Settings
from quantroute.engines.base import Engine
from quantroute.engines.llamacpp.draft import Draft, pick_draft
from quantroute.engines.llamacpp.engine import LlamaCppEngine
from quantroute.engines.supervisor import RestartPolicy
from quantroute.engines.table import ENGINES, BuildContext, EngineKind
from quantroute.engines.table import default_threads as default_threads  # its old home
from quantroute.quality.profile import PROFILE_NAME, Trust, load_profiles, stale_profiles
from quantroute.registry.digests import Digests
from quantroute.registry.manifest import BranchArtifact
from quantroute.registry.repository import ModelEntry, RepositoryScan, scan_repository
from quantroute.registry.signing import TrustPolicy
from quantroute.routing.table import Branch, ModelRoute
from quantroute.routing.versions import Rule, VersionSplit
from quantroute.telemetry import plan_cpu_affinity
from quantroute.telemetry.occupancy import PlacementRequest
from quantroute.types import versioned_name

log = logging.getLogger(__name__)


def local_workers(scan: RepositoryScan) -> int:
    """How many branches of ``scan`` run in local worker processes (they share the
    host's cores; a remote branch costs none)."""
    return sum(1 for m in scan.models for v in m.versions for a in v if a.url is None)


def placement_request(b: Branch) -> PlacementRequest:
    """What placing ``b`` takes: its file, and the draft a reference's worker holds."""
    draft = b.engine.draft if isinstance(b.engine, LlamaCppEngine) else None
    path = draft.path if draft is not None else None
    return PlacementRequest(b.id, b.engine.model_path, b.artifact.problem, b.artifact.device, path)


def fingerprint(a: BranchArtifact, draft: BranchArtifact | None = None) -> str:
    """What decides a branch's engine, hashed: its file, sha256, problem and spec (engine
    options, device), and the draft a reference speculates with. A reload that finds the
    same one keeps the engine."""
    spec = a.spec.model_dump(mode="json") if a.spec is not None else {}
    held = [str(draft.path), draft.sha256] if draft is not None else []
    text = json.dumps([str(a.path), a.sha256, a.problem, a.url, spec, *held], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ModelBuild:
    """A model's routes from one scan, and its version split (versioned models)."""

    model: str
    routes: tuple[ModelRoute, ...]
    split: VersionSplit | None
    fingerprints: Mapping[str, str]  # branch id -> fingerprint
    new_branches: tuple[Branch, ...]  # branches with engines built for this build


class Catalog:
    """Routes from scans; ``engines`` is the engine table branches are built from (a
    test may add an engine to it)."""

    def __init__(self, settings: Settings, engines: Mapping[str, EngineKind] = ENGINES):
        self._settings = settings
        self._engines = engines
        e = settings.engine
        self._policy = RestartPolicy(
            backoff_s=e.restart_backoff_s,
            backoff_max_s=e.restart_backoff_max_s,
            stop_grace_s=e.cancel_grace_s,
            max_crashes=e.max_crashes,
            failed_retry_s=e.failed_retry_s,
        )
        self.digests = Digests()  # across reloads: an unchanged file is not read again

    def trust(self) -> TrustPolicy:
        r = self._settings.repository
        return TrustPolicy(
            required=r.require_signatures,
            public_key=r.public_key,
            sigstore_identity=r.sigstore_identity,
            sigstore_issuer=r.sigstore_issuer,
        )

    def scan(self) -> RepositoryScan:
        """Validate and verify the repository (blocking: run it in a thread)."""
        r = self._settings.repository
        return scan_repository(
            self._settings.repo,
            self.trust(),
            timeout_s=r.check_timeout_s,
            memory_bytes=r.check_memory_bytes,
            digests=self.digests,
            follow_links=r.follow_links,
            engines=self._engines,
        )

    def build_all(self, scan: RepositoryScan) -> list[ModelBuild]:
        """Every model of ``scan`` with new engines (the first table), CPUs pinned as
        configured."""
        e, t = self._settings.engine, self._settings.telemetry
        n_workers = local_workers(scan)
        pinning = (
            plan_cpu_affinity(n_workers, pinned=t.cpu_affinity)
            if (e.pin_cpus or t.cpu_affinity) and n_workers
            else None
        )
        cpus = iter(tuple(sorted(p)) for p in pinning) if pinning else None
        return [self.build(m, {}, n_workers, cpus) for m in scan.models]

    def build(
        self,
        entry: ModelEntry,
        keep: Mapping[str, tuple[str, Engine]],
        n_workers: int,
        cpus: Iterator[tuple[int, ...]] | None = None,
    ) -> ModelBuild:
        """``entry``'s routes. A branch in ``keep`` (id -> (fingerprint, engine)) with
        the same fingerprint keeps its engine (with a fresh profile); the others get
        new, unstarted engines."""
        manifest = entry.manifest
        routes, fingerprints, fresh = [], {}, []
        # under require_signatures a profile routes only if the signature covers it
        trust = Trust(self._settings.repository.require_signatures, entry.signed.get(PROFILE_NAME))
        versioned = bool(manifest.versions)
        for version, artifacts in zip(manifest.version_names(), entry.versions, strict=True):
            name = versioned_name(manifest.model, version if versioned else None)
            reference, _ = manifest.version_spec(version)
            profiles, warnings = load_profiles(entry.directory, artifacts, trust)
            stale = (
                stale_profiles(entry.directory, artifacts, trust)
                if version == manifest.version
                else frozenset()
            )
            for warning in warnings:
                log.warning("profile: %s", warning)
            branches = []
            draft = pick_draft(artifacts) if self._settings.routing.speculation != "off" else None
            for a in artifacts:
                held = draft if a.is_reference else None
                fp = fingerprints[f"{name}:{a.name}"] = fingerprint(a, held)
                old = keep.get(f"{name}:{a.name}")
                engine = old[1] if old is not None and old[0] == fp else None
                if engine is None:
                    pinned = next(cpus, ()) if cpus is not None and a.url is None else ()
                    engine = self.engine(name, a, n_workers, pinned)
                    if held is not None and isinstance(engine, LlamaCppEngine):
                        engine.speculate(self._draft(name, held))
                    new = Branch(name, a.name, a.precision, a, engine, profiles[a.name])
                    fresh.append(new)
                    branches.append(new)
                else:
                    branches.append(Branch(name, a.name, a.precision, a, engine, profiles[a.name]))
            routes.append(ModelRoute(name, reference, tuple(branches), tuple(warnings), stale))
        split = None
        if versioned:
            split = VersionSplit(
                manifest.model,
                manifest.default_version or manifest.version,
                tuple(
                    Rule(r.version, r.percent, r.header.lower() if r.header else None, r.value)
                    for r in manifest.traffic
                ),
                tuple(manifest.version_names()),
            )
        return ModelBuild(manifest.model, tuple(routes), split, fingerprints, tuple(fresh))

    def _draft(self, route: str, a: BranchArtifact) -> Draft:
        """``a`` as the draft of ``route``'s reference, as the settings ask."""
        r = self._settings.routing
        mode: Literal["auto", "always"] = "always" if r.speculation == "always" else "auto"
        return Draft(f"{route}:{a.name}", a.path, a.verified(), mode, r.speculation_k_max)

    def engine(
        self, route: str, a: BranchArtifact, n_workers: int, cpus: tuple[int, ...] = ()
    ) -> Engine:
        """A new (unstarted) engine for ``a``, built by its entry of the engine table."""
        context = BuildContext(
            self._settings, self._policy, route, n_workers, cpus, secret=self._settings.secret
        )
        return self._engines[a.engine].build(context, a)
