"""GET /items/{item_id} and /items/{item_id}/image: an indexed image's catalogue entry and its file."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from retrieval.data.formats import IMAGE_MEDIA_TYPES
from retrieval.serve.images import QueryError
from retrieval.serve.routes.context import Api
from retrieval.serve.routes.responses import file_chunks
from retrieval.serve.routes.schemas import ItemId, ItemModel, error_responses
from retrieval.serve.service import SearchService

ITEM_PATH = "/items/{item_id}"
IMAGE_PATH = "/items/{item_id}/image"

router = APIRouter()


def item_or_404(service: SearchService, item_id: str) -> dict[str, Any]:
    """The catalogue entry of the indexed image ``item_id`` names, else a 404."""
    # ASCII digits only, and within SQLite's integer range: anything else is simply not an id (404)
    is_id = item_id.isascii() and item_id.isdigit() and len(item_id) <= 18
    row = service.item(int(item_id)) if is_id else None
    if row is None:
        raise QueryError(f"no indexed image with id {item_id[:40]!r}", 404)
    return row


@router.get(ITEM_PATH, response_model=ItemModel, responses=error_responses(401, 403, 404))
def item(item_id: ItemId, api: Api) -> dict[str, Any]:
    """The catalogue entry of an indexed image."""
    return item_or_404(api.service, item_id)


IMAGE_CONTENT = {media: {"schema": {"type": "string", "format": "binary"}} for media in IMAGE_MEDIA_TYPES.values()}


@router.get(
    IMAGE_PATH,
    response_class=Response,
    responses={200: {"description": "the image file", "content": IMAGE_CONTENT}} | error_responses(401, 403, 404),
)
def item_image(item_id: ItemId, api: Api) -> Response:
    """The image file itself; only regular files of indexed catalogue rows are ever served."""
    row = item_or_404(api.service, item_id)
    handle, size, media_type = api.service.open_image_file(row["id"])
    return StreamingResponse(
        file_chunks(handle), media_type=media_type, headers={"content-length": str(size)}
    )
