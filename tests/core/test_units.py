import pytest

from hpipe.core.errors import InputError
from hpipe.core.units import UnitRange, even_cuts, ranges_from_cuts, unit_kind, unit_name


def test_chain_naming():
    names = [unit_name(u, 2) for u in range(6)]
    assert names == ["embed", "attn_0", "mlp_0", "attn_1", "mlp_1", "head"]


def test_unit_outside_model():
    with pytest.raises(InputError, match="outside"):
        unit_kind(6, 2)


@pytest.mark.parametrize("start,end", [(-1, 3), (0, 0), (3, 2), (0, 7)])
def test_bad_ranges(start, end):
    with pytest.raises(InputError):
        UnitRange(start, end, 2)


def test_range_properties():
    r = UnitRange(2, 6, 2)
    assert not r.has_embed and r.has_head and r.attention_layers() == [1] and len(r) == 4


def test_even_cuts_and_ranges():
    cuts = even_cuts(62, 3)
    ranges = ranges_from_cuts(cuts, 30)
    assert cuts == [21, 41] and [len(r) for r in ranges] == [21, 20, 21]
    assert ranges[0].start == 0 and ranges[-1].end == 62
    with pytest.raises(InputError):
        ranges_from_cuts([5, 5], 30)
    with pytest.raises(InputError):
        ranges_from_cuts([70], 30)
