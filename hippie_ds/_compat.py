"""The DeepSpeed versions hippie-ds is tested against. It subclasses PipelineEngine internals
(instruction map, pipe buffers, grad_layer, loss slots), which change between minor releases."""
SUPPORTED_DEEPSPEED = ((0, 19), (0, 20))  # [0.19, 0.20)


def check_deepspeed_version(version: str | None = None) -> None:
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        raise ImportError(f"hippie-ds cannot parse the DeepSpeed version {version!r}") from None
    lo, hi = SUPPORTED_DEEPSPEED
    if not lo <= (major, minor) < hi:
        raise ImportError(f"hippie-ds supports DeepSpeed >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]} (it subclasses "
                          f"PipelineEngine internals); found DeepSpeed {version}. Install 'deepspeed>=0.19,<0.20'.")
