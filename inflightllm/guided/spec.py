"""What a constrained request asks for, and its validation before any tokenizer is needed.

A `GuidedSpec` is a kind and a text: a JSON schema (JSON text), any JSON object, a regular
expression, an EBNF (GBNF-style) grammar, or a choice among strings (a JSON list). It
travels inside `SamplingParams` (hashable, serializable) and is the key of the compiled
grammar cache. `check_spec` parses it with xgrammar's tokenizer-independent parsers, so
preprocessing and the engine refuse a bad schema, regex or grammar at once, with an error
naming the field, never after it reached the batch.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

# Kinds and the request field that sets each (vLLM's `guided_*` names).
KINDS = {
    "json_schema": "guided_json",
    "json_object": "guided_json_object",
    "regex": "guided_regex",
    "grammar": "guided_grammar",
    "choice": "guided_choice",
}

# The kinds' codes in the engine model's `guided_type` input (0: no constraint); the text
# travels as UTF-8 bytes in `guided_guide` (docs/INTERFACE.md, "preprocessing -> engine").
KIND_CODES = {"json_schema": 1, "json_object": 2, "regex": 3, "grammar": 4, "choice": 5}
KIND_BY_CODE = {code: kind for kind, code in KIND_CODES.items()}

# JSON Schema keywords xgrammar enforces (json_schema_converter), and annotations that
# constrain nothing. Any other keyword (allOf, multipleOf, uniqueItems, not, if/then, ...)
# would be ignored or only partly enforced by the grammar: it is refused instead, naming
# where it is.
ENFORCED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "$ref", "$defs",
    "definitions", "pattern", "minLength", "maxLength", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "format", "minProperties", "maxProperties",
    "patternProperties", "propertyNames",
})
ANNOTATION_KEYWORDS = frozenset({
    "$schema", "$id", "$comment", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "strict", "$anchor",
})
# Keywords whose value maps names to subschemas (the names are not keywords).
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")
# String formats the grammar enforces; any other `format` is refused.
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference",
    "uri-template", "ipv4", "ipv6", "hostname",
})


class GuidedSpecError(ValueError):
    """A guided-decoding setting that cannot be compiled; the message names the field."""


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """One constraint: `kind` (a key of KINDS) and its text (the schema as JSON text, the
    regex, the grammar, or the choices as a JSON list; empty for json_object)."""

    kind: str
    text: str = ""

    @property
    def field(self) -> str:
        return KINDS.get(self.kind, "guided_decoding")

    def describe(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"{self.kind} {text!r}" if text else self.kind


def choice_spec(choices) -> GuidedSpec:
    """A choice among strings: `choices` a list of non-empty strings."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise GuidedSpecError("guided_choice: expected a non-empty list of strings")
    for index, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise GuidedSpecError(f"guided_choice[{index}]: {choice!r} is not a non-empty string")
    return GuidedSpec("choice", json.dumps(list(choices), ensure_ascii=False))


def json_schema_spec(schema, field: str = "guided_json") -> GuidedSpec:
    """A JSON schema given as a dict or JSON text (normalised to compact JSON text, the key
    order kept: it is the order of the generated object's properties)."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise GuidedSpecError(f"{field}: the schema is not valid JSON: {error}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GuidedSpecError(f"{field}: the schema must be a JSON object, got {type(schema).__name__}")
    return GuidedSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def choice_grammar(text: str) -> str:
    """The EBNF grammar of a choice: `root ::= "a" | "b"` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(text))


