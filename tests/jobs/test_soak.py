"""The fault soak (benchmarks/soak.py): its 20-fault smoke mode as CI runs it, and a replay of every fault whose
seed found a bug (the soak's plan is a pure function of the seed and the fault's index, so ``--only K`` throws
the very fault again: same kind, configuration, step, moment and variant)."""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import seeded_random

pytestmark = pytest.mark.slow
FLAGS = ("torn", "hung", "leaked", "failed")


def soak(argv: list[str]) -> dict[str, Any]:
    return importlib.import_module("soak").main(argv)


def bad(run: dict[str, Any]) -> bool:
    return any(run[flag] for flag in FLAGS)


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference runs, shared by the smoke and the replays of one session (same checkout): a
    replay of a smoke seed needs the very reference the smoke ran, and would spend some 10 s running it again."""
    return tmp_path_factory.mktemp("soak-references")


@pytest.mark.timeout(1800)
def test_soak_smoke_twenty_faults(tmp_path: Path, references: Path) -> None:
    """20 seeded faults, every kind two or three times (an object-store outage on an s3:// save_dir among them), one and two
    simulated nodes, three jobs side by side: nothing torn, hung, leaked or failed; a rank kill costs at most two
    steps from memory, a lost node of a 2-node job comes back from the surviving node's replicas. A disk_full
    that could not mount its tmpfs (not root) is "not run", never a pass: the test says so."""
    seed = seeded_random().randrange(1 << 30)
    out = tmp_path / "smoke.json"
    result = soak(["--smoke", "--seed", str(seed), "--jobs", "3", "--json", str(out), "--dir", str(tmp_path / "work"),
                   "--reference-cache", str(references)])
    assert json.loads(out.read_text()) == result and result["seed"] == seed and result["complete"]
    runs = result["runs"]
    assert [run["index"] for run in runs] == list(range(20))
    plan = importlib.import_module("soak_plan")
    assert {run["fault"] for run in runs} == set(plan.available_kinds()), "every kind must be thrown"
    assert result["pending"] == {}
    regressions = [run for run in runs if bad(run)]
    assert not regressions, json.dumps(regressions, indent=1)[:6000]
    not_run = [run for run in runs if run["not_run"]]
    assert all(run["fault"] == "disk_full" and run["why"] for run in not_run), not_run
    assert os.geteuid() != 0 or not not_run, f"running as root, yet the tmpfs of disk_full was not mounted: {not_run}"
    for run in runs:
        if not run["fired"]:
            continue
        if run["fault"] == "rank_kill":
            assert run["source"] == "memory" and 0 <= run["lost"] <= 2, run
        if run["fault"] == "node_loss" and run["config"] == "plain-2x1":
            assert run["source"] == "replica" and 0 <= run["lost"] <= 2, run
        if run["fault"] == "node_loss" and run["config"] == "plain-1x1":
            assert run["source"] in ("disk", "scratch"), run   # the only node's memory is gone
    total = result["table"][-1]
    assert total["fault"] == "all" and total["runs"] == 20
    assert total["torn"] == total["hung"] == total["leaked"] == total["failed"] == 0, total


# (the soak's arguments, the fault's index, the bug it found): each fault is replayed with the settings it ran with
class TornRun(AssertionError):
    """A replayed fault's run came back torn (and nothing worse)."""


# The kinds before object_store_outage was added (2026-11-27): a fault is drawn from its seed, index and kind list,
# so the replays of faults found before then name that list.
BEFORE_OUTAGE = ["--kinds", "rank_kill,node_loss,agent_kill,rank_stop,disk_full,flip_slot,flip_disk"]

# The eight kinds of the 1000-fault soak begun on 2026-11-27 (seed 20261127).
ALL_KINDS_20261127 = [*BEFORE_OUTAGE[1].split(","), "object_store_outage"]
REPLAYS = [
    pytest.param(["--smoke", "--seed", "11", *BEFORE_OUTAGE], 1,
                 "a byte flipped in latest_checkpointed_iteration.txt: read_tracker "
                 "raised UnicodeDecodeError, so every agent died at start-up and load() failed instead of passing the "
                 "tracker over", id="smoke-11-1"),
    # extended: the lag gate's rule has its unit tests (tests/unit/test_lag_gate.py); the job takes 78 s
    pytest.param(["--smoke", "--seed", "11", *BEFORE_OUTAGE], 7,
                 "the leader's agent killed in a 2-node job before the tracker: the "
                 "ranks' lag gates took each other's waits for step time, each wait about 2.7 times the one before, "
                 "until they stopped each other (the job hung)", id="smoke-11-7", marks=pytest.mark.extended),
    # extended: a bug of the soak's own judge, not of easyckpt (78-109 s)
    pytest.param(["--seed", "101", *BEFORE_OUTAGE], 8,
                 "the soak's own judge: a node frozen inside its snapshot of step 7, lost and "
                 "resumed at 7 from the replicas, was judged failed because one of its ranks never logged step 7 "
                 "(which the resumed state, digest checked, already holds)", id="101-8", marks=pytest.mark.extended),
    pytest.param(["--seed", "101", *BEFORE_OUTAGE], 19,
                 "the disk full to the end of a 2-node HF job: the TrainerWrapper's export "
                 "thread waited export_timeout (600 s) for each step whose persist had failed, holding up the end of "
                 "training (hung); then, restarted by torchrun after close() failed, it resumed at global step 20 "
                 "of max_steps=20 and trained steps 21 and 22 (torn)", id="101-19"),
    # extended: tests/agent/test_agent.py::test_a_byte_flipped_in_a_committed_slot_is_refused_and_an_older_step_loaded
    # catches the same flip in 5 s
    pytest.param(["--seed", "101", *BEFORE_OUTAGE], 34,
                 "a byte flipped in the tensor bytes of a committed slot of a single-node job "
                 "was loaded as is and trained on: only multi-node agents checksummed their slots (torn)", id="101-34",
                 marks=pytest.mark.extended),
    pytest.param(["--seed", "101", *BEFORE_OUTAGE], 99,
                 "the agent killed at step 7 of a short 2-rank HF run, and no snapshot after "
                 "it to replace the agent: the end of training waited export_timeout (600 s) for the exports of "
                 "steps 10, 15 and 20 that no agent would write (hung)", id="101-99"),
    pytest.param(["--seed", "7", *BEFORE_OUTAGE], 5,
                 "the agent killed while the job ran: a rank's replacement agent that lost the "
                 "start-up race took the lock after the job's agent had exited and waited out its idle timeout (an "
                 "agent and its control block left behind)", id="7-5"),
    pytest.param(["--seed", "5", "--kinds", "object_store_outage", "--configs", "plain-1x1,plain-2x1", "--steps", "12",
                  "--interval", "3"], 3,
                 "the object store down from inside a persist to the end of a 2-node job: the leader's agent crashed "
                 "listing the staged steps (ConnectionError), and every agent a rank started then crashed at start-up "
                 "reading the store, so node 0's memory was left behind without a word (leaked)", id="5-outage-3"),
    pytest.param(["--seed", "4242", "--kinds", "flip_disk", "--configs", "plain-1x1", "--steps", "12"], 2,
                 "a byte flipped in the only iteration: the load refused it and the ranks died before their first "
                 "snapshot; their agent waited the whole idle_timeout (300 s) with nothing in memory (an agent and "
                 "its control block left behind)", id="4242-flip_disk-2"),
    pytest.param(["--seed", "20261127", "--kinds", ",".join(ALL_KINDS_20261127)], 57,
                 "the same refused load in a 2-node job (plain-2x2): the early exit was for one node only, so both "
                 "agents waited their whole idle_timeout with nothing in memory and no backup (leaked)",
                 id="20261127-57", marks=pytest.mark.extended),
    pytest.param(["--seed", "1127", "--kinds", ",".join(ALL_KINDS_20261127)], 11,
                 "the store down in a 2x2 job and a rank killed meanwhile: the store came back and both nodes persisted "
                 "the final step, but the leader listed its stages only at the end of the pause its failed listings "
                 "had grown to (20 s): the job ended with no step committed (failed)", id="1127-11",
                 marks=pytest.mark.extended),
    # extended: a bug of the soak's own judge, not of easyckpt (104 s in the campaign)
    pytest.param(["--seed", "1127", "--kinds", ",".join(ALL_KINDS_20261127)], 493,
                 "the soak's own judge: the object store down from the job's first object write to its end (plain-1x2), "
                 "the job ended with PersistError as it must, and `easyckpt verify` found no save_dir in the bucket "
                 "(nothing was ever committed): judged failed", id="1127-493", marks=pytest.mark.extended),
    # extended: the kill lands between the publish and the tracker only now and then;
    # tests/agent/test_agent.py::test_agent_killed_before_the_tracker_update_the_published_step_is_loaded puts it there
    # with a fault point every time
    pytest.param(["--seed", "1127", "--kinds", ",".join(ALL_KINDS_20261127)], 221,
                 "the whole job killed between the publish of iteration 5 and the tracker's update, then a byte "
                 "flipped in the tracked iteration 0: the load passed the whole iteration 5 over (newer than the "
                 "tracker) and refused 0, and the job could not start (failed)", id="1127-221",
                 marks=pytest.mark.extended),
    pytest.param(["--smoke", "--seed", "798013051", "--kinds", ",".join(ALL_KINDS_20261127)], 14,
                 "a byte flipped inside a key of common.json (\"block.linear2.bias\" became \"bloc9...\"): still "
                 "valid JSON and not checksummed, so one rank of a 2-node job loaded the newest iteration with its "
                 "state under a wrong name and died in load_state_dict while the other went on (torn, failed)",
                 id="798013051-14"),
    pytest.param(["--smoke", "--seed", "325356583"], 12,
                 "a byte flipped in the step of a committed slot's header (slot format 1 had no checksum over its "
                 "header): the rank resumed \"step 2089670227099910147\" from memory and the job hung at its end (the "
                 "header is now 8 bytes longer, so the byte this fault draws is in the generation; "
                 "tests/unit/test_tiers_ladder.py flips the soak's very byte)", id="325356583-12"),
    # Extended: the rank's late load needs the job to end around it, which depends on timing; the judge's rule and the
    # agent's answer have their unit tests (tests/unit/test_soak_judge.py, tests/unit/test_agent_resume.py).
    pytest.param(["--seed", "11301", "--configs", "plain-2x1,plain-2x2,hf-2x1"], 0,
                 "the store down to the end of a 2x2 job: node 1's agent tried the store for each rank's RESUME in turn "
                 "(2 s of retries each), so rank 3 was still in load() when node 0's ranks failed at close and node "
                 "1's torchrun died with the rendezvous; the soak's judge took its first run's fresh start for its "
                 "resume (\"ranks resumed different steps: [19, 19, 19, None]\", torn)", id="11301-0",
                 marks=pytest.mark.extended),
    # Extended: the bug needs the restarted rendezvous to swap the nodes' ranks. It did so now and then only when it
    # was found; since 2026-12-04 this fault draws the soak's "leader" variant, which swaps them every time (node 1
    # runs rank 0 until it is lost), as tests/unit/test_agent_node_agreement.py does in one process.
    pytest.param(["--smoke", "--seed", "7"], 7,
                 "node 1 lost in a 2x1 job; the restarted rendezvous put rank 0 on node 1 and rank 1 on node 0, whose "
                 "agent still counted its dead rank 0 as local: no step after the resume was backed up or persisted "
                 "(the final flush waited 25 s, the tracker stayed at 0: failed)", id="7-7",
                 marks=pytest.mark.extended),
    # Extended: the persist must take the space between the harness's look at the free space and its write, which it
    # does now and then only; tests/unit/test_soak_faults.py makes the disk full under the write every time.
    pytest.param(["--smoke", "--seed", "300322676"], 18,
                 "the soak's own harness: disk_full filled the tmpfs while the persist in flight took the space first; "
                 "bytes stayed in the filler file's buffer and its close raised ENOSPC, so the job was judged failed "
                 "(\"OSError: [Errno 28] No space left on device\")", id="300322676-18", marks=pytest.mark.extended),
    # Extended: the whole job must be lost between the leader's and the other node's shards of a step, which it is
    # now and then only; tests/unit/test_agent_lifecycle.py (a stage of an earlier incarnation) puts the leader there
    # every time.
    pytest.param(["--smoke", "--seed", "33569623"], 11,
                 "a byte flipped in the only iteration of a 2-node job lost just after the leader wrote its shards of "
                 "step 3: the rerun's ranks refused the iteration and died with nothing in memory, and the leader's "
                 "agent waited STAGE_WAIT (120 s) for the other node's shards of step 3, which had died with the first "
                 "run (an agent and its control block left behind)", id="33569623-11", marks=pytest.mark.extended),
    # Extended: the other node must write its files of the last step before the leader fails its own, which it does
    # now and then only; tests/jobs/test_s3_multinode.py fails only the leader's persists every time.
    pytest.param(["--seed", "1323"], 523,
                 "the disk full to the end of a 2-node job, the other node's files of the last step written before "
                 "the leader's persist of it failed: that node's rank waited flush_timeout for a commit that could "
                 "not come until its launcher killed it, and its agent, never told, kept the slots without saying why "
                 "(leaked)", id="1323-523", marks=pytest.mark.extended),
    # Extended: another process must take the port in the seconds before torchrun listens on it;
    # tests/unit/test_soak_plan.py checks where the ports now come from.
    pytest.param(["--seed", "1323"], 26,
                 "the soak's own harness: the port of a whole job's relaunch was picked by the kernel (bind to 0), and "
                 "an outgoing connection took it before node 0's torchrun listened (EADDRINUSE: no rank restarted)",
                 id="1323-26", marks=pytest.mark.extended),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("argv,index,bug", REPLAYS)
def test_soak_replays_the_faults_that_found_bugs(tmp_path: Path, references: Path, argv: list[str], index: int,
                                                 bug: str) -> None:
    result = soak([*argv, "--only", str(index), "--json", str(tmp_path / "replay.json"), "--dir", str(tmp_path / "w"),
                   "--reference-cache", str(references)])
    (run,) = result["runs"]
    assert run["index"] == index and run["fired"], run
    worse = {flag: run[flag] for flag in ("hung", "leaked", "failed")}
    assert not any(worse.values()), f"{bug}:\n{json.dumps(run, indent=1)[:4000]}"
    if run["torn"]:
        raise TornRun(f"{bug}:\n{json.dumps(run, indent=1)[:4000]}")
