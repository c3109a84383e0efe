"""Where a rank sits on its node, from each launcher's variables or from the node names of the process group
(easyckpt.node.topology). The two-node job without torchrun's variables is
tests/jobs/test_multinode.py::test_killed_rank_resumes_from_memory_at_most_two_steps_back[1-no-local-variables]."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from easyckpt.node import topology


@pytest.mark.parametrize("environ,expected", [
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2, "LOCAL_WORLD_SIZE (torchrun)")),
    ({"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}, (1, 2, "LOCAL_SIZE (the DeepSpeed launcher)")),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     (1, 2, "OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI)")),
    ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 2, "MPI_LOCALNRANKS (MPICH or Intel MPI)")),
    # torchrun's names win over those of an MPI runtime it was started under
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, (0, 1, "LOCAL_WORLD_SIZE (torchrun)")),
    # a count without a local rank: the ranks of a node are consecutive, as every launcher above gives them
    ({"LOCAL_WORLD_SIZE": "2"}, (1, 2, "LOCAL_WORLD_SIZE (torchrun)")),
])
def test_each_launchers_variables_place_the_rank(environ: dict[str, str], expected: tuple[int, int, str]) -> None:
    found = topology.from_environment(environ, rank=3, world_size=4)
    assert found is not None
    assert (found.local_rank, found.local_world_size, found.source) == expected
    assert (found.rank, found.world_size) == (3, 4)


@pytest.mark.parametrize("environ", [{}, {"LOCAL_RANK": "1"}, {"LOCAL_WORLD_SIZE": " "}])
def test_no_count_of_the_nodes_ranks_is_no_placement(environ: dict[str, str]) -> None:
    """Lightning's launcher sets LOCAL_RANK alone: that says nothing of how many ranks the node has."""
    assert topology.from_environment(environ, rank=1, world_size=4) is None


