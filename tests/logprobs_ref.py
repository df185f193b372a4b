"""The reference for log-prob tests: transformers' fp32 logits of a whole sequence, and
checks of pdserve's TokenLogprobs (and their JSON shapes) against them."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

ATOL = 1e-5


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir, tokens: Sequence[int]) -> torch.Tensor:
    """`[len(tokens), V]` fp32 logits; row i predicts token i + 1."""
    with torch.inference_mode():
        return hf_model(str(model_dir))(torch.tensor([list(tokens)])).logits[0].float()


def hf_logprobs(model_dir, tokens: Sequence[int]) -> torch.Tensor:
    """transformers' raw log_softmax of the logits, `[len(tokens), V]`."""
    return hf_logits(model_dir, tokens).log_softmax(dim=-1)


def check_entry(lp, row: torch.Tensor, token: int, n: int, *, atol: float = ATOL) -> None:
    """A TokenLogprobs equals the reference row `[V]` of log-probs: the token's value, its
    rank (vLLM's: tokens at least as likely), and the top n ids and values."""
    assert lp.token_id == token
    want = row[token].item()
    assert abs(lp.logprob - want) <= atol, (lp.logprob, want)
    assert (row > want + atol).sum().item() < lp.rank <= (row >= want - atol).sum().item()
    check_top(lp.top, row, n, atol=atol)


def check_top(top, row: torch.Tensor, n: int, *, atol: float = ATOL) -> None:
    """(id, log-prob) pairs equal the reference's n most likely, best first."""
    ref = torch.topk(row, n)
    assert len(top) == n
    got = torch.tensor([v for _, v in top], dtype=torch.float32)
    finite = torch.isfinite(ref.values)
    assert torch.equal(torch.isfinite(got), finite)  # -inf where the filters cut
    k = int(finite.sum())  # past the filters' cut, which -inf token comes first is moot
    assert [t for t, _ in top[:k]] == ref.indices[:k].tolist()
    torch.testing.assert_close(got[finite], ref.values[finite], atol=atol, rtol=0)


def check_prompt(prompt_lps, ref: torch.Tensor, prompt: Sequence[int], n: int) -> None:
    """Prompt log-probs (first entry None) against `ref` rows of the prompt's positions."""
    assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
    for i in range(1, len(prompt)):
        check_entry(prompt_lps[i], ref[i - 1], prompt[i], n)
