"""pdserve engine: the Ray-free core shared by the prefill and decode pools."""

from __future__ import annotations

from engine.request import FinishReason, Request, RequestStatus, SamplingParams

__all__ = ["LLM", "SamplingParams", "Request", "RequestStatus", "FinishReason"]


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing engine.request should not load the model stack
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
