"""The options of the gallery commands (`retrieval index build|add|remove|repair|upgrade|compare|stats|export|text`,
`retrieval search`, `retrieval compare`), each declared once (``retrieval.options``): the commands' click options
(``retrieval.cli.config_options.command_options``) and docs/INDEX.md's table of them are made from ``IndexOptions``.

A field is a declaration, not a setting: no config file reads these. Where one flag means different things on
different commands (each command's ``--model`` is its own model), each meaning is a field of its own, and ``dest``
gives every command the same parameter name. A leaf (no NumPy, no faiss): ``--help`` loads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from retrieval.cli.help_text import default_max_pixels, image_extensions
from retrieval.options import LABEL_COLUMN_HELP, TRUSTED_MODEL, option
from retrieval.utils.workers import DECODE_THREADS_TEXT

DEFAULT_MAX_QUERIES = 1000  # query images one search takes: a folder given by mistake is refused, not embedded
LABEL_RULE_NAMES = "parent|top|manifest|none"
INGEST = ("batch_size", "workers", "shard_size", "max_pixels", "gpu")  # how a writer reads and embeds images
# Milvus' vector index types (retrieval.index.milvus.milvus_collection.INDEX_TYPES, kept equal by a test: that
# module loads the index package, which --help must not)
MILVUS_INDEX_TYPES = ("AUTOINDEX", "FLAT", "HNSW", "IVF_FLAT", "IVF_PQ")
ENGINE = ("engine", "ray_address", "ray_actors", "ray_gpus_per_actor", "ray_cpus_per_actor")  # where it embeds them


def _gallery_help(what: str) -> str:
    """``what`` images a command takes, and the forms they come in (the decoder's formats, read when shown)."""
    return (f"{what}: a folder (searched recursively for {image_extensions()}), a manifest.csv (path,label[,split]) "
            "or a .parquet file with the same columns.")


def _label_rules() -> str:
    from retrieval.index.sources import LABEL_RULES

    return "; ".join(f"{name}: {text}" for name, text in LABEL_RULES.items())


@dataclass(frozen=True)
class IndexOptions:
    """Every option of the gallery commands, declared once (sections: the headings of docs/INDEX.md's table)."""

    # the index folder
    index_flag: str | None = option(
        None, "index folder", "the index folder, as `retrieval search` and `retrieval serve` name it (or give it as "
        "INDEX_DIR).", flag="--index", metavar="INDEX_DIR", path="dir", exists=True)
    search_index: str | None = option(None, "index folder", "the index folder to search (`retrieval index build` "
                                      "writes one); or --milvus and --collection.", flag="--index", dest="index_dir",
                                      path="dir", exists=True)
    search_milvus: str | None = option(
        None, "index folder", "search a Milvus collection instead of a folder (`retrieval index push` fills one): "
        "http://HOST:19530 or a FILE.db (Milvus Lite); with --collection. Text queries search its keywords with "
        "Milvus' BM25 where it was pushed with --text-columns (docs/INDEX.md, \"Keywords on Milvus\").",
        flag="--milvus", dest="milvus", metavar="URI")
    search_collection: str | None = option(None, "index folder", "the collection --milvus searches.",
                                           flag="--collection", dest="collection", metavar="NAME")
    # the models
    build_model: str | None = option(None, "models", f"exported .onnx embedder (with --images). {TRUSTED_MODEL}",
                                     flag="--model", dest="model", path="file")
    recorded_model: str | None = option(None, "models", f"default: the model recorded in index.json. {TRUSTED_MODEL}",
                                        flag="--model", dest="model", path="file")
    upgrade_model: str | None = option(
        None, "models", "the new model (.onnx); default: the one of the upgrade under way, which this run resumes. "
        f"{TRUSTED_MODEL}", flag="--model", dest="model", path="file", exists=True)
    compared_model: str | None = option(
        None, "models", "the model (.onnx) to compare with the index's own, e.g. a fine-tuned one before an upgrade. "
        f"{TRUSTED_MODEL}", flag="--model", dest="model", path="file", exists=True, required=True)
    new_model: str | None = option(None, "models", f"the new model (.onnx), compared with --baseline. {TRUSTED_MODEL}",
                                   flag="--model", dest="model", path="file", exists=True, required=True)
    baseline: str | None = option(
        None, "models", "the model to compare it with (.onnx): the one serving now, or the pretrained backbone "
        "exported (trusted input too).", path="file", exists=True, required=True)
    index_text_model: str | None = option(
        None, "models", "the text tower to record (the text.onnx `retrieval text train` writes): trained for the "
        f"index's image model, or for one that model is declared compatible with. {TRUSTED_MODEL}",
        flag="--text-model", dest="text_model", path="file", exists=True)
    adapt_text_model: bool = option(
        True, "searching by text", "a zero-shot text tower (`retrieval export --pretrained` writes one) is adapted "
        "to the index's images with pseudo-captions and the adapted tower (text.adapted.HASH.onnx in the index "
        "folder) is recorded, when it measures no worse on held-out images (docs/TEXT.md, \"Adapting a zero-shot "
        "tower\"); --no-adapt records it as it is.", flag="--adapt", dest="adapt")
    search_text_model: str | None = option(
        None, "models", f"with --text: the text tower (text.onnx) that embeds the queries. {TRUSTED_MODEL}",
        flag="--text-model", dest="text_model", path="file", exists=True,
        default_text="the one `retrieval index text` recorded in index.json")
    # the images
    build_images: str | None = option(None, "images", lambda: _gallery_help("the images to index (with --model)"),
                                      flag="--images", dest="images", path="any")
    add_images: str | None = option(None, "images", lambda: _gallery_help("the images to add"), flag="--images",
                                    dest="images", path="any", required=True)
    compare_images: str | None = option(
        None, "images", "a folder of images (searched recursively; sub-folders are labels where there are any).",
        flag="--images", dest="images", path="any", exists=True, required=True)
    split: str | None = option(None, "images", "with a manifest: index only the rows of this split.")
    label_column: str | None = option(None, "images", LABEL_COLUMN_HELP, metavar="NAME",
                                      default_text="label; `index add` reads the index's own")
    label_from: str | None = option(
        None, "images", lambda: f"where an image's label comes from: {_label_rules()}. `index add` keeps the index's "
        "rule.", metavar=LABEL_RULE_NAMES)
    relabel: str | None = option(
        None, "images", lambda: "relabel the index's gallery images by this rule (labels only, nothing is "
        f"re-embedded); where an image's label comes from: {_label_rules()}.", flag="--label-from",
        dest="label_from", metavar=LABEL_RULE_NAMES)
    # building
    embeddings: str | None = option(
        None, "building", "instead of --images and --model: build from vectors you already have, with no images and "
        "no model; DIR holds embeddings/*.npy (or clip-retrieval's img_emb/*.npy) and optionally metadata/*.parquet "
        "with the same rows, as `retrieval index export --format npy` writes (docs/INDEX.md). The index is searched "
        "with embeddings.", path="any", metavar="DIR")
    allow_outside_paths: bool = option(
        False, "building", "with --embeddings: catalogue metadata paths that resolve outside DIR (or the gallery "
        "folder its _export.json records) too: absolute, with .. or through a symlink. Refused by default, as a "
        "server sends every catalogued file to whoever searches.", negatable=False)
    build_out: str | None = option(None, "building", "index folder (resumes if interrupted).", flag="--out",
                                   dest="out", path="dir", required=True)
    index_key: str = option("auto", "building", "auto | Flat | HNSW32 | IVF{K},Flat | IVF{K},PQ{m} | any faiss "
                                                "factory key ({K}, {m} filled in).")
    max_index_memory: str | None = option(
        None, "building", "with --index-key auto: the best index whose estimated RAM fits, e.g. 4G, 512M (as "
        "autofaiss does; `index stats` shows the choice).", metavar="SIZE")
    max_query_ms: float | None = option(
        None, "building", "tune the search settings (nprobe, efSearch) for the best recall whose median time per "
        "query stays under MS milliseconds.", low=0, low_open=True, metavar="MS")
    display_columns: str | None = option(
        None, "building", "comma-separated manifest columns every answer shows with each image, e.g. title,price "
        "(the CLI, --json, the API, the app's captions); '' shows paths only.", metavar="COLUMNS",
        default_text="the manifest's title-like columns (title, name, product_name, caption) and price, and any "
        "--text-columns")
    text_columns: str | None = option(
        None, "searching by text", "comma-separated manifest columns (label too) whose words a text query finds, "
        "e.g. title,brand: kept in a keyword index (SQLite FTS5) beside the index, kept in step by add and remove, "
        "and fused with the text model's ranks (docs/TEXT.md, \"Keywords\").", metavar="COLUMNS")
    # reading and embedding images (build, add, repair, upgrade)
    batch_size: int = option(64, "reading and embedding", "images per embedding batch.")
    workers: int | None = option(None, "reading and embedding", "decoding threads (beside the model's own).",
                                 default_text=DECODE_THREADS_TEXT)
    shard_size: int = option(4096, "reading and embedding", "images per shard (the unit of resumption).")
    max_pixels: int | None = option(None, "reading and embedding", "refuse images with more pixels (decompression "
                                    "bombs).", default_text=default_max_pixels)
    gpu: bool = option(False, "reading and embedding", "train/search faiss on the GPU (needs faiss-gpu and a GPU).",
                       negatable=False)
    # the Ray engine
    engine: str = option("local", "Ray engine", "local: decode + embed in this process; ray: Ray Data on a Ray "
                         "cluster (pip install 'ray[data]').", choices=("local", "ray"))
    ray_address: str = option("auto", "Ray engine", "auto (the running cluster, see `ray start`), local (start Ray "
                              "here), ray://HOST:PORT or HOST:PORT.")
    ray_actors: int = option(1, "Ray engine", "embedding actors (each loads the model).")
    ray_gpus_per_actor: float = option(0.0, "Ray engine", "GPUs per embedding actor (onnxruntime CUDA provider when "
                                       "onnxruntime-gpu is installed).")
    ray_cpus_per_actor: float = option(1.0, "Ray engine", "CPUs (onnxruntime threads) per actor.")
    # upgrading to a new model
    order: str = option(
        "random", "upgrade", "which images are re-embedded first: random (measured best), uncertain (the old "
        "embeddings whose neighbours disagree with their label, or lie farthest, first) or id (catalogue order). It "
        "matters only for a model declared compatible, whose vectors are served as they come.",
        choices=("random", "uncertain", "id"))
    commit_every: int = option(4096, "upgrade", "images re-embedded between two publishes of a compatible model's "
                               "upgrade (each publish rewrites the faiss part; a server swaps in each).", low=1)
    native: bool = option(
        False, "upgrade", "re-embed into the new model's own embedding (a swap, faiss rebuilt in its size) even where "
        "its compatible output, a projection into the old space, could serve the old index as it goes.",
        negatable=False)
    force: bool = option(
        False, "upgrade", "upgrade even to a model its own training measured as not compatible with the index's (for "
        "a model declared compatible), or to one measured worse than the index's vectors on the index's own labels; "
        "both are refused by default, with the numbers. The upgrade says what it was forced past, and index.json "
        "keeps it.", negatable=False)
    # comparing two models
    sample: int = option(2000, "comparison", "images compared (seeded sample); exact neighbours among them, sample^2 "
                         "work per model.", low=2)
    neighbours: int = option(10, "comparison", "neighbours per image.", flag="-k", dest="k", low=1)
    threads: int = option(2, "comparison", "decoding threads.", flag="--workers", dest="workers", low=1)
    # removing, repairing, inspecting
    ids: str = option("", "removing and repairing", "comma-separated catalogue ids.")
    paths: tuple[str, ...] = option(
        (), "removing and repairing", "image path as the tools print it: relative to the gallery, from the working "
        "folder, or absolute (repeatable).")
    rebuild: bool = option(False, "removing and repairing", "rebuild the faiss part from the shards instead of "
                           "updating it.", negatable=False)
    queries: int = option(500, "statistics", "sampled queries for recall and latency.")
    failed: bool = option(False, "statistics", "instead: list every image that could not be read (or listed), with "
                          "why; an unfinished build's too.", negatable=False)
    # exporting
    fmt: str = option(
        "parquet", "export", "parquet: one table with an embedding column (pandas, vector databases); npy: "
        "embeddings/*.npy + metadata/*.parquet in the same row order (autofaiss, clip-retrieval's layout).",
        choices=("parquet", "npy"), flag="--format")
    export_out: str | None = option(
        None, "export", "FILE.parquet (one file, --format parquet) or a folder of part files; written under a "
        "temporary name and renamed into place when complete.", flag="--out", dest="out", path="any", required=True)
    overwrite: bool = option(False, "export", "replace --out if it is a file or an earlier export folder (never "
                             "another folder).", negatable=False)
    rows_per_file: int = option(1_000_000, "export", "rows per part file of a folder export.", low=1)
    absolute_paths: bool = option(False, "export", "write the catalogue's absolute paths instead of paths relative "
                                  "to the gallery (as the API shows).", negatable=False)
    # searching
    results: int = option(10, "search", "results per query.", flag="-k", dest="k")
    max_queries: int = option(DEFAULT_MAX_QUERIES, "search", "the most query images one search takes, each image in "
                              "a folder counted; more are refused before the model loads.", low=1)
    exclude_self: bool = option(False, "search", "leave out the gallery image that is the query itself (the same "
                                "file bytes), as the app and the API do.", negatable=False)
    texts: tuple[str, ...] = option(
        (), "search", "search by text instead of images: what you are looking for, e.g. --text \"a red apple\" "
        "(repeatable: one query each). Needs a text model: --text-model, or the one index.json records.",
        flag="--text", metavar="TEXT")
    where: str | None = option(
        None, "search", "search only the gallery images whose catalogue columns match, e.g. --where 'label = \"cat\" "
        "and price < 20' (columns: id, path, label and a manifest's own, such as split; = != < <= > >=, in (...), "
        "and, or, not).", metavar="EXPR")
    search_gpu: bool = option(False, "search", "search on the GPU (needs faiss-gpu and a GPU).", flag="--gpu",
                              dest="gpu", negatable=False)
    # a Milvus collection (retrieval index push; add, remove and upgrade keep it in step)
    push_milvus: str | None = option(
        None, "Milvus", "where the collection is: http://HOST:19530 for a Milvus server or cluster (https:// with "
        "TLS), or a FILE.db path for Milvus Lite, the same engine in this process (`pip install "
        "'retrieval[milvus]'`).", flag="--milvus", dest="milvus", metavar="URI", required=True)
    push_collection: str | None = option(
        None, "Milvus", "the name servers use (`retrieval serve --milvus URI --collection NAME`): an alias of the "
        "collection that holds the rows, created once every row is in.", flag="--collection", dest="collection",
        metavar="NAME", required=True)
    index_type: str | None = option(
        None, "Milvus", "Milvus' vector index: FLAT (exact), HNSW, IVF_FLAT, IVF_PQ or AUTOINDEX (Milvus chooses; "
        "docs/SCALE.md says which for which size and memory).", choices=MILVUS_INDEX_TYPES,
        default_text="the collection's; AUTOINDEX for a new one")
    build_milvus: str | None = option(
        None, "Milvus", "with --engine ray: the Ray actors write the vectors straight into a collection of this Milvus "
        "server (http://HOST:19530; https:// with TLS), never through this machine; with --collection. --out then "
        "keeps the catalogue (what resumes the build) and the model's record, no shards and no faiss index: search "
        "it with `retrieval serve --milvus URI --collection NAME`. A Milvus Lite FILE.db is refused (one process "
        "only; the actors are others).", flag="--milvus", dest="milvus", metavar="URI")
    build_collection: str | None = option(
        None, "Milvus", "the name servers use for the collection --milvus builds: an alias, created once every row "
        "is in.", flag="--collection", dest="collection", metavar="NAME")
    sync_milvus: str | None = option(
        None, "Milvus", "also bring this Milvus collection in step once the index is written (as `retrieval index "
        "push` does; with --collection).", flag="--milvus", dest="milvus", metavar="URI")
    sync_collection: str | None = option(
        None, "Milvus", "the collection --milvus keeps in step (an upgrade to another model moves this name to the "
        "new model's rows in one step).", flag="--collection", dest="collection", metavar="NAME")
    # what a command prints
    as_json: bool = option(False, "output", "print the whole summary as JSON (for programs).", flag="--json",
                           negatable=False)
    search_json: bool = option(False, "output", "print JSON instead of a table.", flag="--json", dest="as_json",
                               negatable=False)
