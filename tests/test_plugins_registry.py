"""The plugin registries and the implementation-under-test slot: lookups, errors, entry points."""

from types import SimpleNamespace

import pytest

from harness.plugins import conformance
from harness.plugins import entry_points as plugins

pytestmark = pytest.mark.cpu


class _Point(SimpleNamespace):
    def load(self):
        return self.target


def test_unknown_entry_names_what_is_registered_and_how_to_add_one():
    registry = plugins.Registry("replay family", "Add one through the entry point.")
    registry.register("sd3", object(), origin="suite")
    with pytest.raises(KeyError, match=r"unknown replay family 'qwen'; registered: sd3\. Add one"):
        registry.get("qwen")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("sd3", object(), origin="other")


def test_entry_points_register_once_in_name_order_and_failures_name_the_plugin():
    seen = []
    points = [_Point(name="b_pkg", value="b:register", dist=None, target=lambda p: seen.append("b")),
              _Point(name="a_pkg", value="a:register", dist=None, target=lambda p: seen.append("a"))]
    assert plugins.load_plugins(lambda group: points) == ["a_pkg", "b_pkg"]
    assert plugins.load_plugins(lambda group: points) == []  # idempotent
    assert seen == ["a", "b"]

    def broken(p):
        raise RuntimeError("no such model")

    bad = [_Point(name="broken_pkg", value="x:register", dist=None, target=broken)]
    with pytest.raises(plugins.PluginError, match="'broken_pkg'.*no such model"):
        plugins.load_plugins(lambda group: bad)


def test_implementation_under_test_is_counted_and_bad_specs_are_named():
    try:
        conformance.use("attention", "tests.dist_tasks:double")  # shaped like the attention contract
        fn = conformance.resolve("attention", default=len)
        assert fn is not len and conformance.active("attention") == "tests.dist_tasks:double"
        assert fn(2) == 4
        assert conformance.calls("attention") == 1
        with pytest.raises(ValueError, match="cannot take the attention contract's call"):
            conformance.use("attention", "harness.judging.compare:sha256")
        assert conformance.resolve("decode", default=len) is len
        with pytest.raises(ValueError, match="unknown path 'video'"):
            conformance.use("video", "harness.judging.compare:sha256")
        with pytest.raises(ValueError, match="must read 'package.module:callable'"):
            conformance.use("ar", "harness.judging.compare")
        with pytest.raises(ValueError, match="has no attribute 'nope'"):
            conformance.use("ar", "harness.judging.compare:nope")
    finally:
        conformance.clear()


def test_a_source_checkout_without_entry_points_still_knows_the_shipped_families_and_kernels(monkeypatch):
    """Metadata that predates the entry points (a checkout on PYTHONPATH) installs none: the replay and attention
    lookups and the checkpoint kinds register the suite's own entries themselves, into empty registries."""
    from harness.attention import kernels
    from harness.decode import families as decode_families
    from harness.inputs import checkpoints
    from harness.replay import families

    monkeypatch.setattr(plugins, "_installed", lambda: ())
    for name in ("REPLAY_FAMILIES", "ATTENTION_KERNELS", "CHECKPOINT_KINDS"):
        old = getattr(plugins, name)
        monkeypatch.setattr(plugins, name, plugins.Registry(old.kind, old.how_to_add))
    assert families.get_family("sana") is families.SANA
    fresh = plugins.Registry("replay family", "")
    monkeypatch.setattr(plugins, "REPLAY_FAMILIES", fresh)
    assert [f.name for f in families.registered_families()] == sorted(
        f.name for f in (*families.SHIPPED, *families.REMOTE_CODE))
    monkeypatch.setattr(plugins, "REPLAY_FAMILIES", plugins.Registry("replay family", ""))
    monkeypatch.setattr(plugins, "CHECKPOINT_KINDS", plugins.Registry("checkpoint kind", ""))
    assert families.family_for_class("FluxTransformer2DModel") is families.FLUX
    assert kernels.kernels_under_test() == tuple(n for n, spec in kernels.KERNELS.items() if spec.under_test)
    monkeypatch.setattr(plugins, "ATTENTION_KERNELS", plugins.Registry("attention kernel", ""))
    assert kernels.get_kernel("flex") is kernels.KERNELS["flex"]
    monkeypatch.setattr(plugins, "CHECKPOINT_KINDS", plugins.Registry("checkpoint kind", ""))
    kinds = {kind.name for kind in checkpoints.registered_kinds()}
    assert kinds == ({f.checkpoint_kind.name for f in families.SHIPPED} | {k.name for k in checkpoints.SHIPPED_KINDS}
                     | {decode_families.MINIMAX_H3_KIND.name})
