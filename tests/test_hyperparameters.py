"""Hyperparameter checking without building anything: unknown names get a "did you mean", also
for the names torch.optim uses (lr, wd, epsilon, betas, momentum), and only where it applies."""

from pathlib import Path

import pytest

from tbegen.module import HYPERPARAMETER_ALIASES, check_hyperparameters
from tbegen.spec import load_spec

OPTIMIZERS = Path(__file__).resolve().parent.parent / "optimizers"


def _error(optimizer, **given):
    with pytest.raises(TypeError) as info:
        check_hyperparameters(load_spec(str(OPTIMIZERS / f"{optimizer}.yaml")), given)
    return str(info.value)


@pytest.mark.parametrize("optimizer, alias, meant", [
    ("sgd", "lr", "learning_rate"),
    ("adam", "lr", "learning_rate"),
    ("adam", "wd", "weight_decay"),
    ("adamw", "decay", "weight_decay"),
    ("adam", "epsilon", "eps"),
    ("rowwise_adagrad", "epsilon", "eps"),
    ("adam", "momentum", "beta1"),
])
def test_torch_optim_names_get_a_did_you_mean(optimizer, alias, meant):
    message = _error(optimizer, **{alias: 0.1})
    assert f"{alias!r} (did you mean {meant!r}?)" in message, message


def test_betas_is_spelled_out_as_beta1_and_beta2():
    message = _error("adam", betas=(0.9, 0.99), learning_rate=0.1)
    assert "'betas' (did you mean 'beta1' and 'beta2'? betas=(b1, b2) is beta1=b1, beta2=b2)" in message


def test_an_alias_is_only_suggested_where_the_optimizer_has_its_target():
    # sgd has no weight decay and no momentum: no misleading hint, but the list of what it has
    message = _error("sgd", wd=0.1, momentum=0.9)
    assert "'wd' for" not in message and "did you mean" not in message, message
    assert "learning_rate (float, default 0.01)" in message
    # adagrad_with_momentum has a real `momentum`: it is accepted, not mapped to beta1
    spec = load_spec(str(OPTIMIZERS / "adagrad_with_momentum.yaml"))
    assert check_hyperparameters(spec, {"momentum": 0.5}, complete=False) == {"momentum": 0.5}


def test_misspellings_still_get_the_closest_name():
    assert "'learnig_rate' (did you mean 'learning_rate'?)" in _error("adam", learnig_rate=0.1)
    assert "'beta_2' (did you mean 'beta2'?)" in _error("adam", beta_2=0.9)


def test_every_alias_target_is_a_hyperparameter_of_some_spec():
    names = set()
    for path in OPTIMIZERS.glob("*.yaml"):
        names |= {h.name for h in load_spec(str(path)).hyperparameters}
    for alias, targets in HYPERPARAMETER_ALIASES.items():
        assert set(targets) <= names, (alias, targets)
