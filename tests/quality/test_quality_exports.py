"""``quantroute.quality`` exports exactly its public API."""

from __future__ import annotations

import quantroute.quality as quality


def test_all_names_resolve_once() -> None:
    assert len(set(quality.__all__)) == len(quality.__all__)
    for name in quality.__all__:
        assert getattr(quality, name) is not None, name


def test_every_public_member_is_exported() -> None:
    modules = {"drift", "metrics", "plot", "profile", "profiler", "remote", "runners"}
    public = {n for n in vars(quality) if not n.startswith("_") and n not in modules}
    assert public - {"annotations"} == set(quality.__all__)
