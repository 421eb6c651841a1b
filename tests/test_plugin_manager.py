import sys
import warnings

import pytest

from miles_core.errors import PluginLoadError, UnknownComponentError
from miles_core.plugin_manager import PluginHost, PluginLoadWarning
from tests.fake_dists import entry_points_in, make_dist

GOOD = """
from miles_core.api import RewardSpec, hookimpl

@hookimpl
def miles_register_rewards():
    return [RewardSpec(name="shiny", ref="json:dumps", description="test reward")]
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith(("acme", "other", "broken"))]:
        del sys.modules[name]


def host_for(root, **kwargs):
    kwargs.setdefault("strict", False)
    kwargs.setdefault("disabled", ())
    return PluginHost(entry_points=entry_points_in(root), **kwargs)


def test_good_plugin_registers_with_provenance(plugin_dir):
    make_dist(plugin_dir, "acme-rewards", "1.2.3", {"shiny": GOOD})
    host = host_for(plugin_dir)
    (record,) = host.records
    assert (record.name, record.distribution, record.version, record.status) == ("shiny", "acme-rewards", "1.2.3", "ok")
    assert record.registers == {"reward": ["shiny"]}
    registration = host.registries.reward.get("shiny")
    assert str(registration.plugin) == "acme-rewards 1.2.3"
    import json

    assert registration.load() is json.dumps


def test_import_failure_is_recorded_and_others_keep_working(plugin_dir):
    make_dist(plugin_dir, "acme-rewards", "1.0", {"shiny": GOOD})
    make_dist(plugin_dir, "broken-plugin", "0.3", {"broken": "raise RuntimeError('kaboom')\n"})
    with pytest.warns(PluginLoadWarning, match=r"'broken' \(broken-plugin 0.3, entry point broken_plugin_broken\).*kaboom"):
        host = host_for(plugin_dir)
    broken = host.record("broken")
    assert broken.status == "failed"
    assert "RuntimeError: kaboom" in broken.error
    assert host.record("shiny").status == "ok"
    assert "shiny" in host.registries.reward
    # Asking for something unknown names the installed ones and the failed plugin.
    with pytest.raises(UnknownComponentError, match=r"installed: shiny; plugins that failed to load: broken \(broken-plugin 0.3\)"):
        host.registries.reward.get("missing")


def test_strict_mode_raises(plugin_dir):
    make_dist(plugin_dir, "broken-plugin", "0.3", {"broken": "import no_such_module_xyz\n"})
    with pytest.raises(PluginLoadError, match=r"broken-plugin 0.3.*No module named 'no_such_module_xyz'"):
        host_for(plugin_dir, strict=True)


def test_strict_mode_from_environment(plugin_dir, monkeypatch):
    make_dist(plugin_dir, "broken-plugin", "0.3", {"broken": "raise ValueError('x')\n"})
    monkeypatch.setenv("MILES_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError):
        PluginHost(entry_points=entry_points_in(plugin_dir), disabled=())
    monkeypatch.setenv("MILES_STRICT_PLUGINS", "0")
    with pytest.warns(PluginLoadWarning):
        PluginHost(entry_points=entry_points_in(plugin_dir), disabled=())


@pytest.mark.parametrize(
    "source, error",
    [
        (
            "from miles_core.api import hookimpl\n@hookimpl\ndef miles_register_rewards(config):\n    return []\n",
            r"invalid hook: .*miles_register_rewards.*config",
        ),
        (
            "def miles_register_rewardz():\n    return []\n",
            r"unknown hook miles_register_rewardz \(did you mean miles_register_rewards\?\)",
        ),
        ("def miles_register_rewards():\n    return ['shiny']\n", r"miles_register_rewards returned str, expected RewardSpec"),
        ("def miles_register_rewards():\n    return 42\n", r"miles_register_rewards must return a list, got int"),
        (
            "from miles_core.api import LossSpec\ndef miles_register_rewards():\n    return [LossSpec(name='l', ref='a:b')]\n",
            r"returned LossSpec, expected RewardSpec",
        ),
        ("def miles_register_rewards():\n    raise KeyError('inside hook')\n", r"KeyError: 'inside hook'"),
    ],
)
def test_bad_hooks_fail_the_plugin_only(plugin_dir, source, error):
    make_dist(plugin_dir, "acme-rewards", "1.0", {"shiny": GOOD})
    make_dist(plugin_dir, "broken-plugin", "0.1", {"broken": source})
    with pytest.warns(PluginLoadWarning):
        host = host_for(plugin_dir)
    record = host.record("broken")
    assert record.status == "failed"
    assert record.registers == {}
    import re

    assert re.search(error, record.error, re.S), record.error
    assert host.record("shiny").status == "ok"


def test_disabled_plugins_are_never_imported(plugin_dir):
    make_dist(plugin_dir, "broken-plugin", "0.1", {"broken": "raise SystemExit('must not run')\n"})
    make_dist(plugin_dir, "acme-rewards", "1.0", {"shiny": GOOD})
    host = host_for(plugin_dir, disabled={"broken"})
    assert host.record("broken").status == "disabled"
    assert "broken_plugin_broken" not in sys.modules
    assert host.record("shiny").status == "ok"


def test_disable_all_keeps_core_builtins_unless_named():
    host = PluginHost(strict=True, disabled={"*"})
    statuses = {r.name: r.status for r in host.records}
    assert statuses.pop("core") == "ok"
    assert statuses and set(statuses.values()) == {"disabled"}
    assert host.registries.loss.names() == ["custom_loss", "nft", "policy_loss", "sft_loss"]
    assert len(host.registries.model_family) == 0
    host = PluginHost(strict=True, disabled={"*", "core"})
    assert {r.status for r in host.records} == {"disabled"}
    assert len(host.registries.loss) == 0


def test_environment_variable_disables(monkeypatch):
    monkeypatch.setenv("MILES_DISABLED_PLUGINS", "sd3, rewards")
    host = PluginHost(strict=True)
    assert host.record("sd3").status == "disabled"
    assert host.record("rewards").status == "disabled"
    assert host.record("wan22").status == "ok"
    assert "sd3" not in host.registries.model_family


def test_conflicting_names_name_both_distributions(plugin_dir):
    make_dist(plugin_dir, "acme-rewards", "1.0", {"shiny": GOOD})
    make_dist(
        plugin_dir,
        "other-rewards",
        "2.5",
        {
            "other": GOOD.replace("json:dumps", "json:loads"),
        },
    )
    with pytest.warns(PluginLoadWarning) as caught:
        host = host_for(plugin_dir)
    # Plugins load in entry-point name order, so "other" registers first and "shiny" fails.
    message = host.record("shiny").error
    assert "reward 'shiny' is registered by both other-rewards 2.5 (plugin 'other')" in message
    assert "acme-rewards 1.0 (plugin 'shiny')" in message
    assert host.record("shiny").status == "failed"
    assert host.record("other").status == "ok"
    assert host.registries.reward.get("shiny").load().__name__ == "loads"
    assert any("acme-rewards 1.0" in str(w.message) for w in caught)
    with pytest.raises(PluginLoadError, match="registered by both"):
        host_for(plugin_dir, strict=True)


def test_identical_reregistration_is_a_no_op(plugin_dir):
    make_dist(plugin_dir, "acme-rewards", "1.0", {"shiny": GOOD, "again": GOOD})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host = host_for(plugin_dir)
    assert [r.status for r in host.records] == ["ok", "ok"]
    assert host.registries.reward.names() == ["shiny"]
    assert str(host.registries.reward.get("shiny").plugin) == "acme-rewards 1.0"


def test_plugin_flag_colliding_with_core_fails_the_plugin(plugin_dir):
    source = (
        "from miles_core.api import Flag\ndef miles_add_arguments():\n    return [Flag(name='--lr', group='optimizer', type='float')]\n"
    )
    make_dist(plugin_dir, "broken-plugin", "0.1", {"broken": source})
    with pytest.warns(PluginLoadWarning, match="flag --lr is already defined by miles-core"):
        host = host_for(plugin_dir)
    assert host.record("broken").status == "failed"


def test_spec_records_validate_themselves():
    from miles_core.api import ModelFamilySpec, RewardSpec

    with pytest.raises(ValueError, match="must look like 'package.module:object'"):
        RewardSpec(name="x", ref="not a ref")
    with pytest.raises(ValueError, match="lower-case"):
        RewardSpec(name="Bad-Name", ref="a:b")
    with pytest.raises(ValueError, match="exceeds max_microgroup_size"):
        ModelFamilySpec(
            name="f",
            ref="a:b",
            checkpoint_patterns=("f",),
            lora_target_modules=("q",),
            n_samples_per_prompt=4,
            rollout_microgroup_size=2,
            max_microgroup_size=1,
        )
