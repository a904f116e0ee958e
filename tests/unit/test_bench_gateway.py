"""bench/gateway.py's order of targets: a target that always ran in the same
slot of a round, after the same neighbour, carried that slot's share of the
machine's drift into its figures."""

from __future__ import annotations

from bench.gateway import round_order

TARGETS = ["direct", "direct-tls", "gateway", "gateway-plain", "gateway-plain@039fa63",
           "floor", "nginx"]  # fmt: skip


def test_the_first_round_runs_the_targets_as_given() -> None:
    assert round_order(TARGETS, 0) == TARGETS


def test_every_round_runs_each_target_once() -> None:
    for rnd in range(6):
        assert sorted(round_order(TARGETS, rnd)) == sorted(TARGETS)


def _before(order: list[str], target: str) -> str | None:
    i = order.index(target)
    return order[i - 1] if i else None


def test_a_target_changes_its_slot_and_its_neighbour_between_rounds() -> None:
    orders = [round_order(TARGETS, rnd) for rnd in range(3)]
    assert len({tuple(o) for o in orders}) == 3
    for target in ("gateway-plain", "gateway-plain@039fa63"):
        assert len({o.index(target) for o in orders}) > 1
        assert len({_before(o, target) for o in orders}) > 1


def test_two_runs_of_the_benchmark_order_their_rounds_alike() -> None:
    first = [round_order(TARGETS, rnd) for rnd in range(4)]
    assert [round_order(TARGETS, rnd) for rnd in range(4)] == first
