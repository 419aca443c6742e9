"""The base model of the API's own response bodies (not documents); request bodies have
`model.bodies.RequestBody`, which the direct client checks with too."""

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ResponseBody(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
