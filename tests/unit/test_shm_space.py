"""How many slots fit in shared memory, the refusal that names the fix, and the reservation of a slot's pages
(``easyckpt.snapshot.shm_space``), in one process on files in a temporary directory."""
from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from easyckpt.config import MIN_SLOTS
from easyckpt.snapshot import shm_space
from easyckpt.snapshot.shm_space import ShmSpaceError, check_space, fitting_count, reserve
from easyckpt.snapshot.slots import RankSlots

MIB = 1 << 20


@given(default=st.integers(MIN_SLOTS, 6), slot_bytes=st.integers(1, 10 * MIB), local=st.integers(1, 8),
       room=st.integers(0, 600 * MIB))
def test_the_count_is_the_most_that_fit_never_fewer_than_two(default: int, slot_bytes: int, local: int,
                                                               room: int) -> None:
    count = fitting_count(default=default, slot_bytes=slot_bytes, local_ranks=local, room=room)
    if room < MIN_SLOTS * slot_bytes * local:
        assert count is None
        return
    assert count is not None and MIN_SLOTS <= count <= default
    assert count * slot_bytes * local <= room
    assert count == default or (count + 1) * slot_bytes * local > room


def test_a_refusal_names_the_directory_the_rank_and_the_shm_size(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_space, "free_bytes", lambda directory: 5 * MIB)
    check_space(tmp_path, rank=3, needed=5 * MIB, slot_bytes=MIB, count=3, full_count=3, local_ranks=2)   # fits
    with pytest.raises(ShmSpaceError) as info:
        check_space(tmp_path, rank=3, needed=6 * MIB, slot_bytes=2 * MIB, count=3, full_count=3, local_ranks=1)
    message = str(info.value)
    assert f"{tmp_path} has 5.0 MiB free" in message and "rank 3 needs 6.0 MiB more" in message, message
    assert "--shm-size=1g (3 slots per rank x 1 local rank(s)" in message and "EASYCKPT_SLOTS=2" in message, message


def test_a_file_system_without_fallocate_keeps_the_new_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some file systems have no fallocate (EOPNOTSUPP): the slot keeps the size it was given, its pages come on
    first touch. (Before this module, the size went back to the old one and the slot was too small.)"""
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    path = tmp_path / "slot"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        monkeypatch.setattr(os, "posix_fallocate", unsupported)
        reserve(fd, path, 3 * MIB, rank=0)
        assert os.fstat(fd).st_size == 3 * MIB
    finally:
        os.close(fd)


def test_a_full_file_system_keeps_the_old_size_and_names_the_fix(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    path = tmp_path / "slot"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve(fd, path, MIB, rank=0)
        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(ShmSpaceError) as info:
            reserve(fd, path, 4 * MIB, rank=5)
        assert os.fstat(fd).st_size == MIB
        assert f"{path}: cannot reserve 4.0 MiB for rank 5" in str(info.value) and "--shm-size" in str(info.value)
        # the node's ranks sizing their slots at once each pass the free-space check and fill it together: the
        # message says how full the file system is and the size that holds every local rank's slots
        with pytest.raises(ShmSpaceError) as info:
            reserve(fd, path, 4 * MIB, rank=5,
                    advice=shm_space.shm_size_advice(slot_bytes=4 * MIB, full_count=3, local_ranks=8))
        assert f"({tmp_path}: " in str(info.value) and " free of " in str(info.value), info.value
        assert "--shm-size=1g (3 slots per rank x 8 local rank(s) x 4.0 MiB = 96.0 MiB, plus room)" in str(info.value)
    finally:
        os.close(fd)


def test_slots_on_a_file_system_without_fallocate_are_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through ``RankSlots``: before ``reserve``, a new slot went back to 0 bytes there and its mapping
    failed ("0 bytes is smaller than a slot header")."""
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    slots = RankSlots(tmp_path, "job", 0, 1, 1, count=2)
    try:
        write = slots.write(MIB, step=0)
        assert write is not None
        with write:
            write.commit(0, 0, b"")
        assert sorted(p.stat().st_size for p in tmp_path.glob("easyckpt-job-*")) == [MIB, MIB]
        assert list(slots.committed()) == [0]
    finally:
        slots.close()


@pytest.mark.parametrize("world,local,count,cost", [
    (4, 2, 3, "a rank kill may then cost more than two snapshot intervals"),   # three-lost, test_agreement.py
    (4, 2, 2, "the time of a persist plus two snapshot intervals"),
    (2, 2, 2, "the time of a persist plus two snapshot intervals"),
])
def test_fewer_slots_than_the_default_asked_for_say_what_they_cost(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, world: int, local: int, count: int, cost: str) -> None:
    """slots= (or EASYCKPT_SLOTS) below the default (4 across nodes, 3 on one node) works, but invariant 9's bound is
    for the default: the node's first rank says so once at WARNING, naming the count, the default and the fix;
    the others at INFO. The default count and more say nothing."""
    caplog.set_level(logging.INFO, logger="easyckpt")
    for rank in (0, 1):
        RankSlots(tmp_path, "job", rank, world, local, count=count).close()
    said = [r for r in caplog.records if "slots per rank asked for" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.INFO], said
    message = said[0].getMessage()
    default = 4 if world > local else 3
    assert f"rank 0: {count} slots per rank asked for" in message and f"fewer than the {default}" in message, message
    assert cost in message and f"EASYCKPT_SLOTS={default}" in message, message
    caplog.clear()
    RankSlots(tmp_path, "job", 0, world, local, count=default).close()
    RankSlots(tmp_path, "job", 0, world, local, count=None).close()
    assert not [r for r in caplog.records if "slots per rank asked for" in r.getMessage()]
