"""What the native kernels are checked against, written once: plain PyTorch over the same inputs.

* ``paged_attention_reference``: attention over a paged KV cache, row by row (test_kernels, test_bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_reference(query, k_cache, v_cache, tables, row_seq, lens, scale) -> torch.Tensor:
    """Gather each row's context in order from its sequence's block table and run PyTorch's attention on it.

    ``query`` [rows, heads, d]; ``k_cache``/``v_cache`` [blocks, block_size, kv_heads, d]; ``tables``
    [sequences, max_blocks]; ``row_seq`` each row's sequence; ``lens`` each row's context length (a prompt
    row sees its context up to and including itself, which is what makes the chunk causal).
    """
    out = []
    for row in range(query.shape[0]):
        ctx = int(lens[row])
        blocks = tables[int(row_seq[row]), : -(-ctx // k_cache.shape[1])]
        k = k_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1)  # [kv_heads, ctx, d]
        v = v_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1)
        q = query[row].unsqueeze(1)  # [heads, 1, d]
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(out)
