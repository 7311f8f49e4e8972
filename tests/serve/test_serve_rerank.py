"""Re-ranking where searches are answered: ``Index.search(..., rerank=)`` (what `retrieval search`, the API and the
app call) re-orders the filtered, de-duplicated shortlist exactly as ``retrieval.rerank`` says; POST /search and
/search/batch take ``rerank`` (a method name or an object, checked and bounded: 422 naming the choices or the range);
the app's picker re-ranks as the API does; an IVF index gives its vectors back, an index that cannot is a clear
error."""

from __future__ import annotations

import base64

import faiss
import numpy as np
import pytest
from serve_fixtures import BACKENDS

from retrieval.index import Index
from retrieval.index.faiss_backend.faiss_search import NoStoredVectors, reconstructed_vectors
from retrieval.rerank import RERANKERS, RerankConfig, rerank_lists
from retrieval.serve.service import SearchService

pytestmark = pytest.mark.timeout(300)
METHODS = list(RERANKERS)
SERVED_FROM = BACKENDS  # the service's tests on the index folder and on a Milvus collection of it


@pytest.fixture(scope="module")
def index(artifacts):
    with Index.open(artifacts.index_dir) as opened:
        yield opened


@pytest.fixture(scope="module")
def query(index) -> np.ndarray:
    """A query embedding among the gallery's: the first indexed vector, slightly moved."""
    vector = index.reconstructed_vectors(index.ids[:1])[0]
    moved = vector + 0.05 * np.random.default_rng(0).normal(size=vector.shape).astype(np.float32)
    return moved / np.linalg.norm(moved)


def expected_order(index, query: np.ndarray, k: int, config: RerankConfig, exclude=(), where=None) -> list[int]:
    """The ids ``Index.search`` must give: the plain shortlist (after exclusions and filter) re-ranked by hand."""
    plain = index.search(query[None], max(k, config.candidates), exclude_ids=exclude, where=where)[0]
    ids = np.array([[r.id for r in plain]])
    reranked, _ = rerank_lists(query[None], ids, index.reconstructed_vectors, config)
    return reranked[0][:k].tolist()


@pytest.mark.parametrize("method", METHODS)
def test_index_search_re_ranks_the_shortlist_as_the_core_says(index, query, method):
    config = RerankConfig(method=method, candidates=12, k=3, k1=5, k2=2)
    found = index.search(query[None], 8, rerank=config)[0]
    assert [r.id for r in found] == expected_order(index, query, 8, config)
    assert all(r.rerank_score is not None and -1 <= r.score <= 1 for r in found)
    assert "rerank_score" in found[0].to_dict()
    plain = index.search(query[None], 8)[0]
    assert "rerank_score" not in plain[0].to_dict()  # answers without re-ranking are as they were


def test_results_beyond_the_shortlist_keep_their_order(index, query):
    config = RerankConfig(method="kreciprocal", candidates=4, k1=3, k2=2)
    plain = [r.id for r in index.search(query[None], 10)[0]]
    found = index.search(query[None], 10, rerank=config)[0]
    assert sorted(r.id for r in found[:4]) == sorted(plain[:4]) and [r.id for r in found[4:]] == plain[4:]
    assert all(r.rerank_score is None for r in found[4:])


@pytest.mark.parametrize("method", METHODS)
def test_a_filter_and_exclusions_apply_before_the_re_ranking(index, query, method):
    labels = sorted({label for _, label in index.catalogue.labelled()})
    where = f'label in ("{labels[0]}", "{labels[1]}")'
    own = int(index.search(query[None], 1)[0][0].id)
    config = RerankConfig(method=method, candidates=10, k=2, k1=4, k2=2)
    found = index.search(query[None], 6, exclude_ids=(own,), where=where, rerank=config)[0]
    assert found and all(r.label in labels[:2] and r.id != own for r in found)
    assert [r.id for r in found] == expected_order(index, query, 6, config, exclude=(own,), where=where)


def test_a_filter_matching_nothing_or_one_image_answers_sensibly(index, query):
    config = RerankConfig(method="kreciprocal")
    assert index.search(query[None], 5, where="id < 0", rerank=config) == [[]]
    one = int(index.ids[3])
    found = index.search(query[None], 5, where=f"id = {one}", rerank=config)[0]
    assert [r.id for r in found] == [one]


