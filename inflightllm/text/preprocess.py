"""The `preprocessing` model's logic: client inputs -> one engine request.

`build_engine_request` validates a request's inputs (docs/INTERFACE.md, "Ensemble
inputs"), merges the vLLM-style `sampling_parameters` JSON, applies the chat template,
tokenizes, packs stop/bad words, and returns the full "preprocessing -> engine" tensor
set with defaults filled in. It works on plain NumPy arrays (each with the leading batch
dimension of 1 that Triton gives), so it is tested without a server; the Triton model
only converts tensors and turns `RequestError` into an error response.

Every error message names the input (`input 'temperature'` for a tensor,
`sampling_parameters key 'temperature'` for the JSON), the bad value and what is allowed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from inflightllm import request_rules as rules
from inflightllm import token_sequences as packing
from inflightllm.guided.spec import (
    KIND_CODES,
    GuidedSpec,
    GuidedSpecError,
    check_spec,
    choice_spec,
    json_schema_spec,
)

# sampling_parameters keys, in the order docs/INTERFACE.md lists them.
SAMPLING_PARAMETER_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "bad_words",
    "ignore_eos",
    "logprobs",
    "n",
    # Structured output (docs/STRUCTURED-OUTPUT.md): at most one of the guided_* constraints.
    "guided_json",
    "guided_json_object",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "best_of",
    "beam_width",
    "length_penalty",
    "early_stopping",
)

# TensorRT-LLM's `guided_decoding_guide_type` values -> our constraint kinds.
TRTLLM_GUIDE_TYPES = {"json": "json_object", "json_schema": "json_schema", "regex": "regex", "ebnf_grammar": "grammar"}
# `guided_decoding_backend` values accepted (vLLM's names for the one backend there is).
GUIDED_BACKENDS = ("xgrammar", "auto")

# Inputs accepted for compatibility and otherwise ignored (their outputs are always sent,
# and outputs are never padded).
IGNORED_INPUTS = ("pad_id", "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")

# Other backends' names for our inputs: TensorRT-LLM's `random_seed` and `min_length`.
# Giving both names of one setting is an error.
INPUT_ALIASES = {"random_seed": "seed", "min_length": "min_tokens"}

# vLLM's sampling_parameters come as JSON whose numbers may be strings (genai-perf sends
# {"max_tokens": "128"}); the vLLM backend converts these keys, and so do we.
_NUMERIC_STRING_KEYS = {
    "temperature": float, "top_p": float, "min_p": float, "repetition_penalty": float,
    "presence_penalty": float, "frequency_penalty": float,
    "top_k": int, "max_tokens": int, "min_tokens": int, "seed": int, "logprobs": int, "n": int,
    "best_of": int, "beam_width": int, "length_penalty": float,
}

# The "preprocessing -> engine" tensors: name -> NumPy dtype. Each is [1, ...].
ENGINE_REQUEST_DTYPES: dict[str, type] = {
    "input_ids": np.int32,
    "input_length": np.int32,
    "max_tokens": np.int32,
    "min_tokens": np.int32,
    "streaming": np.bool_,
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "min_p": np.float32,
    "repetition_penalty": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "seed": np.int64,
    "end_id": np.int32,
    "ignore_eos": np.bool_,
    "stop_words": np.int32,
    "bad_words": np.int32,
    "return_log_probs": np.bool_,
    "num_top_logprobs": np.int32,
    "priority": np.int32,
    "exclude_input_in_output": np.bool_,
    "timeout_ms": np.int32,
    # Structured output: the kind's code (inflightllm.guided.spec.KIND_CODES, 0 = none) and
    # the schema, regex, grammar or choices as UTF-8 bytes ([1, n], n >= 1).
    "guided_type": np.int32,
    "guided_guide": np.uint8,
    # Several outputs (docs/SEQUENCE-GROUPS.md): n, best_of (0 = n), beam_width,
    # length_penalty and early_stopping (EARLY_STOPPING_CODES) of beam search.
    "n": np.int32,
    "best_of": np.int32,
    "beam_width": np.int32,
    "length_penalty": np.float32,
    "early_stopping": np.int32,
}

# early_stopping on the wire: 0 false, 1 true, 2 "never" (transformers' three values).
EARLY_STOPPING_CODES = {False: 0, True: 1, "never": 2}


class RequestError(ValueError):
    """A request's input is invalid; the message is sent to the client as is."""


