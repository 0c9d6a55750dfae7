"""Read the tensors out of torch files that also pickle code, without running any of it.

Lightning checkpoints (taming's `.ckpt`) pickle callbacks and hyper-parameters next to the weights, and
OpenAI's `encoder.pkl` / `decoder.pkl` pickle whole modules of the `dall_e` package, so
`torch.load(weights_only=True)` refuses them and `weights_only=False` would execute whatever the file names.
Here a file is first tried with `weights_only=True`; if it names other classes or functions, it is read
again with an unpickler that rebuilds only what PyTorch's weights-only loader allows (tensors, parameters,
storages, plain containers) and replaces every other class or function the file names by an inert
`Placeholder` that records its arguments and state and is never called: nothing from the file runs
(the "Restricting Globals" recipe of the `pickle` documentation, with torch's own allowlist).
"""

from __future__ import annotations

import os
import pickle
import types
import warnings
import zipfile

import torch


class Placeholder(list):
    """Stands for a class or function the file names. Keeps what unpickling gives it; runs no code.

    A list subclass so that pickled list subclasses can be appended to; dict-like items go to `items`."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        return list.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.__dict__["state"] = state

    def __setitem__(self, key, value):
        self.__dict__.setdefault("items", {})[key] = value

    def __repr__(self):
        return f"<placeholder for {self.qualname}>"


def _allowed_globals() -> dict:
    from torch import _weights_only_unpickler

    return _weights_only_unpickler._get_allowed_globals()


class _InertUnpickler(pickle.Unpickler):
    _placeholders: dict[str, type] = {}

    def find_class(self, module: str, name: str):
        allowed = _allowed_globals().get(f"{module}.{name}")
        if allowed is not None:
            return allowed
        key = f"{module}.{name}"
        if key not in self._placeholders:  # one class per name: classes used as dict keys stay distinct
            self._placeholders[key] = type(name, (Placeholder,), {"qualname": key})
        return self._placeholders[key]


def _inert_load(file, **kwargs):
    return _InertUnpickler(file, **kwargs).load()


# what torch.load needs of a `pickle_module`
_INERT_PICKLE = types.SimpleNamespace(Unpickler=_InertUnpickler, load=_inert_load, __name__="inert_pickle")


def load_untrusted(path: str, flag: str):
    """The object in torch file `path`, with any pickled code replaced by placeholders. `flag` names the
    command-line flag that gave the path, for the error messages."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path} does not exist")
    mmap = zipfile.is_zipfile(path)  # a 1 GB Lightning checkpoint stays on disk until its tensors are copied
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        pass  # names classes or functions: read it again without running them
    except Exception as e:
        raise ValueError(f"{flag} {path} is not a readable torch file ({type(e).__name__}: {str(e)[:160]})") from None
    try:
        with warnings.catch_warnings():  # the legacy format compares pickled module source with the placeholders'
            warnings.filterwarnings("ignore", message="Couldn't retrieve source code")
            return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_INERT_PICKLE, mmap=mmap)
    except Exception as e:
        raise ValueError(
            f"{flag} {path} could not be read without running the code it pickles ({type(e).__name__}: "
            f"{str(e)[:160]}); extract its state dict where you trust the file: "
            "torch.save(torch.load(PATH, weights_only=False)['state_dict'], 'weights.pt') (Lightning) or "
            "torch.save(torch.load(PATH, weights_only=False).state_dict(), 'encoder.pt') (a pickled module)"
        ) from None


def module_state_dict(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """The state dict of a pickled nn.Module read by `load_untrusted`, from its placeholders' `__dict__`s."""
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
