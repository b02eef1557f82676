"""A bounded check of an ONNX branch's files, before anything trusts them.

An ONNX branch (``engine: onnxruntime``) is two files the manifest names, each
with its sha256: the decoder graph (``model.onnx``) and its vocabulary
(``tokenizer.gguf``; the layout is ``engines/onnx/layout.py``'s).

:func:`check_onnx` walks ``model.onnx`` as protobuf the way the GGUF check
reads a header: plain bounded reads, never a parse into objects sized by the
file. It descends only into what it checks (the graph, its nodes and their
attributes, subgraphs, initializers, the graph's inputs and outputs) and
skips everything else by its length, so a weight's bytes are never read. It
refuses, in words, a file that is not well-formed protobuf (a field running
past its message, a varint over 10 bytes, groups), an IR version it does not
know, a model without a graph or an opset, absurd counts (fields, nodes,
tensors, dimensions, nesting), an initializer whose dimensions declare more
bytes than it holds (a tensor ORT would allocate from its dimensions), and
**external data** (a tensor whose bytes live in another file) unless the branch
declares that file (:class:`DataFile`: ``model.onnx.data`` beside the graph,
verified by its sha256): then every external tensor must name exactly that file
(its ``location``: not another file, not a path, not ONNX Runtime's in-memory
addresses), with ``offset`` and ``length`` inside it and ``length`` the bytes its
dimensions declare; any other key, or a graph that declares a data file and keeps
nothing in it, is refused too. And it reads
the decoder's interface: ``past_key_values.{i}.key/value`` inputs (layers,
key/value heads, head width, element type) and the ``logits`` width, which
the memory model needs (:class:`OnnxSummary`).

The tokenizer, and both files' check in a child process bounded in time and
memory, are :mod:`quantroute.registry.onnx_pair`'s.

>>> import io
>>> check_onnx_stream(io.BytesIO(b"GGUF"), 4)
Traceback (most recent call last):
...
quantroute.errors.ArtifactIntegrityError: not an ONNX file (protobuf wire type 7)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from quantroute.errors import ArtifactIntegrityError

__all__ = [
    "MAX_FIELDS",
    "DataFile",
    "OnnxSummary",
    "check_onnx",
    "check_onnx_stream",
    "external_location",
]

MAX_FIELDS = 1 << 21  # protobuf fields visited in one file (a real decoder: ~10^5)
MAX_DEPTH = 8  # graphs nested in attributes (If/Loop bodies)
MAX_NODES = 1 << 20
MAX_TENSORS = 1 << 20
MAX_VALUES = 1 << 16  # inputs and outputs of the graph
MAX_DIMS = 16
MAX_ELEMENTS = 1 << 40
MAX_LAYERS = 1 << 12
MAX_NAME = 256  # bytes of an input's or output's name that is read (longer: not ours)
# a sparse tensor's dense elements: ONNX Runtime makes it dense at load, so a few bytes
# of indices could declare gigabytes (2^27 eight-byte elements: 1 GiB)
MAX_SPARSE_ELEMENTS = 1 << 27
# a message field given twice is merged by protobuf (dims concatenated): each copy
# passing alone proves nothing of the merged tensor
_MERGED = "a tensor field given twice (protobuf would merge the copies)"
IR_VERSIONS = range(3, 33)
_CHUNK = 1 << 16

# TensorProto.DataType -> bits per element; 8 (string) has none
_ITEM_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32}
_ITEM_BITS |= {13: 64, 14: 64, 15: 128, 16: 16, 17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4}
_ITEM_BITS |= {23: 4, 24: 8, 25: 2, 26: 2, 27: 6, 28: 6}
_STRING_TYPE = 8
_FLOAT16 = 10
_KV_TYPES = {1: 4, 10: 2, 16: 2}  # float32, float16, bfloat16
_NBITS = b"MatMulNBits"
_PAST = re.compile(r"past_key_values\.(0|[1-9][0-9]{0,3})\.(key|value)")
_PAST_LIKE = re.compile(r"past_key_values\.[0-9]+\.(?:key|value)")  # 00, 007: another name


@dataclass(frozen=True, slots=True)
class OnnxSummary:
    """What the check read of an ONNX decoder (and of its tokenizer, where it was checked
    with it: ``n_ctx_train`` and on are ``0`` when unknown)."""

    ir_version: int
    n_nodes: int
    n_tensors: int
    weights_bytes: int  # the initializers' data
    float16_bytes: int  # ... of which float16
    quantized_matmuls: int  # MatMulNBits nodes (int8/int4 weights in blocks)
    n_layer: int
    n_kv_heads: int  # the most of any layer
    head_dim: int  # the widest of any layer
    kv_bytes_per_token: int  # keys and values of every layer, one token
    kv_element_bytes: int
    n_vocab: int  # the logits' width (0: not fixed in the graph)
    n_ctx_train: int = 0  # from the tokenizer's metadata
    n_head: int = 0
    n_embd: int = 0
    n_ff: int = 0
    keeps_rows: bool = False  # the graph takes logits_to_keep: K rows of logits, not all T


@dataclass(frozen=True, slots=True)
class DataFile:
    """A graph's external data file as the branch declares it: ``name``, the file's name
    in the graph's folder (what every external tensor's ``location`` must be; ``None``:
    whichever one name the graph gives, for :func:`external_location`), and ``size``, its
    verified size in bytes."""

    name: str | None
    size: int


class _Refused(ArtifactIntegrityError):
    pass


class _Source:
    """Bounded reads of a file through a window, at absolute positions."""

    def __init__(self, stream: BinaryIO, size: int):
        self._stream, self.size = stream, size
        self._buf, self._base = b"", 0
        self.fields = 0

    def _window(self, pos: int, n: int) -> tuple[bytes, int]:
        if not (self._base <= pos and pos + n <= self._base + len(self._buf)):
            self._stream.seek(pos)
            self._buf, self._base = self._stream.read(max(n, _CHUNK)), pos
        return self._buf, pos - self._base

    def read(self, pos: int, n: int) -> bytes:
        buf, at = self._window(pos, n)
        data = buf[at : at + n]
        if len(data) != n:
            raise _Refused("the file ends inside a protobuf field (truncated?)")
        return data

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        buf, at = self._window(pos, 10)
        value = shift = 0
        for i in range(10):
            if pos + i >= end or at + i >= len(buf):
                raise _Refused("a protobuf varint runs past its message (truncated or corrupt)")
            byte = buf[at + i]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value, pos + i + 1
            shift += 7
        raise _Refused("a protobuf varint is over 10 bytes long (corrupt)")

    def fields_of(self, start: int, end: int) -> Any:
        """``(field, wire type, value, position)`` of each field of the message in
        ``[start, end)``: a varint's or a fixed field's value, a length-delimited field's
        length (its bytes start at ``position``)."""
        pos = start
        while pos < end:
            self.fields += 1
            if self.fields > MAX_FIELDS:
                raise _Refused(f"over {MAX_FIELDS} protobuf fields (absurd)")
            key, pos = self.varint(pos, end)
            field, wire = key >> 3, key & 7
            if field == 0:
                raise _Refused("a protobuf field numbered 0 (corrupt)")
            if wire == 0:
                value, pos = self.varint(pos, end)
                yield field, wire, value, pos
            elif wire in (1, 5):
                width = 8 if wire == 1 else 4
                if pos + width > end:
                    raise _Refused("a protobuf field runs past its message (truncated or corrupt)")
                raw = self.read(pos, width)
                yield field, wire, int.from_bytes(raw, "little"), pos
                pos += width
            elif wire == 2:
                n, pos = self.varint(pos, end)
                if pos + n > end:
                    raise _Refused("a protobuf field runs past its message (truncated or corrupt)")
                yield field, wire, n, pos
                pos += n
            else:
                raise _Refused(f"not an ONNX file (protobuf wire type {wire})")


@dataclass(slots=True)
class _Walk:
    src: _Source
    nodes: int = 0
    tensors: int = 0
    weights: int = 0
    float16: int = 0
    nbits: int = 0  # MatMulNBits nodes
    # the top graph's inputs and outputs: name -> (element type, dims; -1 = not fixed)
    values: dict[str, tuple[int, list[int]]] | None = None
    data: DataFile | None = None  # the declared external data file (None: none allowed)
    location: str | None = None  # the name the external tensors give it (None: none seen)


def check_onnx(path: Path, data: DataFile | None = None) -> OnnxSummary:
    """Check ``path`` (see the module docstring), its external tensors against ``data``
    (``None``: it may have none); raises :class:`ArtifactIntegrityError`."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            return check_onnx_stream(fh, size, data)
    except OSError as exc:
        raise ArtifactIntegrityError(f"cannot read {path.name}: {exc.strerror}") from exc


