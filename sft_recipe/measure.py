"""Measurements of one process and its shards: weight checksums (position-weighted word sums), live tensor bytes,
resident memory kinds.

The run record (record.py), the trainer's save costs and the tests all measure through these. What each stands for
on a GPU: live tensor bytes and the model state are what sharding divides; anonymous RSS follows live tensors when
launched with MALLOC_MMAP_THRESHOLD_=65536 (see RssWatch); CUDA's max_memory_allocated where there is a GPU.
"""

from __future__ import annotations

import resource
import time

import torch


def _shard_of(p: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "to_local"):  # FSDP2 DTensor
        return p.to_local()
    ds_shard = getattr(p, "ds_tensor", None)  # DeepSpeed ZeRO-3: p itself is empty, or gathered for a moment
    if ds_shard is not None:
        return ds_shard
    shard = getattr(p, "_local_shard", None)  # FSDP1 FlatParameter keeps its shard even while unsharded
    return shard if shard is not None else p


CHECKSUM_MODULUS = 1 << 55  # sums of checksums over parameters and up to 256 ranks stay inside int64
_POSITIONS = 251  # a word's weight is 1 + its position mod this prime
_CHUNK_WORDS = 1 << 20  # words weighted per pass: int64 temporaries of 8 MiB, and no int64 sum can overflow


def _checksum(t: torch.Tensor) -> int:
    """A dtype-agnostic fingerprint of a tensor's bytes (packed 4-bit storage read as bf16 can be NaN): the sum of
    its 32-bit words plus, weighted by 1_000_003, the sum of each word times (1 + its position mod 251). Any changed
    value changes it, and so does moving values to other positions (a plain sum is blind to a permutation: a rank
    whose packing order differs). Not cryptographic: a change that cancels in both sums goes unseen."""
    flat = t.detach().contiguous().reshape(-1)
    words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.uint8)
    total = int(words.sum(dtype=torch.int64))  # reduces without materialising an int64 copy
    weighted = 0
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS]
        weight = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device) % _POSITIONS + 1
        weighted += int((chunk.to(torch.int64) * weight).sum())  # |word| < 2^31, weight <= 251: no overflow
    return (total + 1_000_003 * weighted) % CHECKSUM_MODULUS


def tensors_checksum(tensors) -> int:
    """The checksum of the bytes of `tensors` (meta tensors have none), in a word that fits int64."""
    with torch.no_grad():
        return sum(_checksum(t) for t in tensors if t.device.type != "meta") % CHECKSUM_MODULUS


def local_sums(model) -> tuple[int, int]:
    """(checksum of frozen params, checksum of trainable params) over this rank's shards: change detectors."""
    frozen = trainable = 0
    with torch.no_grad():
        for p in model.parameters():
            local = _shard_of(p)
            if local.numel() and local.untyped_storage().size() == 0:
                continue  # freed unsharded view; its values are counted through the shard
            if p.requires_grad:
                trainable += _checksum(local)
            else:
                frozen += _checksum(local)
    return frozen % CHECKSUM_MODULUS, trainable % CHECKSUM_MODULUS


def all_ranks_sum(accelerator, values: tuple[int, int]) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=accelerator.device)
    return [int(x) for x in accelerator.reduce(t, reduction="sum")] if accelerator.num_processes > 1 else list(values)


def trainable_checksum(accelerator, model) -> int:
    """Collective under FSDP: the checksum of all trainable weights, summed over ranks."""
    return all_ranks_sum(accelerator, local_sums(model))[1]


def live_tensor_mib(tensors) -> float:
    """Bytes of the distinct storages behind `tensors`, meta tensors excluded (they hold no memory)."""
    seen, total = set(), 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total / 2**20


def quant_state_tensors(model) -> list[torch.Tensor]:
    """The tensors of bitsandbytes' 4-bit quantization state (absmax, code, nested absmax and code, offset): live
    weight bytes that are attributes of a weight or its module, not parameters or buffers. Every rank keeps them
    whole (FSDP shards parameters only)."""
    tensors, seen = [], set()

    def visit(state) -> None:
        if state is None or id(state) in seen:
            return
        seen.add(id(state))
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif type(value).__name__ == "QuantState":  # double quantization: the absmax's own state
                visit(value)

    for module in model.modules():
        visit(getattr(module, "quant_state", None))
        # the registered weight only: a module's `weight` attribute may be computed (PEFT's trainable-tokens wrapper
        # merges its rows into the base weight on read, which fails on FSDP2's DTensor shards)
        visit(getattr(module._parameters.get("weight"), "quant_state", None))
    return tensors


