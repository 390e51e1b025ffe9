"""The values real trainer state contains, as tagged JSON: encoded safely, decoded only into allowed types.

The Checkpointer saves ``Stateful`` objects; their state dicts (and plain state
entries, and a save's ``extra``) mix tensors with plain values. :func:`encode`
turns such a value into JSON, moving every tensor out into a name -> tensor
table (the tensors are stored as tensors, in the step's ``_state`` layer);
:func:`decode` is its inverse. Nothing here ever unpickles, and nothing
imports a module or looks up a class named by the stored data.

Encoding (JSON values are themselves; everything else is a one-key object)::

    None, bool, int, str, finite float, list   -> themselves
    dict with str keys (none of them a tag)    -> a JSON object
    other dicts (int keys, tuple keys, ...)     {"__kv__": [[key, value], ...]}
    tuple (and torch.Size, named tuples)        {"__tuple__": [...]}        (a tuple again)
    set, frozenset                              {"__set__": [...]}, {"__frozenset__": [...]}
    bytes, bytearray                            {"__bytes__": "<base64>"}
    nan, inf, -inf                              {"__float__": "nan" | "inf" | "-inf"}
    pathlib paths                               {"__path__": ["Path" | "PurePosixPath" | ..., "<str>"]}
    argparse.Namespace                          {"__namespace__": {attribute: value}}
    torch.dtype, torch.device                   {"__dtype__": "bfloat16"}, {"__device__": "cuda:1"}
    an enum member                              {"__enum__": {"type": "<module>.<qualname>", "name", "value"}}
    a dataclass instance                        {"__dataclass__": {"type": "<module>.<qualname>", "fields"}}
    torch.Tensor                                {"__tensor__": "<name in the table>"}
    numpy array                                 {"__ndarray__": "<name in the table>"}
    numpy scalar                                {"__npscalar__": ["<dtype>", value]}

**Enums and dataclasses decode to their class only where that class is
known without trusting the data**: the object being restored into already
holds a value of that class at the same place (``like``, the template: the
state entry's current value, or the current ``state_dict()`` of the
``Stateful`` being loaded), or the class was allowed with
:func:`allow_value_types` (as ``torch.serialization.add_safe_globals`` allows
classes for ``weights_only`` loads). Otherwise an enum member decodes to the
string ``"<module>.<qualname>.<NAME>"`` and a dataclass to a plain dict of
its fields with ``"__type__": "<module>.<qualname>"``: the type name is kept,
no code of the data's choosing runs.

Anything else (a module, a function, a plain ``DataLoader``, an arbitrary
object, a distributed tensor outside a module) is refused with
:class:`~tierstore.errors.InvalidValueError` naming where it sits
(``sched.lr_lambdas[0]``) and saying what to do, before anything is written.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import json
import math
import pathlib
import threading
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tierstore.errors import CorruptObjectError, InvalidValueError, RestoreMismatchError

try:  # optional: numpy RNG state and arrays in trainer state (torch works without numpy)
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every torch wheel we test
    np = None  # type: ignore[assignment]

__all__ = ["TAGS", "allow_value_types", "decode", "encode", "type_name"]

TAGS = ("__kv__", "__tuple__", "__bytes__", "__float__", "__tensor__", "__ndarray__", "__npscalar__",
        "__set__", "__frozenset__", "__path__", "__namespace__", "__dtype__", "__device__", "__enum__",
        "__dataclass__")
_MAX_DEPTH = 200
_NONE = object()  # no template at this place
_PATHS: dict[str, type[pathlib.PurePath]] = {
    "Path": pathlib.Path, "PurePath": pathlib.PurePath, "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}
_DTYPES: dict[str, torch.dtype] = {str(v).removeprefix("torch."): v for n in dir(torch)
                                   if isinstance(v := getattr(torch, n, None), torch.dtype)}
_ALLOWED: dict[str, type] = {}
_ALLOWED_LOCK = threading.Lock()


def type_name(cls: type) -> str:
    """``<module>.<qualname>``: how a stored enum or dataclass names its class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def allow_value_types(*classes: type) -> None:
    """Let :func:`decode` rebuild these enum and dataclass types wherever they are stored.

    Without this, an enum member or a dataclass decodes to its class only where
    the object being restored into holds one at the same place (see the module
    docstring). Allowing a class is the caller's statement that constructing it
    from stored field values is safe (a dataclass's ``__init__`` and
    ``__post_init__`` run).

    Raises:
        InvalidValueError: a class that is neither an ``Enum`` subclass nor a dataclass.
    """
    for cls in classes:
        if not isinstance(cls, type) or not (issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls)):
            raise InvalidValueError(f"allow_value_types takes Enum subclasses and dataclasses, got {cls!r}",
                                    key=repr(cls))
    with _ALLOWED_LOCK:
        for cls in classes:
            _ALLOWED[type_name(cls)] = cls


