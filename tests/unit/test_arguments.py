"""Arguments a user passes on every step or once at start, checked in process before anything runs:
``easyckpt.config.check_step`` (the step given to ``save_if_needed``, ``save`` and ``note_step``) and the empty
``save_dir`` refused by ``easyckpt_wire.storage.location``. The Checkpointer's use of both (and its warning for steps
that go back), with an agent, is in ``tests/agent/test_bad_input.py``."""
from __future__ import annotations

from pathlib import Path

import numpy
import pytest
import torch

from easyckpt.config import CheckpointerConfig, check_step
from easyckpt_wire import protocol
from easyckpt_wire.storage import location


@pytest.mark.parametrize("step, value", [(7, 7), (numpy.int64(7), 7), (torch.tensor(7), 7), (0, 0),
                                         (protocol.MAX_STEP, protocol.MAX_STEP)])
def test_a_step_is_taken_as_its_int_value(step: object, value: int) -> None:
    taken = check_step(step, rank=3)
    assert taken == value and type(taken) is int


@pytest.mark.parametrize("step", [7.0, "7", True, None, torch.tensor(7.0), torch.tensor([7, 8]), numpy.float32(7)])
def test_a_step_that_is_not_an_int_is_refused_naming_its_type(step: object) -> None:
    with pytest.raises(TypeError) as info:
        check_step(step, rank=3)
    message = str(info.value)
    assert "rank 3" in message and type(step).__name__ in message and "global training step" in message, message


@pytest.mark.parametrize("step", [-1, protocol.MAX_STEP + 1])
def test_a_step_out_of_range_is_refused(step: int) -> None:
    with pytest.raises(ValueError, match=f"step {step} is out of range"):
        check_step(step, rank=0)


@pytest.mark.parametrize("where", ["", "  ", b""])
def test_an_empty_save_dir_is_refused_naming_the_setting(where: str | bytes, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        location(where, "save_dir")   # type: ignore[arg-type]
    message = str(info.value)
    assert "save_dir is empty" in message and "'.' for the working directory" in message, message
    assert location(".", "save_dir") == tmp_path.resolve(), "'.' still names the working directory"


@pytest.mark.parametrize("where", [" /data/ckpt", "/data/ckpt\n", "ckpt ", "\ts3://bucket/ckpt"])
def test_a_save_dir_with_whitespace_at_an_end_is_refused_and_a_path_object_taken(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """" /data/ckpt" (a value read from a file or a YAML) went to a folder named " " of the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        location(where, "save_dir")
    message = str(info.value)
    assert f"save_dir {where!r} begins or ends with whitespace: strip it" in message, message
    with pytest.raises(ValueError, match="begins or ends with whitespace"):
        CheckpointerConfig(save_dir=where, save_mem_interval=1, save_storage_interval=5, max_ckpt_num=2)
    assert location(Path(" odd name "), "save_dir") == tmp_path / " odd name ", "a Path is taken as it is"
    assert location("/data/my ckpt", "save_dir") == Path("/data/my ckpt"), "a space inside a name is fine"


@pytest.mark.parametrize("mem, storage, lag", [(1, 5, 2), (1, 1, 1), (2, 10, 4), (10, 10, 10), (1, 100, 2)])
def test_the_default_backup_lag_is_two_snapshot_intervals_at_most_the_persist_interval(
        mem: int, storage: int, lag: int, tmp_path: Path) -> None:
    """A node loss resumes from the node-safe step, which the lag gate keeps within ``max_backup_lag`` steps: by
    default two snapshot intervals, what a rank kill may cost (invariant 9), and never more than the disk's interval.
    Counted in snapshot intervals, not steps: a bound below one snapshot interval would wait at every snapshot."""
    def config(given: int | None) -> CheckpointerConfig:
        return CheckpointerConfig(save_dir=tmp_path, save_mem_interval=mem, save_storage_interval=storage,
                                  max_ckpt_num=2, max_backup_lag=given)

    assert config(None).max_backup_lag == lag
    assert config(0).max_backup_lag == 0, "0 still turns the gate off"


def _config(tmp_path: Path, **given: object) -> CheckpointerConfig:
    return CheckpointerConfig(save_dir=tmp_path / "ckpt", save_mem_interval=1, save_storage_interval=5, max_ckpt_num=2,
                              shm_dir=tmp_path / "shm", **given)   # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["flush_timeout", "peer_timeout", "load_timeout", "agent_start_timeout"])
@pytest.mark.parametrize("value, error, says", [
    ("10", TypeError, "must be a number of seconds (int or float), got str '10'"),   # read from a config file
    (True, TypeError, "got bool True"),
    (float("nan"), ValueError, "positive, finite number of seconds, got nan"),
    (float("inf"), ValueError, "positive, finite number of seconds, got inf"),
    (0, ValueError, "positive, finite number of seconds, got 0"),
    (-1.5, ValueError, "got -1.5"),
])
def test_a_timeout_that_is_not_a_positive_finite_number_is_refused_by_name(
        name: str, value: object, error: type[Exception], says: str, tmp_path: Path) -> None:
    """A timeout read from a YAML file or the environment arrives as a string: refused naming the setting, not with
    a comparison's TypeError; NaN and infinity would end a wait at once or never."""
    with pytest.raises(error) as info:
        _config(tmp_path, **{name: value})
    assert str(info.value).startswith(f"{name} must be") and says in str(info.value), info.value
    assert _config(tmp_path, **{name: 2}).__dict__[name] == 2, "an int of seconds is fine"


@pytest.mark.parametrize("name", ["start_agent", "replicate_unique", "final_persist"])
@pytest.mark.parametrize("value", ["false", 0, None])
def test_a_switch_that_is_not_a_bool_is_refused(name: str, value: object, tmp_path: Path) -> None:
    """``start_agent="false"`` from the environment would be taken as True and spawn an agent."""
    with pytest.raises(ValueError, match=f"{name} must be True or False, got {value!r}"):
        _config(tmp_path, **{name: value})


def test_a_log_file_path_that_names_a_directory_is_refused_with_a_file_to_use(tmp_path: Path) -> None:
    """The agent appends a line per persist to log_file_path: a directory there could only be warned about in the
    agent's own log. A file in a folder that does not exist yet is fine: the folder is made."""
    with pytest.raises(IsADirectoryError) as info:
        _config(tmp_path, log_file_path=str(tmp_path))
    assert f"log_file_path {tmp_path} is a directory" in str(info.value)
    assert f"log_file_path='{tmp_path / 'easyckpt-persists.log'}'" in str(info.value), info.value
    (tmp_path / "a-file").write_text("")
    with pytest.raises(NotADirectoryError, match=f"{tmp_path / 'a-file'} is a file, not a directory"):
        _config(tmp_path, log_file_path=str(tmp_path / "a-file" / "persists.log"))
    wanted = tmp_path / "logs" / "new" / "persists.log"
    assert _config(tmp_path, log_file_path=str(wanted)).log_file_path == str(wanted)
    assert wanted.parent.is_dir() and not wanted.exists(), "the folder is made, the file is the agent's to write"
