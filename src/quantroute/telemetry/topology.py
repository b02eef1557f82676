"""How devices are connected: pairwise links, nearest first.

The vocabulary is ``nvidia-smi topo -m``'s: NV# (bonded NVLinks), PIX (at most
one PCIe bridge), PXB (several PCIe bridges), PHB (through a PCIe host
bridge), NODE (between host bridges in one NUMA node), SYS (across the SMP
interconnect between NUMA nodes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum


class LinkKind(StrEnum):
    """A link between two devices, ordered by :attr:`rank` (0 = nearest)."""

    SELF = "self"
    NVLINK = "nvlink"
    PIX = "pix"
    PXB = "pxb"
    PHB = "phb"
    NODE = "node"
    SYS = "sys"
    UNKNOWN = "unknown"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {kind: i for i, kind in enumerate(LinkKind)}


@dataclass(frozen=True, slots=True)
class Link:
    """The link between ``a`` and ``b`` (stored with ``a < b``); ``nvlinks`` counts bonded links."""

    a: str
    b: str
    kind: LinkKind
    nvlinks: int = 0


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


@dataclass(frozen=True, slots=True)
class Topology:
    """Symmetric pairwise links between device ids. Immutable; build with :meth:`from_links`.

    >>> topo = Topology.from_links([Link("cuda:0", "cuda:1", LinkKind.NVLINK, 12)])
    >>> topo.link("cuda:1", "cuda:0"), topo.link("cuda:0", "cuda:2")
    (<LinkKind.NVLINK: 'nvlink'>, <LinkKind.UNKNOWN: 'unknown'>)
    """

    links: tuple[Link, ...] = ()
    _by_pair: dict[tuple[str, str], Link] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        by_pair = {_key(link.a, link.b): link for link in self.links}
        object.__setattr__(self, "_by_pair", by_pair)

    @classmethod
    def from_links(cls, links: Iterable[Link]) -> Topology:
        """Normalise each link to ``a < b``, drop self links, last one for a pair wins."""
        pairs: dict[tuple[str, str], Link] = {}
        for link in links:
            if link.a == link.b:
                continue
            a, b = _key(link.a, link.b)
            pairs[(a, b)] = Link(a, b, link.kind, link.nvlinks)
        return cls(tuple(pairs[k] for k in sorted(pairs)))

    def link(self, a: str, b: str) -> LinkKind:
        """The link kind between two devices; ``self`` for one device, ``unknown`` if not known."""
        if a == b:
            return LinkKind.SELF
        found = self._by_pair.get(_key(a, b))
        return found.kind if found else LinkKind.UNKNOWN

    def nvlinks(self, a: str, b: str) -> int:
        """How many NVLinks join ``a`` and ``b`` (0 when none or unknown)."""
        found = self._by_pair.get(_key(a, b))
        return found.nvlinks if found else 0

    def devices(self) -> list[str]:
        """Every device id named in a link, sorted."""
        return sorted({link.a for link in self.links} | {link.b for link in self.links})

    def __iter__(self) -> Iterator[Link]:
        return iter(self.links)

    def __len__(self) -> int:
        return len(self.links)
