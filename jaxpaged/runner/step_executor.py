"""How a :class:`~jaxpaged.runner.model_runner.ModelRunner` runs its model: the one part of a
step that differs between a model on one device group and a model cut into pipeline stages.

``ModelRunner`` holds one executor and calls it for exactly these things (no subclass of the
runner overrides its methods): building the programs over a loaded model (:meth:`load`),
copying pages (:meth:`copy_pages`), starting a prepared step (:meth:`dispatch`,
:meth:`launch`), the compiled programs of a step shape (:meth:`executables_for`), the devices
it runs on, and refusing what it cannot do (:meth:`refuse`). :class:`SingleStageExecutor`
runs the model as one forward program over the runner's whole mesh;
``jaxpaged.runner.pipeline_runner.PipelineExecutor`` as ``pp`` stage programs on disjoint
devices. Both keep the model state, programs and pool on the runner (``_state``,
``_programs``, ``_kv_caches``), which the rest of the runner (compilation, weight updates,
scratch prefills) reads.

The runner owns its executor; the executor reaches back through a weak reference
(:func:`runner_ref`). A strong one would make runner and executor a reference cycle, which only
CPython's cyclic collector frees, and the engine moves every object alive after start-up out of
that collector's reach (``gc.freeze``, ``jaxpaged.engine.gc_heap``): a dropped engine's runner
(weights, KV pool, compiled steps) would then stay in memory for the life of the process.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Protocol

import jax
import numpy as np
from flax import nnx

from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.layers.attention import BatchLayout
from jaxpaged.layers.layer_stack import distinct_leaves
from jaxpaged.runner.compilation import _shape_key
from jaxpaged.runner.input_batch import StepInputs
from jaxpaged.runner.pending_step import PendingStep, copy_indices
from jaxpaged.runner.step_programs import (build_programs, is_plain_greedy,
                                           sample_inputs)
from jaxpaged.sampling.sampler import SamplerOutput

if TYPE_CHECKING:
    from jaxpaged.distributed.pipeline_parallel import PipelineParallel
    from jaxpaged.runner.model_runner import ModelRunner


def runner_ref(runner: ModelRunner) -> ModelRunner:
    """A weak proxy of ``runner`` for its executor to hold (module docstring: the runner dies
    by reference count). Using it after the runner is gone raises ReferenceError."""
    return weakref.proxy(runner)


class StepExecutor(Protocol):
    """What ``ModelRunner`` asks of the way its model runs (module docstring)."""

    #: The pipeline stages (None: one stage).
    pipeline: PipelineParallel | None

    def load(self, model: nnx.Module) -> None:
        """Split ``model`` into the runner's graph and state and build its programs (the
        runner holds its compile lock)."""

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (source -> destination) in every layer's pool, in place."""

    def dispatch(self, scheduler_output: SchedulerOutput):
        """Prepare and start the step; its ``result()`` waits and returns the
        ``ModelRunnerOutput``."""

    def launch(self, layout: BatchLayout, inputs: StepInputs, draft_ids=None,
               scheduler_output: SchedulerOutput | None = None) -> tuple:
        """Dispatch the forward and the sampler over prepared ``inputs``: (SamplerOutput
        with prompt logprobs, pooled rows, the verifier's accepted [B] bool or None)."""

    def executables_for(self, layout: BatchLayout, inputs: StepInputs, forward: bool = True,
                        sampler: bool = True) -> tuple:
        """The compiled forward program(s) and sampler of ``inputs``' shapes."""

    @property
    def devices(self) -> list:
        """The devices the model and its pool live on, by id."""

    def refuse(self, feature: str) -> None:
        """Raise when ``feature`` (a runner method's name) cannot run on this executor."""


