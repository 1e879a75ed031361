"""Guided (structured) decoding: JSON schema, JSON object, regex, grammar and choice
constraints, applied as a per-row token bitmask inside the engine's batched step
(docs/STRUCTURED-OUTPUT.md)."""

from inflightllm.guided.spec import (
    GuidedSpec,
    GuidedSpecError,
    check_spec,
    choice_spec,
    json_schema_spec,
)

__all__ = ["GuidedSpec", "GuidedSpecError", "check_spec", "choice_spec", "json_schema_spec"]
