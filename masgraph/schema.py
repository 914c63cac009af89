"""The graph file's JSON Schema for editors: GraphSpec's, with the registered algorithms and backends filled in."""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, TypeAdapter

from masgraph.spec import GraphSpec


def graph_json_schema(train_sections: list[type[BaseModel]], backends: list[str]) -> dict[str, Any]:
    """GraphSpec's JSON Schema for editors, with `train:` as the union of the registered algorithms' sections
    (keyed by `algorithm`) and `backend:` as the registered backends."""
    schema = GraphSpec.model_json_schema()
    defs = schema.setdefault("$defs", {})
    if train_sections:
        union = train_sections[0] if len(train_sections) == 1 else Union[tuple(train_sections)]  # noqa: UP007
        train = TypeAdapter(union).json_schema(ref_template="#/$defs/{model}")
        defs.update(train.pop("$defs", {}))
        if "$ref" not in train and "title" in train:  # one algorithm: its section inline; keep it under $defs
            defs[train["title"]], train = train, {"$ref": f"#/$defs/{train['title']}"}
        doc = schema["properties"]["train"].get("description", "")
        members = train["anyOf"] if "anyOf" in train else [train]
        schema["properties"]["train"] = {"anyOf": [*members, {"type": "null"}], "default": None, "description": doc}
    defs["PolicySpec"]["properties"]["backend"]["enum"] = sorted(backends)
    return schema
