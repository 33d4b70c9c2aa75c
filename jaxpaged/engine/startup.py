"""What an :class:`~jaxpaged.engine.engine.Engine` does before it takes requests: join the
job's processes, load the model (and a speculative draft model) onto the devices, compile
its step shapes (or start compiling them in the background,
``jaxpaged.runner.background_compile``), and load the tokenizer meanwhile.

The tokenizer (transformers' import and the tokenizer files: seconds of Python,
``docs/measurements.md``, "Start-up") loads on its own thread while this one loads the model
and compiles its steps (XLA compiles without the GIL); a tokenizer that fails stops the
precompile early.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from jaxpaged.distributed.multihost import check_same_everywhere, initialize as initialize_multihost
from jaxpaged.distributed.step_sync import install_signal_handlers, stop_requested_anywhere
from jaxpaged.distributed.tensor_parallel import request_host_devices
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.engine_config import EngineConfig
from jaxpaged.runner.background_compile import SERVE, BackgroundCompile, compile_plan
from jaxpaged.runner.worker import Worker, build_worker
from jaxpaged.spec_decode.draft_model import DraftModel, DraftModelProposer
from jaxpaged.tokenizer import load_tokenizer


def join_processes(args: EngineArgs) -> None:
    """Ask for the host devices the engine's parallelism needs and join a multi-host job
    (both before anything starts JAX's backends); in a job, SIGINT / SIGTERM to any process
    stop the whole job, and every process must have started with the same settings.

    Raises:
        MultiHostError: inconsistent multi-host flags, or processes started with different
            settings.
    """
    request_host_devices(args.tensor_parallel_size * args.pipeline_parallel_size
                         * args.data_parallel_size // args.num_processes)
    initialize_multihost(args.coordinator_address, args.num_processes, args.process_id)
    if args.num_processes > 1:
        install_signal_handlers()
    check_same_everywhere("engine settings", {
        k: v for k, v in dataclasses.asdict(args).items() if k != "process_id"})


@dataclass(frozen=True)
class LoadedModel:
    """The device side of an engine, built and compiled.

    Attributes:
        worker: the target model's runner and pool facts (``jaxpaged.runner.worker``).
        drafter: the draft model's proposer (``method="draft_model"``), else None.
        tokenizer: the model's tokenizer.
        background: the step compilations still running on background threads.
    """

    worker: Worker
    drafter: DraftModelProposer | None
    tokenizer: Any
    background: list[BackgroundCompile]


def load_and_compile(config: EngineConfig, devices: list | None = None,
                     background_compile: str | None = None) -> LoadedModel:
    """Load the model (and its draft model) onto ``devices``, precompile its step shapes
    (unless ``enforce_eager``), and load the tokenizer on another thread meanwhile.
    ``background_compile`` (``"serve"``, ``"offline"`` or None: every shape before this
    returns) says which shapes compile before this returns and which on a background
    thread (:func:`jaxpaged.runner.background_compile.compile_plan`); a server's threads
    start at ``Engine.start_background_compile``, after its warm-up request.

    Raises:
        SpeculativeConfigError: a draft model that does not fit the target (before
            anything loads). Otherwise as :func:`jaxpaged.runner.worker.build_worker` and
            :func:`jaxpaged.tokenizer.load_tokenizer` raise.
    """
    load, speculative_config = config.load_config, config.speculative_config
    draft = DraftModel.check(speculative_config, config.model_config, load=load,
                             attention_backend=config.attention_backend,
                             scheduler_config=config.scheduler_config)
    background = []
    with ThreadPoolExecutor(1, thread_name_prefix="jaxpaged-tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, load.tokenizer or load.model,
                                load.trust_remote_code)
        worker = build_worker(config, tokenizer=tokenizer.result, devices=devices,
                              extra_bytes_per_page=draft and draft.kv_bytes_per_page)
        if speculative_config is not None:
            worker.runner.enable_spec_decode(speculative_config.num_speculative_tokens)
        drafter = draft and draft.build(worker, speculative_config.num_speculative_tokens)
        if not config.enforce_eager:
            for runner in [worker.runner] + ([drafter.runner] if drafter else []):
                first, later = compile_plan(runner.step_shapes(), background_compile)
                runner.precompile(should_stop=lambda: stop_requested_anywhere() or (
                    tokenizer.done() and tokenizer.exception() is not None), shapes=first,
                    samplers=background_compile is None)
                if later:
                    background.append(BackgroundCompile(runner, later,
                                                        pad=background_compile == SERVE,
                                                        start=background_compile != SERVE))
        try:
            return LoadedModel(worker, drafter, tokenizer.result(), background)
        except BaseException:
            for job in background:
                job.stop()
            raise
