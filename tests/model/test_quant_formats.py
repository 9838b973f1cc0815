"""The uniform decode of GGUF quantized tensors is exact, and the kernels' tile layout round-trips.

gguf's own numpy dequantizers are the reference: a model run from the decoded codes must see the very
weights llama.cpp's reference does, so every comparison is bit-for-bit (float32 bit patterns, which also
tells signed zeros apart), never within a tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from conveyor.model.quant.formats import (
    SUPPORTED_TYPES,
    TILE,
    PackedTiles,
    QuantizedMatrix,
    concat_rows,
    decode,
    dequantize,
    pack_tiles,
    permute_rows,
    unpack_tiles,
)

# byte offsets of each block's f16 fields (d, and m or dmin), from ggml's block structs
F16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "Q3_K": (108,),
    "Q2_K": (80, 82),
}
SYMMETRIC_ZERO_POINT = {"Q8_0": 128, "Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "IQ4_NL": 128, "IQ4_XS": 128, "Q3_K": 4}
F16_SCALES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}
CODE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "IQ4_NL": 4,
             "IQ4_XS": 4, "Q3_K": 3, "Q2_K": 2}
GROUPS_OF_16 = {"Q6_K", "Q3_K", "Q2_K"}
TYPES = sorted(SUPPORTED_TYPES)
SHAPES = [(1, 256), (7, 512), (33, 256)]


def block_sizes(type_name: str) -> tuple[int, int]:
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def random_f16(rng: np.random.Generator, count: int, lo: float = 1e-4, hi: float = 1.0) -> np.ndarray:
    """Finite f16 values of either sign with log-uniform magnitudes in [lo, hi]."""
    magnitude = np.exp(rng.uniform(np.log(lo), np.log(hi), count))
    return (rng.choice([-1.0, 1.0], count) * magnitude).astype(np.float16)


def random_raw(
    type_name: str, n: int, k: int, rng: np.random.Generator, lo: float = 1e-4, hi: float = 1.0
) -> np.ndarray:
    """Random blocks [n, bytes_per_row], as GGUFReader gives them, with sane f16 fields (no inf/NaN)."""
    block, type_size = block_sizes(type_name)
    raw = rng.integers(0, 256, (n, k // block * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in F16_FIELDS[type_name]:
        blocks[:, offset : offset + 2] = random_f16(rng, len(blocks), lo, hi).view(np.uint8).reshape(-1, 2)
    return raw


def reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    return gguf_dequantize(raw, GGMLQuantizationType[type_name])


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "equal values, different signed zeros"


def assert_same_values(got: np.ndarray, want: np.ndarray) -> None:
    """Bit-for-bit but for the sign of zeros, which a symmetric-to-asymmetric join cannot keep."""
    assert np.array_equal(got, want)
    assert_same_bits(np.where(got == 0, np.float32(0), got), np.where(want == 0, np.float32(0), want))


def random_matrix(type_name: str, n: int, k: int, seed: int, **f16_range: float) -> QuantizedMatrix:
    return decode(random_raw(type_name, n, k, np.random.default_rng(seed), **f16_range), type_name, n, k)


# -- decode is exact ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_matches_gguf_bit_for_bit(type_name: str, shape: tuple[int, int]) -> None:
    n, k = shape
    raw = random_raw(type_name, n, k, np.random.default_rng([TYPES.index(type_name), n, k]))
    assert_same_bits(dequantize(decode(raw, type_name, n, k)), reference(raw, type_name))


@pytest.mark.parametrize("type_name", TYPES)
def test_exact_over_the_whole_finite_f16_range(type_name: str) -> None:
    """Any finite f16 field, subnormals and 65504 included: the exactness does not rest on tame scales."""
    rng = np.random.default_rng(7)
    n, k = 512, 256
    _, type_size = block_sizes(type_name)
    raw = rng.integers(0, 256, (n, k // block_sizes(type_name)[0] * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in F16_FIELDS[type_name]:
        bits = rng.integers(0, 1 << 16, len(blocks)).astype(np.uint16)
        bits[:4] = [0x0001, 0x8000, 0x7BFF, 0xFBFF]  # smallest subnormal, -0, largest finite of each sign
        bits[(bits & 0x7C00) == 0x7C00] &= 0xFBFF  # inf/NaN -> finite
        blocks[:, offset : offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    assert_same_bits(dequantize(decode(raw, type_name, n, k)), reference(raw, type_name))


@pytest.mark.parametrize("type_name", TYPES)
def test_form_of_each_format(type_name: str) -> None:
    n, k = 33, 512
    m = random_matrix(type_name, n, k, seed=3)
    assert m.q.dtype == np.uint8 and m.q.shape == (n, k)
    assert m.code_bits == CODE_BITS[type_name] and int(m.q.max()) < 2**m.code_bits
    assert m.group == (16 if type_name in GROUPS_OF_16 else 32)
    assert m.scales.shape == (n, k // m.group)
    assert m.scales.dtype == (np.float16 if type_name in F16_SCALES else np.float32)
    assert (m.mins is None) == (type_name in SYMMETRIC_ZERO_POINT)
    if m.mins is None:
        assert m.zero_point == SYMMETRIC_ZERO_POINT[type_name]
    else:
        assert m.mins.shape == m.scales.shape and m.mins.dtype == m.scales.dtype
    assert m.storage_bits == (4 if m.code_bits <= 4 and m.group == 32 else 8)
    assert m.source == type_name


def test_codes_use_their_whole_range() -> None:
    """Random bytes reach both ends of every code range: no bit of a code is lost or invented."""
    for type_name in TYPES:
        q = random_matrix(type_name, 64, 512, seed=5).q
        assert (int(q.min()), int(q.max())) == (0, 2 ** CODE_BITS[type_name] - 1), type_name


def test_flat_and_row_shaped_bytes_decode_alike() -> None:
    raw = random_raw("Q5_1", 7, 256, np.random.default_rng(1))
    a, b = decode(raw, "Q5_1", 7, 256), decode(raw.ravel(), "Q5_1", 7, 256)
    assert np.array_equal(a.q, b.q) and np.array_equal(a.scales, b.scales) and np.array_equal(a.mins, b.mins)


def test_hand_built_blocks() -> None:
    """Bit positions checked by hand, independent of the gguf reference."""
    q4_0 = np.zeros(18, np.uint8)
    q4_0[:2] = np.array([0.5], np.float16).view(np.uint8)
    q4_0[2] = 0x3A  # weight 0 is the low nibble (10), weight 16 the high one (3)
    m = decode(q4_0, "Q4_0", 1, 32)
    assert (m.q[0, 0], m.q[0, 16], m.zero_point) == (10, 3, 8)
    assert dequantize(m)[0, 0] == 1.0 and dequantize(m)[0, 16] == -2.5
    q5_0 = np.zeros(22, np.uint8)
    q5_0[2 + 2] = 0b10  # qh bit 17: weight 17 gets 16 added
    q5_0[6 + 1] = 0x50  # weight 17 is the high nibble of qs[1]
    assert decode(q5_0, "Q5_0", 1, 32).q[0, 17] == 16 + 5
    q8_0 = np.zeros(34, np.uint8)
    q8_0[2:5] = np.array([-128, 0, 127], np.int8).view(np.uint8)
    assert list(decode(q8_0, "Q8_0", 1, 32).q[0, :3]) == [0, 128, 255]


# -- the default model's real file ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_reader() -> GGUFReader:
    from conveyor.model.weights.paths import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return GGUFReader(path)


def test_default_model_tensors_decode_exactly(default_reader: GGUFReader) -> None:
    tensors = {t.name: t for t in default_reader.tensors}
    names = ["token_embd.weight"] + [n for n in tensors if n.startswith("blk.0.") and n.endswith(".weight")]
    checked = set()
    for name in names:
        t = tensors[name]
        if t.tensor_type.name == "F32":
            continue
        n, k = reversed(t.shape.tolist())
        m = decode(t.data, t.tensor_type.name, n, k)
        assert_same_bits(dequantize(m), gguf_dequantize(t.data, t.tensor_type))
        checked.add(t.tensor_type.name)
    assert checked == {"Q8_0", "Q4_1"} and len(names) >= 8


# -- row operations, against the same operations on the floats ----------------------------------------------


def test_permute_rows_moves_codes_scales_and_mins_together() -> None:
    for type_name in ("Q4_1", "Q6_K", "Q8_0"):
        m = random_matrix(type_name, 33, 256, seed=11)
        order = np.random.default_rng(2).permutation(33)
        permuted = permute_rows(m, order)
        assert_same_bits(dequantize(permuted), dequantize(m)[order])
        assert (permuted.source, permuted.group, permuted.zero_point) == (m.source, m.group, m.zero_point)


def test_permute_rows_refuses_a_non_permutation() -> None:
    m = random_matrix("Q4_0", 4, 32, seed=0)
    for order in ([0, 1, 2], [0, 1, 1, 2], [[0, 1, 2, 3]]):
        with pytest.raises(ValueError, match="permutation"):
            permute_rows(m, np.array(order))


CONCATS = [
    # parts, then the expected form: (symmetric?, scale dtype, code_bits, zero_point)
    (["Q4_1", "Q4_1", "Q4_1"], (False, np.float16, 4, 0)),
    (["Q8_0", "Q8_0"], (True, np.float16, 8, 128)),
    (["Q4_0", "Q4_1"], (False, np.float16, 4, 0)),
    (["Q8_0", "Q4_1"], (False, np.float16, 8, 0)),
    (["Q4_0", "Q5_0"], (False, np.float16, 5, 0)),
    (["Q4_1", "Q4_K"], (False, np.float32, 4, 0)),
    (["Q4_0", "Q5_K", "Q8_0"], (False, np.float32, 8, 0)),
]


@pytest.mark.parametrize(("parts", "form"), CONCATS, ids=["+".join(p) for p, _ in CONCATS])
def test_concat_rows_is_exact(parts: list[str], form: tuple) -> None:
    mats = [random_matrix(t, n, 256, seed=i) for i, (t, n) in enumerate(zip(parts, [33, 7, 16]))]
    joined = concat_rows(mats)
    want = np.concatenate([dequantize(m) for m in mats])
    if len({m.mins is None for m in mats}) == 1 and len({m.zero_point for m in mats}) == 1:
        assert_same_bits(dequantize(joined), want)
    else:  # s * (q - zp) is -0.0 for q == zp under a negative scale; s * q - zp * s is +0.0
        assert_same_values(dequantize(joined), want)
    symmetric, dtype, code_bits, zero_point = form
    assert (joined.mins is None, joined.scales.dtype, joined.code_bits, joined.zero_point) == (
        symmetric,
        dtype,
        code_bits,
        zero_point,
    )
    assert joined.source == "+".join(dict.fromkeys(parts))


def test_concat_widens_where_f16_mins_would_overflow() -> None:
    """-128 * d leaves float16 for |d| > 511.75: the join then keeps exactness in float32."""
    big = random_matrix("Q8_0", 5, 64, seed=1, lo=600.0, hi=60000.0)
    joined = concat_rows([big, random_matrix("Q4_1", 3, 64, seed=2)])
    assert joined.scales.dtype == np.float32
    assert np.isfinite(joined.mins).all()
    assert_same_values(
        dequantize(joined), np.concatenate([dequantize(big), dequantize(random_matrix("Q4_1", 3, 64, 2))])
    )


def test_concat_refuses_what_it_cannot_join_exactly() -> None:
    with pytest.raises(ValueError, match="group"):
        concat_rows([random_matrix("Q6_K", 2, 256, seed=0), random_matrix("Q8_0", 2, 256, seed=1)])
    with pytest.raises(ValueError, match="k=512"):
        concat_rows([random_matrix("Q4_1", 2, 256, seed=0), random_matrix("Q4_1", 2, 512, seed=1)])
    with pytest.raises(ValueError, match="nothing"):
        concat_rows([])


# -- the kernels' tile layout --------------------------------------------------------------------------------


@pytest.mark.parametrize(("type_name", "n"), [("Q4_1", 33), ("Q4_0", 7), ("Q8_0", 33), ("Q6_K", 7), ("Q5_0", 20)])
def test_pack_tiles_round_trips(type_name: str, n: int) -> None:
    m = random_matrix(type_name, n, 512, seed=4)
    p = pack_tiles(m)
    tiles, groups = -(-n // TILE), 512 // m.group
    assert p.codes.flags.c_contiguous and p.codes.dtype == np.uint8
    assert p.codes.shape == (tiles, groups, m.group * (16 if m.storage_bits == 8 else 8))
    assert p.scales.shape == (tiles, groups, TILE) and p.scales.dtype == m.scales.dtype
    assert (p.n, p.k, p.group, p.storage_bits, p.zero_point) == (n, 512, m.group, m.storage_bits, m.zero_point)
    q, scales, mins = unpack_tiles(p)
    assert np.array_equal(q, m.q) and np.array_equal(scales, m.scales)
    assert (mins is None) == (m.mins is None) and (mins is None or np.array_equal(mins, m.mins))
    q_all, scales_all, mins_all = unpack_tiles(p, keep_padding=True)
    assert q_all.shape[0] == tiles * TILE
    assert not q_all[n:].any() and not scales_all[n:].any() and (mins_all is None or not mins_all[n:].any())


def patterned(n: int, k: int, code_bits: int, pattern) -> QuantizedMatrix:
    """A matrix whose code at (i, j) is pattern(i, j) and whose scale at (i, g) is i + g / 64, exactly."""
    i, j = np.indices((n, k))
    groups = np.indices((n, k // 32))
    scales = (groups[0] + groups[1] / 64).astype(np.float16)
    return QuantizedMatrix(pattern(i, j).astype(np.uint8), scales, None, 0, code_bits, 32, "test")


def test_byte_layout_by_hand() -> None:
    """codes[t, g] as [quad, row, 4]: tile 1, group 1, quad 2, row 3, input 1 is q[19, 32 + 9]."""
    p = pack_tiles(patterned(20, 64, 8, lambda i, j: (7 * i + j) % 256))
    assert p.codes[1, 1].reshape(8, 16, 4)[2, 3, 1] == (7 * 19 + 41) % 256 == 174
    assert p.codes[1, 1, (2 * 16 + 3) * 4 + 1] == 174
    assert p.scales[1, 1, 3] == np.float16(19 + 1 / 64)
    assert not p.codes[1, 0].reshape(8, 16, 4)[:, 4:].any()  # rows 20..31 (tile 1, rows 4..15) are padding


def test_nibble_layout_by_hand() -> None:
    """codes[t, g] as [octet, row, 4]: byte (octet 1, row 5, b 2) of group 1 holds q[5, 42] | q[5, 46] << 4."""
    p = pack_tiles(patterned(5 + 1, 64, 4, lambda i, j: (i + 3 * j) % 16))
    low, high = (5 + 3 * 42) % 16, (5 + 3 * 46) % 16
    assert (low, high) == (3, 15)
    assert p.codes[0, 1].reshape(4, 16, 4)[1, 5, 2] == low | high << 4 == 0xF3
    assert p.codes[0, 1, (1 * 16 + 5) * 4 + 2] == 0xF3
    assert p.scales[0, 1, 5] == np.float16(5 + 1 / 64) and p.mins is None


def test_packed_tiles_is_the_documented_record() -> None:
    p = pack_tiles(random_matrix("Q4_1", 3, 32, seed=0))
    assert isinstance(p, PackedTiles) and p.mins is not None and p.mins.shape == (1, 1, TILE)


# -- refusals -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["IQ1_S", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "F32", "BF16", "NOT_A_TYPE"])
def test_unsupported_type_is_named(type_name: str) -> None:
    with pytest.raises(ValueError, match=rf"{type_name}.*supported: .*Q4_0"):
        decode(np.zeros(256, np.uint8), type_name, 1, 256)


def test_wrong_sizes_are_refused() -> None:
    raw = random_raw("Q4_1", 2, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="takes 80 uint8 bytes; got 79"):
        decode(raw.ravel()[:-1], "Q4_1", 2, 64)
    with pytest.raises(ValueError, match="takes 120 uint8 bytes; got 80"):
        decode(raw, "Q4_1", 3, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        decode(raw, "Q4_K", 1, 160)
    with pytest.raises(ValueError, match="of float32"):
        decode(raw.view(np.float32), "Q4_1", 2, 64)


def test_malformed_matrix_is_refused() -> None:
    with pytest.raises(ValueError, match="scales"):
        QuantizedMatrix(np.zeros((2, 64), np.uint8), np.zeros((2, 1), np.float16), None, 8, 4, 32, "x")
    with pytest.raises(ValueError, match="mins"):
        QuantizedMatrix(
            np.zeros((2, 64), np.uint8), np.zeros((2, 2), np.float16), np.zeros((2, 2), np.float32), 0, 4, 32, "x"
        )