@dataclass(frozen=True)
class RequestLimits:
    """The deployment's limits a request is checked against."""

    max_input_length: int  # longest prompt, in tokens
    max_output_len: int  # largest max_tokens
    max_model_len: int  # prompt tokens + max_tokens
    priority_levels: int  # priorities 0 .. priority_levels - 1
    vocab_size: int  # token ids are 0 .. vocab_size - 1

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], vocab_size: int) -> RequestLimits:
        """From the `preprocessing` config's string parameters. `max_model_len` defaults
        to max_input_length + max_output_len; the others to the engine defaults."""

        def integer(key: str, default: int) -> int:
            raw = str(params.get(key, "")).strip()
            if raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"preprocessing parameter {key!r}: {raw!r} is not an integer") from None

        max_input_length = integer("max_input_length", 2048)
        max_output_len = integer("max_output_len", 1024)
        return cls(
            max_input_length=max_input_length,
            max_output_len=max_output_len,
            max_model_len=integer("max_model_len", max_input_length + max_output_len),
            priority_levels=integer("priority_levels", 3),
            vocab_size=vocab_size,
        )


# ----------------------------------------------------------------------------- helpers


def _tensor_label(name: str) -> str:
    return f"input '{name}'"


def _json_label(key: str) -> str:
    return f"sampling_parameters key '{key}'"


