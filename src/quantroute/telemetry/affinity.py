"""CPU pinning for worker processes: split the cores among workers instead of overlapping.

Two llama.cpp workers whose threads share cores both run at half speed and
thrash each other's caches; a worker whose cores span two NUMA nodes reads
half its weights across the interconnect. So workers get disjoint core sets,
each inside one NUMA node where the count allows. An explicit configuration
(``cpu_affinity: [[0, 1], [2, 3]]``) overrides the plan.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from quantroute.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> set[int]:
    """Parse the kernel's cpulist format: ``"0-3,8-11"`` → {0, 1, 2, 3, 8, 9, 10, 11}.

    >>> sorted(parse_cpulist("0-2,5"))
    [0, 1, 2, 5]
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"bad cpulist entry {part!r}") from None
        if hi < lo:
            raise ValueError(f"bad cpulist range {part!r}")
        cpus.update(range(lo, hi + 1))
    return cpus


def read_numa_nodes(root: Path = DEFAULT_NODE_ROOT) -> dict[int, set[int]]:
    """NUMA node → its cpus, from ``node*/cpulist``; empty when the kernel exposes none."""
    nodes: dict[int, set[int]] = {}
    if not root.is_dir():
        return nodes
    for entry in sorted(root.glob("node[0-9]*")):
        suffix = entry.name[4:]
        if not suffix.isdigit():
            continue
        try:
            cpus = parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError) as exc:
            logger.warning("cannot read %s/cpulist: %s", entry, exc)
            continue
        if cpus:
            nodes[int(suffix)] = cpus
    return nodes


def _split(cpus: Sequence[int], parts: int) -> list[set[int]]:
    """Contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(set(cpus[start:end]))
        start = end
    return out


def _apportion(weights: Sequence[int], total: int) -> list[int]:
    """Largest-remainder apportionment of ``total`` among ``weights``, each share ≥ 1."""
    n = len(weights)
    shares = [1] * n
    rest = total - n
    if rest > 0:
        whole = sum(weights)
        exact = [rest * w / whole for w in weights]
        floors = [int(x) for x in exact]
        shares = [s + f for s, f in zip(shares, floors, strict=True)]
        left = rest - sum(floors)
        by_remainder = sorted(range(n), key=lambda i: exact[i] - floors[i], reverse=True)
        for i in by_remainder[:left]:
            shares[i] += 1
    return shares


def plan_cpu_affinity(
    n_workers: int,
    cpus: Collection[int] | None = None,
    numa_nodes: Mapping[int, Collection[int]] | None = None,
    *,
    pinned: Sequence[Sequence[int]] | None = None,
) -> list[set[int]]:
    """One core set per worker, disjoint whenever there are at least as many cores as workers.

    ``cpus`` defaults to this process's affinity (``os.sched_getaffinity(0)``),
    ``numa_nodes`` to :func:`read_numa_nodes`. With ``pinned`` (the explicit
    configuration) worker *i* gets ``pinned[i]``, checked against ``cpus``.

    Workers are spread over NUMA nodes in proportion to each node's usable
    cores, and each node's cores are cut into contiguous chunks. With fewer
    workers than nodes, each worker takes whole nodes. With more workers than
    cores, sharing cannot be avoided: cores are dealt round-robin (logged).

    >>> plan_cpu_affinity(2, cpus=range(8), numa_nodes={0: range(4), 1: range(4, 8)})
    [{0, 1, 2, 3}, {4, 5, 6, 7}]
    """
    if n_workers < 1:
        raise ValueError(f"n_workers must be ≥ 1, got {n_workers}")
    available = set(os.sched_getaffinity(0) if cpus is None else cpus)
    if not available:
        raise ConfigError("no cpus available for workers")
    if pinned is not None:
        return _check_pinned(n_workers, pinned, available)
    nodes = read_numa_nodes() if numa_nodes is None else numa_nodes
    groups = [sorted(available & set(node_cpus)) for _, node_cpus in sorted(nodes.items())]
    groups = [g for g in groups if g]
    covered = set().union(*groups) if groups else set()
    if available - covered:  # cpus outside every known node: one more group
        groups.append(sorted(available - covered))
    if n_workers > len(available):
        ordered = sorted(available)
        logger.warning("%d workers on %d cpus: workers share cores", n_workers, len(ordered))
        return [{ordered[i % len(ordered)]} for i in range(n_workers)]
    if n_workers < len(groups):
        # Whole nodes per worker, consecutive nodes together.
        node_shares = _split(list(range(len(groups))), n_workers)
        return [set().union(*(groups[g] for g in share)) for share in node_shares]
    # Never give a node more workers than it has cores.
    shares = _apportion([len(g) for g in groups], n_workers)
    while any(s > len(g) for s, g in zip(shares, groups, strict=True)):
        i = next(i for i, (s, g) in enumerate(zip(shares, groups, strict=True)) if s > len(g))
        j = max(range(len(groups)), key=lambda k: len(groups[k]) - shares[k])
        shares[i] -= 1
        shares[j] += 1
    plan: list[set[int]] = []
    for group, share in zip(groups, shares, strict=True):
        plan.extend(_split(group, share))
    return plan


def _check_pinned(
    n_workers: int, pinned: Sequence[Sequence[int]], available: set[int]
) -> list[set[int]]:
    if len(pinned) < n_workers:
        raise ConfigError(
            f"cpu_affinity pins {len(pinned)} workers but {n_workers} are configured",
            param="cpu_affinity",
        )
    plan = []
    for i, cores in enumerate(pinned[:n_workers]):
        chosen = set(cores)
        if not chosen:
            raise ConfigError(f"cpu_affinity[{i}] is empty", param="cpu_affinity")
        outside = sorted(chosen - available)
        if outside:
            raise ConfigError(
                f"cpu_affinity[{i}] names cpus {outside} this process may not use",
                param="cpu_affinity",
            )
        plan.append(chosen)
    for i in range(len(plan)):
        for j in range(i + 1, len(plan)):
            if plan[i] & plan[j]:
                logger.warning("cpu_affinity: workers %d and %d share cores", i, j)
    return plan
