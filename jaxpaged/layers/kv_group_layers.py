"""Decoder layers over a pool laid out by KV cache groups (``jaxpaged.core.kv_groups``).

With a :class:`~jaxpaged.core.kv_groups.KVLayout` the pool holds ``layout.slots`` pairs of
``(k_pages, v_pages)``, not one per layer: layer ``i`` reads and writes pair
``layout.layer_slot[i]`` through the page table and slot mapping of its group
``layout.layer_group[i]`` (group 0's are the step metadata's own ``page_table`` and
``slot_mapping``, the others' come stacked in ``metadata["kv_groups"]``,
``jaxpaged.runner.input_batch.attention_metadata``). Layers of different groups sharing a
slot write different page ids of it, so they never overwrite each other; the attention
backends are unchanged (they see one page table, as for any layer).

The layout is a static attribute of the model's decoder (``kv_layout``, set before the
runner splits the model: :func:`set_kv_layout`), so each bucket still compiles once.
"""

from __future__ import annotations

from flax import nnx

from jaxpaged.core.kv_groups import KVLayout


def group_metadata(metadata: dict, num_groups: int) -> list[dict]:
    """Per group, the metadata its layers attend with: group 0 the step's own (less
    ``kv_groups``), group k its ``page_table`` [B, P] and ``slot_mapping`` [T] in place of
    those (traced slices of ``kv_groups``).

    Raises:
        KeyError: ``num_groups`` > 1 and the metadata carries no ``kv_groups``.
    """
    base = {k: v for k, v in metadata.items() if k != "kv_groups"}
    if num_groups == 1:
        return [base]
    groups = metadata["kv_groups"]
    return [base] + [{**base, "page_table": groups["page_table"][k],
                      "slot_mapping": groups["slot_mapping"][k]}
                     for k in range(num_groups - 1)]


def run_grouped_layers(layers, x, positions, kv_caches: list, metadata: dict,
                       layout: KVLayout):
    """x [T, H] through ``layers`` in order (``layout.num_layers`` of them), layer i on pool
    slot ``layout.layer_slot[i]`` with its group's metadata -> ([T, H], the updated
    ``layout.slots`` slots)."""
    per_group = group_metadata(metadata, len(layout.groups))
    caches = list(kv_caches)
    for i, layer in enumerate(layers):
        slot = layout.layer_slot[i]
        x, caches[slot] = layer(x, positions, caches[slot], per_group[layout.layer_group[i]])
    return x, caches


def set_kv_layout(model: nnx.Module, layout: KVLayout | None) -> int:
    """Give every decoder of ``model`` (a module with a ``kv_layout`` attribute) the pool
    layout; returns how many took it."""
    decoders = [node for _, node in nnx.iter_graph(model) if hasattr(node, "kv_layout")]
    for node in decoders:
        node.kv_layout = layout
    return len(decoders)


def model_kv_layout(model: nnx.Module) -> KVLayout | None:
    """The layout ``model``'s decoder runs with (None: one pool pair per layer)."""
    for _, node in nnx.iter_graph(model):
        if getattr(node, "kv_layout", None) is not None:
            return node.kv_layout
    return None
