"""mlx-lm baselines run on the model as mlx-lm's own users get it, not on JustFit's weight layout."""

from contextlib import contextmanager, nullcontext


@contextmanager
def mlx_lm_layout(model):
    """Within: every weight back in mlx-lm's layout (W [out, in], models/layout.py undone), so an mlx-lm row
    times what `mlx_lm.load` gives (float32 on the CPU, as for JustFit); JustFit's layout again after.
    Each switch transposes the weights (~0.5 s for the default model), outside any timed region."""
    from ..models import layout

    swapped = layout.standard(model)
    try:
        yield model
    finally:
        if swapped:
            layout.row_major(model)


def layout_for(system: str, model):
    """mlx_lm_layout(model) for an 'mlx-lm…' system, else a no-op context."""
    return mlx_lm_layout(model) if system.startswith("mlx-lm") else nullcontext(model)
