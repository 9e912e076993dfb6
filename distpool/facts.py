"""What every typed error shares: its facts are its attributes, and it crosses a process boundary
with all of them.

Ray pickles an exception raised in an actor. By default an exception is rebuilt by calling its
class with its `args`, which for a typed error is its message alone: the constructor fails, or the
facts are lost. An error that lists `Facts` first among its bases is rebuilt from its `args` and its
attributes instead, whatever its constructor takes.
"""

from __future__ import annotations


class Facts:
    """Mixin for an exception whose facts are its attributes (list it first among the bases)."""

    __slots__ = ()

    def __reduce__(self):
        return _restore, (type(self), self.args, vars(self))


def _restore(cls: type[BaseException], args: tuple, facts: dict) -> BaseException:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(facts)
    return error
