"""The runner of DALI's own tests (``python -m benchmarks compat dali``) on a file of our own.

The file stands for DALI's: it imports ``nvidia.dali`` names and DALI's test
helpers. Run with the rename only, it must see mpexec under DALI's names in
every process, get the helpers' behaviour, and survive a hanging test.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from benchmarks.compat import dali_suite

pytestmark = pytest.mark.usefixtures("no_leaks")

FAKE_DALI_TESTS = """
import os
import time

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.types as types
from nvidia.dali.pipeline import Pipeline
from nose2.tools import params
from nose_utils import raises
from test_utils import get_dali_extra_path, np_type_to_dali

images_dir = os.path.join(get_dali_extra_path(), "db", "single", "jpeg")


def test_the_rename_is_mpexec():
    import mpexec
    import nvidia.dali

    assert nvidia.dali is mpexec and fn is mpexec.fn
    assert np_type_to_dali(np.float32) is types.FLOAT is mpexec.types.FLOAT


def _pid(x):
    import nvidia.dali

    assert nvidia.dali.__name__ == "mpexec", "the workers see the rename too"
    return np.array([os.getpid()])


def test_functions_run_in_workers_under_the_rename():
    pipe = Pipeline(2, 1, 0, 1)
    with pipe:
        pipe.set_outputs(fn.python_function(types.Constant(0), function=_pid))
    (pids,) = pipe.run()
    assert int(pids.at(0)[0]) != os.getpid()
    pipe.close()


def test_the_jpeg_folder_is_dali_extras_layout():
    dirs = sorted(os.listdir(images_dir))
    assert "image_list.txt" in dirs and "0" in dirs and "814" in dirs
    pipe = Pipeline(5, 1, 0, 1)
    with pipe:
        jpegs, labels = fn.readers.file(file_root=images_dir)
        pipe.set_outputs(fn.decoders.image(jpegs, device="cpu"), labels)
    images, labels = pipe.run()
    assert images.at(0).shape[2] == 3
    assert [int(x[0]) for x in labels] == [0, 0, 0, 0, 1], "four JPEGs in 0/, as in DALI_extra"
    pipe.close()


@raises(ValueError, "boom*here")
def test_raises_reads_a_glob_anywhere_in_the_message():
    raise ValueError("the BOOM is here, now")


@raises(ValueError, "not*this")
def test_raises_fails_on_another_message():
    raise ValueError("something else")


@params(1, 2, 3)
def test_params_make_one_test_each(x):
    assert x in (1, 2)


def test_hangs():
    time.sleep(600)


def test_after_the_hang():
    pass
"""


def test_runner_renames_in_every_process_and_survives_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("PIL")
    tests = tmp_path / "test_python_function.py"
    tests.write_text(FAKE_DALI_TESTS)
    # The runner's work folder goes to a temporary folder of this test's own: another
    # runner on the machine (a second test process, a user's) makes folders of its own.
    # A short path (not tmp_path): fork servers put their sockets in it (108 bytes at most).
    scratch = Path(tempfile.mkdtemp(prefix="mpx-dc-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "out.json"
    status = dali_suite.main(
        [str(tests), "--runs", "mpexec", "--test-timeout", "20", "--json", str(out)]
    )
    assert status == 0
    runs = json.loads(out.read_text())["runs"]["mpexec"]
    got = {k.split("::")[1]: v["outcome"] for k, v in runs["outcomes"].items()}
    assert got == {
        "test_the_rename_is_mpexec": "passed",
        "test_functions_run_in_workers_under_the_rename": "passed",
        "test_the_jpeg_folder_is_dali_extras_layout": "passed",
        "test_raises_reads_a_glob_anywhere_in_the_message": "passed",
        "test_raises_fails_on_another_message": "failed",
        "test_params_make_one_test_each[0-1]": "passed",
        "test_params_make_one_test_each[1-2]": "passed",
        "test_params_make_one_test_each[2-3]": "failed",
        "test_hangs": "timeout",
        "test_after_the_hang": "passed",
    }
    assert not list(scratch.glob("mpexec-dali-compat-*")), "cleaned up"
