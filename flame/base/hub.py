"""Hub names (``org/name``) of tokenizers, models, datasets and lm-eval's data: the local HF cache first, then the hub, briefly.

huggingface_hub retries a request that cannot connect five times (23 s), and loading one name
makes several requests, so a name not in the cache took 50-96 s to fail where the hub was
unreachable. ``cache_first`` loads a name from the local cache without any request; only when it
is not there does it ask the hub once whether it answers (``unreachable``: one request of at
most HF_HUB_ETAG_TIMEOUT seconds, no retry), and it loads online only if it does. A name neither
cached nor reachable is one line naming the remedy.
"""

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TypeVar

import httpx
from huggingface_hub import constants
from huggingface_hub.utils import get_session

from flame.base.errors import ConfigError, gist

T = TypeVar("T")


def is_hub_name(location: str) -> bool:
    """Whether ``location`` reads as a hub repo (``name`` or ``org/name``), not as a local path."""
    return not os.path.isabs(location) and not location.startswith((".", "~")) and location.count("/") <= 1


def download_remedy(name: str) -> str:
    """The remedy for a model or tokenizer not in the cache."""
    return (f"download it where there is network (hf download {name}) into this HF_HOME, or set HF_HOME to a cache "
            "that holds it")


@contextlib.contextmanager
def offline(*configs: ModuleType) -> Iterator[None]:
    """What HF_HUB_OFFLINE=1 sets, for one lookup: huggingface_hub's switch (transformers reads it too) and that
    of each of ``configs``, a library's own copy of the variable read at its import (``datasets.config``)."""
    switched = (constants, *configs)
    before = [module.HF_HUB_OFFLINE for module in switched]
    for module in switched:
        module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for module, value in zip(switched, before):
            module.HF_HUB_OFFLINE = value


@functools.cache  # asked once per process: one unreachable hub fails every later name at once
def unreachable() -> str | None:
    """Why the hub cannot be reached (None: it answers), from one request without retry."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except httpx.HTTPError as error:
        return f"{constants.ENDPOINT}: {gist(error)}"
    return None


def cache_first(what: str, remedy: str, load: Callable[[], T], *configs: ModuleType) -> T:
    """``load()`` offline, from the local HF cache alone (``configs``: as ``offline``); where that fails, ``load()``
    online once the hub answers; else ConfigError: ``what`` is neither cached nor reachable, and ``remedy``.

    The online call's own errors (a name the hub does not have, ...) are the caller's to word.
    """
    try:
        with offline(*configs):
            return load()
    except (OSError, ValueError) as error:  # not cached (OSErrors), or not as asked: datasets' cache lacks a config
        cached = error
    if (why := unreachable()) is not None:
        if not isinstance(cached, OSError):  # the cache holds the name, and its error says what it lacks
            raise cached
        raise ConfigError(f"{what} is not in the local HF cache ({constants.HF_HOME}) and the hub is unreachable "
                          f"({why}); {remedy}")
    return load()
