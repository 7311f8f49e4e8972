"""`retrieval search`: the k most similar gallery images to each query image, or to each description (--text, through
the index's text model), from an index folder (and re-ranked, with --rerank)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from retrieval.cli.config_options import command_option, command_options
from retrieval.cli.errors import OptionCommand, where_problem
from retrieval.cli.index_common import gallery_root_option
from retrieval.cli.index_options import IndexOptions
from retrieval.cli.options import rerank_config, rerank_options


def _check_k(_ctx: click.Context, _param: click.Parameter, k: int) -> int:
    """-k within the range every search accepts (``retrieval.index.search.check_k``), before the model loads."""
    from retrieval.index.search import check_k

    try:
        return check_k(k)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _check_where(_ctx: click.Context, _param: click.Parameter, where: str | None):
    """--where parsed before the index and the model load (``retrieval.index.filters``)."""
    if where is None:
        return None
    from retrieval.index.filters import FilterError, parse_filter

    try:
        return parse_filter(where)
    except FilterError as exc:
        raise click.BadParameter(where_problem(exc)) from exc


def _where_summary(index, matching: int) -> str:
    """How many indexed images --where matches; for none, how paths and labels are compared, with the index's own."""
    summary = f"--where matches {matching} of {len(index)} indexed images"
    if matching or not len(index):
        return summary
    return f"{summary}: no image matches, so every result list is empty. {index.filter_table.no_match_hint()}"


def _check_texts(_ctx: click.Context, _param: click.Parameter, texts: tuple[str, ...]) -> tuple[str, ...]:
    """Each --text bounded as the API bounds a text query (``retrieval.text.tokens.check_query_text``), before any
    model loads."""
    from retrieval.text.tokens import check_query_text

    try:
        return tuple(check_query_text(text) for text in texts)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


QUERY_BATCH = 32  # queries decoded and embedded together, so that a folder's images are never all held at once


