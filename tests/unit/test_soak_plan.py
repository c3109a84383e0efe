"""The fault soak's plan (benchmarks/soak_plan.py) and its simulated nodes' rank order (benchmarks/soak_job.py):
the node losses that strike the leader's node, and the ports its jobs listen on."""
from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import soak_job
import soak_plan

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def node_losses(seed: int, configs: list[str], count: int) -> list[soak_plan.Fault]:
    return [soak_plan.plan(seed, index, kinds=["node_loss"], configs=configs, steps=20, interval=5)
            for index in range(count)]


def test_half_the_node_losses_of_a_two_node_job_lose_the_leader_and_a_one_node_job_has_no_leader_to_lose() -> None:
    two = node_losses(1313, ["plain-2x1", "plain-2x2", "hf-2x1"], 200)
    leaders = sum(fault.variant == "leader" for fault in two)
    assert 70 <= leaders <= 130, f"{leaders} of 200 node losses lost the leader's node"
    assert {fault.variant for fault in two} == {"", "leader"}
    assert all(fault.victim == 1 for fault in two)
    one = node_losses(1313, ["plain-1x1", "plain-1x2", "hf-1x2"], 100)
    assert all(fault.variant == "" and fault.victim == 0 for fault in one)


def test_the_leader_variant_leaves_every_earlier_draw_of_a_seed_as_it_was() -> None:
    """The node losses of a soak run before the variant existed (seed 1311, 2026-12-04) draw the same configuration,
    step, moment and victim now: its JSON still replays them (``--only K``), a leader loss now and then aside."""
    result = json.loads((RESULTS / "soak-1311-multinode-outage.json").read_text())
    runs = [run for run in result["runs"] if run["fault"] == "node_loss"]
    assert len(runs) >= 5
    for run in runs:
        fault = soak_plan.plan(result["seed"], run["index"], kinds=result["kinds"], configs=result["configs"],
                               steps=result["steps"], interval=result["interval"])
        drawn = (fault.kind, fault.config, fault.step, fault.moment, fault.victim)
        assert drawn == ("node_loss", run["config"], run["step"], run["moment"], run["victim"]), run["index"]


@pytest.mark.parametrize("name", ["plain-2x1", "plain-2x2", "plain-3x1"])
def test_the_node_that_leads_has_the_lowest_address_and_runs_rank_0(tmp_path: Path, name: str) -> None:
    config = soak_plan.CONFIGS[name]
    cluster = soak_job.Cluster(config, tmp_path, shape=soak_plan.Shape.of(config.api, 12, 3),
                               deadline=time.monotonic() + 60)
    try:
        per, last = config.ranks_per_node, config.nodes - 1

        def order() -> list[range]:
            return [cluster.ranks_of(node) for node in range(config.nodes)]
        assert order() == [range(n * per, (n + 1) * per) for n in range(config.nodes)]
        cluster.lead_with(last)
        assert order() == [range((n + 1) * per, (n + 2) * per) for n in range(last)] + [range(0, per)]
        # what torchrun's --local-addr gets
        assert cluster.addrs == {**{n: f"127.0.0.{n + 2}" for n in range(last)}, last: "127.0.0.1"}
    finally:
        cluster.cleanup()


def test_the_three_node_configuration_is_drawn_only_when_asked_for() -> None:
    """A configuration added to the table would change the configuration drawn for every earlier seed's faults; the
    3-node one is left out of the default list, which stays what it was."""
    assert soak_plan.DEFAULT_CONFIGS == ["plain-1x1", "plain-1x2", "plain-2x1", "plain-2x2", "hf-1x1", "hf-1x2",
                                         "hf-2x1"]
    three = node_losses(1315, ["plain-3x1"], 40)
    assert all(fault.victim == 2 for fault in three) and any(fault.variant == "leader" for fault in three)
    with pytest.raises(ValueError, match="1 to 3 nodes"):
        soak_plan.Config(api="plain", nodes=4, ranks_per_node=1, weight=1)


def test_ports_to_listen_on_are_free_below_the_ephemeral_range_and_never_given_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Soak seed 1323, fault 26: a port the kernel picked (bind to 0) was taken by another process's outgoing
    connection before the relaunched node 0's torchrun listened on it (EADDRINUSE)."""
    low = soak_job.ephemeral_low()
    ports = [soak_job.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports) and all(1024 <= p < low for p in ports), (low, ports)
    for port in ports:   # each was bindable when given
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
    with socket.socket() as taken:
        # A port below the range that someone else listens on, and that no free_port() of this process gave (a port
        # given before would be skipped as given, and the test would pass for that reason).
        for candidate in range(low - 1, 1024, -1):
            if candidate not in soak_job._GIVEN:
                try:
                    taken.bind(("127.0.0.1", candidate))
                    break
                except OSError:
                    continue
        taken.listen()
        busy = taken.getsockname()[1]
        assert busy not in soak_job._GIVEN and busy > 0, busy

        class Draws(random.Random):
            """The busy port drawn first, then the usual draws."""

            first = True

            def randrange(self, *args: Any, **kwargs: Any) -> int:
                if self.first:
                    self.first = False
                    return busy
                return super().randrange(*args, **kwargs)

        monkeypatch.setattr(soak_job, "_PORTS", Draws())
        assert soak_job.free_port() != busy, "a port in use is skipped"
    (tmp_path / "range").write_text("40000\t60999\n")
    assert soak_job.ephemeral_low(tmp_path / "range") == 40000
    assert soak_job.ephemeral_low(tmp_path / "missing") == 32768
