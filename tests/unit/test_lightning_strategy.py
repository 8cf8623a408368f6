"""scape_ds.lightning without a process group: the private names it overrides, the config it accepts."""
from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")

from scape_ds.lightning import ScapeDeepSpeedStrategy, check_lightning_internals  # noqa: E402


def test_installed_lightning_has_the_private_names():
    check_lightning_internals()  # raises naming the Lightning version if they moved


def _strategy(gas, accumulate):
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "ScapeAdamS", "params": {"lr": 1e-3}}}
    if gas is not None:
        cfg["gradient_accumulation_steps"] = gas
    strategy = ScapeDeepSpeedStrategy(config=cfg)
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(accumulate_grad_batches=accumulate,
                                                                         gradient_clip_val=None))
    return strategy


@pytest.mark.parametrize("gas", [None, 2])
def test_gradient_accumulation_in_the_config_is_kept_when_it_equals_the_trainers(gas):
    strategy = _strategy(gas, 2)
    strategy._format_batch_size_and_grad_accum_config()  # the stock strategy raises for any value
    assert strategy.config["gradient_accumulation_steps"] == 2


def test_gradient_accumulation_that_disagrees_with_the_trainer_is_refused():
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps = 4 .*accumulate_grad_batches=2"):
        _strategy(4, 2)._format_batch_size_and_grad_accum_config()


def test_a_module_without_configure_optimizers_gets_one_when_the_config_has_the_optimizer():
    import lightning as L
    from lightning.pytorch.utilities.model_helpers import is_overridden

    module = L.LightningModule()
    strategy = _strategy(None, 1)
    strategy.connect(module)
    assert is_overridden("configure_optimizers", module) and module.configure_optimizers() is None
