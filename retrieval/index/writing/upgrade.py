"""``retrieval index upgrade``: re-embed an index's gallery with a new model while servers keep answering.

Two ways, chosen by what the new model declares (``query_embedder.is_compatible``):

* mixed, for a model declared compatible with the index's (trained with ``--compatible-with`` it): index.json
  names the new model at once, so queries are embedded by it and compared with the gallery's old vectors, which
  backward-compatible training makes sound (Shen et al., BCT, CVPR 2020: new queries against the old gallery do at
  least as well as old against old). The gallery is then re-embedded batch by batch, each batch published under the
  writer lock (catalogue, faiss, index.json), so a server swaps in every step and its answers improve as the share
  re-embedded grows. The order is random by default: measured on two data sets (docs/RESULTS.md), it beat
  ``order="uncertain"``, the least certain old embeddings first (the idea of FastFill, Jaeckle et al., ICLR 2023,
  with an uncertainty read off the old embeddings' neighbours: ``uncertainty_order``), because the re-embedded
  vectors draw the new queries, and re-embedding first the images whose neighbourhoods are mixed puts exactly
  those in front.
* swap, for any other model: the new vectors are written beside the old ones while the index, untouched, keeps
  answering with the old model; once all are embedded, one publish under the writer lock points the catalogue at
  them, builds faiss afresh (a new embedding size is fine) and names the new model, and a server swaps the new
  state in at once.

A model declared compatible whose own embedding has another size than the index's reaches the old space through
its compatible output (a projection trained with it, ``--compatible-with`` an old model of another size): the
upgrade is mixed with that output, and index.json records it (``model_output``, ``model_output_space``), so that
the model keeps searching and adding with it. ``native=True`` (``--native``) re-embeds into the model's own space
instead: a swap, faiss rebuilt in the new size (also from an index its compatible output upgraded).

Every answer stays complete: each indexed image has exactly one vector in faiss at every moment. Resumable after
kill -9: new vectors go to new shards (numbered after ``upgrade_first_shard``, recorded when the upgrade starts),
so a row whose catalogue shard is older still holds an old vector and is re-embedded by the next run; a publish
marks the catalogue stale before it moves the rows and clears the mark once faiss and index.json follow, and a run
that finds the mark rebuilds faiss from the shards first. One upgrade at a time (``IndexLayout.upgrade_lock``);
other writers are refused until it has finished (``records.require_complete``). When it ends, index.json and the
catalogue name the new model and every shard no indexed row uses (the old vectors) is deleted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from retrieval.compatibility import COMPATIBLE, compatibility_sentence, int8_record, recorded_compatibility
from retrieval.errors import ParameterError
from retrieval.index.catalogue import UPGRADE_MODEL_PATH, Catalogue, Outcome, Status
from retrieval.index.embedding.embed_rows import RowEmbedder
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.faiss_backend import faiss_files, faiss_params
from retrieval.index.faiss_backend.faiss_build import build_faiss, update_faiss
from retrieval.index.layout import IndexLayout
from retrieval.index.portable import MODEL_RELATIVE, find_model, relative_to_index
from retrieval.index.query_embedder import (
    EMBEDDINGS_SOURCE,
    LEGACY_MODEL_KEY,
    OUTPUT_FIELDS,
    PARENT_MODEL_KEY,
    ImageEmbedder,
    NoModelError,
    built_without_model,
    compatible_view,
    hash_matches,
    is_compatible,
    load_model,
    output_fields,
    same_output,
    with_output,
)
from retrieval.index.shards import SHARD_PATTERN, ShardStore
from retrieval.index.vectors import done_chunks
from retrieval.index.writing.mend import mend
from retrieval.index.writing.records import meta_values, model_fields, relocate, require_complete
from retrieval.index.writing.upgrade_checks import check_record, check_upgrade, text_off
from retrieval.index.writing.upgrade_text import text_sentence
from retrieval.records.index_info import IndexInfo
from retrieval.text.text_index import has_text_model
from retrieval.utils.progress import progress_bar
from retrieval.utils.workers import default_decode_threads

log = logging.getLogger(__name__)

ORDERS = ("uncertain", "id", "random")
DEFAULT_COMMIT_EVERY = 4096  # images re-embedded between two publishes of a mixed upgrade
NEIGHBOURS = 10  # old neighbours that measure how certain an old embedding is
MODEL_META = ("model_path", MODEL_RELATIVE, "model_hash", LEGACY_MODEL_KEY, "source_model_hash", PARENT_MODEL_KEY,
              "embedding_dim", "model_normalized", "similarity", *OUTPUT_FIELDS)
UPGRADE_MODEL_RELATIVE = "upgrade_model_path_relative"  # the new model's path from the index folder (it may move)
CHECKS = "upgrade_checks"  # what was checked before the upgrade began (verdict, labels, --force), for its end
UPGRADE_META = ("upgrade_model_hash", UPGRADE_MODEL_PATH, UPGRADE_MODEL_RELATIVE, "upgrade_mode", "upgrade_from",
                "upgrade_first_shard", "upgrade_model_output", CHECKS)
STALE = "upgrade_stale"  # set while a publish has moved catalogue rows that faiss does not hold yet


def shard_number(name: str) -> int:
    """The sequence number of a shard file name (``shard-000012.npz`` -> 12)."""
    match = SHARD_PATTERN.match(name)
    if match is None:
        raise ValueError(f"not a shard file name: {name!r}")
    return int(match.group(1))


def next_shard_number(store: ShardStore) -> int:
    names = store.names()
    return shard_number(names[-1]) + 1 if names else 0


def uncertainty_order(ids: np.ndarray, scores: np.ndarray, found: np.ndarray,
                      labels: Mapping[int, str | None]) -> np.ndarray:
    """``ids`` least certain old embedding first, from each one's nearest old neighbours (``found`` [n, k] ids,
    -1 for none, ``scores`` their similarities; its own id, wherever it appears, is left out): with labels, the
    share of its ``NEIGHBOURS`` nearest that carry its label, ties broken by their mean similarity; without, the
    mean similarity alone (an isolated embedding is the least settled); then by id."""
    agreement, closeness = [], []
    for row_id, row_scores, row_found in zip(ids.tolist(), scores.tolist(), found.tolist(), strict=True):
        others = [(s, f) for s, f in zip(row_scores, row_found, strict=True) if f >= 0 and f != row_id][:NEIGHBOURS]
        own = labels.get(row_id)
        same = [labels.get(f) == own for _, f in others] if own is not None else []
        agreement.append(float(np.mean(same)) if same else 1.0)
        closeness.append(float(np.mean([s for s, _ in others])) if others else 1.0)
    return np.asarray(ids, dtype=np.int64)[np.lexsort((np.asarray(ids), np.asarray(closeness), np.asarray(agreement)))]


def backfill_order(store: ShardStore, catalogue: Catalogue, faiss_index: faiss.Index, ids: np.ndarray,
                   order: str, seed: int = 0) -> np.ndarray:
    """``ids`` in the order to re-embed them: ``uncertain`` (``uncertainty_order``, the neighbours found by the
    index itself at its tuned search cost), ``id`` (catalogue order) or ``random`` (seeded shuffle)."""
    ids = np.asarray(ids, dtype=np.int64)
    if order == "id" or len(ids) < 2:
        return np.sort(ids)
    if order == "random":
        return np.random.default_rng(seed).permutation(np.sort(ids))
    if order != "uncertain":
        raise ParameterError("order", f"must be one of {', '.join(ORDERS)}, got {order!r}")
    done = catalogue.done_shards()
    wanted = {int(i): done[int(i)] for i in ids if int(i) in done}
    k = min(NEIGHBOURS + 1, int(faiss_index.ntotal))
    parts_ids, parts_scores, parts_found = [], [], []
    for chunk_ids, vectors in done_chunks(store, wanted):
        scores, found = faiss_index.search(vectors, k)
        parts_ids.append(chunk_ids)
        parts_scores.append(scores)
        parts_found.append(found)
    if not parts_ids:
        return np.zeros(0, np.int64)
    all_ids, found = np.concatenate(parts_ids), np.concatenate(parts_found)
    rows = catalogue.rows(np.union1d(all_ids, found[found >= 0]).tolist())
    return uncertainty_order(all_ids, np.concatenate(parts_scores), found,
                             {i: row["label"] for i, row in rows.items()})


def _record_model(catalogue: Catalogue, embedder: ImageEmbedder, model_path: str | None, index_root: Path) -> None:
    """The catalogue's model fields become ``embedder``'s (those it lacks, e.g. an output space, are cleared)."""
    fields = model_fields(embedder, model_path, index_root)
    catalogue.set_meta(**meta_values({key: fields.get(key) for key in MODEL_META}))
    catalogue.delete_meta(*(key for key in MODEL_META if fields.get(key) is None))


def _with_model(info: IndexInfo, *parts: Mapping[str, Any]) -> IndexInfo:
    """``info`` updated by ``parts``; an output field that became None (the model's own output) is left out."""
    merged = info.with_fields({key: value for part in parts for key, value in part.items()})
    return merged.without(*(key for key in OUTPUT_FIELDS if merged.holds(key) and merged.value_of(key) is None))


def upgrade_target(embedder: ImageEmbedder, info: IndexInfo, native: bool = False) -> ImageEmbedder:
    """The output an upgrade re-embeds with: the one that reaches the index's space (``compatible_view``: mixed),
    else, or with ``native``, the model's own (a swap into its own space and size)."""
    model = with_output(embedder, None)
    view = None if native else compatible_view(model, info)
    return view if view is not None else model


def _old_rows(catalogue: Catalogue, first_shard: int) -> np.ndarray:
    """Ids of the indexed rows whose vector is still in a shard older than the upgrade (an old model's)."""
    return np.asarray(sorted(i for i, shard in catalogue.done_shards().items() if shard_number(shard) < first_shard),
                      dtype=np.int64)


def _publish(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, info: IndexInfo,
             outcomes: list[Outcome], final_fields: dict[str, Any] | None, rebuild: bool,
             options: IngestOptions) -> IndexInfo:
    """Point the catalogue at the new vectors of ``outcomes`` (recorded with their shard), bring faiss in line and
    write index.json; ``final_fields`` (the new model's) end the upgrade. Caller holds the writer lock."""
    catalogue.set_meta(**{STALE: "1"})
    catalogue.record(outcomes)
    changed = np.asarray([o.id for o in outcomes], dtype=np.int64)
    if rebuild:
        key = info.requested_index_key
        dim = int(final_fields["embedding_dim"] if final_fields else info.value_of("embedding_dim"))
        faiss_fields = build_faiss(layout, catalogue, store, key, dim, policy=options.policy)
    else:
        faiss_fields = update_faiss(layout, catalogue, store, info, changed=changed, policy=options.policy)
        faiss_fields.pop("updated_by", None)
    info = _with_model(info, faiss_fields, final_fields or {})
    if info.holds("upgrade"):  # how many images still hold an old vector, for stats and the app
        first = int(catalogue.get_meta("upgrade_first_shard") or 0)
        info = info.with_fields({"upgrade": {**info.upgrade.under_way, "left": len(_old_rows(catalogue, first))}})
    layout.write_info(info)
    catalogue.delete_meta(STALE)
    return info


def _delete_unused_shards(catalogue: Catalogue, store: ShardStore) -> int:
    """Delete every shard no indexed row takes its vector from (the old model's); returns how many."""
    used = set(catalogue.done_shards().values())
    unused = [name for name in store.names() if name not in used]
    catalogue.forget_shards(unused)
    for name in unused:
        (store.folder / name).unlink(missing_ok=True)
    return len(unused)


def upgrade_index(
    index_dir: str | Path,
    model: str | Path | None = None,
    embedder: ImageEmbedder | None = None,
    order: str = "random",
    commit_every: int = DEFAULT_COMMIT_EVERY,
    options: IngestOptions | None = None,
    on_publish: Callable[[dict[str, Any]], None] | None = None,
    native: bool = False,
    gallery_root: str | Path | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Re-embed the index's gallery with ``model`` (mixed or swap, see the module docstring); resumes an
    unfinished upgrade to the same model. ``native``: into the model's own space even where its compatible output
    could serve the old one (a swap). ``on_publish(progress)`` is called after each publish (for tests and
    curves). A gallery that moved (``records.relocate``; ``gallery_root``: where to) is followed first.

    Before a new upgrade begins (``upgrade_checks``): a model its training measured not compatible is refused for a
    mixed upgrade, and so is one measured worse than the index's vectors on the index's own labels
    (``UpgradeRefused``); ``force`` goes on, and says so. A text model recorded for the old space is turned off
    where the new vectors leave it (``text_off``). Returns a summary."""
    started = time.perf_counter()
    if order not in ORDERS:
        raise ParameterError("order", f"must be one of {', '.join(ORDERS)}, got {order!r}")
    if int(commit_every) < 1:
        raise ParameterError("commit_every", f"must be >= 1 images, got {commit_every}")
    options = options or IngestOptions()
    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    with layout.upgrade_lock():
        with layout.write_lock("upgrade"), Catalogue(layout.catalogue) as catalogue:
            if catalogue.get_meta("source") == EMBEDDINGS_SOURCE:  # before any model loads
                raise NoModelError(f"{built_without_model(layout.root)}: an upgrade replaces the model an index was "
                                   "built by, and its vectors came from elsewhere; build an index of the images with "
                                   "the new model instead (retrieval index build)")
            recorded = catalogue.get_meta(UPGRADE_MODEL_PATH)
            if model is None and recorded is None:
                raise ParameterError("model", "is needed (the new .onnx file): no upgrade is under way to resume")
            model_path = str(Path(model).expanduser().resolve()) if model is not None else _upgrade_model(
                layout, catalogue, recorded)
            embedder = embedder or load_model(model_path)
            info = require_complete(layout, catalogue, upgrading=True)
            info = info.with_fields(relocate(layout, catalogue, gallery_root))  # the images are re-read where they are
            embedder = _output_of_upgrade(catalogue, info, embedder, native)
            store = ShardStore(layout.shards)
            mend(catalogue, store)
            checks = None
            if catalogue.get_meta("upgrade_model_hash") is None and not _same_model(embedder, info):
                checks = check_upgrade(catalogue, store, info, embedder, _planned_mode(embedder, info), force, options)
            state = _start(layout, catalogue, store, info, embedder, model_path, checks)
            info = layout.read_record()
        measured = _measured_compatibility(embedder, state["mode"])
        summary = _run(layout, state, embedder, model_path, order, int(commit_every), options, on_publish)
    summary["compatibility"] = measured
    summary |= {key: state["checks"].get(key) for key in ("on_labels", "on_text", "forced")} if state["checks"] else {}
    summary["text_model"] = state.get("text_model") or summary.get("text_model")
    # an int8 model of the index's own: how close to its parent it stayed, as measured when it was quantized
    summary["int8"] = int8_record(getattr(embedder, "metadata", None)) if state["mode"] == "mixed" else None
    summary["seconds"] = round(time.perf_counter() - started, 3)
    return summary


def _same_model(embedder: ImageEmbedder, info: IndexInfo) -> bool:
    return hash_matches(info.model.hash, embedder) and same_output(embedder, info)


def _planned_mode(embedder: ImageEmbedder, info: IndexInfo) -> str:
    """mixed where the output chosen (``upgrade_target``) is declared compatible and embeds into the index's space
    and size; else swap."""
    compatible = is_compatible(embedder, info) and int(embedder.embedding_dim) == int(info.value_of("embedding_dim"))
    return "mixed" if compatible else "swap"


def _measured_compatibility(embedder: ImageEmbedder, mode: str) -> dict[str, Any] | None:
    """A mixed upgrade's new queries meet old vectors until it ends: the compatibility the model's training
    measured (its metadata), said once now (a warning unless compatible) and returned for the summary."""
    measured = recorded_compatibility(getattr(embedder, "metadata", None)) if mode == "mixed" else None
    if measured is not None:
        say = log.info if measured["verdict"] == COMPATIBLE else log.warning
        say("the new model serves the old vectors as they are replaced; as measured when it was trained, %s",
            compatibility_sentence(measured))
    return measured


def _output_of_upgrade(catalogue: Catalogue, info: IndexInfo, embedder: ImageEmbedder,
                       native: bool) -> ImageEmbedder:
    """``embedder`` with the output this upgrade embeds with: the one recorded when the upgrade under way to this
    model started, else ``upgrade_target``'s."""
    model = with_output(embedder, None)
    if not hash_matches(catalogue.get_meta("upgrade_model_hash"), model):
        return upgrade_target(model, info, native)
    recorded = with_output(model, catalogue.get_meta("upgrade_model_output"))
    if native and getattr(recorded, "output_name", None) != getattr(model, "output_name", None):
        raise ParameterError("native", f"the upgrade under way in {catalogue.path.parent} embeds with the model's "
                                       f"compatible output {recorded.output_name}; finish it first (run the upgrade "
                                       "again without `native`), then upgrade with `native`")
    return recorded


def _upgrade_model(layout: IndexLayout, catalogue: Catalogue, recorded: str) -> str:
    """The new model of the upgrade under way, found by its hash (``portable.find_model``: the index folder and the
    model may have moved together since it began), or ModelNotFoundError naming its hash and ``model``."""
    record = IndexInfo.from_json({"model_path": recorded, MODEL_RELATIVE: catalogue.get_meta(UPGRADE_MODEL_RELATIVE),
                                  "model_hash": catalogue.get_meta("upgrade_model_hash")})
    return str(find_model(record, layout.root, role="is being upgraded to").resolve())


def _start(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, info: IndexInfo,
           embedder: ImageEmbedder, model_path: str, checks: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record the upgrade and what ``check_upgrade`` found (or check the one under way is to this model); for a mixed
    one, name the new model in index.json at once (a text model turned off there where the model's training refuted
    its compatibility). Returns the upgrade's state (mode, first shard, old model hash, checks)."""
    under_way = catalogue.get_meta("upgrade_model_hash")
    if under_way is not None and not hash_matches(under_way, embedder):
        raise ParameterError("model", f"has model_hash {embedder.model_hash}, but the upgrade under way in "
                             f"{layout.root} is to {catalogue.get_meta(UPGRADE_MODEL_PATH)} (model_hash {under_way}); "
                             "finish that one first (give its model, or none)")
    # a publish was interrupted: faiss may hold vectors the catalogue moved on from. A mixed upgrade's are the same
    # size: rebuild now. A swap's last publish is simply done again at the end (index.json and faiss still agree on
    # the old model, which keeps answering; the new vectors may be of another size)
    if catalogue.get_meta(STALE) and catalogue.get_meta("upgrade_mode") != "swap":
        info = _publish(layout, catalogue, store, info, [], None, rebuild=True, options=IngestOptions())
    text_model = None
    if under_way is None:
        old_hash = info.model.hash
        if _same_model(embedder, info):
            return {"mode": "none", "from": old_hash, "first_shard": next_shard_number(store),
                    "checks": None}
        # mixed: the output chosen (upgrade_target) embeds into the index's space and size
        mode = _planned_mode(embedder, info)
        output = getattr(embedder, "output_name", None)
        catalogue.set_meta(upgrade_model_hash=embedder.model_hash, upgrade_mode=mode,
                           upgrade_from=old_hash, upgrade_first_shard=str(next_shard_number(store)),
                           **{UPGRADE_MODEL_PATH: model_path,
                              UPGRADE_MODEL_RELATIVE: relative_to_index(model_path, layout.root)},
                           **({"upgrade_model_output": output} if output else {}),
                           **({CHECKS: json.dumps(checks)} if checks else {}))
        if mode == "mixed":  # queries by the new model from now on, against the old vectors (compatible)
            new_fields = model_fields(embedder, model_path, layout.root)
            _record_model(catalogue, embedder, model_path, layout.root)
            if has_text_model(info):
                text_model = {"state": "kept", "reason": "the new model is declared compatible with the space its "
                              "text model maps into"}
                on_text = (checks or {}).get("on_text") or {}
                if checks and checks.get("refuted"):
                    why = (f"the new model {embedder.model_hash} is declared compatible with model "
                           f"{old_hash}, whose space the text model maps into, but its training measured "
                           "it not compatible (upgraded with force)")
                    info = text_off(info, embedder, why, layout.root, model_path)
                    text_model = {"state": "off", "reason": why}
                elif on_text.get("worse"):
                    why = (f"the new model {embedder.model_hash} would serve the text model worse than the old "
                           f"vectors do: {text_sentence(on_text)}")
                    info = text_off(info, embedder, why, layout.root, model_path)
                    text_model = {"state": "off", "reason": why}
            record = {"from": old_hash, "mode": mode, **check_record(checks),
                      **({"text_model": text_model} if text_model else {})}
            layout.write_info(_with_model(info, new_fields, {"upgrade": record}))
    recorded = catalogue.get_meta(CHECKS)
    return {"mode": catalogue.get_meta("upgrade_mode"), "from": catalogue.get_meta("upgrade_from"),
            "first_shard": int(catalogue.get_meta("upgrade_first_shard")),
            "checks": json.loads(recorded) if recorded else None, "text_model": text_model}


def _run(layout: IndexLayout, state: dict[str, Any], embedder: ImageEmbedder, model_path: str, order: str,
         commit_every: int, options: IngestOptions, on_publish: Callable[[dict[str, Any]], None] | None,
         ) -> dict[str, Any]:
    """Embed the rows still holding old vectors, publishing each batch (mixed) or all at the end (swap)."""
    mode, first = state["mode"], state["first_shard"]
    summary = {"index_dir": str(layout.root), "mode": mode, "from_model_hash": state["from"],
               "model_hash": embedder.model_hash, **output_fields(embedder),
               "embedding_dim": int(embedder.embedding_dim), "reembedded": 0, "unreadable": 0, "published": 0}
    if mode == "none":
        return summary | {"note": "the index already uses this model"}
    with Catalogue(layout.catalogue) as catalogue:
        store = ShardStore(layout.shards)
        waiting = _embedded_unpublished(catalogue, store, first)
        remaining = np.setdiff1d(_old_rows(catalogue, first), [o.id for o in waiting])
        faiss_index = faiss_files.read_index(layout.faiss)
        faiss_params.set_search_params(faiss_index, layout.read_record().vectors.params or {})
        ordered = backfill_order(store, catalogue, faiss_index, remaining, order)
        del faiss_index
        total = len(ordered) + len(waiting)
        summary["to_reembed"] = int(total)
    workers = default_decode_threads() if options.workers is None else options.workers
    step = commit_every if mode == "mixed" else options.shard_size
    bar = progress_bar(total=total, initial=len(waiting), desc="upgrade", unit="img", disable=not options.progress)
    rows_embedder = RowEmbedder(embedder, options.batch_size, workers, options.max_pixels)
    with bar:
        if mode == "mixed" and waiting:
            _publish_batch(layout, waiting, summary, on_publish, total)
        for start in range(0, len(ordered), step):
            batch = ordered[start:start + step].tolist()
            with Catalogue(layout.catalogue) as catalogue:
                rows = catalogue.rows(batch, status=Status.DONE)
            items = [(i, rows[i]["path"]) for i in batch if i in rows]  # removed meanwhile: nothing to do
            outcomes = []
            for chunk in range(0, len(items), options.shard_size):
                embedded = rows_embedder.embed(items[chunk:chunk + options.shard_size])
                # an unreadable file leaves the index: its old vector is another model's
                chunk_outcomes = [Outcome(d.id, Status.DONE, d.sha256, d.size) if d.error is None else
                                  Outcome(d.id, Status.ERROR, d.sha256, d.size,
                                          error=f"unreadable when re-embedded: {d.error}") for d in embedded.records]
                name = ShardStore(layout.shards).write(embedded.ids, embedded.vectors, chunk_outcomes)
                outcomes += [Outcome(o.id, o.status, o.sha256, o.size, o.error, shard=name if o.status ==
                                     Status.DONE else None) for o in chunk_outcomes]
                bar.update(len(chunk_outcomes))
            summary["reembedded"] += sum(o.status == Status.DONE for o in outcomes)
            summary["unreadable"] += sum(o.status == Status.ERROR for o in outcomes)
            if mode == "mixed":
                _publish_batch(layout, outcomes, summary, on_publish, total)
    _finish(layout, embedder, model_path, mode, first, summary, options, on_publish, total, state.get("checks"))
    return summary


def _embedded_unpublished(catalogue: Catalogue, store: ShardStore, first: int) -> list[Outcome]:
    """The new vectors a run wrote before it was stopped and that no catalogue row points at yet."""
    done = catalogue.done_shards()
    waiting = []
    for name in store.names():
        if shard_number(name) < first:
            continue
        shard = store.read(name)
        held = set(shard.ids.tolist())
        for outcome in shard.outcomes:
            if outcome.id in done and shard_number(done[outcome.id]) < first and (
                    outcome.status != Status.DONE or outcome.id in held):
                waiting.append(Outcome(outcome.id, outcome.status, outcome.sha256, outcome.size, outcome.error,
                                       shard=name if outcome.status == Status.DONE else None))
    return waiting


def _publish_batch(layout: IndexLayout, outcomes: list[Outcome], summary: dict[str, Any],
                   on_publish: Callable[[dict[str, Any]], None] | None, total: int) -> None:
    """One step of a mixed upgrade: its batch's new vectors published under the writer lock."""
    with layout.write_lock("upgrade"), Catalogue(layout.catalogue) as catalogue:
        store = ShardStore(layout.shards)
        mend(catalogue, store)
        current = catalogue.status_of([o.id for o in outcomes])
        kept = [o for o in outcomes if current.get(o.id) == Status.DONE]  # removed meanwhile: leave it removed
        info = _publish(layout, catalogue, store, layout.read_record(), kept, None, rebuild=False,
                        options=IngestOptions())
        summary["published"] += len(kept)
    if on_publish is not None:
        on_publish({"published": summary["published"], "total": total, "left": info.value_of("upgrade")["left"]})


def _finish(layout: IndexLayout, embedder: ImageEmbedder, model_path: str, mode: str, first: int,
            summary: dict[str, Any], options: IngestOptions, on_publish: Callable[[dict[str, Any]], None] | None,
            total: int, checks: Mapping[str, Any] | None = None) -> None:
    """The last publish: every remaining new vector in (swap: all of them), faiss retrained on the new vectors
    where it has training, the new model named (a swap turns a recorded text model off: its space is gone), the
    old vectors deleted, the upgrade's records cleared and what it checked kept (``last_upgrade``)."""
    with layout.write_lock("upgrade"), Catalogue(layout.catalogue) as catalogue:
        store = ShardStore(layout.shards)
        mend(catalogue, store)
        info = layout.read_record()
        waiting = _embedded_unpublished(catalogue, store, first)
        left = _old_rows(catalogue, first)
        if len(np.setdiff1d(left, [o.id for o in waiting])):
            raise RuntimeError(f"{len(left)} images of {layout.root} still hold the old model's vectors; run the "
                               "upgrade again to re-embed them")
        # the models this index's vectors came from before, oldest first (lineage; never a licence to search)
        new_fields = model_fields(embedder, model_path, layout.root) | {"upgraded_from": [
            *(info.upgrade.upgraded_from if info.holds("upgraded_from") else []), catalogue.get_meta("upgrade_from")]}
        trained = not isinstance(faiss_params.inner(faiss_files.read_index(layout.faiss)), faiss.IndexFlatCodes)
        text_model = (info.upgrade.under_way or {}).get("text_model")  # a mixed upgrade's, from its start
        if mode == "swap" and has_text_model(info):
            why = (f"the gallery was re-embedded into the space of model {embedder.model_hash}, and the text model "
                   f"maps text into the space of model {info.model.hash}")
            info = text_off(info, embedder, why, layout.root, model_path)
            text_model = {"state": "off", "reason": why}
        summary["text_model"] = text_model
        new_fields["last_upgrade"] = {"from": catalogue.get_meta("upgrade_from"), "to": embedder.model_hash,
                                      "mode": mode, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                      **check_record(checks), **({"text_model": text_model} if text_model else {})}
        info = _publish(layout, catalogue, store, info.without("upgrade"), waiting, new_fields,
                        rebuild=mode == "swap" or trained, options=options)
        summary["published"] += len(waiting)
        _record_model(catalogue, embedder, model_path, layout.root)
        summary["deleted_shards"] = _delete_unused_shards(catalogue, store)
        catalogue.delete_meta(*UPGRADE_META)
        summary |= {"index_key": info.value_of("index_key"), "count": info.vectors.count}
    if on_publish is not None:
        on_publish({"published": summary["published"], "total": total, "left": 0})
    log.info("upgraded %s to model %s", layout.root, embedder.model_hash)
