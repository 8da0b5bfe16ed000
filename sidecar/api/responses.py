"""The API's JSON reply: Starlette's, except that a string which is not valid text (a file name
that is not UTF-8 reaching a reason or a detail) is shown with ``\\xNN`` bytes instead of failing
the whole reply with a 500 (sidecar/control/filenames.py)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from sidecar.control.filenames import shown_data


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:  # rare: only then is every string walked
            return super().render(shown_data(content))


__all__ = ["SafeJSONResponse"]
