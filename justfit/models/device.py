"""Which device MLX computes on; below both load.py (the weight policy) and layout.py (row-major on the CPU)."""


def backend() -> str:
    """'metal', 'cuda' or 'cpu': the device MLX computes on."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"
