"""Every typed error crosses a process boundary (Ray pickles what an actor raises) with all its facts."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

from distpool.facts import Facts
from distpool.memory.errors import DoesNotFit, KeepsNoCheckpoints
from distpool.worker.config import WorkerConfigInvalid
from transfer.wire import ChannelError, FailureKind, HeaderRefused, TransferError

PACKAGES = ("distpool", "prefill", "decode", "transfer")
# Importing every module imports Ray Serve, whose config models warn of pydantic's deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def package_exceptions() -> set[type[BaseException]]:
    found = set()
    for name in PACKAGES:
        package = importlib.import_module(name)
        modules = [package] + [
            importlib.import_module(info.name)
            for info in pkgutil.walk_packages(package.__path__, f"{name}.")
            if not info.name.endswith("__main__")
        ]
        for module in modules:
            for cls in vars(module).values():
                is_error = inspect.isclass(cls) and issubclass(cls, BaseException)
                if is_error and cls.__module__ == module.__name__:
                    found.add(cls)
    return found


def test_every_error_with_its_own_constructor_keeps_its_facts_across_processes():
    """An exception is rebuilt by calling its class with its `args` unless it says otherwise: one
    whose constructor takes its facts must list `Facts` among its bases."""
    errors = package_exceptions()
    custom = {
        cls
        for cls in errors
        if any("__init__" in vars(k) for k in cls.__mro__ if k.__module__.split(".")[0] in PACKAGES)
    }
    assert len(custom) > 50  # the walk found the packages' errors
    assert sorted(cls.__qualname__ for cls in custom if Facts not in cls.__mro__) == []


def test_an_error_is_rebuilt_with_its_message_and_every_fact():
    errors = [
        KeepsNoCheckpoints(),  # its constructor takes nothing: calling it with its message failed
        DoesNotFit("r", "no room", low=1, pages=7, low_free=0, pages_free=3, pinned=2),
        WorkerConfigInvalid("device", "gpu9", "cpu or cuda"),
        ChannelError("the link went", kind=FailureKind.TIMEOUT),
        TransferError(
            "r",
            FailureKind.REFUSED,
            "refused",
            channel_broken=True,
            cause=HeaderRefused(FailureKind.REFUSED, "layout", "rows differ"),
        ),
    ]
    for error in errors:
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and again.args == error.args
        assert vars(again).keys() == vars(error).keys()
        for name, value in vars(error).items():
            if isinstance(value, BaseException):
                assert type(getattr(again, name)) is type(value) and vars(getattr(again, name)) == vars(value)
            else:
                assert getattr(again, name) == value, name
