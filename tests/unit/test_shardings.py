"""A layout whose mesh does not split some leaf of the train state evenly cannot start: JAX refuses it at MaxText's
first compile (IndivisibleError). One rank of the H100 x 1,024 preset as it shipped (EP 16 x FSDP 64), compiled on
an H200 under JAX's mock GPU topology, stopped there on `wkv_b`'s kernel [512, 3, 128, 256] split 1,024 ways over
fsdp x expert (bench/one_rank.py); temoe.tools.shardings reads the same off MaxText's abstract state, so `temoe plan`,
the sweep and `temoe train` refuse such layouts before anything compiles."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from conftest import ROOT, SMOKE, run_temoe, xla_flags
from temoe.tools import plan, planner, shardings

CONFIGS = ROOT / "configs"


def leaf(shape, spec, **sizes):
  names = ("data", "fsdp", "expert")
  mesh = AbstractMesh(tuple(sizes.get(n, 1) for n in names), names)
  return jax.ShapeDtypeStruct(shape, "float32", sharding=NamedSharding(mesh, spec))


def test_a_dimension_its_axes_do_not_divide_is_found():
  state = {"wkv_b": leaf((512, 3), P(("fsdp", "expert"), None), fsdp=64, expert=16),
           "embed": leaf((7168, 2), P(("fsdp", "expert")), fsdp=64, expert=16)}
  found = shardings.indivisible(state)
  assert [(f.path, f.dim, f.axes, f.ways) for f in found] == [("wkv_b", 0, ("fsdp", "expert"), 1024)]
  assert "wkv_b [512, 3]: dimension 0 (512) does not split 1024 ways over fsdp x expert" in shardings.refusal(found)


@pytest.mark.parametrize("sizes", [{"fsdp": 32, "expert": 16}, {"fsdp": 1, "expert": 1}, {"data": 3}])
def test_axes_that_divide_or_are_not_named_pass(sizes):
  assert shardings.indivisible({"w": leaf((512, 3), P(("fsdp", "expert")), **sizes)}) == []


def test_axes_of_size_one_are_not_named_in_the_refusal():
  found = shardings.indivisible({"w": leaf((512, 3), P(("data", "fsdp", "expert")), fsdp=1024)})
  assert [(f.axes, f.ways) for f in found] == [(("fsdp",), 1024)]


def test_the_h100_preset_as_it_shipped_fails_where_the_h200_compile_failed():
  p = planner.make_plan(str(CONFIGS / "deepseek3-671b-h100x1024.yml"),
                        ["num_slices=128", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=64", "per_device_batch_size=4"],
                        1024, "h100")
  first = shardings.indivisible(p.estimate.state)[0]
  assert (first.path, first.shape, first.dim, first.axes, first.ways) == (
      "model/decoder/dense_layers/self_attention/wkv_b/kernel", (512, 3, 128, 256), 0, ("fsdp", "expert"), 1024)


def jax_refuses(state) -> set[str]:
  """The leaves whose own NamedSharding JAX refuses for their shape (`shard_shape` raises its IndivisibleError)."""
  out = set()
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    try:
      x.sharding.shard_shape(x.shape)
    except ValueError:  # jax's IndivisibleError
      out.add(jax.tree_util.keystr(path))
  return out


@pytest.mark.parametrize("overrides", [["dcn_data_parallelism=1", "dcn_fsdp_parallelism=64"], []], ids=["old", "now"])
def test_the_leaves_found_are_the_ones_jax_refuses(overrides):
  """The check's arithmetic against JAX's own rule, leaf by leaf over the whole 671B train state: the H100 preset's
  old mesh (MLA's projections and their optimizer moments refused) and its mesh now (nothing)."""
  p = planner.make_plan(str(CONFIGS / "deepseek3-671b-h100x1024.yml"), ["num_slices=128", *overrides], 1024, "h100")
  leaves = jax.tree_util.tree_flatten_with_path(p.estimate.state)[0]
  found = {jax.tree_util.keystr(path) for path, x in leaves if shardings.indivisible({"x": x})}
  assert found == jax_refuses(p.estimate.state)
  assert len(found) == (12 if overrides else 0)


@pytest.mark.parametrize("config,devices,slices,gpu", [("deepseek3-671b-h100x1024.yml", 1024, 128, "h100"),
                                                       ("deepseek3-671b-h200x128.yml", 128, 16, "h200"),
                                                       ("deepseek3-671b-gb200x256.yml", 256, 64, "gb200"),
                                                       ("deepseek3-proxy-8gpu.yml", 8, 1, "h200")])
def test_every_shipped_multi_gpu_preset_shards_evenly(config, devices, slices, gpu):
  p = planner.make_plan(str(CONFIGS / config), [f"num_slices={slices}"], devices, gpu)
  assert shardings.indivisible(p.estimate.state) == []


def test_plan_says_such_a_layout_does_not_start(capsys):
  code = plan.main([str(CONFIGS / "deepseek3-671b-h100x1024.yml"), "--devices", "1024", "--slices", "128", "--gpu",
                    "h100", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=64"])
  out = capsys.readouterr().out
  assert code == 1 and "\ndoes not start: the train state does not shard evenly over this mesh" in out
  assert "wkv_b/kernel [512, 3, 128, 256]: dimension 0 (512) does not split 1024 ways over fsdp x expert" in out


def test_train_refuses_it_in_one_line_before_compiling(tmp_path):
  done = run_temoe("train", SMOKE, f"base_output_directory={tmp_path}", "run_name=uneven", "dataset_type=synthetic",
                   "steps=2", "ici_fsdp_parallelism=3", env={"XLA_FLAGS": xla_flags(3), "JAX_PLATFORMS": "cpu"})
  lines = [line for line in done.stderr.splitlines() if line.startswith("temoe:")]
  assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
  assert lines[0].startswith("temoe: the train state does not shard evenly over this mesh")
  assert "dimension 0 (64) does not split 3 ways over fsdp" in lines[0] and "the mesh (fsdp=3)" in lines[0]
  assert not (tmp_path / "uneven" / "checkpoints").exists()
