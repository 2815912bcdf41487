"""How much R-KV's decode-time compressions depend on the order its cache stores the kept entries in (the numbers in
kvbench/methods/rkv.py's docstring and docs/method_ambiguities.md, R-KV row 7).

The authors' code (Zefan-Cai/R-KV d15c976, loaded as scripts/parity/rkv/generate.py loads it, in its side
environment) stores the kept entries in ``topk`` order, scores descending; its max-pooling and its "last similar key"
then follow that order at the next compression. This script runs the code's schedule (``rkv/modeling.py``: the prompt
compressed at prefill with its last 8 queries, then one token per step, the whole cache compressed whenever the count
of tokens seen is a multiple of 128, with the query cache of the last 8 queries) twice on seeded inputs: once as the
code keeps its cache, once with the cache put back in position order before every compression (kvbench's layout),
and counts the (compression, KV head) pairs whose kept sets differ.

    /work/side/rkv-env/bin/python scripts/parity/rkv/cache_order.py --official /work/side/rkv-src [--kernel 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tests"))
sys.path.insert(0, str(HERE))
from generate import load_official  # noqa: E402
from parity_inputs import stream  # noqa: E402

WINDOW, DIVIDE = 8, 128


def kept_sets(r1_kv, seed: int, hq: int, hkv: int, d: int, n: int, steps: int, budget: int, kernel: int,
              position_order: bool) -> list[list[list[int]]]:
    """Kept positions per KV head after every decode-time compression. The values carry each entry's position (the
    code gathers keys and values with one index), so the positions are read back from them."""
    q, k, _ = (torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous()
               for a in stream(seed, 0, n, steps, hq, hkv, d, 1.5))
    pos = torch.arange(n + steps, dtype=torch.float32).view(1, 1, -1, 1).expand(1, hkv, -1, d)
    cluster = r1_kv.R1KV(budget=budget, window_size=WINDOW, kernel_size=kernel)
    keys, positions = cluster.update_kv(k[:, :, :n], q[:, :, n - WINDOW : n], pos[:, :, :n])
    out = []
    for t in range(n, n + steps):
        keys = torch.cat([keys, k[:, :, t : t + 1]], 2)
        positions = torch.cat([positions, pos[:, :, t : t + 1]], 2)
        if t % DIVIDE == 0:  # the flag set after the forward that made the count of tokens seen t
            if position_order:
                order = positions[..., 0].argsort(-1)[..., None]
                order = order.expand(-1, -1, -1, d)
                keys, positions = keys.gather(2, order), positions.gather(2, order)
            keys, positions = cluster.update_kv(keys, q[:, :, t - WINDOW + 1 : t + 1], positions)
            out.append([sorted(positions[0, h, :, 0].long().tolist()) for h in range(hkv)])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", required=True, help="checkout of Zefan-Cai/R-KV at d15c976")
    parser.add_argument("--kernel", type=int, default=7)
    args = parser.parse_args()
    r1_kv = load_official(Path(args.official))
    differ = total = 0
    for seed in range(1, 6):
        code, by_position = (kept_sets(r1_kv, seed, 8, 2, 32, 300, 640, 128, args.kernel, flag)
                             for flag in (False, True))
        pairs = [(a, b) for x, y in zip(code, by_position) for a, b in zip(x, y)]
        differ += sum(a != b for a, b in pairs)
        total += len(pairs)
        print(f"seed {seed}: {len(code)} compressions; kept entries that differ (of {len(pairs[0][0])}), per "
              f"compression and head: {[len(set(a) - set(b)) for a, b in pairs]}")
    print(f"(compression, head) pairs whose kept sets differ: {differ} of {total}")


if __name__ == "__main__":
    main()
