"""Registry[T]: the one place a kind of pluggable part (model, attention backend,
connector, send policy, send queue, fairness or chunk policy) is named.

CLI choices, config validation and `--help` read the names and their one-line help from
the registry, so a new part is one module plus one `register(...)` call. Entries are
light: heavy code (torch kernels, Ray) is named by a `"package.module:attr"` reference
that `load_ref` imports on first use, so listing the names (`pdserve --help`) imports
nothing heavy. Plain Python, no third-party imports.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> entries of one kind, in registration order.

    `kind` is the name users see (the config key, e.g. "fairness_policy"); errors say
    `unknown fairness_policy 'x'; known: [...]`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, item: T, *, help: str = "", replace: bool = False) -> T:
        """Add `item` under `name`; a taken name raises unless `replace=True`."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if name in self._items and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered "
                             "(pass replace=True to override it)")
        self._items[name] = item
        self._help[name] = help
        return item

    def unregister(self, name: str) -> None:
        """Remove `name` (tests that register a part of their own clean up with this)."""
        self.get(name)
        del self._items[name], self._help[name]

    def get(self, name: str) -> T:
        """The entry of `name`; ValueError naming the kind and every known name if absent."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ValueError(self.unknown(name)) from None

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered (with a close match, if any)."""
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}; known: {list(self.names())}{hint}"

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def help(self, name: str) -> str:
        self.get(name)
        return self._help[name]

    def describe(self) -> str:
        """'a (what a does), b, ...': every name with its help, for --help texts."""
        return ", ".join(f"{n} ({h})" if h else n for n, h in self._help.items())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._items)})"


def load_ref(ref: Any) -> Any:
    """`"package.module:attr"` -> that attribute (imported now); anything else as is."""
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"a reference must look like 'package.module:attr', got {ref!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
