"""A decoder's per-layer packed weights held as one array per kind, stacked over the layers.

A jitted step takes its weights as arguments, and JAX's dispatch pays for each one: checks,
reference counts and usage events on ~10 cache lines of host metadata per array, which the
step's own weight streaming has evicted. SmolLM2-135M's GGUF keeps 694 arrays (30 layers of
seven packed projections of three arrays each, and two norms), and calling its decode step
cost a noticeable share of the step in host time, most of it these arguments, on the cores the
step's kernels need (``docs/measurements.md``, "Layer stack").

:func:`stack_layer_weights` replaces every layer's copy of one kind (say ``q_proj``'s
``blocks``) with a :class:`LayerSlice`, a view of row ``i`` of one stacked ``[L, ...]``
array; the packed kernel reads the row in place
(:func:`jaxpaged.layers.packed_linear.packed_projections` passes the stack and the layer).
A :class:`LayerSlice` is a pytree node whose one child is the stack, so a flattened state
names each stack once per layer; the runner passes each distinct array once
(:func:`distinct_leaves`, ``jaxpaged.runner.step_programs``): 694 arguments become 27.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx


@jax.tree_util.register_pytree_node_class
class LayerSlice:
    """Row ``index`` of ``stack`` ([L, ...]), standing for one layer's weight.

    Attributes:
        stack: the stacked array (a tracer inside a jitted step).
        index: the layer (static).
    """

    def __init__(self, stack, index: int):
        self.stack, self.index = stack, index

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    def __getitem__(self, key):
        """``x[...]`` is the slice itself (the way modules read their parameters)."""
        if key is Ellipsis:
            return self
        return self.stack[self.index][key]

    def tree_flatten(self):
        return (self.stack,), self.index

    @classmethod
    def tree_unflatten(cls, index, children):
        return cls(children[0], index)

    def __repr__(self) -> str:
        return f"LayerSlice({self.index} of {getattr(self.stack, 'shape', '?')})"


def unstack(value):
    """The array ``value`` stands for: a :class:`LayerSlice`'s row (a copy), else itself."""
    return value.stack[value.index] if isinstance(value, LayerSlice) else value


def distinct_leaves(tree) -> tuple[list, Any, tuple[int, ...]]:
    """``tree``'s leaves with each array once, in order of first appearance (a stack stands
    for every layer's :class:`LayerSlice`), its treedef, and each leaf's index among them:
    leaf ``i`` is ``distinct[index[i]]``."""
    leaves, treedef = jax.tree.flatten(tree)
    first: dict[int, int] = {}
    index = tuple(first.setdefault(id(a), len(first)) for a in leaves)
    by_id = {id(a): a for a in leaves}
    return [by_id[i] for i in first], treedef, index


def stack_layer_weights(layers: Sequence[nnx.Module],
                        wanted: Callable[[tuple], bool]) -> int:
    """Stack, across ``layers`` (modules of one structure), every variable whose path
    within its layer satisfies ``wanted`` and whose arrays share one shape and dtype in
    every layer; each layer's variable then holds its :class:`LayerSlice`. A kind whose
    shapes differ between layers (a file mixing block types) stays per layer.

    Returns:
        How many kinds were stacked.
    """
    if len(layers) < 2:
        return 0
    paths = [dict(nnx.iter_graph(layer)) for layer in layers]
    stacked = 0
    for path, var in paths[0].items():
        if not isinstance(var, nnx.Variable) or not wanted(path):
            continue
        variables = [p.get(path) for p in paths]
        values = [v.get_value() if isinstance(v, nnx.Variable) else None for v in variables]
        if any(not isinstance(x, jax.Array) for x in values) or \
                len({(x.shape, x.dtype) for x in values}) != 1:
            continue
        # Stacked on the host and placed once: jnp.stack would compile a program for each
        # kind's shape at every start-up (docs/measurements.md, "Layer stack").
        stack = jax.device_put(np.stack([np.asarray(x) for x in values]), values[0].sharding)
        for i, v in enumerate(variables):
            v.set_value(LayerSlice(stack, i))
        stacked += 1
    return stacked
