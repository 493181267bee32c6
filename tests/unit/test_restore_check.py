"""What a restored train state cannot hold (`checkpointing.impossible_values`), and MaxText's NaN-loss
exit turned into a stop (`failures.loss_stopped`): no training run needed."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import optax
import pytest

from temoe.maxtext import checkpointing, failures


def adam_state(nu_value: float = 1e-4, param_value: float = 0.5):
  params = {"decoder": {"wi": jnp.full((4, 8), param_value), "norm": jnp.ones(8)}}
  opt_state = optax.adamw(1e-3).init(params)
  adam = opt_state[0]._replace(nu=jax.tree_util.tree_map(lambda x: jnp.full_like(x, nu_value), opt_state[0].nu))
  return {"params": params, "opt_state": (adam, *opt_state[1:]), "step": jnp.int32(5)}


def test_an_intact_state_passes():
  assert checkpointing.impossible_values(adam_state()) is None


def test_a_negative_second_moment_is_named_but_a_negative_parameter_or_first_moment_is_not():
  state = adam_state(nu_value=-2.0, param_value=-3.0)
  state["opt_state"][0].mu["decoder"]["wi"] = -jnp.ones((4, 8))
  found = checkpointing.impossible_values(state)
  assert found == "a negative Adam second moment in opt_state/0/nu/decoder/norm, opt_state/0/nu/decoder/wi"


def test_nan_and_inf_anywhere_are_named_with_the_negative_moment():
  state = adam_state(nu_value=-1.0)
  state["params"]["decoder"]["wi"] = state["params"]["decoder"]["wi"].at[1, 2].set(jnp.inf)
  found = checkpointing.impossible_values(state, limit=1)
  assert found == "NaN/Inf in params/decoder/wi and a negative Adam second moment in opt_state/0/nu/decoder/norm"


def test_a_dict_restored_state_uses_the_same_names():
  """Orbax's raw restore (no target) gives dicts and lists; 'nu' is found there too."""
  state = {"opt_state": [{"count": jnp.int32(3), "mu": {"w": jnp.zeros(2)}, "nu": {"w": jnp.array([0.0, -1e-30])}}],
           "params": {"w": jnp.zeros(2)}}
  assert checkpointing.impossible_values(state) == "a negative Adam second moment in opt_state/0/nu/w"


CONFIG = types.SimpleNamespace(steps=8, enable_checkpointing=False, checkpoint_dir="/nowhere")


@pytest.mark.parametrize("loss,flag", [(float("nan"), "abort_on_nan_loss"), (float("inf"), "abort_on_inf_loss")])
def test_a_nonfinite_loss_becomes_a_stop_naming_the_step(loss, flag, monkeypatch):
  monkeypatch.setattr(failures, "progress", {})  # not inside a run: steps from the config
  stop = failures.loss_stopped({"scalar": {"learning/loss": loss}}, 7, CONFIG)
  assert stop.exit_code == 2
  assert str(stop).startswith("training stopped at step 7 of 8: ") and f"(MaxText's {flag}); no checkpoint" in str(stop)


def test_a_finite_loss_is_some_other_exit():
  assert failures.loss_stopped({"scalar": {"learning/loss": 2.5}}, 7, CONFIG) is None
