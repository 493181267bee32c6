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
