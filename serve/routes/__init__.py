"""The HTTP API's routes, one ``APIRouter`` per resource; ``retrieval.serve.api.create_api`` includes them.

- ``context``: ``ApiContext`` (the service, the lanes and body budget, the settings), the one object the routes
  share, kept on ``app.state.api`` and given to each route by the ``Api`` dependency.
- ``schemas``: the documented shapes (response models, error statuses, request bodies, query parameters).
- ``queries``: JSON search bodies -> queries, ``k``, ``where``, ``exclude_self`` (CPU work, run off the loop).
- ``responses``: rendering answers in worker threads, the error handlers, the 503 of a full lane.
- ``search``: POST /search and POST /search/batch.
- ``items``: GET /items/{item_id} and /items/{item_id}/image.
- ``status``: GET /stats and /health (GET /metrics is ``retrieval.serve.observability``'s).
- ``openapi``: the OpenAPI document as served (request bodies of this index's dimension, no list-shaped 422).
- ``leaf_routes`` (here): an app's routes with its included routers opened, what the token (``server``) and the
  metrics (``observability``) match request paths against.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from starlette.routing import BaseRoute


def leaf_routes(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """``routes`` with each router that ``include_router`` added opened into its own routes, in order.

    Recent FastAPI keeps an included router as one route of the app (older versions copied its routes in); the
    API's routers are included without a prefix, so their routes' own paths are the app's.
    """
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from leaf_routes(included.routes)
        else:
            yield route
