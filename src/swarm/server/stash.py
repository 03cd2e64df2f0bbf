"""Weights kept for the forward graphs that a step overtook (weight stashing in sync mode).

A stage steps while some of its forwards still wait for their backwards: trainers keep several
microbatches in flight, so at every step boundary some are between the two passes. The step changes
the weights in place, and autograd refuses a graph whose saved weights changed; recomputing each such
forward at the new weights cost a fifth to four fifths of a stage's backwards.

Instead, a forward runs under saved-tensor hooks that save a reference to a parameter (the parameter,
or any view of it) rather than the tensor itself. Just before a step changes weights that kept graphs
still need, `keep` copies them, once per step, whatever the number of graphs (only those some graph saved:
under autocast a matmul saves its own half-precision cast of the weight, which no step changes). A backward then reads
the weights its forward ran at: the live ones if no step came in between, else the copy. Its gradient
is the exact gradient at the weights its forward saw, for the stage's parameters and its inputs alike,
and goes into the step that follows the backward (a microbatch overtaken by a step counts one step
late). The copy is dropped as soon as no kept graph needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _ParamView:
    """What a graph saves in place of a parameter: which one, at which version, and the view's shape."""

    index: int
    version: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class KeptWeights:
    def __init__(self, params: list[torch.Tensor], version: Callable[[], int]):
        """`version`: the runtime's count of changes to the weights, read when a graph is unpacked."""
        self.params = params
        self.version = version
        self._kept: dict[int, list[torch.Tensor | None]] = {}
        self._saved: dict[int, set[int]] = {}  # version -> the parameters graphs saved by reference at it

    def holds(self, version: int) -> bool:
        return version in self._kept

    def saving(self) -> contextlib.AbstractContextManager:
        """Hooks for one forward: parameters are saved by reference at the current version.

        Only parameters that own their whole storage are recognised (views into a shared flat buffer
        would be ambiguous); a graph that saves anything else saves it as autograd always does."""
        slots = {(p.device, p.untyped_storage().data_ptr()): i for i, p in enumerate(self.params)
                 if p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size()}
        at = self.version()
        by_reference = self._saved.setdefault(at, set())

        def pack(t: torch.Tensor) -> torch.Tensor | _ParamView:
            if t.layout != torch.strided:
                return t
            i = slots.get((t.device, t.untyped_storage().data_ptr()))
            if i is None:
                return t
            by_reference.add(i)
            return _ParamView(i, at, t.size(), t.stride(), t.storage_offset())

        def unpack(saved: torch.Tensor | _ParamView) -> torch.Tensor:
            if not isinstance(saved, _ParamView):
                return saved
            weights = self.params if saved.version == self.version() else self._kept[saved.version]
            source = weights[saved.index]
            return source.detach().as_strided(saved.size, saved.stride, saved.offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @torch.no_grad()
    def keep(self) -> None:
        """Before the weights change in place: copy them for the graphs built on them (strides kept, so
        a saved view reads the same elements of the copy)."""
        version = self.version()
        if version not in self._kept:
            saved = self._saved.get(version, ())
            self._kept[version] = [
                torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=p.device).copy_(p) if i in saved
                else None for i, p in enumerate(self.params)]

    def release(self, needed: Iterable[int]) -> None:
        """Drop the copies no kept graph needs any more."""
        needed = set(needed)
        for version in self._kept.keys() - needed:
            del self._kept[version]
        for version in self._saved.keys() - needed - {self.version()}:
            del self._saved[version]
