"""`copy_into`: a transfer without a wire has the receiver's guarantees — the copy equals the source, a manifest
that does not fit the target is refused before anything is applied, a stream that breaks its manifest names what
was applied."""

import pytest
import torch
from tiny_models import tiny_qwen2

from lorarl.weight_sync import PartialLoadError, TensorSpec, copy_into


def source_and_target():
    source, target = tiny_qwen2(seed=1), tiny_qwen2(seed=2)
    return source.state_dict(), target


def manifest(state):
    return [TensorSpec.of(name, t) for name, t in state.items()]


def test_the_copy_equals_the_source():
    state, target = source_and_target()
    stats = copy_into(target, iter(state.items()), version=4, manifest=manifest(state))
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert (stats.version, stats.tensors) == (4, len(state))
    assert stats.bytes == sum(t.nbytes for t in state.values())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: [*m, TensorSpec("extra.weight", "float32", (2,))], "unknown name 'extra.weight'"),
        (lambda m: [TensorSpec(m[0].name, "float32", (1, 2)), *m[1:]], r"sent float32\[1, 2\]"),
        (lambda m: m[1:], "missing"),
    ],
)
def test_a_manifest_that_does_not_fit_applies_nothing(edit, message):
    state, target = source_and_target()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        copy_into(target, iter(state.items()), version=1, manifest=edit(manifest(state)))
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_a_stream_that_breaks_its_manifest_names_what_was_applied():
    state, target = source_and_target()
    items = list(state.items())
    broken = [*items[:3], (items[3][0], items[3][1].double())]  # the fourth tensor arrives in another dtype
    with pytest.raises(PartialLoadError, match="3 tensors already applied") as error:
        copy_into(target, iter(broken), version=1, manifest=manifest(state))
    assert error.value.applied == [name for name, _ in items[:3]]
    with pytest.raises(PartialLoadError, match="ended after 3"):
        copy_into(target, iter(items[:3]), version=1, manifest=manifest(state))
