import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta import TeSA, TeSAError


@st.composite
def bits_tensors(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 1000))
    values = draw(st.sampled_from([[0, 32], [0, 4, 8, 16, 32], [0, 3, 7], [8], [0]]))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(values), shape, generator=g)
    return torch.tensor(values, dtype=torch.uint8)[idx]


def test_constructors_and_reading():
    mask = torch.tensor([[True, False], [False, False]])
    t = TeSA.from_mask(mask, bits=8)
    assert t.shape == (2, 2) and t.density == 0.25
    assert t.bit_histogram() == {0: 3, 8: 1}
    assert torch.equal(t.mask, mask) and t.bits.dtype == torch.uint8
    d = TeSA.dense((3, 4), 16)
    assert d.is_dense and d.density == 1.0 and d.bit_histogram() == {16: 12} and d.uniform == 16
    assert TeSA.pruned((2,)).density == 0.0
    assert "density=0.250" in repr(t) and "8b" in repr(t)


def test_immutable():
    t = TeSA.from_bits(torch.tensor([4, 8]))
    b = t.bits
    b[0] = 0
    assert t.bits[0] == 4
    src = torch.tensor([4, 8], dtype=torch.uint8)
    t2 = TeSA.from_bits(src)
    src[0] = 0
    assert t2.bits[0] == 4


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([1.0, 2.0]), "non-integer dtype"),
    (torch.tensor([float("nan"), 1.0]), "NaN"),
    (torch.tensor([0, 33]), r"0\.\.32"),
    (torch.tensor([-1, 3]), r"0\.\.32"),
    (torch.tensor([True, False]), "from_mask"),
    ("abc", "tensor or array"),
])
def test_invalid_bits(bad, match):
    with pytest.raises(TeSAError, match=match):
        TeSA.from_bits(bad, name="fc1.weight")


def test_invalid_mask_and_shape_names_tensor():
    with pytest.raises(TeSAError, match="0/1"):
        TeSA.from_mask(torch.tensor([0, 2]))
    with pytest.raises(TeSAError, match="bits must be"):
        TeSA.from_mask(torch.tensor([True]), bits=40)
    with pytest.raises(TeSAError, match="'fc1.weight'.*does not match"):
        TeSA.dense((2, 3)).check_shape((3, 2), "fc1.weight")


@settings(max_examples=50, deadline=None)
@given(bits_tensors(), bits_tensors())
def test_lattice_laws(a, b):
    ta = TeSA.from_bits(a)
    if a.shape != b.shape:
        b = b.reshape(-1)[: a.numel()] if b.numel() >= a.numel() else torch.zeros_like(a)
        b = b.reshape(a.shape) if b.numel() == a.numel() else torch.zeros_like(a)
    tb = TeSA.from_bits(b)
    m = ta.meet(tb)
    assert torch.equal(m.bits, torch.minimum(a, b))
    assert m <= ta and m <= tb and m == tb.meet(ta) and ta.meet(ta) == ta
    j = ta.join(tb)
    assert torch.equal(j.bits, torch.maximum(a, b)) and ta <= j


@settings(max_examples=50, deadline=None)
@given(bits_tensors())
def test_serialisation_roundtrip(a):
    t = TeSA.from_bits(a)
    assert TeSA.from_bytes(t.to_bytes()) == t
    assert TeSA.from_json(t.to_json()) == t
    assert TeSA.from_bytes(t.to_bytes()).digest() == t.digest()


@pytest.mark.parametrize("values,encoding", [((0, 32), "mask"), ((0, 4), "mask"), ((4,), "mask"), ((0, 4, 8), "raw"),
                                             ((4, 32), "raw"), ((0,), "raw")])
def test_serialisation_picks_its_encoding_by_the_kept_bit_widths(values, encoding):
    """One kept bit width (with or without pruned elements) is a packed mask; several, or none kept, the raw values."""
    g = torch.Generator().manual_seed(len(values))
    bits = torch.tensor(values, dtype=torch.uint8)[torch.randint(0, len(values), (37, 53), generator=g)]
    bits[0, :len(values)] = torch.tensor(values, dtype=torch.uint8)                 # every value present
    t = TeSA.from_bits(bits)
    header, payload = t.serialize()
    assert header["encoding"] == encoding and TeSA.deserialize(header, payload) == t


def test_serialisation_is_compact_and_not_pickle():
    mask = torch.rand(768, 3072) < 0.1
    t = TeSA.from_mask(mask)
    header, payload = t.serialize()
    assert header["encoding"] == "mask" and len(payload) < 768 * 3072 / 8 * 1.1
    assert TeSA.dense((4096, 4096)).to_bytes().__len__() < 100
    import pickle
    with pytest.raises(TypeError):
        pickle.dumps(t)
    with pytest.raises(TeSAError, match="corrupt"):
        TeSA.from_bytes(t.to_bytes()[:30])


def test_block_density():
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:2, :3] = True
    mask[3, 5] = True
    bd = TeSA.from_mask(mask).block_density(2, 3)
    assert bd.shape == (2, 2)
    assert bd[0, 0] == 1.0 and bd[0, 1] == 0.0 and bd[1, 1] == pytest.approx(1 / 6)
    edge = TeSA.dense((5, 5)).block_density(2, 2)       # ragged edge blocks count real elements
    assert edge.shape == (3, 3) and bool((edge == 1).all())
    assert TeSA.from_mask(np.array([1, 0, 1, 1], dtype=np.int64)).block_density(1, 2).tolist() == [[0.5, 1.0]]
