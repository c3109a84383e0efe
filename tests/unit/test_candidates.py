"""The ranks' agreement on what to resume from (``recovery.candidates``), as the pure rule over every rank's row:
what each rank offers goes through ``encode`` and the rows through ``decide``, as they do after the gather."""
from __future__ import annotations

from conftest import seeded_random

from easyckpt.recovery.candidates import (
    MAX_DISK_CANDIDATES,
    MAX_REPLICA_CANDIDATES,
    MAX_SLOTS,
    Reach,
    decide,
    describe_reach,
    encode,
)


def _decide(*offers: dict[str, list[int]]) -> tuple[list[tuple[int, str]], dict[int, list[int]], Reach]:
    return decide([encode(o.get("memory", []), o.get("disk", []), o.get("replica", [])) for o in offers])


def test_a_lost_nodes_rank_finds_the_survivors_older_step_among_more_than_its_two_newest_replicas() -> None:
    """CI, 2026-11-29 (S3 node loss): the survivors held [14, 10, 9, 8]; the lost node's ranks could pull those
    and newer backups too. Only their two newest replica steps were shared, so no step was common: disk at 8."""
    survivor = {"memory": [14, 10, 9, 8], "disk": [8, 0]}
    lost = {"replica": [13, 12, 10, 9], "disk": [8, 0]}
    ordered, bad, reach = _decide(survivor, survivor, lost, lost)
    assert ordered[0] == (10, "replica") and ordered[-2:] == [(8, "disk"), (0, "disk")]
    assert not bad
    assert reach == {(14, 10, 9, 8): [0, 1], (13, 12, 10, 9): [2, 3]}


def test_memory_before_replica_before_disk_and_only_steps_every_rank_gets() -> None:
    ordered, _, _ = _decide({"memory": [6, 5], "disk": [5]}, {"memory": [5], "replica": [6], "disk": [5]})
    assert ordered == [(6, "replica"), (5, "memory"), (5, "disk")]
    ordered, _, reach = _decide({"memory": [6]}, {"replica": [5]})
    assert ordered == [] and reach == {(6,): [0], (5,): [1]}


def test_an_unhealthy_snapshot_on_one_rank_marks_its_step_for_every_rank() -> None:
    rows = [encode([7, 6], [6]), encode([7, 6], [6], unhealthy={7})]
    ordered, bad, _ = decide(rows)
    assert ordered == [(7, "memory"), (6, "memory"), (6, "disk")] and bad == {7: [1]}


def test_decide_equals_a_plain_set_reading_of_random_offers() -> None:
    """Random offers within the row's widths: the candidates are every step all ranks get, tiers as documented."""
    rng = seeded_random()
    for _ in range(300):
        ranks = rng.randint(1, 5)
        offers = []
        for _ in range(ranks):
            mem = rng.sample(range(30), rng.randint(0, MAX_SLOTS))
            rep = [s for s in rng.sample(range(30), rng.randint(0, MAX_REPLICA_CANDIDATES)) if s not in mem]
            disk = sorted(rng.sample(range(30), rng.randint(0, MAX_DISK_CANDIDATES)), reverse=True)
            offers.append({"memory": mem, "replica": rep, "disk": disk})
        ordered, _, _ = _decide(*offers)
        mem_all = set.intersection(*(set(o["memory"]) for o in offers))
        any_all = set.intersection(*(set(o["memory"]) | set(o["replica"]) for o in offers))
        disk_all = set.intersection(*(set(o["disk"]) for o in offers))
        expected = sorted([(s, "memory" if s in mem_all else "replica") for s in any_all] + [(s, "disk") for s in disk_all],
                          key=lambda x: (-x[0], {"memory": 0, "replica": 1, "disk": 2}[x[1]]))
        assert ordered == expected, offers


def test_the_log_names_what_each_group_of_ranks_can_get() -> None:
    text = describe_reach({(14, 10): [0, 1], (): [2, 3]})
    assert text == "ranks [0, 1]: steps [14, 10]; ranks [2, 3]: none"
    many = {(s,): [s] for s in range(9)}
    assert describe_reach(many).endswith("; and 3 more groups")
    assert "(20 ranks)" in describe_reach({(1,): list(range(20))})