@click.command("search", cls=OptionCommand)
@command_options(IndexOptions, "search_index", "search_milvus", "search_collection")
# No existence check here: a query that cannot be opened is answered with its reason, as an undecodable one is.
@click.argument("images", nargs=-1, required=False, type=click.Path())
@command_option(IndexOptions, "texts", callback=_check_texts)
@command_option(IndexOptions, "results", callback=_check_k)
@command_options(IndexOptions, "max_queries", "recorded_model", "search_text_model", "exclude_self")
@command_option(IndexOptions, "where", callback=_check_where)
@command_option(IndexOptions, "search_gpu")
@gallery_root_option
@command_option(IndexOptions, "search_json")
@rerank_options
def search_command(index_dir, milvus, collection, images, texts, k, max_queries, model, text_model, exclude_self,
                   where, gpu, gallery_root, as_json, **options) -> None:
    """Find the k most similar gallery images to each query IMAGE (a folder: every image in it, recursively, sorted
    by path), or to each --text description. A query that cannot be read is named with the reason, the others are
    answered, and the command then exits with status 1. --rerank re-orders each query's shortlist (docs/INDEX.md,
    "Re-ranking")."""
    from retrieval.index import ModelMismatchError
    from retrieval.index.display_columns import display_text
    from retrieval.index.milvus.milvus_collection import MilvusError
    from retrieval.index.searchable.opening import open_searchable
    from retrieval.index.sources import printable_path
    from retrieval.rerank import gallery_filled

    rerank = rerank_config(options)
    _check_query_kind(images, texts, text_model, exclude_self, max_queries)
    queries = _query_list(images, max_queries) if images else []
    _check_served(index_dir, milvus, collection, gpu)
    try:
        opened = open_searchable(index_dir, milvus, collection, model=model, gallery_root=gallery_root, gpu=gpu)
    except ModelMismatchError as exc:
        raise click.ClickException(f"{exc}: retrieval index upgrade {shlex.quote(str(index_dir))} --model "
                                   f"{shlex.quote(str(model))}") from exc
    except MilvusError as exc:  # no such collection, or a URI or name refused before connecting
        raise click.ClickException(str(exc)) from None
    with opened as index:
        if where is not None:
            matching = len(index.matching_ids(where))  # a column the index lacks fails here, before embedding
            if not as_json:
                click.echo(_where_summary(index, matching))
        # the sizes not given follow the gallery (docs/INDEX.md, "Neighbourhood sizes")
        rerank, defaults = gallery_filled(rerank, index.rerank_neighbourhood)
        if texts:
            answers = _text_answers(index, texts, text_model, k, where, rerank)
        else:
            answers = _answers(index, queries, k, exclude_self, where, rerank)
    if as_json:
        click.echo(json.dumps(answers, indent=2))
    else:
        for answer in answers:
            click.echo(json.dumps(answer["query"], ensure_ascii=False) if texts
                       else printable_path(answer["query"], limit=None))
            if "error" in answer:
                click.echo(f"  cannot search with it: {answer['error']}")
                continue
            if answer.get("no_match"):
                shown = json.dumps(answer["query"], ensure_ascii=False)[1:-1]  # escaped: one printable line
                click.echo(f"  no good match for '{shown}'; the nearest:")
            if answer.get("excluded_self") is not None:
                click.echo(f"  (left out: id={answer['excluded_self']}, the query itself)")
            if rerank.active:
                sizes = ", ".join(f"{name} = {value}" for name, value in rerank.params().items()
                                  if name != "candidates")
                chosen = f"; the sizes not given from the gallery: {defaults}" if defaults else ""
                click.echo(f"  re-ranked by {rerank.method}, the top {rerank.candidates} ({sizes}{chosen}); score = "
                           "cosine, then the re-ranking's score")
            for rank, r in enumerate(answer["results"], 1):  # names may hold newlines or bytes that are not UTF-8
                label = None if r["label"] is None else printable_path(r["label"], limit=None)
                path = printable_path(r["path"], limit=None)
                shown = display_text(r.get("columns"))  # the title and price where the index shows columns
                reranked = f"  {r['rerank_score']:+.4f}" if "rerank_score" in r else ""
                reranked += f"  {r['source']:<7}" if "source" in r else ""  # a text query's: keyword, vector, both
                click.echo(f"  {rank:3d}  {r['score']:+.4f}{reranked}  id={r['id']}  label={label}  "
                           + (f"{shown}  ({path})" if shown else path))
    failed = [a for a in answers if "error" in a]
    if failed:
        shown = ", ".join(printable_path(a["query"]) for a in failed[:3])
        raise click.ClickException(f"{len(failed)} of {len(answers)} queries could not be read ({shown}); the "
                                   "others were answered above")


def _check_served(index_dir: str | None, milvus: str | None, collection: str | None, gpu: bool) -> None:
    """The options that name what is searched go together: --index FOLDER, or --milvus URI and --collection NAME
    (without --index or --gpu)."""
    context = click.get_current_context(silent=True)
    if milvus is None and collection is None:
        if index_dir is None:
            raise click.UsageError("give the index to search: --index FOLDER, or --milvus URI --collection NAME",
                                   ctx=context)
        return
    if milvus is None or collection is None:
        raise click.UsageError("give --milvus URI and --collection NAME together", ctx=context)
    if index_dir is not None or gpu:
        raise click.UsageError(f"--milvus searches the collection, not {'--index' if index_dir else '--gpu'}: leave "
                               "it out", ctx=context)