@pytest.mark.parametrize("environ,words", [
    ({"LOCAL_WORLD_SIZE": "two"}, ["LOCAL_WORLD_SIZE='two'", "whole number"]),
    ({"LOCAL_WORLD_SIZE": "8"}, ["rank 1", "LOCAL_WORLD_SIZE=8", "torchrun", "world size 4"]),
    ({"LOCAL_WORLD_SIZE": "0"}, ["LOCAL_WORLD_SIZE=0"]),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["rank 1", "LOCAL_RANK=2", "node of 2"]),
    ({"LOCAL_RANK": "x", "LOCAL_SIZE": "2"}, ["LOCAL_RANK='x'"]),
])
def test_impossible_values_name_the_variable(environ: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        topology.from_environment(environ, rank=1, world_size=4)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_node_names_give_the_ranks_of_each_node_in_rank_order() -> None:
    names = ["b", "a", "b", "a", "b"]     # ranks spread over the nodes, not in blocks
    placed = [topology.from_node_names(names, rank) for rank in range(5)]
    assert [(p.local_rank, p.local_world_size) for p in placed] == [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
    assert all(p.world_size == 5 and "EASYCKPT_NODE_ID" in p.source for p in placed)


def gathering(rows: list[dict[str, str]], names: list[str], asked: list[int]) -> Callable[[str], list[str]]:
    """A gather over the environments of every rank, as the process group's all-gather gives it."""
    def gather(text: str) -> list[str]:
        asked.append(1)
        return [topology.told(environ, name).encode() for environ, name in zip(rows, names)]
    return gather


TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


def test_a_torchrun_worker_takes_its_variables_without_a_collective() -> None:
    asked: list[int] = []
    gather = gathering([TORCHRUN] * 4, ["n0", "n0", "n1", "n1"], asked)
    placed = topology.place(2, 4, TORCHRUN, gather, "n1")
    assert (placed.local_rank, placed.local_world_size) == (0, 2) and not asked


def test_without_torchrun_the_ranks_ask_each_other_once(caplog: pytest.LogCaptureFixture) -> None:
    """Lightning's launcher: LOCAL_RANK in the ranks it started, nothing in the first; the node names decide."""
    caplog.set_level("INFO", logger="easyckpt.node.topology")
    rows = [{}, {"LOCAL_RANK": "1"}, {}, {"LOCAL_RANK": "1"}]
    names = ["n0", "n0", "n1", "n1"]
    asked: list[int] = []
    gather = gathering(rows, names, asked)
    placed = [topology.place(rank, 4, rows[rank], gather, names[rank]) for rank in range(4)]
    assert [(p.local_rank, p.local_world_size) for p in placed] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert len(asked) == 4, "one gather per rank"
    assert "WARNING" not in caplog.text, "no count was told anywhere: nothing disagrees"
    assert caplog.text.count("2 of the 4 ranks are on this node (the node names") == 2, "each node's first rank"
    rows[3] = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}   # one rank told a count, the others none
    gather = gathering(rows, names, asked)
    assert topology.place(2, 4, rows[2], gather, "n1").local_world_size == 2
    assert "no variable counts the ranks of the node of rank(s) [0, 1, 2]" in caplog.text


def test_accelerates_lie_on_cpu_is_caught_job_wide(caplog: pytest.LogCaptureFixture) -> None:
    """The DeepSpeed launcher sets LOCAL_SIZE=2; Accelerate on CPU then writes LOCAL_WORLD_SIZE=1 into both ranks
    (it reads no LOCAL_SIZE): rank 0 alone sees nothing wrong (local rank 0 of 1), rank 1 does; the gather tells
    both that the variables cannot be taken, so both ranks take the node names."""
    rows = [{"LOCAL_RANK": "0", "LOCAL_SIZE": "2", "LOCAL_WORLD_SIZE": "1"},
            {"LOCAL_RANK": "1", "LOCAL_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}]
    asked: list[int] = []
    gather = gathering(rows, ["box", "box"], asked)
    placed = [topology.place(rank, 2, rows[rank], gather, "box") for rank in range(2)]
    assert [(p.local_rank, p.local_world_size) for p in placed] == [(0, 2), (1, 2)]
    assert "rank 1 was told local rank 1 of a node of 1" in caplog.text


@pytest.mark.parametrize("rows,why", [
    ([("a", 0, 2), ("a", 1, 2), ("b", 0, 2), ("b", 1, 2)], None),
    ([("a", None, 2), ("a", None, 2)], None),
    ([("a", 0, 2), ("a", 1, 2), ("b", 0, 1)], "different counts"),
    ([("a", 0, 2), ("a", 1, 2), ("b", 0, 2)], "do not divide the world of 3"),
    ([("a", 0, 2), ("a", 0, 2)], "do not make nodes of 2"),
    ([("a", 0, 2), ("a", 2, 2)], "rank 1 was told local rank 2"),
    ([("a", 0, None), ("a", 1, 2)], "rank(s) [0]"),
    ([("a", 0, None), ("a", 1, None)], "rank(s) [0, 1]"),
])
def test_the_variables_are_taken_only_when_they_agree_job_wide(rows: list[tuple[str, int | None, int | None]],
                                                                why: str | None) -> None:
    told = [topology.Told(*row) for row in rows]
    found = topology.disagreement(told)
    assert (found is None) if why is None else (found is not None and why in found), found
    placement, said = topology.decide(told, 1)
    assert said == (found if any(row.local_world is not None for row in told) else None)
    if why is not None:   # the node names decide
        names = [row[0] for row in rows]
        assert placement.local_world_size == names.count(names[1])


def test_a_value_that_is_no_number_counts_as_unset_so_that_the_rank_still_joins_the_gather() -> None:
    assert topology.told({"LOCAL_RANK": "x", "LOCAL_SIZE": "two"}, "n") == topology.Told("n", None, None)


def test_what_a_rank_was_told_survives_the_gather() -> None:
    for row in (topology.Told("node\nwith a newline", 3, 8), topology.Told("n", None, None)):
        assert topology.Told.decode(row.encode()) == row


def test_without_a_process_group_every_rank_is_taken_for_one_of_this_node() -> None:
    assert topology.place(0, 1, {}, None).local_world_size == 1
    alone = topology.place(1, 3, {"LOCAL_RANK": "1"}, None)
    assert (alone.local_rank, alone.local_world_size) == (1, 3)
    assert topology.place(2, 3, {}, None).local_rank == 2


TORCHRUN_WORKER = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"}


def test_a_torchrun_worker_whose_restart_would_share_the_rendezvous_store_is_told_the_fix() -> None:
    """The variables torchrun 2.13 writes (tests/jobs/test_torchrun.py runs the real one)."""
    said = topology.restart_hazard(TORCHRUN_WORKER)
    assert said is not None
    for words in ("--max-restarts=3, 1 used", "init_process_group", "pytorch/pytorch#135712",
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        assert words in said


@pytest.mark.parametrize("change", [
    {"TORCHELASTIC_USE_AGENT_STORE": "False"},   # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a store per attempt
    {"TORCHELASTIC_MAX_RESTARTS": "0"},          # no restart to come
    {"TORCHELASTIC_RESTART_COUNT": "3"},         # the last one used
    {"TORCHELASTIC_MAX_RESTARTS": "many"},       # not torchrun's writing: not judged
    {"TORCHELASTIC_RUN_ID": None},               # not a torchrun worker
])
def test_no_restart_to_come_or_a_store_per_attempt_is_no_hazard(change: dict[str, str | None]) -> None:
    environ = {k: v for k, v in {**TORCHRUN_WORKER, **change}.items() if v is not None}
    assert topology.restart_hazard(environ) is None
