"""temoe's abstract train state (what `temoe plan` and the preflight count) is MaxText's own: the same leaves,
shapes, dtypes and shardings as `train_compile.get_shaped_inputs` gives, without its extra trace and batch."""

import jax
import pytest

import temoe
from temoe.maxtext import introspect
from temoe.tools import planner


@pytest.mark.parametrize("path, devices", [("configs/deepseek3-smoke.yml", 1), ("configs/deepseek3-proxy-8gpu.yml", 8)])
def test_abstract_state_is_get_shaped_inputs_state(path, devices):
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel

  temoe.register()
  with planner.platform_seen_as(planner.target("h200", None)[0]):
    config = planner.build_config(path, ["quantization=''"], devices)  # TE is not installed here
    mesh = planner.abstract_mesh(config, devices)
    (theirs, _), *_ = train_compile.get_shaped_inputs(mesh, config)
    ours = introspect.abstract_state(config, mesh)
  a, b = jax.tree_util.tree_leaves_with_path(theirs), jax.tree_util.tree_leaves_with_path(ours)
  assert len(a) == len(b) > 10
  for (pa, x), (pb, y) in zip(a, b):
    assert (pa, x.shape, x.dtype, x.sharding) == (pb, y.shape, y.dtype, y.sharding), jax.tree_util.keystr(pa)


def test_a_yaml_chain_is_read_once_until_a_file_of_it_changes(tmp_path, monkeypatch):
  """introspect.yaml_read_once: MaxText's _load_config runs once per chain; each build gets its own copy (MaxText
  edits it); an edited file of the chain (the base here) is read again."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  base, top = tmp_path / "base.yml", tmp_path / "top.yml"
  base.write_text("a: 1\nrules: [[x, y]]\n")
  top.write_text("base_config: base.yml\nb: 2\n")
  read, load = [], pyconfig._load_config  # pylint: disable=protected-access
  monkeypatch.setattr(pyconfig, "_load_config", lambda name: read.append(name) or load(name))
  with introspect.yaml_read_once():
    first = pyconfig._load_config(str(top))  # pylint: disable=protected-access
    del first["rules"]
    second = pyconfig._load_config(str(top))  # pylint: disable=protected-access
    assert len(read) == 2 and (second.a, second.b, list(second.rules[0])) == (1, 2, ["x", "y"])
    base.write_text("a: 30\nrules: [[x, y]]\n")
    third = pyconfig._load_config(str(top))  # pylint: disable=protected-access
  assert len(read) == 4 and (third.a, third.b) == (30, 2)
  assert not getattr(pyconfig._load_config, "temoe_cached", False)  # pylint: disable=protected-access  (closed again)


def test_a_config_built_from_a_chain_read_before_is_the_same_config():
  """Builds of the 8-GPU proxy (three YAML files) with its chain read fresh and from the copy agree key for key."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  temoe.register()
  argv = ["test", "configs/deepseek3-proxy-8gpu.yml", "quantization=''", "internal_compile=true",
          "internal_compile_num_devices=8", "skip_jax_distributed_system=true", "log_config=false"]
  with planner.platform_seen_as(planner.target("h200", None)[0]):
    fresh = pyconfig.initialize(argv)
    introspect.initialize_config(argv)
    again = introspect.initialize_config(argv)
  assert again.get_keys() == fresh.get_keys()
