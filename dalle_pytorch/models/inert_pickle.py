"""Read the tensors out of torch files that also pickle classes, without running any code from them.

Lightning checkpoints (taming's `.ckpt`) pickle callback classes next to the weights, and OpenAI's
`encoder.pkl` / `decoder.pkl` pickle whole modules of the `dall_e` package, so `torch.load(weights_only=True)`
refuses them and `weights_only=False` would run whatever the file names. Here the file is read by torch's
own weights-only unpickler, with every class or function it names that torch does not allow registered
under that name as an inert `Placeholder`: calling one records its arguments, BUILD stores its state, and
nothing else happens. Everything else stays as torch restricts it: BUILD only on instances of allowed types
(never on a class, so nothing process-wide can change), persistent ids only for storages, no global from a
blocked module (os, sys).

The legacy format (torch < 1.6, or `_use_new_zipfile_serialization=False`) pickles each nn.Module class as
a persistent "module" record, which torch's weights-only reader refuses (its other reader compares the
class's source with the record's and may write a `.patch` file named by the class). Before torch reads
such a file, each record becomes a call of `_module_record`, which returns the placeholder class and does
nothing else.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile

import torch
from torch import _weights_only_unpickler as _wo


class Placeholder(list):
    """Stands for a class or function the file names. Keeps what unpickling gives it; runs no code.

    A list subclass so that pickled list subclasses can be appended to (torch allows APPEND on allowlisted
    list subclasses; SETITEM only on dict, OrderedDict and Counter, so dict subclasses are refused)."""

    qualname = "?"
    __hash__ = object.__hash__  # hashable by identity, as the object it stands for most likely was

    def __new__(cls, *args):  # NEWOBJ calls this alone, REDUCE calls the class: both record the arguments
        self = list.__new__(cls)
        self.__dict__["args"] = args
        return self

    def __init__(self, *args):  # not list.__init__, which would iterate the arguments
        pass

    def __setstate__(self, state):  # BUILD: the state is data to keep, never attributes to set
        self.__dict__["state"] = state

    def __repr__(self):
        return f"<placeholder for {self.qualname}>"


def _placeholder(full_name: str) -> type:
    module, _, name = full_name.rpartition(".")
    return type(name, (Placeholder,), {"qualname": full_name, "__module__": module or "?"})


_MODULE_RECORD = "inert_pickle.module_record"  # the global that stands for the legacy format's module records


def _module_record(kind, cls, *source):
    """What a legacy "module" record stands for: the class of a pickled nn.Module, a placeholder. (torch's own
    reader compares the class's source with the file's and may write a `.patch` file; this does neither.)"""
    if kind != "module" or not (isinstance(cls, type) and issubclass(cls, Placeholder)):
        raise pickle.UnpicklingError(f"a module record must name a class of the file, not {cls!r}")
    return cls


_STRINGS = {"BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINSTRING", "SHORT_BINSTRING", "STRING"}
_PUTS, _GETS = {"BINPUT", "LONG_BINPUT", "PUT"}, {"BINGET", "LONG_BINGET", "GET"}


def _module_records_to_calls(pkl: bytes) -> bytes:
    """The legacy format pickles each nn.Module class as the persistent id ("module", class, file, source),
    which torch's weights-only reader refuses (only storages may be persistent ids). Rewrite each such
    record, `MARK "module" class file source TUPLE [BINPUT] BINPERSID`, into a call of `_module_record`:
    `GLOBAL MARK ... TUPLE [BINPUT] REDUCE`; storage records stay as they are. Protocol 2 opcodes carry no
    byte offsets, so inserting bytes keeps the rest valid."""
    ops = list(pickletools.genops(pkl))
    strings: dict[int, str] = {}  # memo index -> the string put there, to see "module" behind a BINGET
    marks: list[tuple[int, bool]] = []  # (position of MARK, whether its first element is "module")
    closed = None  # (position of MARK, is a module record) of the tuple the last TUPLE built
    edits: list[tuple[int, bytes, int]] = []  # (position, bytes to insert, bytes to drop)
    module, _, name = _MODULE_RECORD.rpartition(".")
    call = f"c{module}\n{name}\n".encode()
    for i, (op, arg, pos) in enumerate(ops):
        if op.name == "MARK":
            nxt, nxt_arg, _ = ops[i + 1]
            is_module = (nxt.name in _STRINGS and nxt_arg == "module") or (
                nxt.name in _GETS and strings.get(nxt_arg) == "module"
            )
            marks.append((pos, is_module))
            closed = None
        elif pickletools.markobject in op.stack_before:
            opened = marks.pop()
            closed = opened if op.name == "TUPLE" else None
        elif op.name in _PUTS:  # memoizing the tuple just built keeps it the persistent id's candidate
            if ops[i - 1][0].name in _STRINGS:
                strings[arg] = ops[i - 1][1]
        elif op.name == "BINPERSID":
            if closed is not None and closed[1]:
                edits += [(closed[0], call, 0), (pos, pickle.REDUCE, 1)]
            closed = None
        else:
            closed = None
    out, last = [], 0
    for pos, insert, drop in sorted(edits):
        out += [pkl[last:pos], insert]
        last = pos + drop
    return b"".join(out) + pkl[last:]


def _scan(path: str) -> tuple[list[str], io.BytesIO | None]:
    """The classes and functions a torch file names that torch's weights-only unpickler does not allow, read
    statically; and for a legacy file whose nn.Module classes are module records, the file rewritten with
    calls instead (see `_module_records_to_calls`), else None.

    The zip format (torch >= 1.6) is scanned by torch's own `get_unsafe_globals_in_checkpoint`; the legacy
    format (a magic number, protocol version and system info, the object's pickle, then the storages: what
    `torch.save(_use_new_zipfile_serialization=False)` writes) by the same opcode scanner, which torch's
    function applies only to zip files. Raises UnpicklingError for an opcode torch's unpickler does not run,
    another error (ValueError, RuntimeError, EOFError) for what is not a torch file."""
    if zipfile.is_zipfile(path):
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path)), None
    with open(path, "rb") as f:
        try:
            magic = _wo.load(f)  # an int: torch's unpickler reads it
        except Exception:
            magic = None
        if magic != torch.serialization.MAGIC_NUMBER:
            raise ValueError("neither a zip archive nor a pickle that starts with torch's magic number")
        _wo.load(f), _wo.load(f)  # protocol version, system info: plain ints and dicts
        start = f.tell()
        names = _wo.get_globals_in_pkl(f)
        end = f.tell()
        f.seek(start)
        pkl = f.read(end - start)
        rewritten = _module_records_to_calls(pkl)
        source = None
        if rewritten != pkl:
            f.seek(0)
            head = f.read(start)
            f.seek(end)
            source = io.BytesIO(head + rewritten + f.read())
    allowed = set(_wo._get_allowed_globals()) | set(_wo._get_user_allowed_globals())
    return sorted(names - allowed), source


def _reason(e: Exception) -> str:
    """torch's message without its advice to load with weights_only=False."""
    msg = str(e)
    msg = msg.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation of torch.load")[0]
    msg = " ".join(msg.split())
    return f"{type(e).__name__}: {msg[:200]}"


