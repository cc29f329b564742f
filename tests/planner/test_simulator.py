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


def test_a_device_holding_two_stages_serves_them_first_come_first_served():
    # stages on devices 0, 1, 0; three items of 1 s each, free links. Device 0 has six seconds of
    # work. It takes stage 0's items first, since they arrived (at 0) before any of stage 2's
    # (at 2, 3, 4), then stage 2's.
    tl = simulate([[1] * 3] * 3, [[0] * 3] * 2, keep=True, devices=[0, 1, 0])
    assert tl.makespan == 6
    assert [(j, k, a, e) for j, k, a, e in tl.compute if j != 1] == [
        (0, 0, 0, 1), (0, 1, 1, 2), (0, 2, 2, 3), (2, 0, 3, 4), (2, 1, 4, 5), (2, 2, 5, 6)]
    # one sender per device: stage 0's and stage 2's outputs would share it (stage 2 sends none)
    assert simulate([[1] * 3] * 3, [[0] * 3] * 2) == 5  # on three devices: (K + N - 1) x 1 s


def test_shared_simulation_matches_the_chain_when_devices_differ():
    import random

    from planner.simulator import _simulate_shared

    rng = random.Random(0)
    for _ in range(50):
        n, k = rng.randint(1, 5), rng.randint(1, 9)
        comp = [[rng.random() for _ in range(k)] for _ in range(n)]
        comm = [[0.3 * rng.random() for _ in range(k)] for _ in range(n - 1)]
        a, b = simulate(comp, comm, keep=True), _simulate_shared(comp, comm, True, list(range(n)))
        assert a.makespan == pytest.approx(b.makespan)
        flat = lambda spans: [x for span in sorted(spans) for x in span]  # noqa: E731
        assert flat(a.compute) == pytest.approx(flat(b.compute))
        assert flat(a.transfers) == pytest.approx(flat(b.transfers))


def _shared_by_scanning(comp, comm, devices):
    """The shared-device rules by brute force: before each computation, scan every stage for the
    earliest start (ties by arrival, then stage). The simulator keeps its candidates in a heap."""
    inf = float("inf")
    n, k_items = len(comp), len(comp[0])
    arrival = [[0.0] * k_items] + [[inf] * k_items for _ in range(n - 1)]
    nxt, free, sender = [0] * n, {d: 0.0 for d in devices}, {d: 0.0 for d in devices}
    compute, transfers = [], []
    for _ in range(n * k_items):
        start, _, j = min((max(free[devices[j]], arrival[j][k]), arrival[j][k], j)
                          for j, k in enumerate(nxt) if k < k_items and arrival[j][k] < inf)
        k = nxt[j]
        nxt[j] += 1
        end = free[devices[j]] = start + comp[j][k]
        compute.append((j, k, start, end))
        if j < n - 1:
            t0 = max(sender[devices[j]], end)
            sender[devices[j]] = arrival[j + 1][k] = t0 + comm[j][k]
            transfers.append((j, k, t0, sender[devices[j]]))
    return max(e for *_, e in compute), sorted(compute), sorted(transfers)


@pytest.mark.parametrize("ties", [False, True])
def test_shared_simulation_equals_brute_force(ties):
    """Devices holding several stages, in rounds or at random; with ``ties``, times on a coarse grid
    so that many computations could start at the same moment."""
    import random

    rng = random.Random(int(ties))
    value = (lambda: rng.randint(0, 4) * 0.5) if ties else rng.random
    for _ in range(300):
        n_dev = rng.randint(1, 4)
        n = rng.randint(1, 9)
        devices = [i % n_dev for i in range(n)] if rng.random() < 0.7 else [rng.randrange(n_dev) for _ in range(n)]
        k = rng.randint(1, 10)
        comp = [[value() for _ in range(k)] for _ in range(n)]
        comm = [[0.3 * value() for _ in range(k)] for _ in range(n - 1)]
        tl = simulate(comp, comm, keep=True, devices=devices)
        assert (tl.makespan, list(tl.compute), list(tl.transfers)) == _shared_by_scanning(comp, comm, devices)