# ---- encoding ---------------------------------------------------------------------------------

def encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str) -> Any:
    """JSON for ``value``; its tensors are added to ``tensors`` under ``prefix`` + a number.

    Args:
        value: a state dict, or any value inside one.
        tensors: the table the tensors go into (names must not repeat across calls:
            give each call its own ``prefix``).
        prefix: the names' prefix (``state/sched/``).
        where: the value's path for error messages (``sched``).

    Raises:
        InvalidValueError: a value that is none of the types above; ``key`` names its path,
            the message says what to do.
    """
    return _enc(value, tensors, prefix, where, 0)


def _refuse(where: str, what: str, fix: str | None = None) -> InvalidValueError:
    fix = fix or ("give its class state_dict() and load_state_dict() (a Stateful entry of its own), or store "
                  "the values it holds; tensors, numpy arrays, bytes, JSON values, tuples, sets, paths, "
                  "Namespaces, enums, dataclasses, torch dtypes and devices can be checkpointed")
    return InvalidValueError(f"state {where!r}: {what} cannot be checkpointed: {fix}", key=where)


def _refusal(where: str, v: Any) -> InvalidValueError:
    what = f"a {type_name(type(v))}"
    if isinstance(v, nn.Module):
        return _refuse(where, what, "a module is not a value; put it in the state as an entry of its own "
                                    "(state={'loss_fn': module}) if it holds trained tensors, else leave it out "
                                    "(Lightning: self.save_hyperparameters(ignore=['loss_fn']))")
    if isinstance(v, torch.utils.data.DataLoader):
        return _refuse(where, what, "a plain DataLoader has no position to save; use "
                                    "torchdata.stateful_dataloader.StatefulDataLoader (the same arguments), whose "
                                    "state_dict() holds the sampler's position and the RNG of its shuffle")
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.LambdaType)) or (
            callable(v) and not isinstance(v, type) and hasattr(v, "__code__")):
        return _refuse(where, what, "code is not state; store the values it uses and rebuild the function when "
                                    "restoring (a LambdaLR's lr_lambdas: keep them out of its state_dict, or use "
                                    "a scheduler whose state is values)")
    if isinstance(v, type):
        return _refuse(where, f"the class {type_name(v)}", "store its name, and map the name back to the class "
                                                          "when restoring")
    return _refuse(where, what)


