"""The plugin registries and the implementation-under-test slot: lookups, errors, entry points."""

from types import SimpleNamespace

import pytest

from harness import conformance, plugins

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
        conformance.use("attention", "harness.compare:sha256")
        fn = conformance.resolve("attention", default=len)
        assert fn is not len and conformance.active("attention") == "harness.compare:sha256"
        import torch

        fn(torch.zeros(2))
        assert conformance.calls("attention") == 1
        assert conformance.resolve("decode", default=len) is len
        with pytest.raises(ValueError, match="unknown path 'video'"):
            conformance.use("video", "harness.compare:sha256")
        with pytest.raises(ValueError, match="must read 'package.module:callable'"):
            conformance.use("ar", "harness.compare")
        with pytest.raises(ValueError, match="has no attribute 'nope'"):
            conformance.use("ar", "harness.compare:nope")
    finally:
        conformance.clear()
