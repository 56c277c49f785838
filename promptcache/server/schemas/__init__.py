"""Request bodies at the HTTP edge (pydantic), one module per API. Unknown fields are accepted
and ignored; known fields are strictly typed (``"max_tokens": "8"`` is a 400, not 8): every
body derives from ``Loose``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
