"""Host-side costs the SGLang adapter adds (no GPU needed; SGLang's own GPU work is not timed here).

1. The stale-draft proof hashes every pushed draft tensor (`tensor_digest`, blake2b on CPU) to
   know which SGLang parameters must change: throughput in MB/s, i.e. seconds per push for a
   draft of a given size (one MTP layer of a 7B-class model is ~0.4 GB in bfloat16).
2. Converting one finished SGLang output to a `Sample` (`sample_from_meta_info`) per 1k tokens.

Usage: specrl bench sglang-adapter [--mb 256] [--repeats 5]
Prints medians of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sidecar.engine.sglang.engine import tensor_digest
from sidecar.engine.sglang.meta import sample_from_meta_info


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="draft size to hash, MB (bfloat16)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    t = torch.randn(args.mb * 1024 * 1024 // 2, dtype=torch.bfloat16)
    s = median_seconds(lambda: tensor_digest(t), args.repeats)
    print(f"tensor_digest: {args.mb} MB in {s:.3f} s -> {args.mb / s:.0f} MB/s")

    n, k = 1024, 3
    steps = n // 3
    meta = {
        "finish_reason": {"type": "length", "length": n},
        "weight_version": "1",
        "weight_versions": [{"version": "1", "start": 0, "end": n}],
        "completion_tokens": n,
        "spec_verify_ct": steps,
        "spec_num_correct_drafts": 2 * steps,  # every verify step accepts 2 of 3 drafts
        "spec_num_proposed_drafts": steps * k,
        "spec_correct_drafts_histogram": [0, 0, steps, 0],
        "output_token_logprobs": [(-0.5, i % 500, None) for i in range(n)],
    }
    out = {"output_ids": [i % 500 for i in range(n)], "meta_info": meta}

    def convert() -> None:
        for _ in range(100):
            sample_from_meta_info(out, request_id="r", prompt_index=0, sample_index=0, speculation_k=k)

    s = median_seconds(convert, args.repeats) / 100
    print(f"sample_from_meta_info: {s * 1e6:.0f} us per {n}-token sample")


if __name__ == "__main__":
    main()
