"""The JSON schema a generated call must match: the call object (its name and arguments), and
its arguments closed to what the function declares.

A forced call (and a strict tool's call under `auto`) writes the declared arguments only: what
OpenAI's strict mode guarantees, and what tool executors check (smolagents refuses a call
with an argument its tool does not declare). So every object schema that declares
`properties` and says nothing of other properties gets `additionalProperties: false`.

Two cases need more than that:
- a function with no `parameters` (or `null`, or `{}`) takes no arguments (OpenAI: "omitting
  parameters defines a function with an empty parameter list"): its arguments are `{}`;
- `allOf` is an intersection: closing each branch on its own would refuse every property the
  other branches declare (an unsatisfiable schema). Branches that are plain object schemas
  (type, properties, required, annotations) are merged into their parent, which is then
  closed once; other `allOf` branches are left open (the parent closes what it declares).
"""

from __future__ import annotations

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

# keywords whose value is one subschema, a list of them, or a map of name -> subschema
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_PLAIN_OBJECT = {"type", "properties", "required", "title", "description", "$schema"}


def call_schema(function, arguments_key: str) -> dict:
    """The schema of one call object of `function` (`{"name": ..., <arguments_key>: {...}}`)."""
    # (no parameters, null or {}: no arguments; a schema without a type is still an object's)
    arguments = NO_ARGUMENTS if not function.parameters else closed({"type": "object", **function.parameters})
    return {"type": "object", "properties": {"name": {"const": function.name}, arguments_key: arguments},
            "required": ["name", arguments_key], "additionalProperties": False}


def closed(schema, close_here: bool = True):
    """`schema` with `additionalProperties: false` on every object that declares properties and
    says nothing of others (module doc); `close_here` False: not on `schema` itself (an `allOf`
    branch: its parent closes)."""
    if not isinstance(schema, dict):
        return schema
    schema = _merge_all_of(schema)
    out = {}
    for key, value in schema.items():
        if key in _ONE:
            out[key] = closed(value)
        elif key in _LIST and isinstance(value, list):
            out[key] = [closed(s) for s in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [closed(s, close_here=False) for s in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: closed(s) for name, s in value.items()}
        else:  # const, enum, default, examples, required, ... : data, not schemas
            out[key] = value
    if close_here and "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _merge_all_of(schema: dict) -> dict:
    """`schema` with its `allOf` merged in when every branch is a plain object schema (module
    doc): the properties of all (a property declared twice must match both), the required of all."""
    branches = schema.get("allOf")
    if not isinstance(branches, list) or not all(_plain_object(b) for b in [*branches, _without_all_of(schema)]):
        return schema
    merged = _without_all_of(schema)
    properties = dict(merged.get("properties", {}))
    required = list(merged.get("required", []))
    for branch in branches:
        for name, sub in branch.get("properties", {}).items():
            properties[name] = {"allOf": [properties[name], sub]} if name in properties else sub
        required += [name for name in branch.get("required", []) if name not in required]
    merged.update(type="object", properties=properties)
    if required:
        merged["required"] = required
    return merged


def _without_all_of(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k != "allOf"}


def _plain_object(schema) -> bool:
    return (isinstance(schema, dict) and set(schema) <= _PLAIN_OBJECT and schema.get("type", "object") == "object"
            and isinstance(schema.get("properties", {}), dict) and isinstance(schema.get("required", []), list))
