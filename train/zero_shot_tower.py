"""``train_zero_shot_tower``: a text tower trained with no captions, onto a pretrained backbone's ImageNet classifier.

The rows of an ImageNet head (``_fc.weight``, 1000 x dim) are directions of the pooled-feature space the pretrained
export returns: row c points where the images of class c lie. The tower (the frozen all-MiniLM-L6-v2 encoder and a
linear projection, ``retrieval.text.tower``) is trained so that each class's texts (its WordNet lemmas, prompts and
definition: ``retrieval.text.class_texts``) land on that class's L2-normalised row, with LiT's symmetric InfoNCE
(``retrieval.text.lit_loss``): a batch holds one text of each of its classes, so two texts of a class are never
each other's negatives. The projection starts at the ridge regression (``TextTower.fit_projection``); the encoder
is frozen, so the texts' sentence features are computed once and each step is one matrix product.

``held_out_share`` holds out whole classes (seeded) and measures where their names land among all 1,000 rows: how
the tower does on words it was never trained on, which is what a shop's queries are.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrieval.errors import ParameterError
from retrieval.text.class_texts import ImageNetClass, class_texts, read_imagenet_classes
from retrieval.text.encoder import SentenceEncoder
from retrieval.text.lit_loss import LiTLoss
from retrieval.text.tokens import TextTokenizer
from retrieval.text.tower import ClassBridge, TextTower
from retrieval.train.text_tower import default_encoder, recalls, sentence_features, text_to_image_ranks
from retrieval.utils.progress import progress_bar

ZERO_SHOT_ORIGIN = "zero-shot"
CHECK_TEXTS = 64  # texts the export is verified on


def _efficientnet_lite0_head() -> torch.Tensor:
    from retrieval.models import efficientnet_lite0_classifier

    return efficientnet_lite0_classifier(pretrained=True)._fc.weight.detach().float().clone()


# backbone -> its pretrained ImageNet-1k head's weight [1000, embedding_dim], whose input is the pooled features
# the pretrained export returns (timm's synset order); a backbone not here gets no zero-shot tower
IMAGENET_HEADS: dict[str, Callable[[], torch.Tensor]] = {"efficientnet_lite0": _efficientnet_lite0_head}


def imagenet_head(backbone: str) -> torch.Tensor | None:
    """The L2-normalised rows [1000, dim] of ``backbone``'s pretrained ImageNet head; None for a backbone without
    one this toolkit knows (``IMAGENET_HEADS``)."""
    load = IMAGENET_HEADS.get(backbone)
    return None if load is None else torch.nn.functional.normalize(load(), dim=1)


@dataclass(frozen=True)
class ZeroShotSettings:
    """How a zero-shot tower is trained (defaults: what measured best, docs/TEXT.md)."""

    prompts: tuple[str, ...] = ("names", "photo", "definition")  # the templates cost 4x the encoding, gain nothing
    epochs: int = 20  # more fits the 1,000 rows closer and words beyond them worse (benchmarks/zero_shot_text.py)
    batch_size: int = 1000  # classes per batch: 1000 contrasts each text with every other class's row
    lr: float = 2e-3
    balance: str = "prompt"  # a class's text each step: "prompt" (a prompt set, then a text of it) or "text"
    held_out_share: float = 0.0  # classes held out to measure unseen words (none for the tower delivered)
    classes: int | None = None  # a seeded subset of the classes trained on (None: all)
    max_tokens: int = 32
    seed: int = 0
    encoder: str | None = None
    # the class bridge beside the projection (``retrieval.text.tower.ClassBridge``): the class texts it reads (none:
    # no bridge), its softmax temperature and the classes it weighs (benchmarks/zero_shot_bridge.py)
    bridge_prompts: tuple[str, ...] = ("names", "photo")
    bridge_temperature: float = 0.1
    bridge_top: int | None = None  # every class: a top-k cut makes the map jump where two classes tie at it

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.batch_size < 2 or not self.lr > 0 or not 0 <= self.held_out_share < 1:
            raise ParameterError("settings", f"need epochs >= 0, batch_size >= 2, lr > 0 and held_out_share in "
                                             f"[0, 1): {self}")
        if self.balance not in ("prompt", "text"):
            raise ParameterError("balance", f"is {self.balance!r}; give 'prompt' or 'text'")
        if self.classes is not None and self.classes < 2:
            raise ParameterError("classes", f"is {self.classes}; LiT contrasts at least 2 classes")


@dataclass
class ZeroShotTower:
    """A trained zero-shot tower, what its export needs and what its training measured."""

    tower: TextTower
    tokenizer: TextTokenizer
    encoder_record: dict[str, Any]
    class_names: list[str]  # every class's usual name, in the head's row order
    check_texts: list[str]
    history: list[dict[str, Any]] = field(default_factory=list)
    texts: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    settings: ZeroShotSettings = field(default_factory=ZeroShotSettings)

    def metadata(self) -> dict[str, str]:
        """The keys a zero-shot text.onnx carries beside its record: the classes in head order, its origin and how
        it was trained."""
        training = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.settings).items()}
        return {"zero_shot_classes": json.dumps(self.class_names), "text_origin": ZERO_SHOT_ORIGIN,
                "zero_shot_training": json.dumps({**training, "texts": self.texts}, sort_keys=True)}


@dataclass(frozen=True)
class ClassTexts:
    """Every training text, the class (head row) of each, and its prompt set."""

    texts: list[str]
    owner: np.ndarray  # int [m]
    prompt: np.ndarray  # int [m]: index into the settings' prompts

    @classmethod
    def of(cls, classes: Sequence[ImageNetClass], rows: Sequence[int], prompts: Sequence[str]) -> ClassTexts:
        texts, owner, prompt = [], [], []
        for row in rows:
            made_of = class_texts(classes[row], prompts)
            for p, kind in enumerate(prompts):
                made = made_of[kind]
                texts += made
                owner += [row] * len(made)
                prompt += [p] * len(made)
        return cls(texts, np.asarray(owner, dtype=np.int64), np.asarray(prompt, dtype=np.int64))


def split_classes(count: int, share: float, subset: int | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(trained, held-out) class rows: a seeded ``share`` held out, of a seeded ``subset`` of the classes (all when
    None)."""
    order = np.random.default_rng(seed).permutation(count)
    order = order[:subset] if subset is not None else order
    held = int(round(len(order) * share))
    return np.sort(order[held:]), np.sort(order[:held])


