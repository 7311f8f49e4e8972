"""Help texts built, when ``--help`` shows them, from the facts they name: the registries and the decoder's formats.

The registries are filled by modules that import torch (losses, backbones, data sets) and the decoder imports numpy
and Pillow, so an option's help is computed only when it is displayed: starting the command line imports none of
them, and no help text keeps a copy of a list that lives elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from retrieval.extras import extra_of_module, install_command


class LazyHelpOption(click.Option):
    """A ``click.Option`` whose help is ``help_text()``, called when the help is shown."""

    def __init__(self, param_decls: Sequence[str], *, help_text: Callable[[], str], **attrs: Any) -> None:
        super().__init__(param_decls, **attrs)
        self.help_text = help_text

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        self.help = self.help_text()
        return super().get_help_record(ctx)


def lazy_help_option(*param_decls: str, help_text: Callable[[], str], **attrs: Any) -> Callable:
    """``click.option`` with a help text computed when shown (see ``LazyHelpOption``)."""
    return click.option(*param_decls, cls=LazyHelpOption, help_text=help_text, **attrs)


def listing(names: Callable[[], list[str]]) -> str:
    """``names()`` as ``a | b | c``; where the registry's modules need an extra that is not installed (the losses and
    backbones need torch), where to get the list instead of a traceback in the middle of --help."""
    try:
        return " | ".join(names())
    except ModuleNotFoundError as exc:
        extra = extra_of_module(exc.name)
        if extra is None:
            raise
        return f"listed once the {extra} extra is installed ({install_command(extra)})"


def dataset_names() -> list[str]:
    """The registered data sets (``retrieval.data.DATASETS``)."""
    from retrieval.data import DATASETS

    return DATASETS.names()


def backbone_names() -> list[str]:
    """The registered backbones, and the ``timm:`` prefix."""
    from retrieval.models import backbone_names

    return backbone_names()


def loss_names() -> list[str]:
    """The registered losses (``retrieval.losses.registry.LOSSES``)."""
    from retrieval.losses.registry import LOSSES

    return LOSSES.names()


def negatives_names() -> list[str]:
    """The registered hard-negative methods (``retrieval.losses.registry.NEGATIVES``)."""
    from retrieval.losses.registry import NEGATIVES

    return NEGATIVES.names()


def augmentation_help() -> str:
    """The augmentation presets (``retrieval.data.augment.AUGMENTATIONS``), each with what it does."""
    from retrieval.data.augment import AUGMENTATIONS, DEFAULT_AUGMENTATION, augmentation_names

    return "; ".join(f"{name}{' (default)' if name == DEFAULT_AUGMENTATION else ''}: "
                     f"{AUGMENTATIONS.build(name).describe()}" for name in augmentation_names())


def image_extensions() -> str:
    """The decoder's file extensions (``IMAGE_EXTENSIONS``) as ``bmp/gif/...``: what a gallery folder holds."""
    from retrieval.data.formats import IMAGE_EXTENSIONS

    return "/".join(sorted(extension.lstrip(".") for extension in IMAGE_EXTENSIONS))


def default_max_pixels() -> str:
    """The decoder's pixel limit (``DEFAULT_MAX_PIXELS``), as ``40,000,000``."""
    from retrieval.data.decode import DEFAULT_MAX_PIXELS

    return f"{DEFAULT_MAX_PIXELS:,}"
