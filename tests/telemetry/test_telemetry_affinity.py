"""CPU pinning plans: disjoint core sets, NUMA-aware, explicit overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quantroute.errors import ConfigError
from quantroute.telemetry import parse_cpulist, plan_cpu_affinity, read_numa_nodes


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,8-9\n", {0, 1, 8, 9}), ("", set()), ("4,2", {2, 4})],
)
def test_parse_cpulist(text: str, cpus: set[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "1-x"])
def test_parse_cpulist_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(text)


def test_read_numa_nodes_from_a_fake_sysfs(tmp_path: Path) -> None:
    for node, cpulist in {"node0": "0-3,8-11", "node1": "4-7,12-15", "node2": ""}.items():
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "possible").write_text("0-2\n")
    assert read_numa_nodes(tmp_path) == {
        0: {0, 1, 2, 3, 8, 9, 10, 11},
        1: {4, 5, 6, 7, 12, 13, 14, 15},
    }
    assert read_numa_nodes(tmp_path / "missing") == {}


TWO_NODES = {0: set(range(0, 8)), 1: set(range(8, 16))}

# n_workers, cpus, nodes, expected plan
PLANS = [
    (1, range(4), {0: range(4)}, [{0, 1, 2, 3}]),
    (2, range(4), {0: range(4)}, [{0, 1}, {2, 3}]),
    (3, range(8), {0: range(8)}, [{0, 1, 2}, {3, 4, 5}, {6, 7}]),
    (2, range(16), TWO_NODES, [set(range(8)), set(range(8, 16))]),
    (4, range(16), TWO_NODES, [{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}]),
    (1, range(16), TWO_NODES, [set(range(16))]),  # fewer workers than nodes: whole nodes
    # only some cpus usable (a cgroup cpuset): node 1 has 2 of them
    (3, [0, 1, 2, 3, 8, 9], TWO_NODES, [{0, 1}, {2, 3}, {8, 9}]),
    (4, [0, 1, 2, 3, 4, 5, 6, 8], TWO_NODES, [{0, 1, 2}, {3, 4}, {5, 6}, {8}]),
    (2, range(4), {}, [{0, 1}, {2, 3}]),  # no NUMA information
]


@pytest.mark.parametrize(("n", "cpus", "nodes", "expected"), PLANS)
def test_plan(
    n: int, cpus: range | list[int], nodes: dict[int, set[int]], expected: list[set[int]]
) -> None:
    plan = plan_cpu_affinity(n, cpus=cpus, numa_nodes=nodes)
    assert plan == expected
    assert sum(len(s) for s in plan) == len(set().union(*plan))  # disjoint
    assert set().union(*plan) <= set(cpus)


def test_more_workers_than_cpus_share_round_robin(caplog: pytest.LogCaptureFixture) -> None:
    assert plan_cpu_affinity(3, cpus=[0, 1], numa_nodes={}) == [{0}, {1}, {0}]
    assert "share cores" in caplog.text


def test_explicit_pinning_wins_and_is_checked() -> None:
    assert plan_cpu_affinity(2, cpus=range(8), numa_nodes=TWO_NODES, pinned=[[6, 7], [0]]) == [
        {6, 7},
        {0},
    ]
    with pytest.raises(ConfigError, match="pins 1 workers but 2"):
        plan_cpu_affinity(2, cpus=range(8), pinned=[[0]])
    with pytest.raises(ConfigError, match=r"cpus \[9\]"):
        plan_cpu_affinity(1, cpus=range(8), pinned=[[0, 9]])
    with pytest.raises(ConfigError, match="empty"):
        plan_cpu_affinity(1, cpus=range(8), pinned=[[]])


def test_defaults_use_this_process_and_this_machine() -> None:
    plan = plan_cpu_affinity(1)
    assert plan == [set(os.sched_getaffinity(0))]
    with pytest.raises(ValueError):
        plan_cpu_affinity(0)