def check_onnx_stream(stream: BinaryIO, size: int, data: DataFile | None = None) -> OnnxSummary:
    """:func:`check_onnx` of an open file of ``size`` bytes."""
    walk, ir_version = _walk_model(stream, size, data)
    if data is not None and walk.location is None:
        raise _Refused(
            f"the branch declares the data file {data.name}, and the graph keeps no tensor "
            "in another file"
        )
    return _interface(walk, ir_version)


def external_location(stream: BinaryIO, size: int, data_size: int) -> str | None:
    """The one file name the external tensors of the graph in ``stream`` give (``None``:
    every tensor is inline), each of them checked against a data file of ``data_size``
    bytes: what a worker names the verified data file's link beside the graph
    (``engines/onnx/worker_model.py``). Raises :class:`ArtifactIntegrityError`."""
    return _walk_model(stream, size, DataFile(None, data_size))[0].location


def _walk_model(stream: BinaryIO, size: int, data: DataFile | None) -> tuple[_Walk, int]:
    src = _Source(stream, size)
    walk = _Walk(src, values={}, data=data)
    ir_version, graphs, opsets = -1, 0, 0
    for field, wire, value, pos in src.fields_of(0, size):
        if field == 1 and wire == 0:
            ir_version = value
        elif field == 7 and wire == 2:
            graphs += 1
            if graphs > 1:
                raise _Refused("two graphs in one model")
            _graph(walk, pos, pos + value, depth=0)
        elif field == 8 and wire == 2:
            opsets += 1
        elif field == 25 and wire == 2:  # a function: its nodes may hold tensors
            _function(walk, pos, pos + value)
    if ir_version not in IR_VERSIONS:
        raise _Refused(f"not an ONNX model this server reads (IR version {ir_version})")
    if not graphs or not walk.nodes:
        raise _Refused("no graph (or an empty one)")
    if not opsets:
        raise _Refused("the model imports no operator set")
    return walk, ir_version


