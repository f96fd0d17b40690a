"""The book's one cost model (d2ldist/cost.py) against the formulas the chapters print."""
import pytest

from d2ldist import cost

M, B = 4 * 11_200_000, 10e9 / 8          # ResNet-18's gradients, 10 Gbit/s


def test_even_shares_give_the_chapters_formula():
    for m, n in [(1, 1), (8, 1), (8, 4), (32, 32)]:
        assert cost.ps_time(M, m, n, B, 1e-3) == pytest.approx((1 + m / n) * M / B + 2e-3)


def test_one_server_holds_everything_whatever_the_shapes():
    shapes = [(64, 3, 3, 3), (64,), (512, 512, 3, 3), (10, 512)]
    nbytes = 4 * sum(cost.numel(s) for s in shapes)
    assert cost.server_loads(shapes, 1) == [nbytes]
    assert cost.ps_time_placed(shapes, 32, 1, B) == pytest.approx(cost.ps_time(nbytes, 32, 1, B))


def test_workers_push_server_by_server_and_each_server_answers_all():
    shapes = [(3_000_000,), (10,)]          # one big tensor split, one small whole
    l0, l1 = cost.server_loads(shapes, 2, bound=1_000_000)
    assert l0 + l1 == 4 * 3_000_010 and abs(l0 - l1) == 40
    by_hand = max(l0 + 4 * l0, l0 + l1 + 4 * l1) / B
    assert cost.ps_time_placed(shapes, 4, 2, B, bound=1_000_000) == pytest.approx(by_hand)


def test_ring_sends_2_n_minus_1_over_n_of_the_bytes():
    assert cost.ring_time(M, 1, B, 1e-3) == 0
    assert cost.ring_time(M, 4, B) == pytest.approx(2 * 3 / 4 * M / B)
    assert cost.ring_time(M, 8, B, 1e-4) == pytest.approx(2 * 7 * (M / 8 / B + 1e-4))


def test_many_workers_one_server_against_n_servers_and_the_ring():
    one, many, ring = cost.ps_time(M, 32, 1, B), cost.ps_time(M, 32, 32, B), cost.ring_time(M, 32, B)
    assert one == pytest.approx(33 * M / B) and many == pytest.approx(2 * M / B)
    assert ring < many < one


def test_hierarchical_is_two_passes_inside_and_a_ring_of_the_machines():
    nvlink = 450e9
    assert cost.hierarchical_time(M, 4, 1, nvlink, B, 1e-4) == cost.ring_time(M, 4, B, 1e-4)
    assert cost.hierarchical_time(M, 1, 8, nvlink, B, 1e-4, 1e-6) == \
        pytest.approx(2 * (M / nvlink + 7e-6))
    by_hand = 2 * (M / nvlink + 7e-6) + 2 * 3 * (M / 4 / B + 30e-6)
    assert cost.hierarchical_time(M, 4, 8, nvlink, B, 30e-6, 1e-6) == pytest.approx(by_hand)
    flat = cost.ring_time(M, 32, B, 30e-6)    # every step of 32 waits for the network
    assert cost.hierarchical_time(M, 4, 8, nvlink, B, 30e-6, 1e-6) < flat
