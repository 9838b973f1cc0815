"""The native kernels against plain PyTorch on the shapes that break them.

Every vector width the CPU can run (256 bits; 512 with AVX-512F) is checked;
a width it cannot run is skipped with the missing feature named. Linear:
column counts that do not fill a 16- or 32-wide tile, odd K, row counts
around the 6- and 8-row micro-kernels and the 64-row block. Paged attention: contexts of one
token, exactly a block, and ragged lengths; block tables in random order;
grouped-query heads; block sizes 1, 4 and 16; prompt rows (causal) beside
decode rows. The whole stack: tests/model/test_native_stack.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.harness import cpu_flags
from tests.references import paged_attention_reference


def test_an_avx512_cpu_gets_the_512_bit_kernels(kernels):
    """The 512-bit path is only ever skipped on a CPU without AVX-512F, never lost on one that has it."""
    flags = cpu_flags()
    assert 256 in kernels.kernel_widths()
    assert (512 in kernels.kernel_widths()) == ("avx512f" in flags) or not flags


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 33, 100])
@pytest.mark.parametrize("k", [7, 8, 64, 70])
def test_packed_linear_matches_f_linear(kernels, width, n, k):
    torch.manual_seed(n * 100 + k)
    weight = torch.randn(n, k)
    packed = kernels.pack_linear_weight(weight, width)
    assert packed.shape[2] == width // 16, "the tile is as wide as the path's micro-kernel"
    for m in [1, 2, 5, 6, 7, 8, 9, 13, 25, 64, 65, 130]:
        x = torch.randn(m, k)
        torch.testing.assert_close(kernels.packed_linear(x, packed, n), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_packed_weights_start_on_a_huge_page_boundary_and_outlive_their_source(kernels, width):
    """Packed weights live in 2 MiB-aligned memory (where Linux may use huge pages for the weight stream), and
    that memory belongs to the tensor: the source and every temporary can go."""
    weight = torch.randn(1000, 576)
    expected = F.linear(torch.ones(3, 576), weight)
    packed = kernels.pack_linear_weight(weight, width)
    del weight
    assert packed.data_ptr() % (2 << 20) == 0
    torch.testing.assert_close(kernels.packed_linear(torch.ones(3, 576), packed, 1000), expected, rtol=1e-5,
                               atol=1e-4)


def test_packing_into_a_slice_of_a_huge_page_buffer(kernels, width):
    """What a model does with all its weights: each packed into its place in one buffer, which starts on a
    2 MiB boundary; the result equals a weight packed on its own. A place of the wrong shape or dtype is refused."""
    weights = [torch.randn(70, 40), torch.randn(33, 40), torch.randn(8, 96)]
    shapes = [kernels.packed_shape(w.shape[0], w.shape[1], width) for w in weights]
    assert shapes[0] == [3 if width == 512 else 5, 40, width // 16]
    sizes = [math.prod(shape) for shape in shapes]
    buffer = kernels.huge_page_buffer(sum(sizes))
    assert buffer.data_ptr() % (2 << 20) == 0
    for weight, shape, part in zip(weights, shapes, buffer.split(sizes)):
        packed = kernels.pack_linear_weight(weight, width, out=part.view(shape))
        assert packed.data_ptr() == part.data_ptr()
        assert torch.equal(packed, kernels.pack_linear_weight(weight, width))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32 tensor of shape"):
        kernels.pack_linear_weight(weights[0], width, out=buffer[: sizes[1]].view(shapes[1]))
    with pytest.raises(RuntimeError, match="nothing to pack"):
        kernels.packed_shape(0, 40, width)


def test_packed_linear_at_every_micro_kernel_height(kernels, width):
    """The heights the timing knob reaches (the 512-bit table has more than it runs by default)."""
    torch.manual_seed(width)
    weight, x = torch.randn(45, 37), torch.randn(67, 37)
    packed = kernels.pack_linear_weight(weight, width)
    for rows in range(1, {256: 6, 512: 14}[width] + 1):
        torch.testing.assert_close(kernels.packed_linear(x, packed, 45, rows), F.linear(x, weight), rtol=1e-5,
                                   atol=1e-4)
    with pytest.raises(RuntimeError, match="max_rows"):
        kernels.packed_linear(x, packed, 45, 15)


def test_packing_for_a_width_the_cpu_lacks_is_refused(kernels):
    if 512 in kernels.kernel_widths():
        pytest.skip("this CPU has avx512f: every width packs")
    with pytest.raises(RuntimeError, match="avx512f"):
        kernels.pack_linear_weight(torch.randn(4, 4), 512)


def test_packed_linear_takes_a_non_contiguous_input(kernels):
    weight = torch.randn(40, 32)
    x = torch.randn(32, 9).t()  # [9, 32], column-major
    torch.testing.assert_close(kernels.packed_linear(x, kernels.pack_linear_weight(weight), 40), x @ weight.t())


def test_packed_linear_rejects_a_wrong_width(kernels):
    packed = kernels.pack_linear_weight(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="features"):
        kernels.packed_linear(torch.randn(2, 31), packed, 16)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 16), (9, 3, 64), (8, 8, 32), (2, 1, 128), (6, 2, 8), (3, 1, 96), (4, 1, 256)],
)
def test_paged_attention_of_decode_rows_matches_reference(kernels, width, block_size, heads, kv_heads, head_dim):
    torch.manual_seed(block_size + heads)
    num_blocks, max_blocks = 300, 40
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size, 37, 97, max_blocks * block_size][:7])
    lens = lens.clamp(max=max_blocks * block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens])
    rows = torch.arange(len(lens))
    query = torch.randn(len(lens), heads, head_dim)
    scale = head_dim**-0.5
    got = kernels.paged_attention(query, cache[0], cache[1], tables, rows, lens, scale, width)
    want = paged_attention_reference(query, cache[0], cache[1], tables, rows, lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_paged_attention_of_a_few_long_rows_matches_reference(kernels, width, rows):
    """Fewer rows than threads to share out: each row's context is split into one run of blocks per thread,
    the parts merged after (a 13-token row has one block, so a thread's part of it is empty)."""
    torch.manual_seed(rows)
    block_size, heads, kv_heads, head_dim, num_blocks = 16, 9, 3, 64, 200
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    tables = torch.stack([torch.randperm(num_blocks)[:60] for _ in range(rows)])
    lens = torch.tensor([950, 13, 411][:rows])
    query = torch.randn(rows, heads, head_dim)
    want = paged_attention_reference(query, cache[0], cache[1], tables, torch.arange(rows), lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 5):  # parts of several sizes, and more parts than a short row has blocks
            torch.set_num_threads(count)
            got = kernels.paged_attention(query, cache[0], cache[1], tables, torch.arange(rows), lens, 0.125, width)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=count: f"{n} threads: {m}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("lens", [[950], [16], [13, 40], [31, 600]], ids=["long", "one-block", "short", "mixed"])
@pytest.mark.parametrize("run", [2, 5, 8, 11])
def test_paged_attention_of_a_decode_and_its_drafts_matches_reference(kernels, width, lens, run):
    """Speculative decoding's verify rows: a decode and its drafts, ``run`` rows of one sequence at consecutive
    positions, read each block once for all of them (attend_rows), span by span: spans that end inside the run
    (some rows see the span to its end, others stop short), runs longer than the kernel takes at once (8), with
    1 to 5 threads; and each row the same bits as the row alone (a request's attention does not depend on the
    rows beside it)."""
    torch.manual_seed(run + lens[0])
    block_size, heads, kv_heads, head_dim, num_blocks = 16, 9, 3, 64, 200
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    tables = torch.stack([torch.randperm(num_blocks)[:70] for _ in lens])
    row_seq = torch.tensor([seq for seq in range(len(lens)) for _ in range(run)])
    row_lens = torch.tensor([start + r for start in lens for r in range(run)])
    query = torch.randn(len(row_seq), heads, head_dim)
    want = paged_attention_reference(query, cache[0], cache[1], tables, row_seq, row_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            got = kernels.paged_attention(query, cache[0], cache[1], tables, row_seq, row_lens, 0.125, width)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=count: f"{n} threads: {m}")
            for row in (0, len(row_seq) - 1):
                alone = kernels.paged_attention(query[row:row + 1], cache[0], cache[1], tables, row_seq[row:row + 1],
                                                row_lens[row:row + 1], 0.125, width)
                assert torch.equal(alone[0], got[row]), f"row {row} differs from its run alone, {count} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
@pytest.mark.parametrize(("block_size", "head_dim"), [(4, 64), (16, 256)])
def test_paged_attention_over_a_window_matches_reference(kernels, width, window, block_size, head_dim):
    """Sliding-window layers: each row sees the last ``window`` positions of its context. Decode rows of contexts
    shorter and longer than the window, a decode with drafts, and a 300-row prompt chunk after a cached prefix
    (the tiled kernel: chunks behind every row's window skipped, a window's first chunk cut inside), with 1 to 3
    threads (a lone decode's window attended in spans). Entries of the tables behind every row's window point
    at a block the kernel must never read (its values NaN)."""
    torch.manual_seed(window + block_size)
    num_blocks, heads, kv_heads = 400, 4, 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    cache[:, 0] = float("nan")  # the block a windowed group's given-back entries point at
    seqs = [[3], [window + 7], [700], [450, 451, 452, 453], list(range(310, 610))]  # rows' context lengths
    tables = torch.stack([torch.randperm(num_blocks - 1)[: 700 // block_size + 1] + 1 for _ in seqs])
    for seq, lens in enumerate(seqs):  # behind every row's window: the NaN block
        behind = max(0, min(lens) - window) // block_size
        tables[seq, :behind] = 0
    row_seq = torch.tensor([seq for seq, lens in enumerate(seqs) for _ in lens])
    row_lens = torch.tensor([n for lens in seqs for n in lens])
    query = torch.randn(len(row_seq), heads, head_dim)
    want = paged_attention_reference(query, cache[0], cache[1], tables, row_seq, row_lens, 0.06, window)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in (slice(0, 1), slice(2, 3), slice(0, None)):  # a lone short decode, a lone long one, all
                got = kernels.paged_attention(query[rows], cache[0], cache[1], tables, row_seq[rows], row_lens[rows],
                                              0.06, width, window=window)
                torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5,
                                           msg=lambda m, n=count: f"{n} threads: {m}")
    finally:
        torch.set_num_threads(threads)


def test_a_lone_prompt_tile_beside_few_rows_keeps_its_attention(kernels, width):
    """A step of one long prompt chunk (a tile) and one decode: two sequences, fewer than two per thread, so the
    decode's context is split in parts and merged; the tile's rows must not be merged over."""
    torch.manual_seed(5)
    block_size, heads, kv_heads, head_dim = 16, 9, 3, 64
    cache = torch.randn(2, 100, block_size, kv_heads, head_dim)
    tables = torch.stack([torch.randperm(100)[:30] for _ in range(2)])
    row_seq = torch.tensor([0] * 37 + [1])
    lens = torch.cat([torch.arange(264, 301), torch.tensor([120])])
    query = torch.randn(len(row_seq), heads, head_dim)
    got = kernels.paged_attention(query, cache[0], cache[1], tables, row_seq, lens, 0.125, width)
    want = paged_attention_reference(query, cache[0], cache[1], tables, row_seq, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_attention_of_prompt_rows_is_causal(kernels, width):
    """Two prompt chunks and a decode row in one call: each prompt row sees its sequence up to itself."""
    torch.manual_seed(11)
    block_size, heads, kv_heads, head_dim = 4, 6, 2, 16
    cache = torch.randn(2, 64, block_size, kv_heads, head_dim)
    tables = torch.stack([torch.randperm(64)[:10] for _ in range(3)])
    # Sequence 0: a fresh 7-token prompt; 1: a chunk at positions 5..13 after a cached prefix; 2: one decode row.
    row_seq = torch.tensor([0] * 7 + [1] * 9 + [2])
    lens = torch.cat([torch.arange(1, 8), torch.arange(6, 15), torch.tensor([23])])
    query = torch.randn(len(row_seq), heads, head_dim)
    got = kernels.paged_attention(query, cache[0], cache[1], tables, row_seq, lens, 0.25, width)
    want = paged_attention_reference(query, cache[0], cache[1], tables, row_seq, lens, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (2, 1, 128), (3, 1, 96), (6, 2, 8)])
def test_paged_attention_of_long_prompt_chunks_matches_reference(kernels, width, block_size, heads, kv_heads,
                                                                  head_dim):
    """Prompt chunks whose rows see 192 positions or more go through the tiled kernel (blocks of up to 64
    consecutive rows), the rest row by row: a fresh 250-token prompt (two blocks of each), a 57-row chunk at
    positions 300..356 after a cached prefix, and decode rows between them."""
    torch.manual_seed(block_size + head_dim)
    num_blocks = 1200 // block_size
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    tables = torch.stack([torch.randperm(num_blocks)[: 400 // block_size] for _ in range(4)])
    row_seq = torch.tensor([0] * 250 + [2] + [1] * 57 + [3])
    lens = torch.cat([torch.arange(1, 251), torch.tensor([77]), torch.arange(301, 358), torch.tensor([399])])
    query = torch.randn(len(row_seq), heads, head_dim)
    got = kernels.paged_attention(query, cache[0], cache[1], tables, row_seq, lens, head_dim**-0.5, width)
    want = paged_attention_reference(query, cache[0], cache[1], tables, row_seq, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_attention_rejects_a_context_past_its_table(kernels):
    cache = torch.randn(2, 8, 4, 1, 8)
    args = torch.tensor([[0, 1]]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="context length"):
        kernels.paged_attention(torch.randn(1, 1, 8), cache[0], cache[1], *args, torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="block table 1"):
        kernels.paged_attention(
            torch.randn(1, 1, 8), cache[0], cache[1], args[0], torch.tensor([1]), torch.tensor([3]), 1.0
        )


def test_paged_attention_refuses_a_head_size_it_has_no_kernel_for(kernels):
    from conveyor.model.native.kernels import NATIVE_HEAD_SIZES

    assert 24 not in NATIVE_HEAD_SIZES
    cache = torch.randn(2, 8, 4, 1, 24)
    with pytest.raises(RuntimeError, match="head size 24"):
        kernels.paged_attention(
            torch.randn(1, 1, 24), cache[0], cache[1], torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([5]), 1.0
        )


def test_packed_layer_with_bias_matches_the_plain_layer(kernels, width):
    """Qwen2-style projections carry a bias; packing must keep it (and free the plain weight)."""
    from conveyor.model.decoder import Linear

    torch.manual_seed(3)
    layer = Linear(24, 40, bias=True)
    x = torch.randn(5, 24)
    want = layer(x).detach()
    layer.pack(kernels, width)
    assert layer.weight.numel() == 0
    torch.testing.assert_close(layer(x).detach(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [1, 8, 13, 16, 40, 64])
def test_silu_and_mul_matches_torch_over_the_whole_float_range(kernels, width, size):
    """The vectorised exp must hold where silu saturates (|x| near 88 and past it) as well as near 0."""
    torch.manual_seed(size)
    gate = torch.cat([torch.randn(3, size) * 4, torch.linspace(-120, 120, 4 * size).view(4, size)])
    up = torch.randn_like(gate)
    got = kernels.silu_and_mul(torch.cat([gate, up], dim=1).contiguous(), width)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("size", [5, 48, 64, 71])
def test_rms_norm_matches_torch(kernels, width, size):
    torch.manual_seed(size)
    x, weight = torch.randn(5, size), torch.randn(size)
    want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5, width), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [8, 16, 40, 64, 128])
def test_rotary_matches_torch(kernels, width, dim):
    torch.manual_seed(dim)
    q, k = torch.randn(5, 4, dim), torch.randn(5, 2, dim)
    angles = torch.randn(5, dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rotate(t):
        half = torch.cat([-t[..., dim // 2 :], t[..., : dim // 2]], -1)
        return t * cos[:, None] + half * sin[:, None]

    want_q, want_k = rotate(q), rotate(k)
    kernels.rotary_embedding(q, k, cos, sin, width)
    torch.testing.assert_close((q, k), (want_q, want_k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 70])
def test_packed_swiglu_matches_the_unfused_pair(kernels, width, rows):
    torch.manual_seed(rows)
    weight, x = torch.randn(192, 40), torch.randn(rows, 40)
    packed = kernels.pack_linear_weight(weight, width)
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    torch.testing.assert_close(kernels.packed_swiglu(x, packed, 96), F.silu(gate) * up, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="whole"):
        kernels.packed_swiglu(x, kernels.pack_linear_weight(torch.randn(160, 40), width), 80 if width == 512 else 88)


def test_kernels_release_the_gil_while_they_compute(kernels):
    """A Python thread keeps running while a long native call computes (the server's event loop does).

    The check counts the other thread's turns rather than timing its worst one: on two cores shared with a
    second test process and the kernel's own threads, one turn can be delayed by the OS for as long as a call,
    but holding the GIL would allow about one turn per call (between two calls), where released it allows one
    every millisecond or so of each call.
    """
    import threading
    import time

    weight = kernels.pack_linear_weight(torch.randn(2048, 2048))
    x = torch.randn(512, 2048)
    calls = 6
    done = threading.Event()
    turns = 0

    def compute() -> None:
        for _ in range(calls):
            kernels.packed_linear(x, weight, 2048)  # about 2 GFLOP: tens of milliseconds or more each
        done.set()

    thread = threading.Thread(target=compute)
    thread.start()
    while not done.is_set():
        time.sleep(0.001)
        turns += 1
    thread.join()
    assert turns >= 5 * calls, turns


@pytest.mark.parametrize("n", [1, 7, 16, 33, 49152])
def test_argmax_matches_torch_on_ties_nan_and_infinities(kernels, width, n):
    """The greedy pick the stack makes: torch's argmax, the first of equals, a NaN (the first) winning."""
    torch.manual_seed(n)
    x = torch.randn(8, n)
    x[1] = 0.0  # all equal
    x[2, [n - 1, n // 2]] = 50.0  # a tie: the first
    x[3, n - 1] = float("nan")  # a NaN in the tail past the last whole vector
    x[4, [n // 3, n - 1]] = float("nan")
    x[5] = float("-inf")
    x[6, n // 2] = float("inf")
    assert kernels.argmax(x, width) == x.argmax(dim=-1).tolist()
    assert kernels.argmax(x[:0], width) == []

