"""What a failed persist tells the user to fix (``easyckpt.node.persist_watch.storage_fix``): the advice names the
save_dir and fits its kind, a directory or an object store."""
from __future__ import annotations

from pathlib import Path

from easyckpt.node.persist_watch import storage_fix
from easyckpt_wire.storage import as_path


def test_a_directory_is_given_space_or_repaired() -> None:
    assert storage_fix(Path("/Data/Run")) == "free space on or repair the file system of save_dir /Data/Run"
    assert storage_fix("/Data/Run", start=True).startswith("Free space on or repair the file system of save_dir /Data/Run")


def test_an_object_store_is_brought_back() -> None:
    for save_dir in ("s3://my-bucket/Run", as_path("s3://my-bucket/Run")):
        fix = storage_fix(save_dir, start=True)
        assert fix.startswith("Bring the object store of save_dir s3://my-bucket/Run back"), fix
        assert "AWS_ENDPOINT_URL_S3" in fix and "file system" not in fix
    assert "object store" in storage_fix("s3://b/x")   # a malformed URL still gets the store's advice
