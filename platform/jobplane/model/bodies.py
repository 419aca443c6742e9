"""The base of request bodies, which the API and the direct client check alike."""

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class RequestBody(BaseModel):
    """camelCase, no unknown fields, and strict: "5" is not a number and 1 is not a string
    (a field that parses text, such as a time, says so with `Field(strict=False)`)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True
    )