@pytest.mark.parametrize("key", ["Flat", "HNSW16", "IVF4,Flat", "IVF4,SQ8"])
def test_index_types_give_their_candidates_vectors_back(key):
    vectors = np.random.default_rng(1).normal(size=(300, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    built = faiss.index_factory(8, f"IDMap2,{key}", faiss.METRIC_INNER_PRODUCT)
    built.train(vectors)
    built.add_with_ids(vectors, np.arange(300, dtype=np.int64) * 7)
    got = reconstructed_vectors(built, np.array([7, 700, 14]))
    np.testing.assert_allclose(got, vectors[[1, 100, 2]], atol=0.02 if "SQ" in key else 1e-6)


class WithoutReconstruction:
    """An IDMap2-shaped index whose inner index cannot reconstruct vectors (as faiss answers for such types)."""

    def __init__(self) -> None:
        self.index, self.id_map = faiss.IndexLSH(8, 16), None

    def reconstruct_batch(self, ids):
        raise RuntimeError("Error in virtual void faiss::Index::reconstruct_batch: not implemented")


def test_an_index_that_cannot_give_vectors_back_says_how_to_rebuild():
    with pytest.raises(NoStoredVectors, match="with the index key Flat, HNSW32"):
        reconstructed_vectors(WithoutReconstruction(), np.array([1, 2]))


# --- the API -----------------------------------------------------------------------------------------------
def test_post_search_takes_rerank_by_name_or_with_parameters(client, index, query):
    body = {"embedding": query.tolist(), "k": 6}
    plain = client.post("/search", json=body).json()
    assert "rerank" not in plain and all("rerank_score" not in r for r in plain["results"])
    named = client.post("/search", json=body | {"rerank": "qe"}).json()
    # the gallery holds pairs (a typical image has 1 other of its label): k follows it, not the paper's 10
    assert named["rerank"]["method"] == "qe" and named["rerank"]["params"] == {"candidates": 100, "k": 1,
                                                                               "alpha": 3.0}
    assert "has 1 other image" in named["rerank"]["defaults"]
    assert [r["id"] for r in named["results"]] == expected_order(index, query, 6, RerankConfig(method="qe", k=1))
    given = client.post("/search", json=body | {"rerank": {"method": "qe", "k": 10}}).json()["rerank"]
    assert given["params"]["k"] == 10 and "defaults" not in given
    config = {"method": "kreciprocal", "candidates": 15, "k1": 6, "k2": 3, "lambda_value": 0.2}
    answer = client.post("/search", json=body | {"rerank": config})
    assert answer.status_code == 200, answer.text
    assert [r["id"] for r in answer.json()["results"]] == expected_order(index, query, 6, RerankConfig(**config))
    assert all(isinstance(r["rerank_score"], float) for r in answer.json()["results"])
    in_query = client.post("/search?rerank=dba", json=body).json()
    assert [r["id"] for r in in_query["results"]] == expected_order(index, query, 6,
                                                                     RerankConfig(method="dba", k=1))


def test_an_uploaded_image_is_re_ranked_by_the_query_parameter(client, artifacts, service):
    data = artifacts.query_paths[1].read_bytes()
    answer = client.post("/search?k=4&exclude_self=true&rerank=kreciprocal",
                         files={"image": ("q.png", data, "image/png")})
    assert answer.status_code == 200, answer.text
    same = service.search(data, 4, exclude_self=True, rerank=RerankConfig(method="kreciprocal")).to_dict()
    assert answer.json()["results"] == same["results"] and answer.json()["rerank"]["method"] == "kreciprocal"
    assert answer.json()["query_item"]["id"] not in [r["id"] for r in same["results"]]


@pytest.mark.parametrize("method", METHODS)
def test_a_batch_is_re_ranked_query_by_query_as_single_searches_are(client, artifacts, method):
    images = [base64.b64encode(path.read_bytes()).decode() for path in artifacts.query_paths[:3]]
    rerank = {"method": method, "candidates": 10, "k": 3, "k1": 4, "k2": 2}
    batch = client.post("/search/batch", json={"queries": [{"image": image} for image in images], "k": 5,
                                                "exclude_self": True, "rerank": rerank})
    assert batch.status_code == 200, batch.text
    for image, answer in zip(images, batch.json()["results"], strict=True):
        single = client.post("/search?exclude_self=true", json={"image": image, "k": 5, "rerank": rerank}).json()
        assert answer["results"] == single["results"] and answer["rerank"] == single["rerank"]
        own = answer["query_item"]["id"] if answer["query_item"] else None
        assert own not in [r["id"] for r in answer["results"]]


@pytest.mark.parametrize("request_args,message", [
    ({"json": {"rerank": "sift"}}, '"rerank.method" must be one of none, qe, dba, kreciprocal'),
    ({"params": {"rerank": "sift"}}, '"rerank.method" must be one of none, qe, dba, kreciprocal'),
    ({"json": {"rerank": {"method": "qe", "k": 1000}}}, '"rerank.k" must be in [1, 100], got 1000'),
    ({"json": {"rerank": {"method": "qe", "candidates": 10**6}}}, '"rerank.candidates" must be in [1, 1000]'),
    ({"json": {"rerank": {"method": "kreciprocal", "lambda_value": 2}}}, '"rerank.lambda_value" must be in [0, 1]'),
    ({"json": {"rerank": {"method": "qe", "steps": 3}}}, "unknown keys 'steps'"),
    ({"json": {"rerank": 3}}, '"rerank" must be a method name (none, qe, dba, kreciprocal)'),
    ({"json": {"rerank": "qe"}, "params": {"rerank": "dba"}}, '"rerank" differs between the JSON body and the query'),
])
def test_a_bad_rerank_is_a_422_that_names_the_problem(client, query, request_args, message):
    body = {"embedding": query.tolist()} | request_args.get("json", {})
    for path, payload in (("/search", body), ("/search/batch", {"queries": [{"embedding": query.tolist()}]}
                                               | {key: value for key, value in body.items() if key == "rerank"})):
        answer = client.post(path, json=payload, params=request_args.get("params"))
        assert answer.status_code == 422 and message in answer.json()["detail"], (path, answer.text)


def test_the_openapi_document_declares_rerank(client):
    doc = client.get("/openapi.json").json()
    for path in ("/search", "/search/batch"):
        post = doc["paths"][path]["post"]
        schema = post["requestBody"]["content"]["application/json"]["schema"]["properties"]["rerank"]
        name, options = schema["oneOf"]
        assert name["enum"] == ["none", *METHODS] and options["required"] == ["method"]
        assert options["properties"]["candidates"]["maximum"] == 1000
        size, unset = options["properties"]["k"]["anyOf"]  # a whole number in range, or null: the gallery sets it
        assert size == {"type": "integer", "minimum": 1, "maximum": 100} and unset == {"type": "null"}
        assert "set by the gallery's class sizes" in options["properties"]["k"]["description"]
        parameter = next(p for p in post["parameters"] if p["name"] == "rerank")
        assert parameter["schema"]["enum"] == ["none", *METHODS]
    result = doc["components"]["schemas"]["Result"]["properties"]
    assert "rerank_score" in result and "rerank" in doc["components"]["schemas"]["SearchResponseModel"]["properties"]


def test_the_service_refuses_re_ranking_an_index_without_vectors(service, monkeypatch):
    from retrieval.serve.images import QueryError

    def no_vectors(ids):
        raise NoStoredVectors("this index (IndexLSH) cannot give back the vectors of its results")

    state = service.current()
    monkeypatch.setattr(state.index, "reconstructed_vectors", no_vectors)
    with pytest.raises(QueryError) as caught:
        service.search(np.ones(state.dim, np.float32), 3, rerank=RerankConfig(method="qe"))
    assert caught.value.status == 422 and "IndexLSH" in str(caught.value)


# --- the app -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def search_tab(service, tmp_path_factory):
    import gradio as gr

    from retrieval.serve.ui.search import ExampleSet, SearchTab
    from retrieval.serve.upload_cache import UploadRecords

    return SearchTab(service, ExampleSet(service, tmp_path_factory.mktemp("examples"), count=0),
                     UploadRecords(gr.Blocks()))


@pytest.mark.parametrize("method", METHODS)
def test_the_apps_picker_re_ranks_as_the_api_does(search_tab, artifacts, client, tmp_path, method):
    path = tmp_path / "query.png"
    path.write_bytes(artifacts.query_paths[1].read_bytes())
    search_tab.uploads.blocks.upload_file_set.add(str(path))  # as Gradio's upload route records it
    items, status, _ = search_tab.search({"path": str(path)}, 5, None, None, method)
    assert f"Re-ranked by **{RERANKERS[method].title}**" in status, status
    sizes = {"qe": "k = 1", "dba": "k = 1", "kreciprocal": "k1 = 3, k2 = 1"}[method]  # from the gallery's pairs
    assert f"{sizes} (sizes from the gallery: a typical image's label has 1 other image" in status, status
    api = client.post(f"/search?k=5&exclude_self=true&rerank={method}",
                      files={"image": ("q.png", path.read_bytes(), "image/png")}).json()
    assert [caption.split(" · ")[-1] for _, caption in items] == [r["path"] for r in api["results"]]


def test_the_app_refuses_an_unknown_re_ranking(search_tab):
    items, status, _ = search_tab.search(None, 3, None, None, "sift")
    assert items == [] and "re-ranking must be one of none, qe, dba, kreciprocal" in status


def test_the_service_search_without_rerank_is_unchanged(artifacts):
    """A fresh service answers a plain search with no rerank block (what clients saw before)."""
    with_service = SearchService(artifacts.index_dir, reload_interval_s=None)
    try:
        answer = with_service.search(artifacts.query_paths[0].read_bytes(), 3).to_dict()
        assert "rerank" not in answer and all("rerank_score" not in r for r in answer["results"])
    finally:
        with_service.close()