def _refused(flag: str, path: str, e: Exception) -> str:
    return (
        f"{flag} {path} could not be read without running the code it pickles ({_reason(e)}). If, and only if, "
        "the file comes from a source you trust, extract its weights with torch.load(PATH, weights_only=False), "
        "which runs that code: torch.save(torch.load(PATH, weights_only=False)['state_dict'], 'weights.pt') for a "
        "Lightning checkpoint, or torch.save(torch.load(PATH, weights_only=False).state_dict(), 'encoder.pt') for "
        "a pickled module; then pass the new file"
    )


def load_untrusted(path: str, flag: str, hint: str = ""):
    """The object in torch file `path`, with the classes and functions it names replaced by placeholders.
    `flag` names the command-line flag that gave the path and `hint` what to check when the file is not a
    torch file at all, for the error messages."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path} does not exist")
    from ..files import is_safetensors, load_tree

    if is_safetensors(path):  # no pickle to scan: a converted cache of ours, or the user's own safetensors weights
        return load_tree(path) if _ours(path) else _plain_safetensors(path)
    try:
        names, source = _scan(path)
    except pickle.UnpicklingError as e:  # an opcode torch's unpickler does not run
        raise ValueError(_refused(flag, path, e)) from None
    except Exception as e:  # ValueError, RuntimeError (a zip without data.pkl), EOFError ...
        hint = f" ({hint})" if hint else ""
        raise ValueError(f"{flag} {path} is not a torch checkpoint{hint}: {_reason(e)}") from None
    blocked = [n for n in names if n.split(".")[0] in _wo._blocklisted_modules]
    if blocked:
        raise ValueError(
            f"refusing {flag} {path}: it names {', '.join(blocked)}, from modules that a checkpoint of "
            "weights never needs (torch's weights-only loader blocks them)"
        )
    allow = [(_placeholder(name), name) for name in names] + [(_module_record, _MODULE_RECORD)]
    mmap = zipfile.is_zipfile(path)  # a 1 GB Lightning checkpoint stays on disk until its tensors are copied
    try:
        with torch.serialization.safe_globals(allow):
            return torch.load(path if source is None else source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # an operation torch's unpickler refuses even with placeholders
        raise ValueError(_refused(flag, path, e)) from None
    except Exception as e:
        raise ValueError(f"{flag} {path} is truncated or corrupted: {_reason(e)}") from None


def module_state_dict(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """The state dict of a pickled nn.Module read by `load_untrusted`, from its placeholders' states."""
    if isinstance(obj, torch.nn.Module):
        return {prefix + k: v for k, v in obj.state_dict().items()}
    state = getattr(obj, "state", None)
    if not isinstance(state, dict) or not isinstance(state.get("_parameters"), dict):
        raise ValueError(f"expected a pickled torch module, found {obj!r}")
    skip = state.get("_non_persistent_buffers_set", ())
    out = {prefix + k: p.detach() for k, p in state["_parameters"].items() if p is not None}
    out.update({prefix + k: b for k, b in state.get("_buffers", {}).items() if b is not None and k not in skip})
    for name, child in state.get("_modules", {}).items():
        if child is not None:
            out.update(module_state_dict(child, f"{prefix}{name}."))
    return out


def _ours(path: str) -> bool:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return "dalle_pytorch" in (f.metadata() or {})


def _plain_safetensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)