def check_schema_keywords(schema, path: str = "") -> None:
    """Refuse keywords the grammar would ignore, naming their place (`#/properties/a`)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GuidedSpecError(f"{path or '#'}: a schema must be an object or a boolean, got {schema!r}")
    for key, value in schema.items():
        where = f"{path or '#'}/{key}"
        if key in ANNOTATION_KEYWORDS:
            continue
        if key not in ENFORCED_KEYWORDS:
            raise GuidedSpecError(
                f"{where}: the JSON Schema keyword {key!r} is not supported by guided decoding "
                f"(supported: {', '.join(sorted(ENFORCED_KEYWORDS))})"
            )
        if key == "format" and value not in FORMATS:
            raise GuidedSpecError(f"{where}: format {value!r} is not supported (supported: {', '.join(sorted(FORMATS))})")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema_keywords(sub, f"{where}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for index, sub in enumerate(value):
                check_schema_keywords(sub, f"{where}/{index}")
        elif key in _SCHEMA_VALUES and isinstance(value, (dict, bool)):
            check_schema_keywords(value, where)


# Specs that passed check_spec (most recent last). A burst of requests under one schema
# checks it once: the meta-schema check and xgrammar's parse of a schema of a few dozen keys
# took ~4-6 ms a request (1,024 constrained requests spent ~4 s in add_request on an H200
# host, with the GPU idle). A spec that fails is checked again each time (its error names
# the field).
CHECKED_SPECS_MAX = 1024
_checked_specs: OrderedDict[GuidedSpec, None] = OrderedDict()
_checked_lock = threading.Lock()


def check_spec(spec: GuidedSpec, meta_schema: bool = True) -> None:
    """Raise GuidedSpecError naming the field when `spec` cannot be compiled: not valid
    JSON, not a valid JSON Schema (`jsonschema`'s meta-schema check), an unsupported
    keyword, a regex or grammar xgrammar does not parse. Needs no tokenizer. A spec that
    passed recently (CHECKED_SPECS_MAX of them) is not checked again.

    meta_schema=False: all but the meta-schema check (the engine's step thread, where a
    new schema's 1.4-2.5 ms in `jsonschema` delayed every running request's next token;
    the grammar compiler's worker then runs the whole check before compiling)."""
    field = spec.field
    try:
        import jsonschema  # noqa: F401 - the meta-schema check
        import xgrammar  # noqa: F401
    except ImportError as error:  # a host without them (the air-gapped bundle has none yet)
        raise GuidedSpecError(f"{field}: structured output needs the {error.name} package, which is not "
                              "installed on this server") from None
    with _checked_lock:
        if spec in _checked_specs:
            _checked_specs.move_to_end(spec)
            return
    _check_spec_uncached(spec, meta_schema)
    if not meta_schema and spec.kind == "json_schema":
        return  # not wholly checked: not remembered as passed
    with _checked_lock:
        _checked_specs[spec] = None
        while len(_checked_specs) > CHECKED_SPECS_MAX:
            _checked_specs.popitem(last=False)


def _check_spec_uncached(spec: GuidedSpec, meta_schema: bool = True) -> None:
    import xgrammar as xgr

    field = spec.field
    if spec.kind not in KINDS:
        raise GuidedSpecError(f"guided_decoding: kind {spec.kind!r} is not one of {', '.join(KINDS)}")
    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if meta_schema:
                _check_meta_schema(schema, field)
            try:
                check_schema_keywords(schema)
            except GuidedSpecError as error:
                raise GuidedSpecError(f"{field}: {error}") from None
            xgr.Grammar.from_json_schema(spec.text)
        elif spec.kind == "regex":
            if not spec.text:
                raise GuidedSpecError(f"{field}: the regex is empty")
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "grammar":
            if not spec.text.strip():
                raise GuidedSpecError(f"{field}: the grammar is empty")
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "choice":
            choice_spec(json.loads(spec.text))
            xgr.Grammar.from_ebnf(choice_grammar(spec.text))
    except GuidedSpecError:
        raise
    except (RuntimeError, ValueError, TypeError) as error:
        raise GuidedSpecError(f"{field}: {_short(error)}") from None


def _check_meta_schema(schema, field: str) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "#/" + "/".join(str(part) for part in error.path) if error.path else "#"
        raise GuidedSpecError(f"{field}: not a valid JSON Schema at {where}: {error.message}") from None


def _short(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1] if "] " in text.split(": ", 1)[0] else text
        if ".cc:" in text.split(" ", 1)[0] or ".h:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[1] if ": " in text else text
    return text.splitlines()[0] if text else type(error).__name__
