"""`PipelineModelRunner`: a `ModelRunner` whose model runs as ``pp`` stages on disjoint devices.

The schedule is GPipe's fill and drain within one engine step (Huang et al., "GPipe:
Efficient Training of Giant Neural Networks using Pipeline Parallelism", 2019, section 2.2,
forward half only): the step's sequences are cut into ``pp`` micro-batches of about equal
token counts (:func:`split_micro_batches`), and micro-batch ``m`` goes through stage 0, then
stage 1, ..., each stage a jitted program on its own devices
(``jaxpaged.runner.pipeline_stage``), its activations copied to the next stage's
devices with ``jax.device_put``; the last stage samples. Every launch is asynchronous, and
each device group runs its own queue in order, so while stage 1 runs micro-batch 0, stage 0
already runs micro-batch 1: with ``pp`` micro-batches over ``pp`` stages the step takes
``2 pp - 1`` stage slots instead of ``pp * pp``. The host waits only when the step's
results are read (:meth:`PipelineStep.result`).

vLLM runs pipeline stages differently: ``pp`` batches in flight at once, each a whole
scheduler step (``max_concurrent_batches`` in ``vllm/v1/engine/core.py``'s batch queue),
which keeps the stages busy across steps at the cost of a scheduler that must not schedule a
sequence whose previous token is still in flight. Micro-batches inside one step keep the
engine and scheduler unchanged; async scheduling (which already overlaps the host with the
device) is off with pipeline parallelism.

Micro-batches are whole sequences, so a step of one sequence (one long prefill) runs the
stages one after the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jaxpaged.distributed.pipeline_parallel import PipelineParallel, PipelineParallelError
from jaxpaged.runner.pipeline_stage import PipelineStage, build_stage_program
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.layers.attention import BatchLayout
from jaxpaged.layers.attention.tensor_parallel import TensorParallelAttention
from jaxpaged.models.loader import param_path
from jaxpaged.runner.input_batch import StepInputs
from jaxpaged.runner.compilation import _shape_key
from jaxpaged.runner.model_runner import ModelRunner
from jaxpaged.runner.pending_step import PendingStep, copy_indices
from jaxpaged.core.runner_output import ModelRunnerOutput
from jaxpaged.runner.step_programs import build_programs, forward_inputs, sample_inputs


def split_micro_batches(sched: SchedulerOutput, num: int) -> list[SchedulerOutput]:
    """Cut ``sched``'s sequences, in batch order, into at most ``num`` non-empty runs of
    about equal token counts: a sequence goes to run ``floor(num * m / total)``, ``m`` the
    position of its middle token among the step's ``total`` tokens.

    Only ``scheduled`` is carried: page copies are made once before the micro-batches, and
    the other fields concern the scheduler, not the device.
    """
    total, runs, done = sched.num_tokens, {}, 0
    for s in sched.scheduled:
        index = min(num - 1, int(num * (done + s.num_new_tokens / 2) // total))
        runs.setdefault(index, []).append(s)
        done += s.num_new_tokens
    return [SchedulerOutput(scheduled=runs[i]) for i in sorted(runs)]


def merge_outputs(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """The micro-batches' outputs as one, in batch order; a micro-batch without logprobs
    (none of its sequences asked) contributes None entries where another has them."""
    def joined(field, missing):
        values = [getattr(o, field) for o in outputs]
        if all(v is None for v in values):
            return None
        return [x for o, v in zip(outputs, values)
                for x in (v if v is not None else missing(o))]

    return ModelRunnerOutput(
        sampled_token_ids=[t for o in outputs for t in o.sampled_token_ids],
        logprobs=joined("logprobs", lambda o: [[None] * len(t) for t in o.sampled_token_ids]),
        prompt_logprobs=joined("prompt_logprobs", lambda o: [None] * len(o.sampled_token_ids)),
        pooled=joined("pooled", lambda o: [None] * len(o.sampled_token_ids)))


@dataclass(frozen=True)
class PipelineStep:
    """A dispatched step: its micro-batches, each a :class:`PendingStep`."""

    parts: list[PendingStep]

    def result(self) -> ModelRunnerOutput:
        """Wait for every micro-batch and return their outputs as the step's."""
        return merge_outputs([p.result() for p in self.parts])