def _show(value) -> str:
    """A value as an error message shows it: JSON for JSON values, NumPy's shortest
    form for tensor values (float32 0.1 shows as 0.1)."""
    if isinstance(value, (np.generic, np.ndarray)):
        return str(value)
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _json_type_name(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _out_of_range(label: str, value, allowed: str) -> RequestError:
    return RequestError(f"{label}: {_show(value)} is out of range; allowed: {allowed}")


def _decode_bytes(label: str, item) -> str:
    if isinstance(item, (bytes, np.bytes_)):
        try:
            return bytes(item).decode("utf-8")
        except UnicodeDecodeError as error:
            raise RequestError(f"{label}: the text is not valid UTF-8 ({error})") from None
    return str(item)


def _scalar(name: str, array: np.ndarray):
    """The one value of a [1, 1] (or [1]) tensor."""
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise RequestError(
            f"{_tensor_label(name)}: expected one value per request, got {flat.size} (shape {list(np.shape(array))})"
        )
    return flat[0]


# JSON type checks: key -> (check, expected type in words).
def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_string_or_strings(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


_JSON_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "temperature": (_is_number, "a number"),
    "top_k": (_is_integer, "an integer"),
    "top_p": (_is_number, "a number"),
    "min_p": (_is_number, "a number"),
    "repetition_penalty": (_is_number, "a number"),
    "presence_penalty": (_is_number, "a number"),
    "frequency_penalty": (_is_number, "a number"),
    "max_tokens": (_is_integer, "an integer"),
    "min_tokens": (_is_integer, "an integer"),
    "seed": (_is_integer, "an integer"),
    "stop": (_is_string_or_strings, "a string or a list of strings"),
    "stop_token_ids": (
        lambda v: isinstance(v, list) and all(_is_integer(i) for i in v),
        "a list of integers",
    ),
    "bad_words": (_is_string_or_strings, "a string or a list of strings"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a boolean"),
    "logprobs": (_is_integer, "an integer"),
    "n": (_is_integer, "an integer"),
    "guided_json": (lambda v: isinstance(v, (dict, str, bool)), "a JSON schema (an object, or its JSON text)"),
    "guided_json_object": (lambda v: isinstance(v, bool), "a boolean"),
    "guided_regex": (lambda v: isinstance(v, str), "a string"),
    "guided_choice": (lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v), "a list of strings"),
    "guided_grammar": (lambda v: isinstance(v, str), "a string"),
    "guided_decoding_backend": (lambda v: isinstance(v, str), "a string"),
    "best_of": (_is_integer, "an integer"),
    "beam_width": (_is_integer, "an integer"),
    "length_penalty": (_is_number, "a number"),
    "early_stopping": (lambda v: isinstance(v, bool) or v == "never", 'true, false or "never"'),
}
assert set(_JSON_TYPES) == set(SAMPLING_PARAMETER_KEYS)


def parse_sampling_parameters(array: np.ndarray | None) -> dict:
    """The `sampling_parameters` JSON object, type-checked. Keys with a null value count
    as not given; an empty string counts as no JSON at all."""
    if array is None:
        return {}
    text = _decode_bytes("sampling_parameters", _scalar("sampling_parameters", array))
    if text.strip() == "":
        return {}
    try:
        params = json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError(f"sampling_parameters: not valid JSON ({error})") from None
    if not isinstance(params, dict):
        raise RequestError(
            f"sampling_parameters: {_show(params)} is {_json_type_name(params)}; expected a JSON object"
        )
    for key, value in list(params.items()):
        if key not in _JSON_TYPES:
            raise RequestError(
                f"sampling_parameters: unknown key '{key}'; allowed keys: {', '.join(SAMPLING_PARAMETER_KEYS)}"
            )
        if value is None:
            continue
        if isinstance(value, str) and key in _NUMERIC_STRING_KEYS:
            value = params[key] = _number_from_string(key, value, _NUMERIC_STRING_KEYS[key])
        check, expected = _JSON_TYPES[key]
        if not check(value):
            described = _json_type_name(value)
            if isinstance(value, list):
                wrong = next(
                    (v for v in value if not (isinstance(v, str) if "string" in expected else _is_integer(v))),
                    None,
                )
                described = f"a list holding {_json_type_name(wrong)}"
            raise RequestError(
                f"{_json_label(key)}: {_show(value)} is {described}; expected {expected}"
            )
    return {key: value for key, value in params.items() if value is not None}


def _number_from_string(key: str, text: str, kind: type):
    """A vLLM-style number given as a JSON string ("128", "0.7")."""
    try:
        number = kind(text.strip())
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise RequestError(
            f"{_json_label(key)}: {_show(text)} is a string that is not {expected}; expected {expected}"
        ) from None
    if kind is float and not math.isfinite(number):
        raise RequestError(f"{_json_label(key)}: {_show(text)} is not a finite number; expected a number")
    return number


class _Resolver:
    """Looks a setting up: the input tensor wins, then the JSON key, then the default."""

    def __init__(self, inputs: Mapping[str, np.ndarray | None], params: dict) -> None:
        self.inputs = inputs
        self.params = params

    def tensor(self, name: str):
        array = self.inputs.get(name)
        return None if array is None else _scalar(name, array)

    def tensor_or_alias(self, name: str):
        """(value, label) of the tensor `name` or of its other backend's name
        (INPUT_ALIASES), or (None, None)."""
        aliases = [alias for alias, target in INPUT_ALIASES.items() if target == name]
        given = [n for n in (name, *aliases) if self.inputs.get(n) is not None]
        if len(given) > 1:
            raise RequestError(
                f"inputs {' and '.join(repr(n) for n in given)}: both were given; they are the same setting, "
                "allowed: one of them"
            )
        if not given:
            return None, None
        return self.tensor(given[0]), _tensor_label(given[0])

    def get(self, name: str, json_key: str | None = None):
        """(value, label) or (None, None) when given neither way."""
        value, label = self.tensor_or_alias(name)
        if value is not None:
            return value, label
        if json_key is not None and json_key in self.params:
            return self.params[json_key], _json_label(json_key)
        return None, None

    def given(self, name: str, json_key: str | None = None) -> bool:
        return self.tensor_or_alias(name)[0] is not None or (json_key is not None and json_key in self.params)


def _check_float(value, label: str, name: str) -> float:
    """A sampling setting checked against the shared rule (inflightllm.request_rules)."""
    rule = rules.SAMPLING_RANGES[name]
    if not rule.contains(value):
        raise _out_of_range(label, value, rule.allowed)
    return float(value)


# ----------------------------------------------------------------------------- prompt

# The roles a chat message may have (OpenAI's, as chat templates know them).
CHAT_ROLES = ("system", "user", "assistant", "tool")


def _prompt_ids(inputs: Mapping[str, np.ndarray | None], tokenizer) -> tuple[list[int], str]:
    """Prompt token ids and the name of the input they came from."""
    text_array = inputs.get("text_input")
    messages_array = inputs.get("messages")
    if text_array is not None and messages_array is not None:
        raise RequestError("inputs 'text_input' and 'messages': both were given; allowed: exactly one of them")
    if text_array is None and messages_array is None:
        raise RequestError(
            "input 'text_input' is missing; allowed: 'text_input' (the prompt) or 'messages' "
            '(a JSON list of {"role", "content"} objects)'
        )
    if text_array is not None:
        if inputs.get("tools") is not None:
            raise RequestError("input 'tools': allowed only with 'messages' (the chat template renders the tools)")
        text = _decode_bytes("input 'text_input'", _scalar("text_input", text_array))
        # As `generate` is usually fed (`tokenizer(text)`): the tokenizer's own special
        # tokens (a BOS for Llama-style tokenizers; none for SmolLM2) are added.
        return list(tokenizer.encode(text, add_special_tokens=True)), "text_input"

    label = "input 'messages'"
    raw = _decode_bytes(label, _scalar("messages", messages_array))
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as error:
        raise RequestError(f"{label}: not valid JSON ({error})") from None
    expected = 'a non-empty JSON list of {"role": string, "content": string} objects'
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"{label}: {_show(messages)} is not {expected}")
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls"):
            message.setdefault("content", "")  # an assistant turn of tool calls alone
            if message["content"] is None:
                message["content"] = ""
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise RequestError(f"{label}: item {index} ({_show(message)}) is not an object with string 'role' and 'content'; expected {expected}")
        if message["role"] not in CHAT_ROLES:
            raise RequestError(
                f"{label}: item {index} has role {_show(message['role'])}; allowed roles: {', '.join(CHAT_ROLES)}"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(f"{label}: this model's tokenizer has no chat template; send the prompt as 'text_input'")
    tools = _tools(inputs)
    try:
        prompt = render_chat(tokenizer, messages, tools)
    except Exception as error:  # the template's own checks (role order, ...) raise anything
        raise RequestError(f"{label}: the chat template rejected the messages: {error}") from None
    # The template already holds the special tokens (BOS included): add none.
    return list(tokenizer.encode(prompt, add_special_tokens=False)), "messages"


# A chat template that does not render tools gets them in a system message of this form.
TOOLS_SYSTEM_PROMPT = (
    "You can call these functions (JSON Schema of their arguments):\n{tools}\n"
    'To call one, reply with only a JSON object: {{"name": <function name>, "arguments": <its arguments>}}.'
)


def _tools(inputs: Mapping[str, np.ndarray | None]) -> list[dict] | None:
    """The `tools` input: a JSON list of OpenAI tool objects ({"type": "function",
    "function": {"name", "description", "parameters"}}), or None."""
    array = inputs.get("tools")
    if array is None:
        return None
    label = "input 'tools'"
    raw = _decode_bytes(label, _scalar("tools", array))
    if raw.strip() == "":
        return None
    try:
        tools = json.loads(raw)
    except json.JSONDecodeError as error:
        raise RequestError(f"{label}: not valid JSON ({error})") from None
    if not isinstance(tools, list):
        raise RequestError(f"{label}: {_show(tools)} is not a JSON list of tool objects")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{label}: item {index} ({_show(tool)}) is not a tool with a function name")
    return tools or None


def _json_or_text(value):
    """OpenAI sends a call's arguments as JSON text: shown as the JSON value it holds."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The chat template applied with the generation prompt. Tools go to the template's own
    tool format when it has one (`tools` in the template); otherwise they are described in
    a system message (TOOLS_SYSTEM_PROMPT), and earlier tool calls become their JSON text."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if tools and "tools" not in template:
        messages = [dict(message) for message in messages]
        for message in messages:
            if message.get("tool_calls"):
                calls = [{"name": call["function"]["name"], "arguments": _json_or_text(call["function"].get("arguments"))}
                         for call in message["tool_calls"]]
                message["content"] = (message.get("content") or "") + json.dumps(
                    calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            message.pop("tool_calls", None)
            message.pop("tool_call_id", None)
        described = TOOLS_SYSTEM_PROMPT.format(
            tools=json.dumps([tool["function"] for tool in tools], ensure_ascii=False))
        if messages[0]["role"] == "system":
            messages[0]["content"] = messages[0]["content"] + "\n\n" + described
        else:
            messages.insert(0, {"role": "system", "content": described})
        tools = None
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


# ----------------------------------------------------------------------------- words


def _words_from_tensor(name: str, array: np.ndarray | None) -> list[str] | None:
    """Words of a BYTES tensor ([1, k] as TensorRT-LLM clients send it, or [k]). Each
    element is one word, commas included; empty elements are ignored (TensorRT-LLM
    clients send [""] for none). None when no word is left."""
    if array is None:
        return None
    words = [_decode_bytes(f"input '{name}'", item) for item in np.asarray(array).reshape(-1)]
    words = [word for word in words if word != ""]
    return words or None


def _words_from_json(key: str, value) -> list[str]:
    words = [value] if isinstance(value, str) else list(value)
    for index, word in enumerate(words):
        if word == "":
            where = "" if isinstance(value, str) else f"item {index} "
            raise RequestError(f'{_json_label(key)}: {where}"" is an empty string; allowed: non-empty strings')
    return words


def word_token_sequences(tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """Token sequences of words: each as written and, when it tokenizes differently,
    with a leading space (so a word is caught whether or not a space precedes it).
    Identical sequences are kept once, first occurrence first."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        for variant in (word, " " + word):
            ids = tuple(int(i) for i in tokenizer.encode(variant, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def pack_token_sequences(sequences: list[tuple[int, ...]]) -> np.ndarray:
    """The packed form (inflightllm.token_sequences) as INT32, shape [1, L]; `[[0]]` for none."""
    return np.array([packing.pack_token_sequences(sequences)], dtype=np.int32)


# ----------------------------------------------------------------------------- other backends' features


def _check_unsupported_features(resolve: _Resolver, params: dict) -> None:
    """Other backends' inputs whose neutral value is accepted and whose other values ask
    for something this engine does not do: refused, never silently ignored."""
    for name in ("return_context_logits", "return_generation_logits"):
        value, label = resolve.get(name)
        if value is not None and bool(value):
            raise RequestError(
                f"{label}: true is not supported: this server returns no logits; allowed: false "
                "(for log probabilities use return_log_probs and num_top_logprobs)"
            )


def _group_settings(resolve: _Resolver, params: dict) -> dict:
    """n / num_return_sequences, best_of, beam_width, length_penalty, early_stopping
    (docs/SEQUENCE-GROUPS.md). Lower bounds here; the engine checks the profile's limits
    (engine.max_n, engine.max_beam_width) and names the engine input."""
    n_value, n_label = resolve.get("num_return_sequences", "n")  # TensorRT-LLM's name, or OpenAI's / vLLM's
    settings = {"n": 1, "best_of": 0, "beam_width": 1, "length_penalty": 1.0, "early_stopping": 0}
    for name, value, label in (("n", n_value, n_label), ("best_of", *resolve.get("best_of", "best_of")),
                               ("beam_width", *resolve.get("beam_width", "beam_width"))):
        if value is None:
            continue
        if int(value) != value or int(value) < 1:
            raise _out_of_range(label, value, "1 or more")
        settings[name] = int(value)
    value, label = resolve.get("length_penalty", "length_penalty")
    if value is not None:
        if not rules.LENGTH_PENALTY.contains(value):
            raise _out_of_range(label, value, rules.LENGTH_PENALTY.allowed)
        settings["length_penalty"] = float(value)
    if "early_stopping" in params:
        settings["early_stopping"] = EARLY_STOPPING_CODES[params["early_stopping"]]
    code = resolve.tensor("early_stopping")
    if code is not None:
        if int(code) not in EARLY_STOPPING_CODES.values():
            raise _out_of_range(_tensor_label("early_stopping"), code, '0 (false), 1 (true) or 2 ("never")')
        settings["early_stopping"] = int(code)
    return settings


# ----------------------------------------------------------------------------- structured output


def _guided_spec(inputs: Mapping[str, np.ndarray | None], params: dict):
    """The request's constraint (a GuidedSpec) or None: from the vLLM-style `guided_*`
    sampling_parameters keys or TensorRT-LLM's `guided_decoding_guide_type` and
    `guided_decoding_guide` inputs; at most one. Checked here (the schema against the
    JSON Schema meta-schema and the supported keywords, the regex or grammar parsed), so
    a bad one is refused naming its input before it reaches the engine."""
    backend = params.get("guided_decoding_backend")
    if backend is not None and backend.split(":", 1)[0] not in GUIDED_BACKENDS:
        raise RequestError(
            f"{_json_label('guided_decoding_backend')}: {_show(backend)} is not supported; "
            f"allowed: {', '.join(GUIDED_BACKENDS)}"
        )
    given: list[tuple[str, object]] = []  # (label, spec builder)
    keys = [key for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if key in params]
    if params.get("guided_json_object"):
        keys.append("guided_json_object")
    for key in keys:
        given.append((_json_label(key), key))
    guide_type = inputs.get("guided_decoding_guide_type")
    type_text = None
    if guide_type is not None:
        type_text = _decode_bytes("input 'guided_decoding_guide_type'", _scalar("guided_decoding_guide_type", guide_type))
        type_text = type_text.strip() or None
    guide_array = inputs.get("guided_decoding_guide")
    if type_text is not None:
        given.append(("input 'guided_decoding_guide_type'", "trtllm"))
    elif guide_array is not None:
        raise RequestError(
            "input 'guided_decoding_guide' was given without 'guided_decoding_guide_type'; allowed types: "
            + ", ".join(TRTLLM_GUIDE_TYPES)
        )
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(
            f"{' and '.join(label for label, _ in given)}: more than one structured-output constraint; allowed: one"
        )
    label, source = given[0]
    try:
        if source == "trtllm":
            kind = TRTLLM_GUIDE_TYPES.get(type_text)
            if kind is None:
                raise RequestError(
                    f"input 'guided_decoding_guide_type': {_show(type_text)} is not supported; allowed: "
                    f"{', '.join(TRTLLM_GUIDE_TYPES)}"
                )
            label = "input 'guided_decoding_guide'"
            guide = None
            if guide_array is not None:
                guide = _decode_bytes(label, _scalar("guided_decoding_guide", guide_array))
            if kind == "json_object":
                spec = GuidedSpec("json_object")
            elif not guide:
                raise RequestError(f"{label} is missing or empty; guide type {_show(type_text)} needs one")
            elif kind == "json_schema":
                spec = json_schema_spec(guide)
            else:
                spec = GuidedSpec(kind, guide)
        elif source == "guided_json":
            spec = json_schema_spec(params["guided_json"])
        elif source == "guided_json_object":
            spec = GuidedSpec("json_object")
        elif source == "guided_choice":
            spec = choice_spec(params["guided_choice"])
        else:
            spec = GuidedSpec("regex" if source == "guided_regex" else "grammar", params[source])
        check_spec(spec)
    except GuidedSpecError as error:  # "guided_json: <what>" -> "<the input's label>: <what>"
        text = str(error)
        detail = text.split(": ", 1)[1] if text.startswith("guided_") and ": " in text else text
        raise RequestError(f"{label}: {detail}") from None
    return spec


def _guided_tensors(spec: GuidedSpec | None) -> tuple[int, np.ndarray]:
    """(guided_type, guided_guide [1, n] uint8) of a constraint, or of none."""
    if spec is None:
        return 0, np.zeros((1, 1), dtype=np.uint8)
    data = np.frombuffer(spec.text.encode("utf-8") or b"\0", dtype=np.uint8)
    return KIND_CODES[spec.kind], data.reshape(1, -1).copy()  # [1, n]


# ----------------------------------------------------------------------------- request


def check_request_parameters(parameters: str | Mapping | None, input_names) -> None:
    """Refuse request parameters this server does not read. Triton hands the fields of an
    HTTP `generate` body that are not inputs (and a gRPC request's `parameters`) to the
    model as request parameters; ignored, a misspelled input or vLLM's `guided_json` at the
    top level would be dropped silently. Triton's own (`triton_` prefix) are allowed."""
    if not parameters:
        return
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except json.JSONDecodeError:
            return  # not ours to parse: Triton's own encoding
    unknown = sorted(str(key) for key in parameters if not str(key).startswith("triton_"))
    if not unknown:
        return
    names = ", ".join(repr(name) for name in unknown)
    hint = ""
    if any(name.startswith("guided_") or name in SAMPLING_PARAMETER_KEYS for name in unknown):
        hint = " (vLLM's sampling parameters, guided_json and the others, go in the sampling_parameters input)"
    raise RequestError(
        f"request parameter{'s' if len(unknown) > 1 else ''} {names}: not an input of this model, and "
        f"not used; inputs are {', '.join(sorted(input_names))}{hint}")


def build_engine_request(
    inputs: Mapping[str, np.ndarray | None], tokenizer, limits: RequestLimits
) -> dict[str, np.ndarray]:
    """Validate one request's inputs and build the "preprocessing -> engine" tensors.

    `inputs` maps ensemble input names to arrays with the leading batch dimension of 1
    (missing inputs: absent or None). Returns every engine input, each `[1, ...]` with
    the dtype of `ENGINE_REQUEST_DTYPES`. Raises `RequestError` for a bad request.
    """
    params = parse_sampling_parameters(inputs.get("sampling_parameters"))
    resolve = _Resolver(inputs, params)
    vocab_allowed = f"0 to {limits.vocab_size - 1} (the vocabulary)"

    # Prompt.
    input_ids, prompt_input = _prompt_ids(inputs, tokenizer)
    allowed_length = f"1 to {limits.max_input_length} tokens (the profile's max_input_length)"
    if not input_ids:
        raise RequestError(f"input '{prompt_input}': the prompt is empty (0 tokens); allowed: {allowed_length}")
    if not rules.prompt_length_range(limits.max_input_length).contains(len(input_ids)):
        raise RequestError(
            f"input '{prompt_input}': the prompt has {len(input_ids)} tokens; allowed: {allowed_length}"
        )

    # Lengths.
    value, label = resolve.get("max_tokens", "max_tokens")
    max_allowed = f"1 to {limits.max_output_len} (the profile's max_output_len)"
    if value is None:
        raise RequestError(
            f"input 'max_tokens' is missing; allowed: {max_allowed}, as the tensor or as sampling_parameters key 'max_tokens'"
        )
    if not rules.max_tokens_range(limits.max_output_len).contains(int(value)):
        raise _out_of_range(label, value, max_allowed)
    max_tokens = int(value)
    room = rules.room_for_output(len(input_ids), max_tokens, limits.max_model_len)
    if room is not None:
        raise RequestError(
            f"{label}: the prompt's {len(input_ids)} tokens + max_tokens {max_tokens} = "
            f"{len(input_ids) + max_tokens} is more than max_model_len {limits.max_model_len}; "
            f"allowed: max_tokens at most {room} for this prompt"
        )
    value, label = resolve.get("min_tokens", "min_tokens")
    min_tokens = 0 if value is None else int(value)
    if not rules.min_tokens_range(max_tokens).contains(min_tokens):
        raise _out_of_range(label, value, rules.min_tokens_range(max_tokens).allowed)

    # Sampling.
    value, label = resolve.get("top_k", "top_k")
    top_k = 0
    if value is not None:
        top_k = int(value)
        if label.startswith("input") and not rules.TOP_K.contains(top_k):
            raise _out_of_range(label, value, rules.TOP_K.allowed)
        if top_k < -1:
            raise _out_of_range(label, value, "-1 or 0 (off), or more")
        top_k = max(top_k, 0)  # vLLM's -1 means off
    value, label = resolve.get("top_p", "top_p")
    top_p = 1.0 if value is None else _check_float(value, label, "top_p")
    value, label = resolve.get("min_p", "min_p")
    min_p = 0.0 if value is None else _check_float(value, label, "min_p")
    value, label = resolve.get("temperature", "temperature")
    if value is not None:
        temperature = _check_float(value, label, "temperature")
    elif any(resolve.given(name, name) for name in ("top_k", "top_p", "min_p")):
        temperature = 1.0  # asking for top-k/top-p/min-p sampling means sampling
    else:
        temperature = 0.0  # greedy
    value, label = resolve.get("repetition_penalty", "repetition_penalty")
    repetition_penalty = (
        1.0 if value is None else _check_float(value, label, "repetition_penalty")
    )
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value, label = resolve.get(name, name)
        penalties[name] = 0.0 if value is None else _check_float(value, label, name)

    value, label = resolve.get("seed", "seed")
    seed = -1
    if value is not None:
        if label.startswith("sampling") and int(value) < 0:
            raise _out_of_range(label, value, "0 or more")
        seed = int(value) % 2**63  # UINT64 (and big JSON ints) folded into INT64

    value, label = resolve.get("end_id")
    end_id = -1
    if value is not None:
        end_id = int(value)
        if not rules.token_id_range(limits.vocab_size).contains(end_id):
            raise _out_of_range(label, value, vocab_allowed)
    ignore_eos = bool(params.get("ignore_eos", False))

    # Stop and bad words (the tensor wins over the JSON key).
    stop_words = _words_from_tensor("stop_words", inputs.get("stop_words"))
    if stop_words is None:
        stop_words = _words_from_json("stop", params["stop"]) if "stop" in params else []
    stop_sequences = word_token_sequences(tokenizer, stop_words)
    for token in params.get("stop_token_ids", []):
        if not rules.token_id_range(limits.vocab_size).contains(token):
            raise _out_of_range(_json_label("stop_token_ids"), token, vocab_allowed)
        if (token,) not in stop_sequences:
            stop_sequences.append((token,))
    bad_words = _words_from_tensor("bad_words", inputs.get("bad_words"))
    if bad_words is None:
        bad_words = _words_from_json("bad_words", params["bad_words"]) if "bad_words" in params else []
    bad_sequences = word_token_sequences(tokenizer, bad_words)

    # Log probs: the tensors win; JSON `logprobs: n` means log probs with n alternatives.
    value, label = resolve.get("num_top_logprobs", "logprobs")
    num_top_logprobs = 0
    if value is not None:
        num_top_logprobs = int(value)
        if not rules.TOP_LOGPROBS.contains(num_top_logprobs):
            raise _out_of_range(label, value, rules.TOP_LOGPROBS.allowed)
    return_log_probs_tensor = resolve.tensor("return_log_probs")
    if return_log_probs_tensor is not None:
        return_log_probs = bool(return_log_probs_tensor)
    else:  # asking for alternatives (or JSON logprobs) means asking for log probs
        return_log_probs = "logprobs" in params or num_top_logprobs > 0
    # vLLM's flags: cumulative_logprob / cum_log_probs and output_log_probs need log probs.
    for name in ("return_cumulative_logprob", "return_logprobs"):
        flag = resolve.tensor(name)
        if flag is not None and bool(flag):
            return_log_probs = True

    _check_unsupported_features(resolve, params)
    guided_type, guided_guide = _guided_tensors(_guided_spec(inputs, params))
    group = _group_settings(resolve, params)

    value, label = resolve.get("priority")
    priority = 0
    if value is not None:
        priority = int(value)
        if not rules.priority_range(limits.priority_levels).contains(priority):
            raise _out_of_range(
                label,
                value,
                f"{rules.priority_range(limits.priority_levels).allowed} (the profile's priority_levels is {limits.priority_levels}; larger is scheduled first)",
            )

    value, label = resolve.get("timeout_ms")
    timeout_ms = 0
    if value is not None:
        timeout_ms = int(value)
        if not rules.TIMEOUT_MS.contains(timeout_ms):
            raise _out_of_range(label, value, rules.TIMEOUT_MS.allowed)

    streaming = resolve.tensor("stream")
    exclude_input = resolve.tensor("exclude_input_in_output")
    scalars = {
        "input_length": len(input_ids),
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "streaming": False if streaming is None else bool(streaming),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": penalties["presence_penalty"],
        "frequency_penalty": penalties["frequency_penalty"],
        "seed": seed,
        "end_id": end_id,
        "ignore_eos": ignore_eos,
        "return_log_probs": return_log_probs,
        "num_top_logprobs": num_top_logprobs,
        "priority": priority,
        "exclude_input_in_output": False if exclude_input is None else bool(exclude_input),
        "timeout_ms": timeout_ms,
        "guided_type": guided_type,
        **group,
    }
    request = {"input_ids": np.array([input_ids], dtype=np.int32)}  # [1, num_prompt_tokens]
    for name, scalar in scalars.items():
        request[name] = np.array([[scalar]], dtype=ENGINE_REQUEST_DTYPES[name])  # [1, 1]
    request["stop_words"] = pack_token_sequences(stop_sequences)  # [1, packed length]
    request["bad_words"] = pack_token_sequences(bad_sequences)
    request["guided_guide"] = guided_guide  # [1, n] UTF-8 bytes
    return {name: request[name] for name in ENGINE_REQUEST_DTYPES}
