"""Count the work of the exact-from-logits paths on the CPU: passes over ``[N, V]`` buffers and
matrix products (for the tests and ``benchmarks/bench_cpu.py``; nothing here runs in a call).

A GPU's time for these paths is set by the bytes they move over ``[N, V]`` tensors (the logits,
their gradients) and by their matrix products; both can be counted without a GPU.

:class:`Traffic` records, while active, the bytes that PyTorch operations and Triton kernels (run
by triton's CPU interpreter, ``TRITON_INTERPRET=1``) read from and write to the buffers it
watches: the tensors given to it, and every tensor of the same number of bytes created while it
is active (the gradient buffers). It counts in *passes*, bytes over the buffer's size:

* a Triton kernel: every element its loads and stores touch, as the GPU would move it (a second
  read of a row is counted, whether or not a cache would serve it);
* PyTorch operations: the chunked engine reads a chunk of rows, then works on it while it is in
  cache. Operations on a range of a buffer inside the range the buffer's previous operation
  touched are that chunk again: free (a read of what the chunk wrote, or a second read of it); a
  new range is counted. Index operations (``index_select``, ``index_copy_``, ...) count the rows
  they move, every time.

:func:`matmul_flops` gives the floating-point operations of the matrix products run inside it
(``torch.utils.flop_counter``) and how many there were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Traffic", "matmul_flops"]

_INDEX_READS = ("index_select", "gather", "index.Tensor", "embedding", "take")
_INDEX_WRITES = ("index_copy", "index_put", "scatter", "index_add", "index_fill")
_NO_READS = ("empty", "_like", "new_", "lift_fresh", "set_", "resize")
_OVERWRITES = ("aten.copy_", "aten.fill_", "aten.zero_")


def _bytes(x: object) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, Tensor))


def _index_write_bytes(target: Tensor, bound: dict) -> int:
    """Bytes an index write moves into ``target``: its source, or the rows it fills."""
    for key in ("source", "src", "values"):
        if isinstance(bound.get(key), Tensor):
            return _bytes(bound[key])
    index = bound.get("index")
    if isinstance(index, Tensor) and target.ndim:
        dim = bound.get("dim", 0)
        return (
            index.numel() * target[0].numel() * target.element_size()
            if dim == 0
            else _bytes(target)
        )
    return _bytes(target)


@dataclass
class _Buffer:
    name: str
    start: int
    nbytes: int
    read: int = 0
    written: int = 0
    # the range the previous operation touched, and what it has been counted for
    last: tuple[int, int] | None = None
    last_read: bool = False
    last_written: bool = False

    def touch(self, lo: int, hi: int, *, reads: bool, writes: bool) -> None:
        if self.last is None or not (self.last[0] <= lo and hi <= self.last[1]):
            self.last, self.last_read, self.last_written = (lo, hi), False, False
        size = hi - lo
        if reads and not (self.last_read or self.last_written):
            self.read += size
            self.last_read = True
        if writes and not self.last_written:
            self.written += size
            self.last_written = True


class Traffic:
    """Bytes read from and written to watched ``[N, V]`` buffers (module docstring).

    ``Traffic(z=z, y=y)`` watches ``z`` and ``y`` and every tensor of ``z``'s size in bytes
    created inside ``with traffic:`` (named ``new0``, ``new1``, ... in order of creation).
    """

    def __init__(self, **tensors: Tensor) -> None:
        self.buffers: dict[str, _Buffer] = {}
        self._size = 0
        self.in_kernel = False
        for name, t in tensors.items():
            self.watch(name, t)

    def watch(self, name: str, t: Tensor) -> None:
        storage = t.untyped_storage()
        self.buffers[name] = _Buffer(name, storage.data_ptr(), storage.nbytes())
        self._size = self._size or storage.nbytes()

    def passes(self, name: str) -> tuple[float, float]:
        """``(reads, writes)`` of the buffer ``name``, in passes over it."""
        b = self.buffers[name]
        return b.read / b.nbytes, b.written / b.nbytes

    def summary(self) -> dict[str, tuple[float, float]]:
        """Every watched buffer's ``(reads, writes)`` in passes, untouched ones left out."""
        return {n: self.passes(n) for n, b in self.buffers.items() if b.read or b.written}

    def total(self) -> float:
        """All passes, reads and writes, in units of the first buffer's size."""
        return sum(b.read + b.written for b in self.buffers.values()) / max(self._size, 1)

    def _find(self, address: int) -> _Buffer | None:
        for b in self.buffers.values():
            if b.start <= address < b.start + b.nbytes:
                return b
        return None

    # -- PyTorch operations ------------------------------------------------------------------

    def _span(self, t: Tensor) -> tuple[_Buffer, int, int] | None:
        if t.device.type == "meta" or not t.numel():
            return None
        b = self._find(t.untyped_storage().data_ptr())
        if b is None:
            return None
        size = t.element_size()
        lo = t.storage_offset() * size
        extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
        return b, lo, lo + (extent + 1) * size

    def _operation(self, func, args, kwargs, out) -> None:
        name = str(func)
        schema = func._schema
        names = [a.name for a in schema.arguments]
        written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
        view = not written and any(r.alias_info is not None for r in schema.returns)
        reads_nothing = view or any(k in name for k in _NO_READS)
        bound = dict(zip(names, args, strict=False)) | kwargs
        for arg_name, value in bound.items():
            for t in (t for t in tree_flatten(value)[0] if isinstance(t, Tensor)):
                span = self._span(t)
                if span is None:
                    continue
                b, lo, hi = span
                writes = arg_name in written
                if writes and any(k in name for k in _INDEX_WRITES):
                    b.written += _index_write_bytes(t, bound)
                    b.last = None
                elif not writes and any(k in name for k in _INDEX_READS):
                    b.read += _bytes(out)
                    b.last = None
                elif writes or not reads_nothing:
                    overwrite = arg_name == "out" or name.startswith(_OVERWRITES)
                    b.touch(lo, hi, reads=not (writes and overwrite), writes=writes)
        for o in tree_flatten(out)[0]:
            if (
                isinstance(o, Tensor)
                and o.device.type != "meta"
                and self._find(o.untyped_storage().data_ptr()) is None
                and o.untyped_storage().nbytes() == self._size
            ):
                self.watch(f"new{sum(n.startswith('new') for n in self.buffers)}", o)

    # -- Triton's interpreter ----------------------------------------------------------------

    def _kernel_access(self, ptrs, mask, *, write: bool) -> None:
        import numpy as np

        addresses = np.asarray(ptrs.data).reshape(-1)
        active = np.asarray(mask.data, dtype=bool).reshape(-1)
        if active.size == 1 and addresses.size > 1:
            active = np.broadcast_to(active, addresses.shape)
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        for b in self.buffers.values():
            inside = active & (addresses >= b.start) & (addresses < b.start + b.nbytes)
            count = int(np.count_nonzero(inside)) * size
            if write:
                b.written += count
            else:
                b.read += count

    @contextlib.contextmanager
    def _interpreter_hooks(self) -> Iterator[None]:
        try:
            from triton.runtime.interpreter import GridExecutor, InterpreterBuilder
        except ImportError:
            yield
            return
        load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
        launch = GridExecutor.__call__
        traffic = self

        def counted_launch(executor, *args, **kwargs):
            # The interpreter's own copies of the arguments are not the kernel's traffic.
            traffic.in_kernel = True
            try:
                return launch(executor, *args, **kwargs)
            finally:
                traffic.in_kernel = False

        def counted_load(builder, ptrs, mask, other, cache_policy, is_volatile):
            traffic._kernel_access(ptrs, mask, write=False)
            return load(builder, ptrs, mask, other, cache_policy, is_volatile)

        def counted_store(builder, ptrs, value, mask, cache_policy):
            traffic._kernel_access(ptrs, mask, write=True)
            return store(builder, ptrs, value, mask, cache_policy)

        InterpreterBuilder.create_masked_load = counted_load
        InterpreterBuilder.create_masked_store = counted_store
        GridExecutor.__call__ = counted_launch
        try:
            yield
        finally:
            InterpreterBuilder.create_masked_load = load
            InterpreterBuilder.create_masked_store = store
            GridExecutor.__call__ = launch

    def __enter__(self) -> Traffic:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._interpreter_hooks())
        self._stack.enter_context(_Recorder(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class _Recorder(TorchDispatchMode):
    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.traffic.in_kernel:
            self.traffic._operation(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def matmul_flops() -> Iterator[dict[str, int]]:
    """``{"flops": ..., "products": ...}`` of the matrix products run inside (filled on exit):
    floating-point operations by ``torch.utils.flop_counter.FlopCounterMode`` (which does not
    see in-place ``addmm_``: the calls below do) and the number of product calls (``mm``,
    ``addmm``, ``addmm_``, ``bmm``, ``baddbmm``)."""
    from torch.utils.flop_counter import FlopCounterMode

    result: dict[str, int] = {}
    counter = FlopCounterMode(display=False)
    calls = _ProductCalls()
    with counter, calls:
        yield result
    result["flops"] = counter.get_total_flops()
    result["products"] = calls.count


class _ProductCalls(TorchDispatchMode):
    _PRODUCTS = ("aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm", "aten.baddbmm")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(p + ".") for p in self._PRODUCTS):
            self.count += 1
        return func(*args, **(kwargs or {}))