class SingleStageExecutor:
    """The model as one forward program over the runner's whole mesh (tensor parallel or
    one device), and one sampler program.

    Args:
        runner: the runner whose state, pool and compiled programs it uses.
    """

    pipeline = None

    def __init__(self, runner: ModelRunner):
        self.runner = runner_ref(runner)

    def load(self, model: nnx.Module) -> None:
        r = self.runner
        for _, node in nnx.iter_graph(model):    # (layer_stack: fewer step arguments)
            if hasattr(node, "stack_packed_weights"):
                node.stack_packed_weights()
        graphdef, r._state = nnx.split(model)
        r._graphdef = graphdef
        r._state_leaves, state_def, r._leaf_index = distinct_leaves(r._state)
        r._programs = build_programs(
            graphdef, [a.sharding for a in r._state_leaves],
            jax.tree.map(lambda a: a.sharding, r._kv_caches), r._replicated,
            r._cpu_matmuls, state_def, r._cpu_argmax, r._leaf_index)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        r = self.runner
        r._kv_caches = r._programs.copy_pages(r._kv_caches, *copy_indices(copies))

    def dispatch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        r = self.runner
        prepared = r._prepare(scheduler_output)
        out, pooled, accepted = self.launch(prepared.layout, prepared.inputs,
                                            prepared.draft_ids, scheduler_output)
        scheduled, starts = scheduler_output.scheduled, prepared.row_starts
        r._prev_rows = lambda: {s.request.request_id: starts[i]
                                for i, s in enumerate(scheduled) if s.samples}
        return PendingStep(scheduler_output, prepared, out, pooled, accepted)

    def launch(self, layout: BatchLayout, inputs: StepInputs, draft_ids=None,
               scheduler_output: SchedulerOutput | None = None) -> tuple:
        """The forward, then the verifier (a verification step), nothing (a plain greedy
        step: the forward's own argmax) or the sampler; with LoRA each token's adapter
        slot from ``scheduler_output``."""
        r = self.runner
        forward, _ = self.executables_for(layout, inputs, sampler=False)
        logits, prompt, pooled, greedy, greedy_prev, r._kv_caches = forward(
            r._state_leaves, r._kv_caches, r._forward_inputs(inputs, scheduler_output),
            r._prev_tokens)
        accepted = None
        if layout.verify_block_q:
            out, accepted = r._sampler_for(logits, inputs, verify=True)(
                logits, sample_inputs(inputs), draft_ids)
        elif is_plain_greedy(inputs, r._free_bitmasks.get(logits.shape[0])):
            out, r._prev_tokens = SamplerOutput(greedy), greedy_prev
        else:       # (the sampler compiled by the first step that samples, if not before)
            out, r._prev_tokens = r._sampler_for(logits, inputs)(
                logits, sample_inputs(inputs), r._prev_tokens)
        return dataclasses.replace(out, prompt_logprobs=prompt), pooled, accepted

    def executables_for(self, layout: BatchLayout, inputs: StepInputs, forward: bool = True,
                        sampler: bool = True) -> tuple:
        """The compiled forward and sample programs for ``inputs``' shapes (compiled now,
        or loaded from the executable store, if new); None for a program not asked for."""
        r, fn = self.runner, None
        if forward:
            fn = r._compiled(
                ("forward", *_shape_key(layout)), r._programs.forward, r._state_leaves,
                r._kv_caches, r._forward_inputs(inputs), r._prev_tokens)
            r._ready_shapes.add(_shape_key(layout))
        # (the forward's logits [B, V] float32, known without asking it: out_info is slow,
        # docs/measurements.md, "Step executor")
        logits = jax.ShapeDtypeStruct((inputs.logits_indices.shape[0], r._limits.vocab_size),
                                      np.float32)
        return fn, (r._sampler_for(logits, inputs, verify=bool(layout.verify_block_q))
                    if sampler else None)

    @property
    def devices(self) -> list:
        return sorted(self.runner._replicated.device_set, key=lambda d: d.id)

    def refuse(self, feature: str) -> None:
        """Everything runs on one stage."""
