"""What the native kernels are checked against, written once: plain PyTorch over the same inputs.

* ``paged_attention_reference``: attention over a paged KV cache, row by row (test_kernels, test_bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ragged_rows(num_blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tables, row_seq, lens) of one attention call over a cache of ``num_blocks``: decode rows of ragged
    contexts (one token, a block and one, 160) and three prompt chunks (causal), the last (positions 200..239)
    long enough for the tiled kernel."""
    max_blocks = 320 // block_size
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in range(6)])
    row_seq = torch.tensor([0, 1, 2] + [3] * 6 + [4] * 4 + [5] * 40)
    lens = torch.cat([torch.tensor([1, block_size + 1, 160]), torch.arange(1, 7), torch.arange(40, 44),
                      torch.arange(201, 241)])
    return tables, row_seq, lens


def paged_attention_reference(query, k_cache, v_cache, tables, row_seq, lens, scale, window=0) -> torch.Tensor:
    """Gather each row's context in order from its sequence's block table and run PyTorch's attention on it.

    ``query`` [rows, heads, d]; ``k_cache``/``v_cache`` [blocks, block_size, kv_heads, d]; ``tables``
    [sequences, max_blocks]; ``row_seq`` each row's sequence; ``lens`` each row's context length (a prompt
    row sees its context up to and including itself, which is what makes the chunk causal); ``window`` > 0:
    a row sees only the last ``window`` positions of its context.
    """
    out = []
    for row in range(query.shape[0]):
        ctx = int(lens[row])
        start = max(0, ctx - window) if window else 0
        blocks = tables[int(row_seq[row]), : -(-ctx // k_cache.shape[1])]
        k = k_cache[blocks].flatten(0, 1)[start:ctx].transpose(0, 1)  # [kv_heads, seen, d]
        v = v_cache[blocks].flatten(0, 1)[start:ctx].transpose(0, 1)
        q = query[row].unsqueeze(1)  # [heads, 1, d]
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(out)