class PipelineModelRunner(ModelRunner):
    """A :class:`ModelRunner` over the stages of ``pipeline``.

    Args:
        model: the loaded model, each parameter already on its stage's devices
            (``PipelineParallel.param_sharding``); its attention layers are given their
            stage's mesh here.
        kv_caches: one ``(k_pages, v_pages)`` per layer, each on its layer's stage.
        pipeline: the stages.
        others: as :class:`ModelRunner` (``replicated`` is replaced by the last stage's,
            where the sampler runs).
    """

    def __init__(self, model: nnx.Module, kv_caches, backend, *, pipeline: PipelineParallel,
                 **kwargs):
        self._pipeline = pipeline
        if pipeline.size > 1:
            for s, (a, b) in enumerate(pipeline.layer_ranges):
                for i in range(a, b):
                    model.model.layers[i].self_attn.backend = TensorParallelAttention(
                        backend, pipeline.stages[s].mesh)
        kwargs["replicated"] = pipeline.stages[-1].replicated
        super().__init__(model, kv_caches, backend, **kwargs)

    def _load(self, model: nnx.Module) -> None:
        pp = self._pipeline
        graphdefs, states, self._stage_forward, self._stage_programs = [], [], [], []
        for s, (a, b) in enumerate(pp.layer_ranges):
            first, last = s == 0, s == pp.num_stages - 1
            graphdef, state = nnx.split(PipelineStage(model, a, b, first=first, last=last))
            state = _placed(state, pp.stages[s])
            shardings = jax.tree.map(lambda x: x.sharding, state)
            kv_sharding = jax.tree.map(lambda x: x.sharding, self._kv_caches[a:b])
            rep = pp.stages[s].replicated
            self._stage_forward.append(build_stage_program(graphdef, shardings, kv_sharding,
                                                           rep, last))
            self._stage_programs.append(build_programs(graphdef, shardings, kv_sharding, rep))
            graphdefs.append(graphdef)
            states.append(state)
        self._graphdef, self._state = tuple(graphdefs), states
        self._programs = self._stage_programs[-1]      # the sampler's
        self._executables.clear()
        self._prev_tokens = jax.device_put(np.zeros(self._buckets.seq_buckets[-1], np.int32),
                                           self._replicated)
        self._prev_rows = dict
        self._free_bitmasks = {}

    @property
    def devices(self) -> list:
        """Every stage's devices, by id."""
        return sorted(self._pipeline.devices, key=lambda d: d.id)

    @property
    def pipeline(self) -> PipelineParallel:
        return self._pipeline

    def enable_spec_decode(self) -> None:
        raise PipelineParallelError("speculative decoding is not supported with "
                                    "pipeline_parallel_size > 1")

    def set_kv_scales(self, scales) -> None:
        raise PipelineParallelError("calculate_kv_scales is not supported with "
                                    "pipeline_parallel_size > 1")

    def run_prefill(self, token_ids: list[int]):
        raise PipelineParallelError("run_prefill (KV-scale calibration) is not supported "
                                    "with pipeline_parallel_size > 1")

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """As :meth:`ModelRunner.copy_pages`, on every stage's layers."""
        if not copies:
            return
        src, dst = copy_indices(copies)
        for (a, b), programs in zip(self._pipeline.layer_ranges, self._stage_programs):
            self._kv_caches[a:b] = programs.copy_pages(self._kv_caches[a:b], src, dst)

    def dispatch(self, scheduler_output: SchedulerOutput) -> PipelineStep:
        """Start the step as ``pp`` micro-batches through the stages (module docstring) and
        return at once; :meth:`PipelineStep.result` waits."""
        self.copy_pages(scheduler_output.page_copies)
        parts = []
        for part in split_micro_batches(scheduler_output, self._pipeline.num_stages):
            prepared = self._prepare(part)
            out, pooled, _ = self._launch(prepared.layout, prepared.inputs)
            parts.append(PendingStep(part, prepared, out, pooled))
        return PipelineStep(parts)

    def _launch(self, layout: BatchLayout, inputs: StepInputs, draft_ids=None) -> tuple:
        stages, sampler = self._executables_for(layout, inputs)
        x, fwd = inputs.input_ids, forward_inputs(inputs)
        for s, ((a, b), fn) in enumerate(zip(self._pipeline.layer_ranges, stages)):
            if s:
                x = jax.device_put(x, self._pipeline.stages[s].replicated)
            *outs, self._kv_caches[a:b] = fn(self._state[s], self._kv_caches[a:b], x, fwd)
            x = outs[0]
        logits, prompt, pooled = outs
        out, _ = sampler(logits, sample_inputs(inputs), self._prev_tokens)
        return dataclasses.replace(out, prompt_logprobs=prompt), pooled, None

    def _executables_for(self, layout: BatchLayout, inputs: StepInputs, forward: bool = True,
                         sampler: bool = True) -> tuple:
        """Every stage's compiled forward for ``inputs``' shapes (with ``forward`` False
        too: the sampler's logits are the last stage's output), and the sampler (None
        without ``sampler``)."""
        pp, stages = self._pipeline, []
        x = inputs.input_ids
        for s, (a, b) in enumerate(pp.layer_ranges):
            fn = self._compiled(("stage", s, *_shape_key(layout)), self._stage_forward[s],
                                self._state[s], self._kv_caches[a:b], x, forward_inputs(inputs),
                                devices=list(pp.stages[s].mesh.devices.flat))
            stages.append(fn)
            if s + 1 < pp.num_stages:
                hidden = fn.out_info[0]
                x = jax.ShapeDtypeStruct(hidden.shape, hidden.dtype,
                                         sharding=pp.stages[s + 1].replicated)
        self._ready_shapes.add(_shape_key(layout))
        return stages, self._sampler_for(stages[-1].out_info[0], inputs) if sampler else None


def _placed(state: nnx.State, tp) -> nnx.State:
    """``state`` with every array on ``tp``'s mesh by its rules (a no-op for arrays already
    there; a copy for the tied embedding the last stage shares with the first)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.device_put(x, tp.param_sharding(param_path(kp), x.shape)), state)
