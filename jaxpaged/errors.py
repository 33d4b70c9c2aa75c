"""Errors of the leaf modules (config, engine arguments), shared by every floor: a leaf, it
imports nothing, so ``EngineArgs`` and ``ModelConfig`` refuse settings without importing the
floors that implement them."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration is not supported."""


class TensorParallelError(ValueError):
    """``tensor_parallel_size`` does not fit the devices or the model's heads
    (``jaxpaged.distributed.tensor_parallel``)."""


class PipelineParallelError(TensorParallelError):
    """``pipeline_parallel_size`` does not fit the devices or the model, or is combined with
    a feature that pipeline parallelism does not support
    (``jaxpaged.distributed.pipeline_parallel``)."""
