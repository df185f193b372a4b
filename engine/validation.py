"""Request validation shared by the offline API and the gRPC server (messages name the field)."""

from __future__ import annotations

from collections.abc import Sequence


def validate_prompt(token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    if len(token_ids) == 0:
        raise ValueError("prompt is empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens; max_model_len is {max_model_len} "
            "(the prompt must leave room for at least one generated token)"
        )
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


MAX_STOP_TOKEN_IDS = 256  # a sampler checks each of them at every step of the request


def validate_stop_token_ids(token_ids: Sequence[int], vocab_size: int | None) -> None:
    """At most MAX_STOP_TOKEN_IDS ids, each in the vocabulary (not checked when None)."""
    if len(token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(token_ids)} entries; at most "
                         f"{MAX_STOP_TOKEN_IDS} are allowed")
    for i, t in enumerate(token_ids if vocab_size is not None else ()):
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop_token_ids[{i}] = {t} is outside the vocabulary "
                             f"[0, {vocab_size})")