def _enc(v: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise _refuse(where, f"a value nested deeper than {_MAX_DEPTH} levels (a cycle?)",
                      "break the cycle, or store a flatter value")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, enum.Enum):  # before int and str: an IntEnum is an int, a StrEnum a str
        return {"__enum__": {"type": type_name(type(v)), "name": v.name,
                             "value": _enc(v.value, tensors, prefix, f"{where}.value", depth + 1)}}
    if isinstance(v, str):
        return str(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return float(v)
        return {"__float__": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"__bytes__": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, torch.Tensor):
        if type(v) is not torch.Tensor and not isinstance(v, nn.Parameter):
            raise _refuse(where, f"a {type(v).__name__}", "a distributed tensor belongs to a module's state: put "
                                                         "the module in the state")
        if v.layout != torch.strided or v.is_nested or v.is_quantized or v.device.type == "meta":
            raise _refuse(where, "a tensor that is not dense and strided (nested, sparse, quantized or meta)",
                          "store it as dense tensors (to_dense(), unbind())")
        name = f"{prefix}{len(tensors)}"
        tensors[name] = v.detach()
        return {"__tensor__": name}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"__device__": str(v)}
    if np is not None and isinstance(v, np.ndarray):
        try:
            t = torch.from_numpy(np.ascontiguousarray(v))
        except TypeError as e:
            raise _refuse(where, f"a numpy array of dtype {v.dtype}", "convert it to a supported dtype or a "
                                                                     "list") from e
        name = f"{prefix}{len(tensors)}"
        tensors[name] = t
        return {"__ndarray__": name}
    if np is not None and isinstance(v, np.generic):
        item = v.item()
        if not isinstance(item, (bool, int, float)):
            raise _refuse(where, f"a numpy scalar of dtype {v.dtype}", "store it as a Python value")
        return {"__npscalar__": [v.dtype.str, _enc(item, tensors, prefix, where, depth + 1)]}
    if isinstance(v, pathlib.PurePath):
        kind = "Path" if isinstance(v, pathlib.Path) else type(v).__name__
        return {"__path__": [kind if kind in _PATHS else "PurePath", str(v)]}
    if isinstance(v, argparse.Namespace):
        return {"__namespace__": _enc(vars(v), tensors, prefix, where, depth + 1)}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        return {"__dataclass__": {"type": type_name(type(v)),
                                  "fields": _enc(fields, tensors, prefix, where, depth + 1)}}
    if isinstance(v, tuple):
        return {"__tuple__": [_enc(x, tensors, prefix, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [_enc(x, tensors, prefix, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, (set, frozenset)):
        items = [_enc(x, tensors, prefix, f"{where}{{{x!r}}}", depth + 1) for x in v]
        items.sort(key=lambda x: json.dumps(x, sort_keys=True))  # the same set, the same document
        return {"__frozenset__" if isinstance(v, frozenset) else "__set__": items}
    if isinstance(v, Mapping):
        if all(isinstance(k, str) for k in v) and not any(k in TAGS for k in v):
            return {k: _enc(x, tensors, prefix, f"{where}.{k}", depth + 1) for k, x in v.items()}
        return {"__kv__": [[_enc(k, tensors, prefix, f"{where}.<key {k!r}>", depth + 1),
                            _enc(x, tensors, prefix, f"{where}[{k!r}]", depth + 1)] for k, x in v.items()]}
    raise _refusal(where, v)


# ---- decoding ---------------------------------------------------------------------------------

def decode(obj: Any, tensors: Mapping[str, torch.Tensor], where: str = "state", *, like: Any = _NONE) -> Any:
    """The value :func:`encode` encoded; tensors are taken from ``tensors`` (cloned by the caller if needed).

    Args:
        like: the template: what the object being restored into holds now at this place (the
            state entry, or the ``state_dict()`` of the Stateful being loaded). Enums and
            dataclasses decode to the class the template holds at the same place when its name
            is the stored one (else see :func:`allow_value_types` and the module docstring).

    Raises:
        CorruptObjectError: a malformed tag or a tensor missing from ``tensors``.
        RestoreMismatchError: a stored dataclass whose fields do not fit its class here.
    """
    depth = _depth(obj)
    if depth > _MAX_STORED_DEPTH:  # before the recursive decode: a hostile document never reaches its limit
        raise CorruptObjectError(f"state {where!r} is nested {depth} levels deep (at most {_MAX_STORED_DEPTH}: "
                                 f"what a value of {_MAX_DEPTH} levels encodes to)", key=where)
    return _dec(obj, tensors, where, like)


#: the deepest stored document :func:`decode` reads: each level of a value encodes to at most 3 JSON levels
#: (``{"__kv__": [[k, v]]}``), and :func:`encode` refuses values deeper than ``_MAX_DEPTH``
_MAX_STORED_DEPTH = 3 * _MAX_DEPTH + 8


def _depth(obj: Any) -> int:
    """The nesting depth of a JSON document (lists and objects), without recursion; stops counting once past
    ``_MAX_STORED_DEPTH``."""
    deepest = 0
    todo = [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if d > deepest:
            deepest = d
            if deepest > _MAX_STORED_DEPTH:
                return deepest
        if isinstance(o, dict):
            todo.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            todo.extend((v, d + 1) for v in o)
    return deepest


def _sub(like: Any, key: Any) -> Any:
    if isinstance(like, Mapping):
        try:
            return like.get(key, _NONE)
        except TypeError:  # an unhashable key
            return _NONE
    if isinstance(like, argparse.Namespace) and isinstance(key, str):
        return vars(like).get(key, _NONE)
    return _NONE


def _peer(like: Any, enc: Any) -> Any:
    """For a dict key or a set element: a member of the template (its keys, its elements) of the class an
    encoded enum or dataclass names, so such keys and elements decode to their class too."""
    if not isinstance(like, (Mapping, set, frozenset)) or not isinstance(enc, dict) or len(enc) != 1:
        return _NONE
    (tag, arg), = enc.items()
    if tag not in ("__enum__", "__dataclass__") or not isinstance(arg, dict):
        return _NONE
    return next((k for k in like if type_name(type(k)) == arg.get("type")), _NONE)


def _item(like: Any, i: int) -> Any:
    return like[i] if isinstance(like, (list, tuple)) and i < len(like) else _NONE


def _dec(obj: Any, tensors: Mapping[str, torch.Tensor], where: str, like: Any) -> Any:
    if isinstance(obj, list):
        return [_dec(x, tensors, f"{where}[{i}]", _item(like, i)) for i, x in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, arg), = obj.items()
        if tag in TAGS:
            return _dec_tag(tag, arg, tensors, where, like)
    return {k: _dec(x, tensors, f"{where}.{k}", _sub(like, k)) for k, x in obj.items()}


def _class_for(name: str, like: Any, kind: str) -> type | None:
    """The class a stored enum or dataclass named ``name`` decodes to: the template's, else an allowed one."""
    if like is not _NONE and like is not None:
        t = type(like)
        if type_name(t) == name and (issubclass(t, enum.Enum) if kind == "enum" else dataclasses.is_dataclass(t)):
            return t
    with _ALLOWED_LOCK:
        return _ALLOWED.get(name)


def _dec_tag(tag: str, arg: Any, tensors: Mapping[str, torch.Tensor], where: str, like: Any) -> Any:
    try:
        if tag == "__tuple__":
            return tuple(_dec(x, tensors, f"{where}[{i}]", _item(like, i)) for i, x in enumerate(arg))
        if tag == "__kv__":
            out = {}
            for k, x in arg:
                key = _hashable(_dec(k, tensors, where, _peer(like, k)))
                out[key] = _dec(x, tensors, f"{where}[{key!r}]", _sub(like, key))
            return out
        if tag in ("__set__", "__frozenset__"):
            items = (_hashable(_dec(x, tensors, where, _peer(like, x))) for x in arg)
            return frozenset(items) if tag == "__frozenset__" else set(items)
        if tag == "__bytes__":
            return base64.b64decode(arg.encode("ascii"), validate=True)
        if tag == "__float__":
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[arg]
        if tag in ("__tensor__", "__ndarray__"):
            t = tensors[arg]
            if tag == "__ndarray__":
                if np is None:  # pragma: no cover
                    raise CorruptObjectError(f"state {where!r} holds a numpy array and numpy is not installed")
                return t.numpy().copy()
            return t
        if tag == "__npscalar__":
            if np is None:  # pragma: no cover
                raise CorruptObjectError(f"state {where!r} holds a numpy scalar and numpy is not installed")
            return np.dtype(arg[0]).type(arg[1])
        if tag == "__path__":
            kind, text = arg
            return _PATHS[kind](_str(text))
        if tag == "__namespace__":
            attrs = _dec(arg, tensors, where, vars(like) if isinstance(like, argparse.Namespace) else _NONE)
            if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
                raise TypeError("a Namespace's attributes must be a str-keyed object")
            return argparse.Namespace(**attrs)
        if tag == "__dtype__":
            return _DTYPES[_str(arg)]
        if tag == "__device__":
            return torch.device(_str(arg))
        if tag == "__enum__":
            return _dec_enum(arg, tensors, where, like)
        if tag == "__dataclass__":
            return _dec_dataclass(arg, tensors, where, like)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        if isinstance(e, RestoreMismatchError):
            raise
        raise CorruptObjectError(f"state {where!r}: malformed {tag} entry ({e!r})", key=where) from e
    raise CorruptObjectError(f"state {where!r}: unknown tag {tag}", key=where)  # pragma: no cover


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _dec_enum(arg: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str, like: Any) -> Any:
    name, member = _str(arg["type"]), _str(arg["name"])
    value = _dec(arg.get("value"), tensors, f"{where}.value", getattr(like, "value", _NONE))
    cls = _class_for(name, like, "enum")
    if cls is not None:
        try:
            return cls[member]  # type: ignore[index]
        except KeyError:
            try:
                return cls(value)
            except ValueError as e:
                raise RestoreMismatchError(f"state {where!r}: {name} has no member {member!r} (value {value!r}) "
                                           "here", layer=None, tensor=where) from e
    return f"{name}.{member}"


def _dec_dataclass(arg: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str, like: Any) -> Any:
    name = _str(arg["type"])
    cls = _class_for(name, like, "dataclass")
    sub = like if cls is not None and isinstance(like, cls) else _NONE
    raw = arg["fields"]
    if not isinstance(raw, dict):
        raise TypeError("a dataclass's fields must be an object")
    values = _dec(raw, tensors, where, _NONE) if sub is _NONE else {
        k: _dec(x, tensors, f"{where}.{k}", getattr(sub, k, _NONE)) for k, x in raw.items()}
    if not isinstance(values, dict):
        raise TypeError("a dataclass's fields must be an object")
    if cls is None:
        return {"__type__": name, **values}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise RestoreMismatchError(f"state {where!r}: stored {name} has fields {unknown} its class here does "
                                   "not have", layer=None, tensor=where)
    try:
        obj = cls(**{k: v for k, v in values.items() if fields[k].init})
    except TypeError as e:
        raise RestoreMismatchError(f"state {where!r}: stored {name} does not fit its class here: {e}",
                                   layer=None, tensor=where) from e
    for k, v in values.items():
        if not fields[k].init:
            object.__setattr__(obj, k, v)  # frozen dataclasses too
    return obj


def _hashable(k: Any) -> Any:
    if isinstance(k, list):
        return tuple(_hashable(x) for x in k)
    if isinstance(k, set):
        return frozenset(k)
    if isinstance(k, dict):
        raise TypeError("a dict cannot be a key")
    return k
