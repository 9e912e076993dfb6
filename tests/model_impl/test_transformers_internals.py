"""transformers' internals the runner uses (`transformers_internals`) hold on the installed transformers,
which must be a release they were checked against; any other is refused at import, naming both.

On an unchecked transformers this file fails at collection with `TransformersVersionError`, whose
message names the installed version and the declared range."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

from distpool.model_impl.hf import transformers_internals as internals
from tests.declared_versions import declared_range, range_of


def test_the_installed_transformers_is_a_release_the_internals_were_checked_against():
    installed = importlib.metadata.version("transformers")
    assert internals.release_of(installed) in internals.CHECKED_RELEASES, (
        f"transformers {installed} is installed; transformers_internals was checked against "
        f"{internals.CHECKED_RELEASES}: check its uses on {installed} and add it, or install "
        f"transformers{internals.DECLARED_RANGE}"
    )


def test_pyproject_declares_exactly_the_checked_releases():
    assert range_of(internals.CHECKED_RELEASES) == internals.DECLARED_RANGE
    assert declared_range("transformers") == internals.DECLARED_RANGE


@pytest.mark.parametrize("version", ["5.25.0", "5.22.1", "4.57.6", "6.0.0", "5.3.0", "main"])
def test_a_release_outside_the_checked_ones_is_refused_naming_it_and_the_range(version):
    with pytest.raises(internals.TransformersVersionError) as refused:
        internals.check_version(version)
    assert (refused.value.installed, refused.value.declared) == (version, ">=5.23,<5.25")
    assert f"transformers {version} is installed" in str(refused.value)
    assert ">=5.23,<5.25" in str(refused.value)


@pytest.mark.parametrize("version", ["5.23.0", "5.24.0", "5.24.2", "5.24.0.dev0"])
def test_a_checked_release_passes(version):
    internals.check_version(version)


def test_importing_the_module_under_another_transformers_raises_before_looking_up_its_names(monkeypatch):
    # The transformers the module will import (another test may have imported it afresh since).
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "5.25.0")
    spec = importlib.util.spec_from_file_location("internals_again", internals.__file__)
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ValueError) as refused:
        spec.loader.exec_module(module)
    assert type(refused.value).__name__ == "TransformersVersionError" and refused.value.installed == "5.25.0"
    assert not hasattr(module, "PagedKVLayer")  # refused before the private names were reached


def test_a_state_layer_keeps_our_tensors_and_transformers_updates_them_in_place():
    conv, recurrent = torch.zeros(1, 3, 4), torch.zeros(1, 2, 5)  # (B, channels, kernel), (B, ...)
    cache = internals.Cache(
        layers=[
            internals.state_layer((conv, recurrent), kernel=4, continuing=False),
            internals.paged_layer(7, None, kernel=4),
            internals.paged_layer(7, (conv.clone(), recurrent.clone()), kernel=4),
        ]
    )
    layer = cache.layers[0]
    assert not cache.has_previous_state(0)
    # A prompt's first chunk: transformers pads it to the kernel and copies it into our tensor.
    full = layer.update_conv_state(torch.ones(1, 3, 2))
    assert full.shape == (1, 3, 4) and conv[0, 0].tolist() == [0, 0, 1, 1]
    # Continuing: the state so far is the left context, and the newest kernel columns are kept.
    full = layer.update_conv_state(torch.full((1, 3, 1), 2.0))
    assert full.shape == (1, 3, 5) and conv[0, 0].tolist() == [0, 1, 1, 2]
    layer.update_recurrent_state(torch.full((1, 2, 5), 3.0))
    assert recurrent.eq(3).all()
    kept_conv, kept_recurrent = internals.layer_states(cache, 0)
    assert kept_conv is conv and kept_recurrent is recurrent
    # The attention layers hand K/V on untouched and report the tokens before this forward.
    key = torch.ones(1, 2, 1, 8)
    assert cache.layers[1].update(key, key)[0] is key
    assert [cache.layers[i].get_seq_length() for i in (1, 2)] == [7, 7]
    assert cache.has_previous_state(2)  # beside attention 7 tokens in: its state continues
