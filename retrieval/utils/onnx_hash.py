"""What an ONNX model's hash covers: its graph, opsets and weights, never its annotations (docs/INDEX.md, "What
changes a model hash"); and the hash earlier versions recorded, by which a model is still recognised.
``retrieval.onnx_runtime`` hashes every model it opens with these."""

from __future__ import annotations

import json
from typing import Any, Protocol


class PreprocessingIdentity(Protocol):
    """What the hashes read of a model's preprocessing (``retrieval.data.preprocessing.ModelPreprocessing``): a
    sha256 object fed with its identity. Named here, not imported: the helpers sit below the data package."""

    def identity_digest(self) -> Any: ...


# what the model hash covers: changing the scheme changes every model's hash (the old one: ``legacy_model_hash``)
MODEL_HASH_SCHEME = b"retrieval-onnx-model-hash/2"


def proto_model_hash(proto: Any, preprocessing: PreprocessingIdentity) -> str:
    """``onnx_model_hash`` of a loaded model proto: what determines its embeddings (the graph's nodes and wiring, its
    inputs and outputs, opsets, functions and weights) and the preprocessing, never its annotations (docs/INDEX.md,
    "What changes a model hash"). The proto is read, not changed; weights are hashed one tensor at a time."""
    digest = preprocessing.identity_digest()
    digest.update(MODEL_HASH_SCHEME)
    structure = _structure(proto).SerializeToString(deterministic=True)
    digest.update(b"%d:" % len(structure))
    digest.update(structure)
    for tensor in proto.graph.initializer:
        _hash_tensor(digest, tensor)
    return digest.hexdigest()[:16]


def _structure(proto: Any) -> Any:
    """A model proto holding ``proto``'s graph without its weights (the graph's initializers) and without what
    does not change what it computes: node and graph names, doc strings, metadata_props, shape annotations
    (``value_info``), the producer, the IR version. Value names stay: they are the graph's wiring."""
    import onnx

    skeleton = onnx.ModelProto()
    skeleton.opset_import.extend(sorted(proto.opset_import, key=lambda entry: (entry.domain, entry.version)))
    graph, source = skeleton.graph, proto.graph
    for field in ("node", "input", "output", "sparse_initializer", "quantization_annotation"):
        getattr(graph, field).extend(getattr(source, field))
    skeleton.functions.extend(proto.functions)
    _strip_graph(graph)
    for function in skeleton.functions:
        function.ClearField("doc_string")
        function.ClearField("metadata_props")
        function.ClearField("value_info")
        for node in function.node:
            _strip_node(node)
    return skeleton


def _strip_graph(graph: Any) -> None:
    """Annotations out of a graph (a subgraph too), in place."""
    for field in ("name", "doc_string", "metadata_props", "value_info"):
        graph.ClearField(field)
    for value in (*graph.input, *graph.output):
        value.ClearField("doc_string")
        value.ClearField("metadata_props")
    for tensor in graph.initializer:  # a subgraph's own weights (the main graph's are hashed apart)
        _strip_tensor(tensor)
    for node in graph.node:
        _strip_node(node)


def _strip_node(node: Any) -> None:
    """A node's name (nothing refers to it), doc string and metadata (the exporter's stack traces), in place."""
    for field in ("name", "doc_string", "metadata_props"):
        node.ClearField(field)
    for attribute in node.attribute:
        attribute.ClearField("doc_string")
        if attribute.HasField("t"):
            _strip_tensor(attribute.t)
        for tensor in attribute.tensors:
            _strip_tensor(tensor)
        if attribute.HasField("g"):
            _strip_graph(attribute.g)
        for subgraph in attribute.graphs:
            _strip_graph(subgraph)


def _strip_tensor(tensor: Any) -> None:
    tensor.ClearField("doc_string")
    tensor.ClearField("metadata_props")


def _hash_tensor(digest: Any, tensor: Any) -> None:
    """One weight tensor into ``digest``: a self-delimiting header (name, type, shape, size), then its values."""
    if tensor.HasField("raw_data"):
        values = tensor.raw_data  # bytes of this one tensor, little-endian as ONNX stores them
    else:  # values in the typed fields (or, unread, in external files): the tensor without its annotations
        import onnx

        plain = onnx.TensorProto()
        plain.CopyFrom(tensor)
        _strip_tensor(plain)
        plain.ClearField("name")
        values = plain.SerializeToString(deterministic=True)
    header = [tensor.name, int(tensor.data_type), [int(d) for d in tensor.dims], tensor.HasField("raw_data"),
              len(values)]
    digest.update(json.dumps(header).encode())
    digest.update(values)


def legacy_model_hash(proto: Any, preprocessing: PreprocessingIdentity) -> str:
    """The model hash versions before ``MODEL_HASH_SCHEME`` computed and recorded (indexes, declarations, text
    towers): of the proto's serialisation but its model-level metadata, annotations included. Matched, never
    recorded anew. The serialisation is fed to the hash part by part, one weight tensor at a time, never made whole."""
    digest = preprocessing.identity_digest()
    if _unknown_fields(proto) or _unknown_fields(proto.graph):  # no field order to place them by: made whole
        for part in _whole_serialisation(proto):
            digest.update(part)
    else:
        for part in _serialisation_parts(proto):
            digest.update(part)
    return digest.hexdigest()[:16]


def _serialisation_parts(proto: Any) -> Any:
    """``proto.SerializeToString(deterministic=True)`` without its metadata_props, in consecutive parts: a message
    serialises its fields in field-number order, a message field as its key, its length and its fields."""
    before, after = _around(proto, "graph", leave=("metadata_props",))
    yield before
    if proto.HasField("graph"):
        graph = proto.graph
        head, tail = _around(graph, "initializer")
        sizes = [tensor.ByteSize() for tensor in graph.initializer]
        key = _key(graph, "initializer")
        yield _key(proto, "graph") + _varint(len(head) + len(tail) + sum(len(key) + len(_varint(size)) + size
                                                                         for size in sizes))
        yield head
        for tensor, size in zip(graph.initializer, sizes, strict=True):
            yield key + _varint(size)
            yield tensor.SerializeToString(deterministic=True)
        yield tail
    yield after


def _around(message: Any, name: str, leave: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    """The serialisations of ``message``'s fields numbered below and above its field ``name`` (``leave`` left
    out), from copies of those fields only."""
    number = message.DESCRIPTOR.fields_by_name[name].number
    below, above = type(message)(), type(message)()
    for field, value in message.ListFields():
        if field.name == name or field.name in leave:
            continue
        target = below if field.number < number else above
        if field.is_repeated:
            getattr(target, field.name).extend(value)
        elif field.cpp_type == field.CPPTYPE_MESSAGE:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)
    return below.SerializeToString(deterministic=True), above.SerializeToString(deterministic=True)


def _key(message: Any, name: str) -> bytes:
    """The key of a length-delimited field (wire type 2)."""
    return _varint(message.DESCRIPTOR.fields_by_name[name].number << 3 | 2)


def _varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _unknown_fields(message: Any) -> bool:
    from google.protobuf.unknown_fields import UnknownFieldSet

    return len(UnknownFieldSet(message)) > 0


def _whole_serialisation(proto: Any) -> Any:
    """The proto serialised whole, its metadata_props left out (and put back)."""
    metadata = list(proto.metadata_props)
    proto.ClearField("metadata_props")
    try:
        yield proto.SerializeToString(deterministic=True)
    finally:
        proto.metadata_props.extend(metadata)
