"""Structured-output test cases: 40 JSON schemas of the kinds of JSON Schema's test suite
(nested objects, arrays with minItems, enums, pattern, numbers with bounds, anyOf, $ref),
20 regular expressions and 5 EBNF grammars, each with an independent check (`jsonschema`,
`re.fullmatch`). Every case is bounded (maxLength, maxItems, enums, repetition counts) so
that a small model's output ends within a few dozen tokens."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict] = [
    # flat objects and scalars
    {"type": "object", "properties": {"name": NAME, "age": SMALL_INT}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}}, "required": ["id"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}, "done": {"type": "boolean"}},
     "required": ["title", "done"]},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "boolean"},
    {"type": "string", "maxLength": 10},
    {"type": "null"},
    # numbers with bounds
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["score"]},
    {"type": "object", "properties": {"t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
     "required": ["t"]},
    {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}}, "required": ["year"]},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "y": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["x", "y"]},
    # enums and const
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"enum": ["small", "medium", "large"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "tag": {"const": "v1"}}, "required": ["level", "tag"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", None]}}, "required": ["answer"]},
    # pattern
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "string", "pattern": "^[a-z]{2,6}$"},
    {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["hex"]},
    # arrays with minItems / maxItems
    {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
     "items": False},
    # nested objects
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"name": NAME, "age": SMALL_INT},
                                                 "required": ["name", "age"]}}, "required": ["person"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": SMALL_INT, "y": SMALL_INT}, "required": ["x", "y"]}, "label": NAME}, "required": ["point", "label"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                                              "n": SMALL_INT}, "required": ["ok", "n"]}},
     "required": ["meta"]},
    # anyOf
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]}},
     "required": ["v"]},
    {"anyOf": [{"type": "object", "properties": {"cat": NAME}, "required": ["cat"]},
               {"type": "object", "properties": {"dog": NAME}, "required": ["dog"]}]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                                       {"type": "string", "pattern": "^[a-z]{3}$"}]}}, "required": ["id"]},
    # $ref
    {"$defs": {"pt": {"type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT}, "required": ["x", "y"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
     "required": ["from", "to"]},
    {"$defs": {"name": NAME}, "type": "array", "items": {"$ref": "#/$defs/name"}, "minItems": 1, "maxItems": 2},
    {"definitions": {"color": {"enum": ["red", "blue"]}}, "type": "object",
     "properties": {"fg": {"$ref": "#/definitions/color"}, "bg": {"$ref": "#/definitions/color"}},
     "required": ["fg", "bg"]},
    {"$defs": {"leaf": {"type": "integer", "minimum": 0, "maximum": 9}}, "type": "object",
     "properties": {"n": {"$ref": "#/$defs/leaf"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]},
    # mixed
    {"type": "object", "properties": {"name": NAME, "role": {"enum": ["admin", "user"]},
                                      "ids": {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 2}},
     "required": ["name", "role", "ids"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                                      "ok": {"type": "boolean"}}, "required": ["date", "ok"]},
]

REGEXES: list[str] = [
    r"\d{3}-\d{4}",
    r"[a-z]{3,8}",
    r"(cat|dog|bird)",
    r"[A-Z][a-z]{2,6} [A-Z][a-z]{2,6}",
    r"\d{4}-\d{2}-\d{2}",
    r"0x[0-9a-f]{4}",
    r"(yes|no)",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"#[0-9A-F]{6}",
    r"v\d\.\d{1,2}\.\d{1,2}",
    r"(true|false)",
    r"[1-9]\d{0,2}(,\d{3}){0,2}",
    r"(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day",
    r"[a-z]{2,5}(-[a-z]{2,5}){1,3}",
    r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}",
    r"[A-Z]{2}\d{6}",
    r"(red|green|blue), (red|green|blue)",
    r"https://[a-z]{3,10}\.com",
    r"Answer: [A-D]",
]

# (EBNF grammar, an equivalent Python regex to check the output independently)
GRAMMARS: list[tuple[str, str]] = [
    ('root ::= greeting " " name\ngreeting ::= "Hello" | "Hi"\nname ::= [A-Z] [a-z]{1,8}',
     r"(Hello|Hi) [A-Z][a-z]{1,8}"),
    ('root ::= "[" item ("," item){0,3} "]"\nitem ::= [0-9]{1,3}', r"\[[0-9]{1,3}(,[0-9]{1,3}){0,3}\]"),
    ('root ::= pair (";" pair){0,2}\npair ::= [a-z]{1,6} "=" [0-9]{1,4}', r"[a-z]{1,6}=[0-9]{1,4}(;[a-z]{1,6}=[0-9]{1,4}){0,2}"),
    ('root ::= "SELECT " col (", " col){0,2} " FROM " table\ncol ::= "id" | "name" | "age"\ntable ::= "users" | "orders"',
     r"SELECT (id|name|age)(, (id|name|age)){0,2} FROM (users|orders)"),
    ('root ::= term (op term){0,3}\nop ::= "+" | "-" | "*"\nterm ::= num | "(" num op num ")"\nnum ::= [0-9]{1,2}',
     r"([0-9]{1,2}|\([0-9]{1,2}[-+*][0-9]{1,2}\))([-+*]([0-9]{1,2}|\([0-9]{1,2}[-+*][0-9]{1,2}\))){0,3}"),
]


def run_to_end(engine) -> tuple[dict[str, list[int]], dict[str, tuple]]:
    """Step the engine until every request ends: each request's tokens, and its
    (finish reason, error) once finished."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, tuple] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finished[output.request_id] = (output.finish_reason, output.error)
    return tokens, finished
