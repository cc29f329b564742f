import pytest

from planner.simulator import simulate


def test_single_stage_is_the_sum():
    assert simulate([[1.0, 2.0, 3.0]], []) == 6.0


def test_two_stages_hand_computed():
    # stage 0: 2, 2 ; link: 1, 1 ; stage 1: 3, 1
    # item0: s0 0-2, link 2-3, s1 3-6 ; item1: s0 2-4, link 4-5, s1 max(6,5)=6-7
    assert simulate([[2, 2], [3, 1]], [[1, 1]]) == 7


def test_link_is_a_resource():
    # the link carries one transfer at a time: item1 waits for item0's transfer
    # s0: 1,1 -> finish 1,2 ; link: 5,5 -> 1-6, 6-11 ; s1: 1,1 -> 6-7, 11-12
    assert simulate([[1, 1], [1, 1]], [[5, 5]]) == 12


def test_three_stage_pipeline_fill_and_drain():
    # uniform: K items, N stages, each t: makespan (K + N - 1) t with free links
    comp = [[1.0] * 5 for _ in range(3)]
    comm = [[0.0] * 5 for _ in range(2)]
    assert simulate(comp, comm) == pytest.approx(7.0)


def test_timeline_intervals():
    tl = simulate([[2, 2], [3, 1]], [[1, 1]], keep=True)
    assert tl.makespan == 7
    assert (1, 1, 6, 7) in tl.compute and (0, 1, 4, 5) in tl.transfers
