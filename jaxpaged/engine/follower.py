"""The engine loop of a multi-host job's other processes, and the warm-up every server
engine runs before it takes requests.

In a multi-host job (``--num-processes`` > 1) process 0 runs the server and its
:class:`~jaxpaged.engine.async_engine.AsyncEngine`, which sends each step's commands to the
other processes (``jaxpaged.distributed.step_sync``) before applying them. Every other process
runs :func:`run_follower`: the same engine, fed with those commands and stepping when process
0 steps, so all of them take the same steps (the collectives of a sharded step need every
process).
"""

from __future__ import annotations

import logging

from jaxpaged.distributed.multihost import leave_failed_job
from jaxpaged.distributed.step_sync import JobStopped, sync_step
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.engine.commands import AddRequest, StopEngine
from jaxpaged.engine.data_parallel import DataParallelEngine, make_engine
from jaxpaged.engine.engine import Engine
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def warm_up(engine: Engine | DataParallelEngine) -> None:
    """Run a one-token request end to end on every replica, so that the first user request
    does not pay for anything that a precompile leaves out (and a broken step fails here).
    The requests carry a seed, so the engine's seed sequence is left as it was; a pooling
    engine embeds the token instead."""
    bos = engine.tokenizer.bos_token_id
    params = PoolingParams() if engine.args.pooler is not None else SamplingParams(
        max_tokens=1, temperature=0, seed=0)
    for i in range(engine.args.data_parallel_size):     # one per replica (least busy first)
        engine.add_request(f"__warmup__{i}", [bos if bos is not None else 0], params)
    while engine.has_unfinished_requests():
        engine.step()


def run_follower(args: EngineArgs) -> int:
    """A non-leader process of a multi-host server: the same engine as process 0's
    :class:`~jaxpaged.engine.async_engine.AsyncEngine`, fed with process 0's commands, stepping when it steps, until a
    stop command or a stop signal to any process. Requests that process 0 refused are refused
    here the same way.

    Returns:
        The exit status: 0 after a stop. If the job breaks (a peer died), the process prints
        the error and leaves at once with status 1 (:func:`leave_failed_job`).
    """
    engine = make_engine(args)
    try:
        warm_up(engine)
        while True:
            for cmd in sync_step():
                if isinstance(cmd, StopEngine):
                    logger.info("process 0 stopped the job")
                    return 0
                if isinstance(cmd, AddRequest):
                    try:
                        engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority,
                                           cmd.lora_request)
                    except Exception:   # noqa: BLE001 - process 0 answered the client already
                        pass
                else:
                    engine.abort_request(cmd.request_id)
            if engine.has_unfinished_requests():
                engine.step()
    except JobStopped as e:
        logger.info("%s", e)
        return 0
    except Exception as e:   # noqa: BLE001 - a broken job: say why in one line and leave
        leave_failed_job(e)
