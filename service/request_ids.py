"""The request ids a worker accepts: non-empty, printable, bounded (a worker keeps them in its
tables and logs, so an unbounded id from a stranger would cost memory and log space)."""

from __future__ import annotations

from splitserve.request.errors import RequestError

# the router's max_request_id_len (256 by default) plus the '#' suffix it adds, with room
MAX_WORKER_REQUEST_ID_LEN = 1024


def check_request_id(request_id: str) -> str:
    if not request_id:
        raise RequestError.invalid("request_id is empty; give every request a unique id")
    if len(request_id) > MAX_WORKER_REQUEST_ID_LEN or not request_id.isprintable():
        raise RequestError.invalid(
            f"request_id must be at most {MAX_WORKER_REQUEST_ID_LEN} printable characters; "
            "use a shorter id"
        )
    return request_id