def _check_query_kind(images: tuple[str, ...], texts: tuple[str, ...], text_model: str | None, exclude_self: bool,
                      max_queries: int) -> None:
    """One kind of query per search: images, or --text descriptions (with what only those take)."""
    context = click.get_current_context(silent=True)
    if images and texts:
        raise click.UsageError("give query IMAGEs or --text descriptions, not both: run one search for each",
                               ctx=context)
    if not images and not texts:
        raise click.UsageError("give a query IMAGE (or a folder of them), or --text 'what you are looking for'",
                               ctx=context)
    if images and text_model is not None:
        raise click.UsageError("--text-model embeds --text descriptions; image queries are embedded by the image "
                               "model (--model): leave it out, or search with --text", ctx=context)
    if texts and exclude_self:
        raise click.UsageError("--exclude-self leaves out the gallery image a query image is; a --text query is no "
                               "gallery image: leave it out", ctx=context)
    if len(texts) > max_queries:
        raise click.UsageError(f"{len(texts)} --text queries: more than --max-queries {max_queries}", ctx=context)


def _text_answers(index, texts: tuple[str, ...], text_model: str | None, k: int, where=None,
                  rerank=None) -> list[dict]:
    """Each --text query's answer, in order (``retrieval.text.text_search``): embedded by the text model
    (``text_model``, else the one index.json records; checked against the index's image model) and searched as an
    embedding is, fused with the keyword index's hits where the index has one (alone where it has no text model)."""
    from retrieval.text.no_match import read_floor
    from retrieval.text.text_index import has_text_model, open_text_model
    from retrieval.text.text_onnx import TextEmbeddingError
    from retrieval.text.text_search import search_text
    from retrieval.text.tokens import WordlessText

    root = index.root
    keywords = index.keywords  # the folder's FTS5 file, or a collection's BM25 search
    text = None if keywords is not None and text_model is None and not has_text_model(index.info) else \
        open_text_model(index.info, root, text_model, image_model=lambda: index.embedder)
    floor = read_floor(index.info, None if text is None else text.model_hashes, shlex.quote(str(root)))
    try:
        if text is not None:
            text.query_tokens(list(texts))  # every query has a word to search by, before any is searched
    except WordlessText as exc:
        raise click.BadParameter(str(exc), param_hint="'--text'") from None
    answers = []
    for start in range(0, len(texts), QUERY_BATCH):
        batch = list(texts[start:start + QUERY_BATCH])
        try:
            vectors = None if text is None else text.embed(batch)
        except TextEmbeddingError as exc:
            raise click.ClickException(str(exc)) from None
        found = search_text(index, batch, k, vectors, keywords, where=where, rerank=rerank)
        for query, results in zip(batch, found, strict=True):
            answers.append({"query": query, "results": [
                r.to_dict() | {"path": index.public_path(r.path), "file": index.image_file(r.path)}
                for r in results]} | floor.answer_field(results))
    if floor.problem is not None and text is not None:
        click.echo(f"note: no \"no good match\" floor for these queries: {floor.problem}", err=True)
    return answers


def _query_list(images: tuple[str, ...], max_queries: int) -> list[tuple[str, str | None]]:
    """The query files in order, each with the reason it cannot be searched (None: not known yet); a folder gives its
    images, found as the index builder finds them and sorted by path. Refuses more than ``max_queries``."""
    from retrieval.data.formats import IMAGE_EXTENSIONS
    from retrieval.index.sources import printable_path, walk_folder

    queries: list[tuple[str, str | None]] = []
    for image in images:
        folder = Path(image)
        if not _is_folder(folder):
            queries.append((image, None))  # opened later: a missing or unreadable file is answered with its reason
        else:
            gallery = walk_folder(folder, limit=max_queries - len(queries))
            found = sorted(item.path for item in gallery.items)
            queries.extend((path, None) for path in found)
            queries.extend((error.path, error.error) for error in gallery.errors)
            if not found and not gallery.errors:
                extensions = ", ".join(sorted(IMAGE_EXTENSIONS))
                queries.append((image, f"a folder with no image in it (searched recursively for {extensions}); "
                                       "give a folder that holds images, or image files"))
        if len(queries) > max_queries:
            raise click.UsageError(
                f"more than {max_queries} query images (counting the images in {printable_path(image)}): pass fewer "
                "images or a smaller folder, or raise --max-queries", ctx=click.get_current_context(silent=True))
    return queries


