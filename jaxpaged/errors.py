"""Errors of the leaf modules (config, engine arguments, sampling parameters), shared by every
floor: a leaf, it imports nothing, so ``EngineArgs``, ``ModelConfig`` and the grammar validator
raise them without importing the floors or modules that use them."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration is not supported."""


class TensorParallelError(ValueError):
    """``tensor_parallel_size`` does not fit the devices or the model's heads
    (``jaxpaged.distributed.tensor_parallel``)."""


class PipelineParallelError(TensorParallelError):
    """``pipeline_parallel_size`` does not fit the devices or the model, or is combined with
    a feature that pipeline parallelism does not support
    (``jaxpaged.distributed.pipeline_parallel``)."""


class SamplingParamsError(ValueError):
    """A field of :class:`SamplingParams` is out of range or of the wrong type.

    Attributes:
        param: the field's name (the OpenAI/vLLM request parameter of the same name).
        detail: the message without the class prefix (``"top_p must be in (0, 1], ..."``),
            for callers that name the field their own way.
    """

    def __init__(self, param: str, message: str):
        self.param = param
        self.detail = f"{param}{'' if message.startswith('=') else ' '}{message}"
        super().__init__(f"SamplingParams.{self.detail}")


def check_param(ok: bool, name: str, message: str) -> None:
    """Raise :class:`SamplingParamsError` ``(name, message)`` unless ``ok``."""
    if not ok:
        raise SamplingParamsError(name, message)
