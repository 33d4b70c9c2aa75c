"""`PipelineExecutor`: a `ModelRunner`'s model run as ``pp`` stages on disjoint devices.

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
from flax import nnx

from jaxpaged.distributed.pipeline_parallel import PipelineParallel, PipelineParallelError
from jaxpaged.runner.pipeline_stage import PipelineStage, build_stage_program
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.layers.attention import BatchLayout
from jaxpaged.layers.attention.tensor_parallel import TensorParallelAttention
from jaxpaged.models.loader import param_path
from jaxpaged.runner.input_batch import StepInputs
from jaxpaged.runner.compilation import _shape_key
from jaxpaged.runner.pending_step import PendingStep, copy_indices
from jaxpaged.core.runner_output import ModelRunnerOutput
from jaxpaged.runner.step_programs import build_programs, forward_inputs, sample_inputs
from jaxpaged.runner.step_executor import runner_ref


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


class PipelineExecutor:
    """How a ``ModelRunner`` runs its model as the stages of ``pipeline``
    (``jaxpaged.runner.step_executor``: the runner holds one, no subclass).

    Args:
        runner: the runner whose pool, compiled programs and sampler it uses; its
            ``_state`` becomes one state per stage.
        pipeline: the stages.
        model: the loaded model, each parameter already on its stage's devices
            (``PipelineParallel.param_sharding``); its attention layers are given their
            stage's mesh here.
        backend: the attention backend the model was built with.
    """

    #: Runner methods a pipeline cannot run, and why.
    _REFUSED = {
        "enable_spec_decode": "speculative decoding is not supported with "
                              "pipeline_parallel_size > 1",
        "set_kv_scales": "calculate_kv_scales is not supported with pipeline_parallel_size > 1",
        "run_prefill": "run_prefill (KV-scale calibration) is not supported with "
                       "pipeline_parallel_size > 1",
    }

    def __init__(self, runner, pipeline: PipelineParallel, model: nnx.Module, backend):
        self.runner = runner_ref(runner)       # (weak: jaxpaged.runner.step_executor)
        self.pipeline = pipeline
        if pipeline.size > 1:
            for s, (a, b) in enumerate(pipeline.layer_ranges):
                for i in range(a, b):
                    model.model.layers[i].self_attn.backend = TensorParallelAttention(
                        backend, pipeline.stages[s].mesh)

    def load(self, model: nnx.Module) -> None:
        r, pp = self.runner, self.pipeline
        graphdefs, states, self._stage_forward, self._stage_programs = [], [], [], []
        for s, (a, b) in enumerate(pp.layer_ranges):
            first, last = s == 0, s == pp.num_stages - 1
            graphdef, state = nnx.split(PipelineStage(model, a, b, first=first, last=last))
            state = _placed(state, pp.stages[s])
            shardings = jax.tree.map(lambda x: x.sharding, state)
            kv_sharding = jax.tree.map(lambda x: x.sharding, r._kv_caches[a:b])
            rep = pp.stages[s].replicated
            self._stage_forward.append(build_stage_program(graphdef, shardings, kv_sharding,
                                                           rep, last))
            self._stage_programs.append(build_programs(graphdef, shardings, kv_sharding, rep))
            graphdefs.append(graphdef)
            states.append(state)
        r._graphdef, r._state = tuple(graphdefs), states
        r._programs = self._stage_programs[-1]      # the sampler's

    @property
    def devices(self) -> list:
        """Every stage's devices, by id."""
        return sorted(self.pipeline.devices, key=lambda d: d.id)

    def refuse(self, feature: str) -> None:
        """Raises PipelineParallelError for speculative decoding, KV-scale calibration and
        scratch prefills."""
        if feature in self._REFUSED:
            raise PipelineParallelError(self._REFUSED[feature])

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """As ``ModelRunner.copy_pages``, on every stage's layers."""
        r = self.runner
        src, dst = copy_indices(copies)
        for (a, b), programs in zip(self.pipeline.layer_ranges, self._stage_programs):
            r._kv_caches[a:b] = programs.copy_pages(r._kv_caches[a:b], src, dst)

    def dispatch(self, scheduler_output: SchedulerOutput) -> PipelineStep:
        """Start the step as ``pp`` micro-batches through the stages (module docstring) and
        return at once; :meth:`PipelineStep.result` waits."""
        parts = []
        for part in split_micro_batches(scheduler_output, self.pipeline.num_stages):
            prepared = self.runner._prepare(part)
            out, pooled, _ = self.launch(prepared.layout, prepared.inputs)
            parts.append(PendingStep(part, prepared, out, pooled))
        return PipelineStep(parts)

    def launch(self, layout: BatchLayout, inputs: StepInputs, draft_ids=None,
               scheduler_output: SchedulerOutput | None = None) -> tuple:
        """Each stage's forward in turn, its activations copied to the next stage's
        devices, then the sampler on the last stage's (no proposals: nothing verified)."""
        r = self.runner
        stages, sampler = self.executables_for(layout, inputs)
        x, fwd = inputs.input_ids, forward_inputs(inputs)
        for s, ((a, b), fn) in enumerate(zip(self.pipeline.layer_ranges, stages)):
            if s:
                x = jax.device_put(x, self.pipeline.stages[s].replicated)
            *outs, r._kv_caches[a:b] = fn(r._state[s], r._kv_caches[a:b], x, fwd)
            x = outs[0]
        logits, prompt, pooled = outs
        out, _ = sampler(logits, sample_inputs(inputs), r._prev_tokens)
        return dataclasses.replace(out, prompt_logprobs=prompt), pooled, None

    def executables_for(self, layout: BatchLayout, inputs: StepInputs, forward: bool = True,
                        sampler: bool = True) -> tuple:
        """Every stage's compiled forward for ``inputs``' shapes (with ``forward`` False
        too: the sampler's logits are the last stage's output), and the sampler (None
        without ``sampler``)."""
        r, pp, stages = self.runner, self.pipeline, []
        x = inputs.input_ids
        for s, (a, b) in enumerate(pp.layer_ranges):
            fn = r._compiled(("stage", s, *_shape_key(layout)), self._stage_forward[s],
                             r._state[s], r._kv_caches[a:b], x, forward_inputs(inputs),
                             devices=list(pp.stages[s].mesh.devices.flat))
            stages.append(fn)
            if s + 1 < pp.num_stages:
                hidden = fn.out_info[0]
                x = jax.ShapeDtypeStruct(hidden.shape, hidden.dtype,
                                         sharding=pp.stages[s + 1].replicated)
        r._ready_shapes.add(_shape_key(layout))
        return stages, r._sampler_for(stages[-1].out_info[0], inputs) if sampler else None


def _placed(state: nnx.State, tp) -> nnx.State:
    """``state`` with every array on ``tp``'s mesh by its rules (a no-op for arrays already
    there; a copy for the tied embedding the last stage shares with the first)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.device_put(x, tp.param_sharding(param_path(kp), x.shape)), state)
