"""``KeptJson``: what every record of a JSON object shares. The object is the contract: ``to_json`` gives back exactly
the keys it held, in its order, with their values (those of keys the record does not know too, kept in ``extra``), so
a record read and written again writes the same bytes, and a key a newer version or a person added survives a
read-modify-write. Values are kept as the object holds them: the record types the keys, not a second opinion on a
hand-edited value.

A record is a frozen dataclass (``eq=False``: records compare as their objects do) with the fields ``extra`` and
``keys_held``; it says how it reads an object (``from_json``) and what a key of it holds (``value_of``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

Record = TypeVar("Record", bound="KeptJson")  # Python 3.10 has no typing.Self


class KeptJson:
    """The updates and the JSON of a record that keeps its object's keys (see the module's docstring)."""

    extra: Mapping[str, Any]
    keys_held: tuple[str, ...]

    @classmethod
    def from_json(cls: type[Record], data: Mapping[str, Any]) -> Record:
        raise NotImplementedError

    @classmethod
    def of(cls: type[Record], data: Record | Mapping[str, Any] | None) -> Record:
        """``data`` as a record: itself, or read from a JSON object (None: the empty record)."""
        return data if isinstance(data, cls) else cls.from_json(data or {})

    def value_of(self, key: str) -> Any:
        """What the object's ``key`` holds (KeyError: the object does not hold it)."""
        raise NotImplementedError

    def holds(self, key: str) -> bool:
        """Whether the object holds ``key`` (a key holding null included)."""
        return key in self.keys_held

    def to_json(self) -> dict[str, Any]:
        """The JSON object the record was read from (with its updates): its keys, in order, and their values."""
        return copy.deepcopy({key: self.value_of(key) for key in self.keys_held})

    def with_fields(self: Record, fields: Mapping[str, Any]) -> Record:
        """The record with the object's ``fields`` set, as a dict's ``data | fields``: a key it held stays in its
        place, a new one comes last."""
        return type(self).from_json({**self.to_json(), **fields})

    def without(self: Record, *keys: str) -> Record:
        """The record without the object's ``keys`` (those it does not hold are ignored)."""
        return type(self).from_json({key: value for key, value in self.to_json().items() if key not in keys})

    def __eq__(self, other: object) -> bool:  # as the objects compare (a dict's ==: the keys' order aside)
        return type(self) is type(other) and self.to_json() == other.to_json()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # it holds lists and dicts: as unhashable as its object


def copied_object(data: Any, what: str) -> dict[str, Any]:
    """A deep copy of the JSON object ``data`` (ValueError naming ``what`` if it is not one): a record shares nothing
    with the object it was read from."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} holds a {type(data).__name__}, not a JSON object")
    return copy.deepcopy(dict(data))


class FlatJson(KeptJson):
    """The base of a record whose fields are its object's keys, by name (``extra`` and ``keys_held`` aside): a key
    the object does not hold reads None; ``PARTS`` names the fields that hold a record of their own (a nested
    object, read by that record; a null stays None). Made by ``from_json`` (or updated by ``with_fields``): a field
    set directly would not be written, and is refused."""

    WHAT: ClassVar[str] = "a JSON object"  # what the object is, for the error when it is not one
    PARTS: ClassVar[Mapping[str, type[KeptJson]]] = {}

    def __post_init__(self) -> None:
        unheld = [key for key in self.known_keys() if getattr(self, key) is not None and key not in self.keys_held]
        if unheld:
            raise TypeError(f"{type(self).__name__}: {', '.join(unheld)} set but not held, so never written; make "
                            "the record with from_json or update it with with_fields")

    @classmethod
    def known_keys(cls) -> tuple[str, ...]:
        """The keys the record's fields name."""
        known = _KNOWN_KEYS.get(cls)
        if known is None:
            names = (f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]  # each subclass is one
            known = _KNOWN_KEYS[cls] = tuple(name for name in names if name not in ("extra", "keys_held"))
        return known

    @classmethod
    def from_json(cls: type[Flat], data: Mapping[str, Any]) -> Flat:
        """The record of the object ``data`` (copied: the record shares nothing with it)."""
        data = copied_object(data, cls.WHAT)
        known = cls.known_keys()
        values = {key: data.get(key) for key in known}
        for key, part in cls.PARTS.items():
            if values[key] is not None:
                values[key] = part.of(values[key])
        extra = {key: value for key, value in data.items() if key not in known}
        return cls(**values, extra=extra, keys_held=tuple(data))  # type: ignore[call-arg]  # a dataclass's fields

    def value_of(self, key: str) -> Any:
        """What the object's ``key`` holds (KeyError: the object does not hold it)."""
        if key not in self.keys_held:
            raise KeyError(key)
        if key not in self.known_keys():
            return self.extra[key]
        value = getattr(self, key)
        return value.to_json() if key in self.PARTS and value is not None else value


Flat = TypeVar("Flat", bound=FlatJson)
_KNOWN_KEYS: dict[type, tuple[str, ...]] = {}  # a FlatJson subclass -> its known keys, worked out once
