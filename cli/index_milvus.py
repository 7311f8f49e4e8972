"""`retrieval index push`: an index folder into a Milvus collection, and the collection kept in step by `index add`,
`index remove` and `index upgrade` given ``--milvus URI --collection NAME`` (``sync_options``)."""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable
from typing import Any, TypeVar

import click

from retrieval.cli.config_options import command_options
from retrieval.cli.errors import OptionCommand
from retrieval.cli.index_common import finish, index_folder, json_option
from retrieval.cli.index_options import IndexOptions

F = TypeVar("F", bound=Callable)


@click.command("push", cls=OptionCommand)
@index_folder
@command_options(IndexOptions, "push_milvus", "push_collection", "index_type")
@json_option
def push_command(index_dir, milvus, collection, index_type, as_json) -> None:
    """Copy the index into a Milvus collection (its vectors, paths, labels and manifest columns; the model's hash,
    embedding size and preprocessing in the collection's properties), or bring one pushed before in step. A push
    stopped midway resumes with the same command; nothing is sent twice."""
    summary = push(index_dir, milvus, collection, index_type, switch=False, progress=not as_json)
    finish(summary, as_json, _line(summary, index_dir),
           f"retrieval serve --milvus {shlex.quote(milvus)} --collection {collection}")


def push(index_dir: str, milvus: str, collection: str, index_type: str | None, switch: bool,
         progress: bool) -> dict[str, Any]:
    """``push_index`` under the command line's names (``--milvus``, ``--collection``, ``--index-type``)."""
    from retrieval.index.layout import IndexLayout
    from retrieval.index.milvus.milvus_collection import MilvusPlace
    from retrieval.index.milvus.milvus_push import push_index

    place = MilvusPlace.checked(milvus, collection)
    where = IndexLayout(index_dir).vectors_in()
    if where is not None:  # built into Milvus: its writers wrote the collection themselves
        return _in_step(index_dir, place, where)
    return push_index(index_dir, place, index_type=index_type, progress=progress, switch=switch)


def _in_step(index_dir: str, place: Any, where: dict[str, str]) -> dict[str, Any]:
    """The summary of a folder whose vectors are in ``place`` already (a Ray build into Milvus): its writers keep
    the collection in step; any other collection is refused, as the vectors it would need are not in the folder."""
    if (place.uri, place.collection) != (where["milvus"], where["collection"]):
        raise click.ClickException(
            f"{index_dir} keeps its vectors in the Milvus collection {where['collection']} at {where['milvus']}, not "
            "in the folder, so they cannot be sent to another collection from it: give --milvus "
            f"{shlex.quote(where['milvus'])} --collection {where['collection']}, or build the index again into the "
            "other collection")
    from retrieval.index.catalogue_reader import CatalogueReader
    from retrieval.index.catalogue_schema import Status
    from retrieval.index.layout import IndexLayout

    with CatalogueReader(IndexLayout(index_dir).catalogue) as catalogue:
        rows = catalogue.counts()[Status.DONE.value]
    return {"collection": place.collection, "physical": where["physical"], "rows": rows, "sent": 0,
            "already_there": rows, "deleted": 0, "dropped": None, "seconds": 0.0, "state": "complete",
            "kept_by_the_writer": True}


def _line(summary: dict[str, Any], index_dir: str) -> str:
    if summary.get("kept_by_the_writer"):
        return (f"{index_dir} -> Milvus collection {summary['collection']} ({summary['physical']}): {summary['rows']} "
                "rows, written there by the command itself (the folder holds no vectors)")
    moved = f"; the name now serves {summary['physical']}, {summary['dropped']} dropped" if summary["dropped"] else ""
    return (f"{index_dir} -> Milvus collection {summary['collection']} ({summary['physical']}): {summary['rows']} "
            f"rows, {summary['sent']} sent, {summary['deleted']} deleted, {summary['already_there']} already there, "
            f"in {summary['seconds']} s{moved}")


def sync_options(switch: bool = False, checks_new_images: bool = False) -> Callable[[F], F]:
    """--milvus and --collection on a writer: once it has written the index, the collection is brought in step
    (``switch``: an upgrade to another model moves the name to the new model's rows); its line follows the
    writer's. ``checks_new_images``: the command takes ``check_new`` (``add_images``'s), given the check that the
    collection can take the new images' columns, before anything is written."""

    def decorate(command: F) -> F:
        @functools.wraps(command)
        def run(*args: Any, milvus: str | None = None, collection: str | None = None, **kwargs: Any) -> Any:
            if (milvus is None) != (collection is None):
                raise click.UsageError("give --milvus URI and --collection NAME together")
            if milvus is not None:  # checked before the writer's work, not after it
                from retrieval.index.layout import IndexLayout
                from retrieval.index.milvus.milvus_collection import MilvusPlace
                from retrieval.index.milvus.milvus_push import new_images_check

                place = MilvusPlace.checked(milvus, collection)
                if checks_new_images and IndexLayout(kwargs["index_dir"]).vectors_in() is None:
                    kwargs["check_new"] = new_images_check(kwargs["index_dir"], place)
            result = command(*args, **kwargs)
            if milvus is not None:
                summary = push(kwargs["index_dir"], milvus, collection, None, switch,
                               progress=not kwargs.get("as_json"))
                if not kwargs.get("as_json"):
                    click.echo(_line(summary, kwargs["index_dir"]))
            return result

        return command_options(IndexOptions, "sync_milvus", "sync_collection")(run)

    return decorate
