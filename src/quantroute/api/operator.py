"""What an operator does to a running gateway (the admin key): put pressure on a
simulated device, restart a branch, drain a branch and let it back.

A drain is the fleet's (``cluster/``): with etcd it is written there and every gateway
applies it within a second; without, it is this gateway's. A drained branch takes no new
request, routed or pinned (a pinned one is a 503 that says so); the requests it has finish,
and it stays loaded, so undraining it lets traffic back at once. The service hands these
calls on; the composition root builds the :class:`Operator` (``api/gateway.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from quantroute.cluster import ClusterState
from quantroute.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from quantroute.routing.table import Branch, RouteTableRef, lookup, parse_model_ref
from quantroute.telemetry import SimDeviceProvider

log = logging.getLogger(__name__)


class Operator:
    """The admin actions on branches and simulated devices."""

    def __init__(
        self,
        routes: RouteTableRef,
        cluster: ClusterState,
        retry_after_s: float,
        sim: SimDeviceProvider | None = None,
    ):
        self._routes = routes
        self._cluster = cluster
        self._retry_after_s = retry_after_s
        self._sim = sim

    def set_pressure(self, device_id: str, nbytes: int) -> None:
        """Simulated devices only: occupy ``nbytes`` of a device, as another tenant would."""
        sim = self._sim
        if sim is None:
            raise InvalidRequestError("pressure can only be set on simulated devices")
        if device_id not in sim.device_ids:
            raise NotFoundError("No such simulated device.", param="device_id", code="not_found")
        sim.set_pressure(device_id, nbytes)

    async def restart(self, branch_ref: str) -> dict[str, Any]:
        """Restart a branch (``model:branch``), clearing its failure; the answer says how it
        came back."""
        branch = self._branch(branch_ref)
        log.warning("%s: restart requested", branch.id)
        await branch.engine.restart()
        return {"branch": branch.id, "ready": branch.engine.ready, "failure": branch.engine.failure}

    async def drain(self, branch_ref: str) -> dict[str, Any]:
        """Stop sending ``branch_ref`` new requests, on every gateway of the fleet."""
        branch = self._branch(branch_ref, exact=True)
        revision = await self._cluster.drain(branch.id)
        log.warning("%s: drained by an operator (%s)", branch.id, self._cluster.store)
        return self._answer(branch, revision)

    async def undrain(self, branch_ref: str) -> dict[str, Any]:
        """Let a drained branch take requests again, on every gateway of the fleet."""
        branch = self._branch(branch_ref, exact=True)
        revision = await self._cluster.undrain(branch.id)
        log.warning("%s: undrained by an operator (%s)", branch.id, self._cluster.store)
        return self._answer(branch, revision)

    def refuse_drained(self, branch: Branch | None) -> None:
        """A 503 that says why, for a request only ``branch`` may serve while it is drained
        (pinned to it; the ``exact`` tier's wait for the reference, which would not help)."""
        if branch is not None and self._cluster.drained(branch.id):
            raise ServiceUnavailableError(
                f"branch {branch.id} is drained: it takes no new requests",
                retry_after_s=self._retry_after_s,
            )

    def _answer(self, branch: Branch, revision: int) -> dict[str, Any]:
        return {
            "branch": branch.id,
            "state": "drained" if self._cluster.drained(branch.id) else "active",
            "in_flight": branch.engine.in_flight,
            "store": self._cluster.store,
            "revision": revision,
        }

    def _branch(self, branch_ref: str, *, exact: bool = False) -> Branch:
        """The branch ``branch_ref`` names (404 if none). ``exact``: a versioned model's
        branch only with its version (``m@v2:b``), never the one the rules would pick."""
        table = self._routes.current
        model, pinned = parse_model_ref(branch_ref)
        if exact and pinned is not None and model in table.splits:
            versions = ", ".join(table.splits[model].versions)
            raise InvalidRequestError(
                f"{model} has versions ({versions}): name the branch with its version, "
                f"{model}@<version>:{pinned}",
                param="branch_id",
            )
        _, branch = lookup(table, branch_ref)
        if branch is None:
            raise InvalidRequestError(
                "name a branch (model:branch), not a model", param="branch_id"
            )
        return branch
