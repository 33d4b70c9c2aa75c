"""One pipeline stage of a loaded decoder, and the jitted program that runs it.

A :class:`PipelineStage` holds references to the loaded model's own parts (no copies until
its state is placed on the stage's devices): the embedding on the first stage, its range of
decoder layers, and on the last stage the final norm and the LM head (with tied embeddings
the embedding too, placed a second time on the last stage's devices). It calls the same
functions as :class:`jaxpaged.models.llama.LlamaModel` (``embed``, ``run_layers``,
``lm_logits``), so every family built from the Llama parts (Mistral, Qwen, Mixtral, Gemma 2)
splits the same way.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxpaged.models.llama import embed, lm_logits, run_layers
from jaxpaged.runner.step_programs import forward_outputs


class PipelineStage(nnx.Module):
    """Decoder layers ``[start, end)`` of ``model`` (a ``LlamaForCausalLM`` or a family
    built from its parts), with the embedding if ``first`` and the final norm and LM head if
    ``last``.

    Called as ``stage(x, positions, kv_caches, metadata)``: ``x`` is [T] int32 token ids on
    the first stage and the previous stage's [T, H] hidden states on the others;
    ``kv_caches`` the stage's layers' ``(k_pages, v_pages)``. Returns ([T, H] hidden states,
    final-normed on the last stage; the updated caches).
    """

    def __init__(self, model: nnx.Module, start: int, end: int, *, first: bool, last: bool):
        inner = model.model
        tied = model.lm_head is None
        self.embed_tokens = inner.embed_tokens if first or (last and tied) else None
        self.embed_scale = inner.embed_scale
        self.layers = nnx.List([inner.layers[i] for i in range(start, end)])
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.final_soft_cap = model.final_soft_cap
        self.first, self.last = first, last

    def __call__(self, x, positions, kv_caches, metadata):
        if self.first:
            x = embed(self.embed_tokens, self.embed_scale, x)
        x, kv_caches = run_layers(self.layers, x, positions, kv_caches, metadata)
        return (self.norm(x) if self.last else x), kv_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Last stage only: as ``LlamaForCausalLM.compute_logits``."""
        return lm_logits(hidden, self.embed_tokens, self.lm_head, self.final_soft_cap)


def build_stage_program(graphdef: nnx.GraphDef, state_sharding, kv_sharding,
                        replicated: jax.sharding.Sharding, last: bool) -> jax.stages.Wrapped:
    """The stage's forward, jitted on its devices with the pool donated:
    ``(state, kv_caches, x, forward_inputs) -> (hidden [T, H], kv_caches)``, or on the last
    stage ``-> (logits [B, V], prompt logprobs, pooled, kv_caches)`` as the single-device
    forward program returns them (``jaxpaged.runner.step_programs.forward_outputs``)."""

    def forward(state, kv_caches, x, inputs: dict):
        stage = nnx.merge(graphdef, state)
        hidden, kv_caches = stage(x, inputs["positions"], kv_caches, inputs["attn_metadata"])
        if not last:
            return hidden, kv_caches
        return *forward_outputs(stage, hidden, inputs), kv_caches

    rep = replicated
    outs = (rep, rep, rep, kv_sharding) if last else (rep, kv_sharding)
    return jax.jit(forward, donate_argnums=(1,),
                   in_shardings=(state_sharding, kv_sharding, rep, rep), out_shardings=outs)
