"""The API's own answer bodies (not documents), which `Client` reads as the API writes them;
request bodies have `model.bodies.RequestBody`."""

from datetime import datetime
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from jobplane.model.documents import ApiKeyPublic, Template

T = TypeVar("T")


class ResponseBody(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class Page(ResponseBody, Generic[T]):
    """A page of a list; `nextCursor`, if any, asks for the next."""

    items: list[T]
    next_cursor: str | None = None


class Registered(Template):
    """The registered version; whether registering made it (false: the definition equals the
    latest version, which is answered); and what may keep its runs from starting: a handler no
    live worker offers on the template's queue. Registering succeeds all the same."""

    created: bool
    warnings: list[str] = Field(default_factory=list)


class KeyCreated(ApiKeyPublic):
    """A new key and its secret, `key`: shown here once, stored only as a hash."""

    key: str


class FireTime(ResponseBody):
    utc: datetime
    local: datetime


class Preview(ResponseBody):
    """A schedule's next fire times, in UTC and in its zone."""

    timezone: str
    times: list[FireTime]