def _graph(walk: _Walk, start: int, end: int, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _Refused(f"graphs nested deeper than {MAX_DEPTH} levels")
    for field, wire, value, pos in walk.src.fields_of(start, end):
        if wire != 2:
            continue
        if field == 1:
            walk.nodes += 1
            if walk.nodes > MAX_NODES:
                raise _Refused(f"over {MAX_NODES} nodes (absurd)")
            _node(walk, pos, pos + value, depth)
        elif field == 5:
            _tensor(walk, pos, pos + value)
        elif field == 15:
            _sparse(walk, pos, pos + value)
        elif field in (11, 12) and depth == 0:
            assert walk.values is not None
            if len(walk.values) >= MAX_VALUES:
                raise _Refused(f"the graph has over {MAX_VALUES} inputs and outputs")
            named = _value_info(walk.src, pos, pos + value)
            if named is not None:
                walk.values.setdefault(named[0], named[1])


def _function(walk: _Walk, start: int, end: int) -> None:
    for field, wire, value, pos in walk.src.fields_of(start, end):
        if field == 7 and wire == 2:
            walk.nodes += 1
            if walk.nodes > MAX_NODES:
                raise _Refused(f"over {MAX_NODES} nodes (absurd)")
            _node(walk, pos, pos + value, 1)


def _node(walk: _Walk, start: int, end: int, depth: int) -> None:
    for field, wire, value, pos in walk.src.fields_of(start, end):
        if field == 4 and wire == 2 and value == len(_NBITS):  # op_type
            walk.nbits += walk.src.read(pos, value) == _NBITS
        elif field == 5 and wire == 2:  # an attribute
            single = 0  # its t and sparse_tensor: protobuf merges a repeated one
            for f, w, v, p in walk.src.fields_of(pos, pos + value):
                if w != 2:
                    continue
                if f in (5, 22):
                    single += 1
                    if single > 1:
                        raise _Refused(_MERGED)
                if f in (5, 10):  # t, tensors
                    _tensor(walk, p, p + v)
                elif f in (6, 11):  # g, graphs
                    _graph(walk, p, p + v, depth + 1)
                elif f in (22, 23):  # sparse_tensor(s)
                    _sparse(walk, p, p + v)


def _sparse(walk: _Walk, start: int, end: int) -> None:
    """A sparse tensor: its values and indices as tensors, and its dense shape bounded
    (:data:`MAX_SPARSE_ELEMENTS`): what it becomes when ONNX Runtime loads it."""
    src = walk.src
    elements = 1
    seen = [0, 0, 0]
    for field, wire, value, pos in src.fields_of(start, end):
        if field in (1, 2) and wire == 2:  # values, indices
            seen[field] += 1
            if seen[field] > 1:
                raise _Refused(_MERGED)
            _tensor(walk, pos, pos + value)
        elif field == 3:  # dims, one by one or packed
            dims = [value] if wire == 0 else []
            p = pos
            while wire == 2 and p < pos + value and len(dims) <= MAX_DIMS:
                dim, p = src.varint(p, pos + value)
                dims.append(dim)
            for dim in dims:
                elements *= dim
                if elements > MAX_SPARSE_ELEMENTS:
                    raise _Refused(
                        f"a sparse tensor over {MAX_SPARSE_ELEMENTS} elements once dense"
                    )


def _tensor(walk: _Walk, start: int, end: int) -> None:
    """One tensor: inline data only, and no more elements than its bytes hold."""
    walk.tensors += 1
    if walk.tensors > MAX_TENSORS:
        raise _Refused(f"over {MAX_TENSORS} tensors (absurd)")
    src = walk.src
    dims: list[int] = []
    kind, raw, data, strings = 1, -1, 0, 0
    external: dict[str, str] | None = None  # its external_data entries, when it has any
    for field, wire, value, pos in src.fields_of(start, end):
        if field == 1:
            if wire == 0:
                dims.append(value)
            elif wire == 2:  # packed
                p = pos
                while p < pos + value:
                    dim, p = src.varint(p, pos + value)
                    dims.append(dim)
                    if len(dims) > MAX_DIMS:
                        break
            if len(dims) > MAX_DIMS:
                raise _Refused(f"a tensor with over {MAX_DIMS} dimensions")
        elif field == 2 and wire == 0:
            kind = value
        elif field == 9 and wire == 2:
            raw = value
        elif field in (4, 5, 7, 10, 11):  # float, int32, int64, double, uint64 data
            data += value if wire == 2 else 1
        elif field == 6:
            strings += 1
        elif field == 13 and wire == 2:  # external_data: a key and a value
            external = external if external is not None else {}
            _entry(src, pos, pos + value, external)
        elif field == 13 or (field == 14 and wire == 0 and value == 1):  # data_location
            external = external if external is not None else {}
    elements = 1
    for dim in dims:
        if dim >= 1 << 63:
            raise _Refused("a tensor with a negative dimension")
        elements *= dim
        if elements > MAX_ELEMENTS:
            raise _Refused("a tensor with an absurd number of elements")
    if kind == _STRING_TYPE:
        if elements > strings:
            raise _Refused("a string tensor declares more strings than it holds")
        return
    bits = _ITEM_BITS.get(kind)
    if bits is None:
        raise _Refused(f"a tensor of unknown element type {kind}")
    declared = -(-elements * bits // 8)
    if external is not None:
        if raw >= 0 or data:
            raise _Refused("a tensor keeps its data both in the graph and in another file")
        _external(walk, external, declared)
        data = declared
    elif raw >= 0:
        if raw != declared:
            raise _Refused(
                f"a tensor holds {raw} bytes and its dimensions say {declared}: the file is corrupt"
            )
        data = raw
    elif declared > 8 * data:  # typed fields: no element's bytes are 8 times its wire bytes
        raise _Refused(f"a tensor declares {declared} bytes and holds {data}: the file is corrupt")
    walk.weights += data
    if kind == _FLOAT16:
        walk.float16 += data


_EXTERNAL_KEYS = frozenset({"location", "offset", "length", "checksum"})  # ONNX Runtime's
_MAX_ENTRY = 1024  # bytes of an external_data key or value (a file name, a decimal number)


def _entry(src: _Source, start: int, end: int, into: dict[str, str]) -> None:
    """One external_data entry (a StringStringEntryProto) into ``into``."""
    key = value = ""
    for field, wire, n, pos in src.fields_of(start, end):
        if wire == 2 and field in (1, 2):
            if n > _MAX_ENTRY:
                raise _Refused(f"a tensor's external data entry is over {_MAX_ENTRY} bytes")
            text = src.read(pos, n).decode("utf-8", "replace")
            key, value = (text, value) if field == 1 else (key, text)
    if key not in _EXTERNAL_KEYS:
        raise _Refused(f"a tensor's external data has a key {key[:64]!r} ONNX does not define")
    if key in into:
        raise _Refused(f"a tensor's external data gives its {key} twice")
    into[key] = value


def _external(walk: _Walk, entries: dict[str, str], declared: int) -> None:
    """A tensor whose ``declared`` bytes lie in another file: that file is the declared
    data file, by its exact name, and they lie inside it."""
    data = walk.data
    if data is None:
        raise _Refused(
            "a tensor keeps its data in another file (external data), and the branch "
            "declares no data file (data: {file, sha256} beside the graph)"
        )
    location = entries.get("location", "")
    if not location:
        raise _Refused("a tensor keeps its data in another file and names none")
    wanted = data.name or walk.location or location
    if location != wanted or "/" in location or "\\" in location or location in (".", ".."):
        raise _Refused(
            f"a tensor keeps its data in {location[:64]!r}, not in the declared data file "
            f"{wanted[:64]} beside the graph"
        )
    walk.location = location
    offset, length = _number(entries, "offset", 0), _number(entries, "length", declared)
    if length != declared:
        raise _Refused(
            f"a tensor's external data is {length} bytes and its dimensions say {declared}"
        )
    if offset + length > data.size:
        raise _Refused(
            f"a tensor's external data (bytes {offset} to {offset + length}) lies past the "
            f"end of the data file ({data.size} bytes)"
        )


def _number(entries: dict[str, str], key: str, default: int) -> int:
    text = entries.get(key)
    if text is None:
        return default
    if not text.isascii() or not text.isdigit() or len(text) > 20:
        raise _Refused(f"a tensor's external data {key} is not a number ({text[:32]!r})")
    return int(text)


def _value_info(src: _Source, start: int, end: int) -> tuple[str, tuple[int, list[int]]] | None:
    """A graph input's or output's name, element type and dims (-1 where not fixed)."""
    name: str | None = None
    kind, dims = 0, list[int]()
    for field, wire, value, pos in src.fields_of(start, end):
        if field == 1 and wire == 2 and value <= MAX_NAME:
            name = src.read(pos, value).decode("utf-8", "replace")
        elif field == 2 and wire == 2:  # TypeProto
            for f, w, v, p in src.fields_of(pos, pos + value):
                if f == 1 and w == 2:  # tensor_type
                    kind, dims = _tensor_type(src, p, p + v)
    return None if name is None else (name, (kind, dims))


def _tensor_type(src: _Source, start: int, end: int) -> tuple[int, list[int]]:
    kind, dims = 0, list[int]()
    for field, wire, value, pos in src.fields_of(start, end):
        if field == 1 and wire == 0:
            kind = value
        elif field == 2 and wire == 2:  # TensorShapeProto
            for f, w, v, p in src.fields_of(pos, pos + value):
                if f == 1 and w == 2:
                    if len(dims) >= MAX_DIMS:
                        raise _Refused(f"a graph input with over {MAX_DIMS} dimensions")
                    dim = -1
                    for f2, w2, v2, _ in src.fields_of(p, p + v):
                        if f2 == 1 and w2 == 0 and v2 < 1 << 31:
                            dim = v2
                    dims.append(dim)
    return kind, dims


def _interface(walk: _Walk, ir_version: int) -> OnnxSummary:
    """The decoder's key/value cache and logits, as the graph's inputs declare them."""
    assert walk.values is not None
    layers: dict[int, dict[str, tuple[int, list[int]]]] = {}
    for name, value in walk.values.items():
        if m := _PAST.fullmatch(name):
            layers.setdefault(int(m[1]), {})[m[2]] = value
        elif _PAST_LIKE.fullmatch(name):  # a second name for a layer's cache
            raise _Refused("the past_key_values inputs do not number the layers 0, 1, ...")
    if 0 not in layers or "input_ids" not in walk.values:
        raise _Refused(
            "not a decoder with a key/value cache (no input_ids and past_key_values.0.key inputs)"
        )
    n_layer = len(layers)
    if n_layer > MAX_LAYERS or set(layers) != set(range(n_layer)):
        raise _Refused("the past_key_values inputs do not number the layers 0, 1, ...")
    heads = width = per_token = element = 0
    for i, kv in sorted(layers.items()):
        for part in ("key", "value"):
            kind, dims = kv.get(part, (0, []))
            if kind not in _KV_TYPES or len(dims) != 4 or min(dims[1], dims[3]) < 1:
                raise _Refused(
                    f"past_key_values.{i}.{part} is not a float [batch, heads, past, "
                    "head_dim] input with fixed heads and head_dim"
                )
            element = _KV_TYPES[kind]
            heads, width = max(heads, dims[1]), max(width, dims[3])
            per_token += dims[1] * dims[3] * element
    _, logits = walk.values.get("logits", (0, list[int]()))
    n_vocab = logits[2] if len(logits) == 3 and logits[2] > 0 else 0
    return OnnxSummary(
        ir_version=ir_version,
        n_nodes=walk.nodes,
        n_tensors=walk.tensors,
        weights_bytes=walk.weights,
        float16_bytes=walk.float16,
        quantized_matmuls=walk.nbits,
        n_layer=n_layer,
        n_kv_heads=heads,
        head_dim=width,
        kv_bytes_per_token=per_token,
        kv_element_bytes=element,
        n_vocab=n_vocab,
        keeps_rows="logits_to_keep" in walk.values,
    )
