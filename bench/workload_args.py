"""The workload flags of ``pdserve bench`` (vllm bench serve style) and the
:class:`bench.workload.WorkloadSpec` they describe.

    --num-prompts 200 --request-rate 4 --mix mixed --prompt-len lognormal:300:0.6 \\
        --tenants gold:0.3:4:500,free:0.7:1
"""

from __future__ import annotations

import argparse
import math
import secrets

from bench.workload import MIXES, LengthDist, TenantSpec, WorkloadSpec


def parse_length(text: str) -> LengthDist:
    """``128`` (fixed), ``64:256`` (uniform), ``lognormal:MEDIAN:SIGMA[:LO:HI]``."""
    parts = text.split(":")
    try:
        if parts[0] == "lognormal" and len(parts) in (3, 5):
            lo, hi = (int(parts[3]), int(parts[4])) if len(parts) == 5 else (1, 1 << 20)
            return LengthDist.lognormal(float(parts[1]), float(parts[2]), lo, hi)
        if len(parts) == 1:
            return LengthDist.fixed(int(parts[0]))
        if len(parts) == 2:
            return LengthDist.uniform(int(parts[0]), int(parts[1]))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected N, LO:HI or lognormal:MEDIAN:SIGMA[:LO:HI]")


def parse_tenants(text: str) -> tuple[TenantSpec, ...]:
    """``gold:0.3:4[:500],free:0.7:1`` = name:share:weight[:ttft_deadline_ms], ..."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        if not 1 <= len(parts) <= 4:
            raise argparse.ArgumentTypeError(f"tenant {item!r}: name:share:weight[:deadline]")
        try:
            nums = [float(x) for x in parts[1:]]
            out.append(TenantSpec(parts[0], *nums[:2], ttft_deadline_ms=(
                nums[2] if len(nums) > 2 else None)))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"tenant {item!r}: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError("--tenants needs at least one tenant")
    return tuple(out)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests/s; inf sends all at once (default inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier")
    g.add_argument("--mix", choices=MIXES, default="chat", help="workload mix (default chat)")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    g.add_argument("--prompt-len", type=parse_length, help="prompt lengths: N, LO:HI or "
                   "lognormal:MEDIAN:SIGMA[:LO:HI] (default: the mix's)")
    g.add_argument("--output-len", type=parse_length, help="output lengths (same forms)")
    g.add_argument("--long-prompt-len", type=parse_length, help="mixed: long prompt lengths")
    g.add_argument("--long-output-len", type=parse_length, help="mixed: long output lengths")
    g.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long prompts")
    g.add_argument("--num-prefix-groups", type=int, default=4, help="shared-prefix: groups")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: prefix tokens")
    g.add_argument("--tenants", type=parse_tenants,
                   help="name:share:weight[:ttft_deadline_ms],... (default one tenant)")
    g.add_argument("--scale", type=float, default=1.0, help="multiply every length by this")
    g.add_argument("--dataset-path", help="sharegpt: the ShareGPT JSON file")


def workload_spec(args: argparse.Namespace, vocab_size: int, max_model_len: int
                  ) -> WorkloadSpec:
    """The workload the flags describe, sized for the served model."""
    return WorkloadSpec(
        num_requests=args.num_prompts, request_rate=args.request_rate,
        burstiness=args.burstiness, mix=args.mix, seed=args.seed,
        vocab_range=(1, vocab_size), prompt_len=args.prompt_len, output_len=args.output_len,
        long_prompt_len=args.long_prompt_len, long_output_len=args.long_output_len,
        long_fraction=args.long_fraction, num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len, tenants=args.tenants or (TenantSpec("default"),),
        scale=args.scale, max_model_len=max_model_len, dataset_path=args.dataset_path,
        id_prefix=f"bench-{secrets.token_hex(3)}-")
