"""The adapter slots on the device: built into the model once, written between steps.

:func:`add_lora_slots` wraps every supported target projection of the loaded model in a
:class:`~jaxpaged.layers.lora.LoRALinear` whose stacked slots are zeros. Under tensor
parallelism the slots shard with their base weights (Megatron's split, as
``jaxpaged.distributed.tensor_parallel`` lays the base out): a column-parallel projection's
``B`` [S, r, d_out] splits its output features and ``A`` is replicated; a row-parallel one's
``A`` [S, d_in, r] splits its input features (the shrink's partial sums join the all-reduce
XLA already inserts for the base) and ``B`` is replicated.

:class:`LoRASlotWriter` writes one adapter into one slot of every target with a single
jitted program over all slot arrays, donated so they are updated in place; the program is
compiled once (a fixed shape: every target is written, zeros where the adapter has none),
so loading, swapping or mixing adapters never recompiles a step.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.tensor_parallel import TP_AXIS, TensorParallel
from jaxpaged.layers.lora import LoRALinear
from jaxpaged.lora.config import LoRAConfig
from jaxpaged.lora.peft import LoRAAdapter
from jaxpaged.lora.targets import COLUMN_PARALLEL, PARENT, target_shapes


def _sharding(tp: TensorParallel, shape: tuple, axis: int | None) -> NamedSharding:
    if axis is None or shape[axis] % tp.size:
        return tp.replicated
    spec = [None] * len(shape)
    spec[axis] = TP_AXIS
    return NamedSharding(tp.mesh, P(*spec))


def add_lora_slots(model: nnx.Module, config: ModelConfig, lora: LoRAConfig,
                   tp: TensorParallel, dtype) -> list[tuple[int, str]]:
    """Wrap each supported target of every decoder layer of ``model`` (in place).

    Args:
        model: a loaded model whose layers are ``model.model.layers``.
        config: its checkpoint config; lora: the slot count and rank; tp: the mesh;
        dtype: the slots' dtype (the model's).

    Returns:
        The ``(layer, target)`` pairs wrapped, in order.
    """
    s, r = lora.num_slots, lora.max_lora_rank
    wrapped = []
    for i, layer in enumerate(model.model.layers):
        for name, (d_in, d_out) in target_shapes(tp.physical_config(config)).items():
            parent = getattr(layer, PARENT[name], None)
            if parent is None or not hasattr(parent, name):
                continue
            column = name in COLUMN_PARALLEL
            a = jax.device_put(np.zeros((s, d_in, r), dtype),
                               _sharding(tp, (s, d_in, r), None if column else 1))
            b = jax.device_put(np.zeros((s, r, d_out), dtype),
                               _sharding(tp, (s, r, d_out), 2 if column else None))
            setattr(parent, name, LoRALinear(getattr(parent, name), a, b))
            wrapped.append((i, name))
    return wrapped


class LoRASlotWriter:
    """Writes adapters into the slot arrays of a split model's state.

    Args:
        targets: the wrapped ``(layer, target)`` pairs (:func:`add_lora_slots`).
        tp: the mesh (k/v columns are repeated as the base's KV heads are).
    """

    def __init__(self, targets: list[tuple[int, str]], tp: TensorParallel):
        self.targets = targets
        self._tp = tp

    def _vars(self, state) -> list[tuple]:
        layers = state["model"]["layers"]
        return [(layers[i][PARENT[n]][n]["lora_a"], layers[i][PARENT[n]][n]["lora_b"])
                for i, n in self.targets]

    def arrays(self, state) -> list[tuple[jax.Array, jax.Array]]:
        """Every target's ``(A [S, d_in, r], B [S, r, d_out])`` in ``state``."""
        return [(a[...], b[...]) for a, b in self._vars(state)]

    def set_arrays(self, state, arrays) -> None:
        """Put ``arrays`` (as :meth:`arrays` returns them) back into ``state``."""
        for (va, vb), (a, b) in zip(self._vars(state), arrays):
            va.set_value(a)
            vb.set_value(b)

    def program(self, state) -> jax.stages.Wrapped:
        """The jitted ``(arrays, slot [] int32, new) -> arrays`` writing ``new`` (per target
        ``(A [d_in, r], B [r, d_out])``) at ``slot``; ``arrays`` donated."""
        shardings = [(a.sharding, b.sharding) for a, b in self.arrays(state)]

        def write(arrays, slot, new):
            return [(a.at[slot].set(na), b.at[slot].set(nb))
                    for (a, b), (na, nb) in zip(arrays, new)]

        return jax.jit(write, donate_argnums=(0,), out_shardings=shardings)

    def host_weights(self, state, adapter: LoRAAdapter | None) -> list[tuple[np.ndarray, ...]]:
        """``adapter``'s weights per target, zero-padded to the slot shapes (k/v heads
        repeated for tensor parallelism) in the slots' dtype; all zeros for None."""
        out = []
        for (i, name), (a, b) in zip(self.targets, self.arrays(state)):
            na = np.zeros(a.shape[1:], a.dtype)
            nb = np.zeros(b.shape[1:], b.dtype)
            pair = None if adapter is None else adapter.weights.get((i, name))
            if pair is not None:
                wa, wb = pair
                path = (name, "kernel")
                na[:, :wa.shape[1]] = wa
                nb[:wb.shape[0]] = self._tp.repeat_kv_heads(path, wb)
            out.append((na, nb))
        return out


def token_slots(scheduled, lora_slots: dict[int, int], num_padded: int) -> np.ndarray:
    """[T] int32 each token's slot for a step of ``scheduled`` sequences (tokens laid out in
    batch order; padding and base-model tokens: 0)."""
    per_seq = [0 if s.request.lora_request is None
               else lora_slots[s.request.lora_request.lora_int_id] for s in scheduled]
    slots = np.zeros(num_padded, np.int32)
    counts = [s.num_new_tokens for s in scheduled]
    slots[:sum(counts)] = np.repeat(np.asarray(per_seq, np.int32), counts)
    return slots
