"""The packed form of token sequences (stop words, bad words) between preprocessing and
the engine: `[n, len_1, ids_1..., len_2, ids_2..., ...]`, `[0]` for none."""

from __future__ import annotations

from inflightllm.sampling_params import InvalidRequestError


def pack_token_sequences(sequences) -> list[int]:
    packed = [len(sequences)]
    for sequence in sequences:
        packed.append(len(sequence))
        packed.extend(int(token) for token in sequence)
    return packed


def unpack_token_sequences(packed: list[int], name: str = "token sequences") -> tuple[tuple[int, ...], ...]:
    """Inverse of `pack_token_sequences`; a malformed list raises InvalidRequestError
    naming `name`."""
    if not packed:
        return ()
    count = packed[0]
    if count < 0:
        raise InvalidRequestError(f"{name}: packed list starts with a negative count {count}")
    sequences = []
    position = 1
    for index in range(count):
        if position >= len(packed):
            raise InvalidRequestError(f"{name}: packed list ends before sequence {index + 1} of {count}")
        length = packed[position]
        if length < 1 or position + 1 + length > len(packed):
            raise InvalidRequestError(f"{name}: sequence {index + 1} has a bad length {length}")
        sequences.append(tuple(packed[position + 1 : position + 1 + length]))
        position += 1 + length
    if position != len(packed):
        raise InvalidRequestError(f"{name}: packed list has {len(packed) - position} trailing values")
    return tuple(sequences)
