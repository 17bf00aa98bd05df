"""Lightning callbacks and hooks that see the model: the same values as one device under gpipe."""

import pytest

from tests.models import Net, pl


def test_pruning_keeps_this_stages_parameters_and_refuses_a_global_ranking_across_stages():
    """One process: of the (layer, name) pairs ModelPruning listed on the whole model, the last stage
    (layers 3..4) keeps its own, the lottery ticket's saved layers follow their new indices, and a
    global ranking over parameters that span stages raises."""
    from lightning_gpipe.strategy.callbacks import _prune_this_stage

    model = Net("mlp")
    last = model.layers[4]
    pruning = pl.callbacks.ModelPruning(
        "l1_unstructured", amount=0.5, use_lottery_ticket_hypothesis=True, use_global_unstructured=False
    )
    pruning.setup(None, model, "fit")
    _prune_this_stage(pruning, model.layers[3:])
    assert pruning._parameters_to_prune == [(last, "weight"), (last, "bias")]
    assert [ref["names"] for ref in pruning._original_layers.values()] == [[(0, "weight"), (1, "bias")]]
    pruning.apply_pruning(0.5)
    pruning.apply_lottery_ticket_hypothesis()
    assert int((last.weight_mask == 0).sum()) == 24 and not hasattr(model.layers[0], "weight_mask")
    ranked = pl.callbacks.ModelPruning(
        "l1_unstructured", amount=0.5
    )  # Lightning's default: one global ranking
    model = Net("mlp")
    ranked.setup(None, model, "fit")
    with pytest.raises(ValueError, match=r"\(this stage holds 2 of the 6 .*use_global_unstructured=False"):
        _prune_this_stage(ranked, model.layers[3:])


@pytest.mark.parametrize("finder", ["BatchSizeFinder", "LearningRateFinder"])
def test_tuners_are_refused_with_a_clear_error(finder):
    """BatchSizeFinder and LearningRateFinder (what Tuner.scale_batch_size / lr_find add) raise, as
    Lightning's own distributed strategies refuse them; other callbacks pass."""
    from lightning_gpipe.strategy.callbacks import refuse_tuners

    namespace = "lightning" if pl.__name__.startswith("lightning") else "pytorch_lightning"
    refuse_tuners([pl.callbacks.LearningRateMonitor()], namespace)
    with pytest.raises(ValueError, match=rf"{finder} is not supported under the gpipe strategy .*one-device"):
        refuse_tuners([getattr(pl.callbacks, finder)()], namespace)


def test_weight_averaging_and_pruning_are_refused_on_sharded_stages_and_other_callbacks_pass():
    """data_parallel="fsdp" (issue 42): a callback holding a copy of the model (weight averaging) or pruning
    it cannot work on DTensor shards; the error names the callback and the fix. Others pass."""
    from lightning_gpipe.strategy.callbacks import refuse_with_shards

    class Averaging(pl.Callback):  # as WeightAveraging keeps its averaged copy
        def __init__(self, model):
            self.average_model = type(model)("mlp")

    model = Net("mlp")
    for callback in (Averaging(model), pl.callbacks.ModelPruning("l1_unstructured")):
        with pytest.raises(
            ValueError,
            match=rf"{type(callback).__name__} cannot run with data_parallel='fsdp'.*"
            "use data_parallel='replicate'",
        ):
            refuse_with_shards(callback, model, "pytorch_lightning")
    refuse_with_shards(pl.callbacks.LearningRateMonitor(), model, "pytorch_lightning")
