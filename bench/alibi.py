"""ALiBi's cost on the long-context path: attention forward + backward over a packed row with ALiBi's slopes (pieces
cut into tiles, each with its bias as the fused kernel's additive mask: kernels/alibi.py) against the same pieces
without a bias (the RoPE models' path), in the same process; and the largest tensor either builds, against s^2.

    python bench/alibi.py                            # s = 8192 in 3 documents, 8 heads (4 kv groups), bf16
    python bench/alibi.py --seq 16384 --dtype fp32 --tiles 128 256 512
    python bench/alibi.py --whole                    # one document: the row's tiles are the batch's, not stacked

Printed per tile edge: seconds per forward + backward, the ratio to the bias-free pieces, and the largest tensor in
elements (as a share of s^2)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qlm_core.kernels import alibi
from qlm_core.kernels.pieces import Documents, self_attention_pieces
from qlm_core.kernels.piecewise import piecewise_attention
from qlm_core.profile.measure import LargestTensor


def run(q, k, v, pieces, slopes, repeats: int) -> tuple[float, int]:
    """Median seconds of forward + backward, and the largest tensor of one more run."""
    times = []
    for _ in range(repeats + 1):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        start = time.perf_counter()
        piecewise_attention(*leaves, pieces, q.shape[-1] ** -0.5, slopes=slopes).float().sum().backward()
        times.append(time.perf_counter() - start)
    with LargestTensor() as seen:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        piecewise_attention(*leaves, pieces, q.shape[-1] ** -0.5, slopes=slopes).float().sum().backward()
    return statistics.median(times[1:]), seen.largest


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--tiles", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whole", action="store_true", help="one document per row, not three packed")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, args.seq, args.head_dim, generator=g).to(dtype)
    k, v = (torch.randn(1, args.groups, args.seq, args.head_dim, generator=g).to(dtype) for _ in range(2))
    third = args.seq // 8
    lengths = torch.tensor([third, args.seq - 3 * third, 2 * third])
    docs = Documents.from_segment_ids(torch.repeat_interleave(torch.arange(3), lengths)[None])
    if args.whole:
        docs, lengths = None, torch.tensor([args.seq])
    plain_pieces = self_attention_pieces(docs, args.seq, None)
    base, base_largest = run(q, k, v, plain_pieces, None, args.repeats)
    s2 = args.seq ** 2
    print(f"s = {args.seq}, documents {lengths.tolist()}, {args.heads} heads / {args.groups} groups, "
          f"head dim {args.head_dim}, {args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'path':<22}{'s fwd+bwd':>11}{'ratio':>8}{'largest tensor':>16}{'/ s^2':>9}")
    print(f"{'no bias (RoPE path)':<22}{base:>11.3f}{1.0:>8.2f}{base_largest:>16,}{base_largest / s2:>9.4f}")
    slopes = alibi.alibi_slopes(args.heads)
    for edge in args.tiles:
        pieces = alibi.tiles(self_attention_pieces(docs, args.seq, None, positional=True), edge)
        seconds, largest = run(q, k, v, pieces, slopes, args.repeats)
        print(f"{f'ALiBi, tiles of {edge}':<22}{seconds:>11.3f}{seconds / base:>8.2f}{largest:>16,}"
              f"{largest / s2:>9.4f}")


if __name__ == "__main__":
    main()
