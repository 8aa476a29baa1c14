"""Checkpoint state without pickles: what a resume needs besides the model, as safetensors + JSON.

transformers' Trainer writes `rng_state*.pth`, `scheduler.pt` and (one process) `optimizer.pt` with `torch.save`,
i.e. pickles. The recipe writes instead:

    rng_state.safetensors | rng_state_<rank>.safetensors   python / numpy / torch CPU (+ accelerator) RNG states
    optimizer.safetensors                                  one-process optimizer state; param_groups as JSON metadata
    scheduler.json                                         LR scheduler state

FSDP checkpoints keep model and optimizer shards in torch's distributed-checkpoint (DCP) folders, which is the only
format that reshards; their `.metadata` file is a pickle that torch reads with plain `pickle.load`, so
`unsafe_dcp_metadata` reads it first with an allow-list unpickler and a resume refuses anything outside that list.
"""

from __future__ import annotations

import enum
import io
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from sft_recipe.atomic import write_atomically

SCHEDULER_FILE = "scheduler.json"
OPTIMIZER_FILE = "optimizer.safetensors"


class StateFileError(RuntimeError):
    pass


def rng_state_file(checkpoint_dir: str | os.PathLike, process_index: int, world_size: int) -> Path:
    name = "rng_state.safetensors" if world_size <= 1 else f"rng_state_{process_index}.safetensors"
    return Path(checkpoint_dir) / name


# --- RNG ------------------------------------------------------------------------------------------------------------

def save_rng_state(path: str | os.PathLike) -> None:
    version, python_state, gauss_next = random.getstate()
    kind, numpy_keys, numpy_pos, has_gauss, cached_gaussian = np.random.get_state()
    tensors = {
        "python": torch.tensor(python_state, dtype=torch.int64),
        "numpy_keys": torch.from_numpy(numpy_keys.astype(np.int64)),
        "torch_cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.random.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    scalars = {"python_version": version, "python_gauss_next": gauss_next, "numpy_kind": kind,
               "numpy_pos": int(numpy_pos), "numpy_has_gauss": int(has_gauss),
               "numpy_cached_gaussian": float(cached_gaussian)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"scalars": json.dumps(scalars)}))


def load_rng_state(path: str | os.PathLike) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        scalars = json.loads(f.metadata()["scalars"])
    tensors = load_file(str(path))
    random.setstate((scalars["python_version"], tuple(int(v) for v in tensors["python"].tolist()),
                     scalars["python_gauss_next"]))
    np.random.set_state((scalars["numpy_kind"], tensors["numpy_keys"].numpy().astype(np.uint32),
                         scalars["numpy_pos"], scalars["numpy_has_gauss"], scalars["numpy_cached_gaussian"]))
    torch.random.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[f"torch_cuda_{i}"] for i in range(len(tensors)) if f"torch_cuda_{i}" in tensors]
    if cuda_states and torch.cuda.is_available():
        for index, state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.random.set_rng_state(state, index)


# --- LR scheduler ---------------------------------------------------------------------------------------------------

def _plain(value):
    """JSON-safe copy of a scheduler/optimizer value; anything else is refused (a silent str() would not resume)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise StateFileError(f"cannot store {type(value).__name__} {value!r} without pickling")


def save_scheduler(scheduler, path: str | os.PathLike) -> None:
    state = _plain(scheduler.state_dict())
    write_atomically(Path(path), lambda tmp: tmp.write_text(json.dumps(state, indent=1)))


def load_scheduler(scheduler, path: str | os.PathLike) -> None:
    state = json.loads(Path(path).read_text())
    current = scheduler.state_dict()
    for key, value in list(state.items()):  # JSON turned tuples into lists: give them their type back
        if isinstance(current.get(key), tuple):
            state[key] = tuple(value)
    scheduler.load_state_dict(state)


# --- optimizer (one process; FSDP runs use DCP shards) ---------------------------------------------------------------

def _flatten(prefix: str, value, tensors: dict, scalars: dict) -> None:
    """Nested optimizer state (bitsandbytes keeps its quantisation state in a dict) -> dotted keys."""
    if isinstance(value, dict):
        for name, item in value.items():
            _flatten(f"{prefix}.{name}", item, tensors, scalars)
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().contiguous().cpu()
        if any(t.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() for t in tensors.values()):
            tensor = tensor.clone()  # bitsandbytes shares one codebook across parameters; safetensors stores each once
        tensors[prefix] = tensor
    else:
        scalars[prefix] = _plain(value)


def _unflatten(state: dict, key: str, value) -> None:
    _, param_id, *path = key.split(".")
    node = state.setdefault(int(param_id), {})
    for name in path[:-1]:
        node = node.setdefault(name, {})
    node[path[-1]] = value


def save_optimizer(optimizer, path: str | os.PathLike) -> None:
    state_dict = optimizer.state_dict()
    tensors, scalars = {}, {}
    for param_id, param_state in state_dict["state"].items():
        _flatten(f"state.{param_id}", param_state, tensors, scalars)
    metadata = {"param_groups": json.dumps(_plain(state_dict["param_groups"])), "scalars": json.dumps(scalars)}
    write_atomically(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_optimizer(optimizer, path: str | os.PathLike) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    state: dict[int, dict] = {}
    for key, value in load_file(str(path)).items():
        _unflatten(state, key, value)
    for key, value in json.loads(metadata["scalars"]).items():
        _unflatten(state, key, value)
    groups = json.loads(metadata["param_groups"])
    for saved, current in zip(groups, optimizer.param_groups):
        for key, value in current.items():
            if isinstance(value, tuple) and key in saved:
                saved[key] = tuple(saved[key])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# --- DCP metadata: read the pickle with an allow-list before torch unpickles it --------------------------------------

_ALLOWED_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.", "torch.distributed.tensor.")
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"),
                    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "tuple"),
                    ("builtins", "list"), ("builtins", "dict"), ("builtins", "int"), ("builtins", "float"),
                    ("builtins", "bool"), ("builtins", "str"), ("builtins", "bytes"), ("builtins", "complex"),
                    ("enum", "Enum"), ("_codecs", "encode"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
                    ("torch.serialization", "_get_layout")}  # maps a layout's name to torch.strided & co


def _enum_member(cls, name):
    """The one `getattr` a DCP index holds: CPython 3.11.2 (Debian 12's) pickles an enum member (DCP's
    `_MEM_FORMAT_ENCODING`) as `getattr(EnumClass, name)`, 3.11.7 by value; found when the suite first ran under
    Debian's interpreter. Only a member of an enum the allow-list admitted is looked up; any other getattr is
    refused."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__.startswith(_ALLOWED_MODULES):
        return cls[name]
    raise pickle.UnpicklingError(f"builtins.getattr({cls!r}, {name!r}) is not part of a distributed-checkpoint index")


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_ALLOWED_MODULES):
            found = super().find_class(module, name)
            if isinstance(found, type):  # DCP's metadata dataclasses and enums; never a function to call
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed-checkpoint index")


def unsafe_dcp_metadata(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Problems with the DCP `.metadata` pickles under `checkpoint_dir` (empty: safe for torch to unpickle)."""
    problems = []
    for path in sorted(Path(checkpoint_dir).rglob("*.metadata")):
        try:
            _AllowListUnpickler(io.BytesIO(path.read_bytes())).load()
        except Exception as error:  # anything the allow-list refuses, or a damaged file
            problems.append(f"{path}: {error}")
    return problems
