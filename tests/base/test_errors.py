"""A library's error in a one-line message (flame.base.errors.gist) says what went wrong in words."""

import pytest

from flame.base.errors import gist


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
