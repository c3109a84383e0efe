"""Where a rank sits on its node, from each launcher's variables or from the node names of the process group
(easyckpt.node.topology). The two-node job without torchrun's variables is
tests/jobs/test_multinode.py::test_killed_rank_resumes_from_memory_at_most_two_steps_back[1-no-local-variables]."""
from __future__ import annotations

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


def test_the_process_group_is_asked_only_when_no_variable_counts_the_nodes_ranks(
        caplog: pytest.LogCaptureFixture) -> None:
    asked: list[int] = []

    def gather() -> list[str]:
        asked.append(1)
        return ["n0", "n0", "n1", "n1"]

    torchrun = topology.place(2, 4, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, gather)
    assert (torchrun.local_rank, torchrun.local_world_size) == (0, 2) and not asked
    caplog.set_level("INFO", logger="easyckpt.node.topology")
    lightning = topology.place(2, 4, {"LOCAL_RANK": "0"}, gather)
    assert (lightning.local_rank, lightning.local_world_size) == (0, 2) and asked == [1]
    assert "the process group says 2 of the 4 ranks are on this node" in caplog.text
    topology.place(3, 4, {"LOCAL_RANK": "1"}, gather)
    assert caplog.text.count("the process group says") == 1, "said by each node's first rank only"


def test_without_a_process_group_every_rank_is_taken_for_one_of_this_node() -> None:
    assert topology.place(0, 1, {}, None).local_world_size == 1
    alone = topology.place(1, 3, {"LOCAL_RANK": "1"}, None)
    assert (alone.local_rank, alone.local_world_size) == (1, 3)
    assert topology.place(2, 3, {}, None).local_rank == 2
