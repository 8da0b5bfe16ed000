"""Routes that take a JSON body (``route_class=JsonBodyRoute``): the bearer token is checked before
the body is read, so a caller without the token learns nothing about its body (FastAPI parses a body
before it runs a route's dependencies), and each member name of the body is given once (Python's
reader takes the last of two ``"stages"`` silently). A body that cannot be read (not UTF-8, nested too
deeply, a name given twice) is 422 ``request_invalid`` saying why, never a bare 400 "There was an error
parsing the body". ``NaN`` and ``Infinity`` are read as Python reads them: the fields' own bounds
refuse them (``duration_invalid``, ...).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from sidecar.api.state import require_token


class _Refused(ValueError):
    """What this reader refuses in text Python's reader takes."""


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"the member {key!r} is given twice; give each once")
        out[key] = value
    return out


def read_json(body: bytes) -> Any:
    """``body`` as JSON, each member name once; every refusal is a ``json.JSONDecodeError`` whose
    ``msg`` says why (FastAPI answers that as a ``json_invalid`` request error)."""
    try:
        return json.loads(body, object_pairs_hook=_members)
    except json.JSONDecodeError as exc:
        raise json.JSONDecodeError(f"{exc.msg} (line {exc.lineno} column {exc.colno})", exc.doc, exc.pos) from None
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"the body is not UTF-8 text (read as {exc.encoding}: {exc.reason} at byte "
                                   f"{exc.start})", "", 0) from None
    except RecursionError:
        raise json.JSONDecodeError("the body is nested too deeply", "", 0) from None
    except _Refused as exc:
        raise json.JSONDecodeError(str(exc), "", 0) from None
    except ValueError:  # Python's own bound on the digits of an integer
        raise json.JSONDecodeError(f"a number has more than {sys.get_int_max_str_digits()} digits", "", 0) from None


class _StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = read_json(await self.body())
        return self._json


class JsonBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle
        needs_token = any(dep.dependency is require_token for dep in self.dependencies)

        async def run(request: Request) -> Response:
            if needs_token:
                await require_token(request)
            return await handle(_StrictJsonRequest(request.scope, request.receive))

        return run


__all__ = ["JsonBodyRoute", "read_json"]
