"""copy_lanes: how a CUDA snapshot's device-to-host copy is spread over the side streams (a pure rule)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from easyckpt.snapshot.stager import copy_lanes

sizes_st = st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, lanes=st.integers(min_value=1, max_value=6), piece=st.integers(min_value=1, max_value=700),
       data=st.data())
def test_every_byte_is_copied_once_and_the_lanes_are_balanced(sizes: list[int], lanes: int, piece: int,
                                                             data: st.DataObject) -> None:
    whole = frozenset(data.draw(st.sets(st.integers(min_value=0, max_value=len(sizes) - 1))))
    out = copy_lanes(sizes, lanes, piece, whole)
    assert len(out) == lanes
    covered: dict[int, list[tuple[int, int]]] = {}
    for lane in out:
        for i, start, end in lane:
            covered.setdefault(i, []).append((start, end))
    assert sorted(covered) == list(range(len(sizes))), "every tensor is copied, even an empty one"
    for i, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == sizes[i], (i, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"tensor {i}: gaps or overlaps {ranges}"
        if i in whole:
            assert ranges == [(0, sizes[i])], "a non-contiguous tensor is copied whole"
        else:
            assert all(end - start <= piece for start, end in ranges)
    loads = [sum(end - start for _, start, end in lane) for lane in out]
    biggest = max((end - start for lane in out for _, start, end in lane), default=0)
    assert max(loads) - min(loads) <= biggest, f"LPT leaves lanes at most one piece apart: {loads}"


def test_one_big_tensor_is_split_evenly_over_two_streams() -> None:
    out = copy_lanes([4 << 30], 2)
    assert [sum(e - s for _, s, e in lane) for lane in out] == [2 << 30, 2 << 30]