def weight_mib(model) -> float:
    """Live weight bytes this rank holds: its parameter shards, buffers and 4-bit quantization state."""
    shards = [_shard_of(p) for p in model.parameters()]
    return live_tensor_mib([*shards, *model.buffers(), *quant_state_tensors(model)])


def unsharded_fsdp2_params(model) -> int:
    """Parameters of an FSDP2 model that are not DTensor shards right now (0 when every unit is sharded)."""
    return sum(type(p).__name__ != "DTensor" for p in model.parameters())


def model_state_mib(model, optimizer) -> float:
    """This rank's share of weights + gradients + optimizer state (shards under FSDP): the part of memory that
    sharding divides by N, measured directly rather than read off RSS (which also holds imports and activations)."""
    tensors = []
    for p in model.parameters():
        local = _shard_of(p)
        tensors.append(local)
        grad = getattr(p, "grad", None)
        if grad is not None:
            tensors.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [t.to_local() if hasattr(t, "to_local") else t for t in state.values()
                        if isinstance(t, torch.Tensor)]
    return live_tensor_mib(tensors)


def rss_kinds_mib() -> tuple[float, float]:
    """(RssAnon, RssFile) of this process in MiB, from /proc (Linux); zeros elsewhere."""
    values = {"RssAnon:": 0.0, "RssFile:": 0.0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, *rest = line.split()
                if name in values:
                    values[name] = float(rest[0]) / 1024  # kB
    except OSError:
        pass
    return values["RssAnon:"], values["RssFile:"]


class RssWatch:
    """Peak private (anonymous) resident memory of this process while a block runs, above its level at entry.

    A thread samples /proc/self/status every `interval_s`. What it can and cannot see: glibc reuses freed blocks
    without growing RSS, so a block that allocates into memory freed earlier reads as adding nothing. Launch with
    `MALLOC_MMAP_THRESHOLD_=65536` (the tests do) and every tensor above 64 KiB is its own mmap, returned to the
    system when freed: RSS then follows live tensor bytes, the quantity that stands for GPU memory in a GPU run.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.start_mib = self.peak_mib = 0.0
        self.seconds = 0.0

    def __enter__(self):
        import threading

        self.start_mib = self.peak_mib = rss_kinds_mib()[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, rss_kinds_mib()[0])
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, rss_kinds_mib()[0])
        self.seconds = time.perf_counter() - self._started

    @property
    def added_mib(self) -> float:
        return self.peak_mib - self.start_mib


def gather_per_rank(accelerator, values: list[float]) -> torch.Tensor:
    """Collective: a (num_processes, len(values)) float64 table of every rank's values."""
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return (accelerator.gather(t) if accelerator.num_processes > 1 else t).reshape(-1, len(values))


def save_cost(accelerator, watch: RssWatch, **extra) -> dict:
    """Collective: a save's wall seconds (slowest rank) and the anonymous RSS it added on each rank."""
    per_rank = gather_per_rank(accelerator, [watch.seconds, watch.added_mib])
    return {"seconds": round(float(per_rank[:, 0].max()), 3),
            "rss_anon_added_mib_per_rank": [round(float(x), 1) for x in per_rank[:, 1]], **extra}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def gpu_peak_gib() -> float | None:
    """torch's peak allocated GPU memory since process start (or the last reset), None without a GPU."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def peak_memory_gib() -> float:
    """This process's peak: GPU memory allocated by torch where there is a GPU, process RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return peak_rss_mib() / 1024


class PeakLiveBytes:
    """Peak bytes of the tensors created while it is active, what `torch.cuda.max_memory_allocated` counts on a GPU
    for the same ops (the caching allocator's rounding aside): every op's fresh output storage is added when it is
    made and taken off when torch frees it. Views and in-place results (a storage an input already holds) are not
    new memory. Runs on real tensors, on meta tensors and under FakeTensorMode (sizes only, nothing allocated), so
    a loss of a 7B's vocabulary is measured in a second. The planner's loss terms are checked with it
    (tests/unit/test_plan_loss.py)."""

    def __init__(self):
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._count(out, (args, kwargs))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def _count(self, out, inputs) -> None:
        import weakref

        from torch.utils._pytree import tree_leaves

        held = {t.untyped_storage()._cdata for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in held or key in self._sizes:
                continue
            self._sizes[key] = storage.nbytes()
            self.live_bytes += storage.nbytes()
            weakref.finalize(storage, self._free, key)  # torch keeps a storage's Python object as long as it lives
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)
