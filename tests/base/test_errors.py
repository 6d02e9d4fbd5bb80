"""A library's error in a one-line message (flame.base.errors.gist) says what went wrong in words."""

import pytest

from flame.base.errors import failure_line, gist


def _raised_from(cause: BaseException) -> RuntimeError:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise RuntimeError("wrapper\nsecond line") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(("error", "words"), [
    (KeyError("text"), "missing key 'text' (KeyError)"),  # str() would be the bare "'text'"
    (KeyError("Column text not in the dataset"), "Column text not in the dataset"),  # a sentence stays one
    (OSError(28), "No space left on device"),  # str() would be the bare "28"
    (PermissionError(13, "Permission denied", "/data/a.jsonl"), "Permission denied: /data/a.jsonl"),
    (ValueError("first line.\nsecond line"), "first line"),
    (KeyError(), "KeyError"),
])
def test_an_error_is_put_in_words(error, words):
    assert gist(error) == words


def test_the_innermost_cause_is_the_one_told():
    assert gist(_raised_from(FileNotFoundError(2, "No such file or directory", "/x"))) == "No such file or directory: /x"


def test_a_broken_connection_to_another_rank_says_that_its_process_ended(tmp_path):
    error = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:52146: "
                         "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
                         "application. Check the logs of the remote worker before reporting an error. GLHF!")
    line = failure_line(error, str(tmp_path), "0")
    assert line.startswith("rank 0 failed: its connection to another rank broke (Read error [10.0.0.2]:52146: "
                           "Connection reset by peer): that rank's process ended."), line
    assert "GLHF" not in line and line.endswith(f"its traceback is in {tmp_path}/rank0-traceback.txt")
    assert "Connection reset by peer" in (tmp_path / "rank0-traceback.txt").read_text()


def test_a_broken_pipe_of_the_rank_itself_is_not_called_a_lost_peer(tmp_path):
    line = failure_line(BrokenPipeError(32, "Broken pipe"), str(tmp_path), "0")
    assert line.startswith("rank 0 failed: Broken pipe (BrokenPipeError)") and "another rank" not in line, line