class _Sampler:
    """Each class's texts, grouped by prompt set, sampled one per class per step."""

    def __init__(self, data: ClassTexts, trained: np.ndarray, balance: str) -> None:
        self.balance = balance
        self.groups: dict[int, list[np.ndarray]] = {}
        keep = np.isin(data.owner, trained)
        for row in trained.tolist():
            mine = np.flatnonzero(keep & (data.owner == row))
            self.groups[row] = [mine[data.prompt[mine] == p] for p in np.unique(data.prompt[mine])]

    def __call__(self, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        picked = []
        for row in rows.tolist():
            groups = self.groups[row]
            if self.balance == "prompt":
                picked.append(rng.choice(groups[rng.integers(len(groups))]))
            else:
                picked.append(rng.choice(np.concatenate(groups)))
        return np.asarray(picked, dtype=np.int64)


def cached_features(encoder: SentenceEncoder, tokenizer: TextTokenizer, texts: Sequence[str],
                    cache: dict[str, torch.Tensor], progress: bool = True) -> torch.Tensor:
    """The frozen encoder's features [m, width] of ``texts``, those in ``cache`` reused, the others added to it."""
    # like lengths together: a batch is padded to its longest text (a definition is 5x a name's tokens)
    todo = sorted((t for t in dict.fromkeys(texts) if t not in cache), key=len)
    cache.update(zip(todo, sentence_features(encoder, tokenizer, todo, progress), strict=True))
    return torch.stack([cache[t] for t in texts]) if texts else torch.zeros(0, encoder.width)


DEFAULT_SETTINGS = ZeroShotSettings()  # what `retrieval export --pretrained` trains with


def train_zero_shot_tower(head: torch.Tensor, settings: ZeroShotSettings | None = None,
                          classes: Sequence[ImageNetClass] | None = None, progress: bool = True,
                          log_line: Callable[[str], None] = lambda _: None,
                          encoded: dict[str, torch.Tensor] | None = None) -> ZeroShotTower:
    """Train a tower onto ``head``'s L2-normalised rows [C, dim] (``imagenet_head``) from the classes' texts
    (``classes``: default the ImageNet-1k classes timm ships, in the head's order). Seeded; the last epoch is
    delivered. With ``held_out_share`` the history holds the held-out classes' names' Recall@K among all rows.
    ``encoded``: sentence features by text, reused and filled in (trainings of one encoder over many settings)."""
    settings = settings if settings is not None else DEFAULT_SETTINGS  # read when called: tests train less
    classes = list(classes) if classes is not None else read_imagenet_classes()
    if head.ndim != 2 or len(head) != len(classes):
        raise ParameterError("head", f"has shape {list(head.shape)}; it must have one row per class "
                                     f"({len(classes)})")
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    rows = torch.nn.functional.normalize(head.detach().float(), dim=1)
    folder = Path(settings.encoder) if settings.encoder else default_encoder()
    tokenizer = TextTokenizer.from_file(str(folder / "tokenizer.json"), settings.max_tokens)
    tower = TextTower(SentenceEncoder.from_folder(folder), rows.shape[1])
    trained, held = split_classes(len(classes), settings.held_out_share, settings.classes, settings.seed)
    data = ClassTexts.of(classes, trained.tolist(), settings.prompts)
    queries = [name for row in held.tolist() for name in classes[row].lemmas]  # held-out classes: their names only
    query_owner = np.asarray([row for row in held.tolist() for _ in classes[row].lemmas], dtype=np.int64)
    loaded = time.perf_counter()
    features = cached_features(tower.encoder, tokenizer, data.texts + queries, {} if encoded is None else encoded,
                               progress)
    features, query_features = features[:len(data.texts)], features[len(data.texts):]
    encoded = time.perf_counter()
    tower.fit_projection(features, rows[data.owner])
    loss_fn = LiTLoss()
    optimizer = torch.optim.AdamW([*tower.projection.parameters(), loss_fn.log_scale], lr=settings.lr,
                                  weight_decay=1e-4)

    def measure(epoch: int, loss: float | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"epoch": epoch, "loss": loss, "scale": float(loss_fn.scale.detach())}
        if len(queries):
            with torch.no_grad():
                text = torch.nn.functional.normalize(tower.projection(query_features), dim=-1).numpy()
            entry.update({f"held_out_{k}": v for k, v in
                          recalls(text_to_image_ranks(text, rows.numpy(), query_owner)).items()})
        return entry

    history = [measure(0, None)]
    sample = _Sampler(data, trained, settings.balance)
    for epoch in progress_bar(range(1, settings.epochs + 1), desc="train zero-shot text tower", unit="epoch",
                              disable=not progress):
        losses = []
        order = rng.permutation(trained)
        for start in range(0, len(order), settings.batch_size):
            batch = order[start: start + settings.batch_size]
            if len(batch) < 2:
                continue
            picked = torch.from_numpy(sample(batch, rng))
            text = torch.nn.functional.normalize(tower.projection(features[picked]), dim=-1)
            loss = loss_fn(text, rows[torch.from_numpy(batch)])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        history.append(measure(epoch, float(np.mean(losses)) if losses else None))
    bridged = np.isin(data.prompt, [settings.prompts.index(p) for p in settings.bridge_prompts
                                    if p in settings.prompts])
    if bridged.any():  # over the trained classes only: held-out ones are what is measured
        present, owner = np.unique(data.owner[bridged], return_inverse=True)
        tower.bridge = ClassBridge.of_texts(features[torch.from_numpy(bridged)], torch.from_numpy(owner),
                                            rows[torch.from_numpy(present)], settings.bridge_temperature,
                                            None if settings.bridge_top is None else
                                            min(settings.bridge_top, len(present)))
    tower.eval()
    done = time.perf_counter()
    names = [c.name for c in classes]
    check = list(dict.fromkeys(names[:CHECK_TEXTS // 2] + data.texts[:: max(1, len(data.texts) // (CHECK_TEXTS // 2))]))
    log_line(f"zero-shot text tower: {len(trained)} classes, {len(data.texts)} texts, {settings.epochs} epochs "
             f"(encode {encoded - loaded:.1f} s, train {done - encoded:.1f} s)")
    return ZeroShotTower(tower, tokenizer, {"name": folder.name if settings.encoder else "all-MiniLM-L6-v2",
                                            "layers_tuned": 0}, names, check[:CHECK_TEXTS], history, len(data.texts),
                         {"load": round(loaded - started, 2), "encode": round(encoded - loaded, 2),
                          "train": round(done - encoded, 2)}, settings)