def _is_folder(path: Path) -> bool:
    """Whether a query names a folder; a path that cannot even be looked at is left to the open that names why."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _open_problem(exc: OSError) -> str:
    """Why a query file could not be opened, and what to do about it."""
    if isinstance(exc, FileNotFoundError):
        return "no such file; check the path"
    if isinstance(exc, PermissionError):
        return "not readable (permission denied); make it readable by this user"
    return f"cannot be opened ({exc.strerror or exc}); check that it is a readable image file"


def _answers(index, queries: list[tuple[str, str | None]], k: int, exclude_self: bool, where=None,
             rerank=None) -> list[dict]:
    """Each query's answer, in order: its results (and the id left out as the query itself), or the reason it
    cannot be searched. Each file is opened once (hashed, then decoded and prepared for the model, as the index
    builder does) in decoding threads, the next ``QUERY_BATCH`` while the model embeds these."""
    from concurrent.futures import ThreadPoolExecutor

    from retrieval.data.eval_preprocess import EvalPreprocess
    from retrieval.utils.workers import default_decode_threads

    if not any(problem is None for _, problem in queries):
        return [{"query": _resolved(query), "error": problem} for query, problem in queries]
    prepare = EvalPreprocess(index.embedder.preprocessing)
    answers = []
    with ThreadPoolExecutor(default_decode_threads(), thread_name_prefix="decode") as pool:
        def submit(start: int) -> list:
            return [pool.submit(_read_query, query, problem, prepare) for query, problem in
                    queries[start:start + QUERY_BATCH]]

        pending = submit(0)
        for start in range(0, len(queries), QUERY_BATCH):
            read = [future.result() for future in pending]
            pending = submit(start + QUERY_BATCH)
            answers.extend(_answer_batch(index, read, k, exclude_self, where, rerank))
    return answers


def _read_query(query: str, problem: str | None, prepare) -> tuple[dict, str | None, object]:
    """(answer so far, sha256, the image prepared for the model), or the answer with the reason it cannot be read."""
    from retrieval.data.decode import ImageDecodeError, open_regular_file, read_image
    from retrieval.index.embedding.gallery_file import file_digest

    answer = {"query": _resolved(query)}
    if problem is not None:
        return answer | {"error": problem}, None, None
    try:
        with open_regular_file(query) as handle:
            sha256, _ = file_digest(handle)
            handle.seek(0)
            image = read_image(handle).image
        return answer, sha256, prepare(image)
    except ImageDecodeError as exc:
        return answer | {"error": str(exc)}, None, None
    except OSError as exc:
        return answer | {"error": _open_problem(exc)}, None, None


def _answer_batch(index, read: list[tuple[dict, str | None, object]], k: int, exclude_self: bool, where=None,
                  rerank=None) -> list[dict]:
    """``_answers`` for one batch of queries read by ``_read_query``: embedded together and searched."""
    import numpy as np

    answers = [answer for answer, _, _ in read]
    readable = [(answer, sha256, array) for answer, sha256, array in read if "error" not in answer]
    embeddings = index.embedder.embed(np.stack([array for _, _, array in readable])) if readable else []
    for (answer, sha256, _), embedding in zip(readable, embeddings, strict=True):
        row = index.indexed_by_sha256(sha256) if exclude_self else None
        excluded = None if row is None else int(row["id"])
        found = index.search(embedding[None], k, exclude_ids=() if excluded is None else (excluded,), where=where,
                             rerank=rerank)[0]
        # path: the spelling --where, index remove, the API and the app use; file: where it lies on this machine
        # (its gallery may have moved; None: a path the moved gallery has no place for)
        results = [r.to_dict() | {"path": index.public_path(r.path), "file": index.image_file(r.path)} for r in found]
        answer.update(results=results, excluded_self=excluded)
    return answers


def _resolved(query: str) -> str:
    """The query's absolute path as the answer names it; a path that cannot be resolved (a symlink loop) as given."""
    try:
        return str(Path(query).resolve())
    except (OSError, RuntimeError):
        return str(Path(query).absolute())
